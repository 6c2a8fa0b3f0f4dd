//! Named engine presets: a GPU, a model and a cost model fitted to published measurements.
//!
//! A step costs `base + prefill × uncached tokens computed + decode × sequences decoding +
//! kv_read × tokens of context attended`, in milliseconds of modelled GPU time. `base` is the
//! weight read that every step pays (why one stream decodes at 1/base tokens/s); prefill is the
//! compute of a prompt token; decode and kv_read are what each extra sequence in the batch adds.
//! KV capacity is what the card has left after weights, in 16-token blocks.
//!
//! Each preset names its source. Where a figure was not published, the comment says which spec-sheet
//! estimate stands in. Presets are fitted once, to the engine, never to the gateway's results.

use serde::{Deserialize, Serialize};

/// Step-time model, milliseconds of modelled GPU time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostModel {
    pub step_base_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_seq: f64,
    pub kv_read_ms_per_1k_tokens: f64,
}

impl CostModel {
    pub fn step_ms(&self, prefill_tokens: usize, decode_seqs: usize, context_tokens: usize) -> f64 {
        self.step_base_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64
            + self.kv_read_ms_per_1k_tokens * context_tokens as f64 / 1000.0
    }
}

fn default_block_size() -> usize {
    super::kv::DEFAULT_BLOCK_SIZE
}

/// One simulated worker's engine: its model, limits and costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineParams {
    /// The served model name, as `--served-model-name` would set it.
    pub model: String,
    pub max_model_len: usize,
    /// KV capacity in blocks of `block_size` tokens (vLLM's `num_gpu_blocks`).
    pub num_gpu_blocks: usize,
    /// Tokens per KV block (vLLM's `--block-size`; 16 on CUDA, a multiple of 32 on its CPU build).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    pub max_num_seqs: usize,
    /// Token budget of one step; prompts longer than what is left are prefilled in chunks.
    pub max_num_batched_tokens: usize,
    pub cost: CostModel,
}

pub struct Preset {
    pub name: &'static str,
    pub describes: &'static str,
    pub source: &'static str,
    pub params: fn() -> EngineParams,
}

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "l4-qwen2.5-7b",
        describes: "Qwen2.5-7B-Instruct BF16 on one NVIDIA L4 (24 GB, 300 GB/s)",
        source: "two-L4 prefix-routing study (512 in/128 out): cold sweep 0.74/2.55/7.66/11.06 \
                 req/s at C=4/16/64/128, 13.0 vs 6.7 req/s shared vs random at C=128 (replayed in \
                 tests/sim_fidelity.rs); KV 57 KB/token (28 layers, 4 KV heads), ~5 GB left after \
                 15.2 GB of weights",
        params: || EngineParams {
            model: "Qwen/Qwen2.5-7B-Instruct".into(),
            max_model_len: 32768,
            // ~5.0 GB / (57 KB × 16 tokens)
            num_gpu_blocks: 5400,
            block_size: super::kv::DEFAULT_BLOCK_SIZE,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            cost: CostModel {
                step_base_ms: 40.0,
                prefill_ms_per_token: 0.38,
                decode_ms_per_seq: 0.12,
                kv_read_ms_per_1k_tokens: 0.25,
            },
        },
    },
    Preset {
        name: "l40s-qwen2.5-7b",
        describes: "Qwen2.5-7B-Instruct BF16 on one NVIDIA L40S (48 GB, 864 GB/s)",
        source: "no published serving table: the l4-qwen2.5-7b preset scaled by the spec sheets, \
                 2.88x the L4's memory bandwidth (864 against 300 GB/s) for the step's base, \
                 per-sequence and KV-read costs and 2.99x its dense BF16 compute (362 against 121 \
                 TFLOP/s) for prefill; KV 57 KB/token, ~26.6 GB left of 90% of 48 GB after 15.2 GB \
                 of weights. With l4-qwen2.5-7b, a pool of one model on unlike GPUs",
        params: || EngineParams {
            model: "Qwen/Qwen2.5-7B-Instruct".into(),
            max_model_len: 32768,
            // ~26.6 GB / (57 KB × 16 tokens)
            num_gpu_blocks: 29000,
            block_size: super::kv::DEFAULT_BLOCK_SIZE,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            cost: CostModel {
                step_base_ms: 14.0,
                prefill_ms_per_token: 0.13,
                decode_ms_per_seq: 0.04,
                kv_read_ms_per_1k_tokens: 0.09,
            },
        },
    },
    Preset {
        name: "rtx4090-mistral-7b",
        describes: "Mistral-7B-Instruct FP16 on one RTX 4090 (24 GB, 1 TB/s)",
        source: "vLLM benchmark_serving, random 256 in/128 out, 300 prompts, by max concurrency: \
                 C=4 2.09 req/s, TTFT mean 63 ms … C=48 11.87 req/s, 667 ms; replayed within 11% on \
                 req/s at every C (tests/sim_fidelity.rs); KV 128 KB/token, ~5.6 GB left",
        params: || EngineParams {
            model: "mistralai/Mistral-7B-Instruct-v0.3".into(),
            max_model_len: 32768,
            // ~5.6 GB / (128 KB × 16 tokens)
            num_gpu_blocks: 2700,
            block_size: super::kv::DEFAULT_BLOCK_SIZE,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            cost: CostModel {
                step_base_ms: 15.0,
                prefill_ms_per_token: 0.17,
                decode_ms_per_seq: 0.08,
                kv_read_ms_per_1k_tokens: 0.10,
            },
        },
    },
    Preset {
        name: "rtx6000ada-qwen2.5-14b",
        describes: "Qwen2.5-14B-Instruct BF16 on one RTX 6000 Ada (48 GB, 960 GB/s)",
        source: "no published serving table: spec-sheet estimate. 29.5 GB of weights at 960 GB/s \
                 gives a ~33 ms step (~30 tok/s single stream); 28 GFLOP/token at ~90 TFLOP/s \
                 effective gives ~0.31 ms per prompt token; KV 192 KB/token (48 layers, 8 KV heads), \
                 ~11.7 GB left",
        params: || EngineParams {
            model: "Qwen/Qwen2.5-14B-Instruct".into(),
            max_model_len: 32768,
            num_gpu_blocks: 3800,
            block_size: super::kv::DEFAULT_BLOCK_SIZE,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            cost: CostModel {
                step_base_ms: 33.0,
                prefill_ms_per_token: 0.31,
                decode_ms_per_seq: 0.08,
                kv_read_ms_per_1k_tokens: 0.20,
            },
        },
    },
];

pub const DEFAULT_PRESET: &str = "rtx4090-mistral-7b";

pub fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

pub fn names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}
