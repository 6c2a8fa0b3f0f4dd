//! The engine: a continuous-batching scheduler over the paged KV cache, stepped in modelled time.
//!
//! Each `step` is one forward pass of vLLM's V1 scheduler: running requests first (one decode
//! token each, or the next chunk of a prompt being prefilled), then waiting requests in FCFS order
//! while `max_num_seqs` and the step's token budget allow. A waiting request first claims the
//! longest cached prefix of its prompt (at least its last token is always computed). When the KV
//! cache cannot grow a running request, the youngest running request is preempted: its blocks are
//! freed and it goes back to the head of the queue to be recomputed. The step's duration comes
//! from the preset's cost model. The engine is synchronous and owns no clock: the caller passes
//! `now` in, so tests drive it in virtual time and the HTTP worker drives it in scaled real time.

use std::collections::VecDeque;

use super::kv::KvCache;
use super::presets::EngineParams;
use super::tokenizer::SimTokenizer;

pub type SeqId = u64;

/// A request as the engine sees it: tokens in, sampling limits.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// Seeds the output text; equal seeds and prompts give equal text.
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Timings of a finished request, seconds of modelled time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    pub queue: f64,
    pub ttft: f64,
    pub e2e: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        text: String,
    },
    Finished {
        reason: FinishReason,
        stop: Option<String>,
        prompt_tokens: usize,
        cached_tokens: usize,
        completion_tokens: usize,
        timings: Timings,
    },
}

/// Monotonic counters, read by the metrics exporter and by tests.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Counted as vLLM counts them, when a request's prefill yields its first token: its prompt
    /// tokens, those it found cached, and the cached last token it recomputed when the whole
    /// prompt but that token was cached (vLLM's `prompt_tokens_by_source`: `local_compute` is
    /// `prompt_tokens - prompt_cached`, `local_cache_hit` is `prompt_cached + prompt_recomputed`).
    pub prompt_tokens: u64,
    pub prompt_cached: u64,
    pub prompt_recomputed: u64,
    pub generation_tokens: u64,
    pub prefill_tokens_computed: u64,
    pub generated_after_disconnect: u64,
    pub aborted: u64,
    pub steps: u64,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub duration: f64,
    /// Tokens the step computed: prompt tokens prefilled plus one per decoding request.
    pub tokens: usize,
    pub events: Vec<(SeqId, Event)>,
    /// Time between two tokens of the same request, for the inter-token histogram.
    pub inter_token: Vec<f64>,
}

struct Seq {
    id: SeqId,
    req: EngineRequest,
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    blocks: Vec<u32>,
    computed: usize,
    /// Leading blocks registered in the cache (full and hashed).
    registered: usize,
    /// Output length at which the simulated model emits EOS.
    natural_len: usize,
    text: String,
    cached_tokens: Option<usize>,
    arrival: f64,
    /// When the server took the request (at or before `arrival`): what TTFT and e2e count from.
    received: f64,
    first_scheduled: Option<f64>,
    first_token: Option<f64>,
    last_token: f64,
    client_gone: bool,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

pub struct Engine {
    params: EngineParams,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    /// Oldest first; the youngest (last) is preempted first.
    running: Vec<Seq>,
    next_id: SeqId,
    pub counters: Counters,
    /// Whose vocabulary output tokens come from.
    tokenizer: SimTokenizer,
}

impl Engine {
    pub fn new(params: EngineParams) -> Self {
        Self {
            kv: KvCache::new(params.num_gpu_blocks, params.block_size),
            params,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            counters: Counters::default(),
            tokenizer: SimTokenizer::Own,
        }
    }

    /// Generates output tokens of this vocabulary (the worker's tokenizer) instead of the
    /// simulator's own.
    pub fn set_tokenizer(&mut self, tokenizer: SimTokenizer) {
        self.tokenizer = tokenizer;
    }

    /// Records KV cache events, as a vLLM worker with `--kv-events-config` does.
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// Hashes each block with the `n` tokens after it, as vLLM 0.33 does with EAGLE-style
    /// speculative decoding ([`KvCache::set_hash_lookahead`]).
    pub fn set_hash_lookahead(&mut self, n: usize) {
        self.kv.set_hash_lookahead(n);
    }

    /// The KV cache events since the last call: one batch's worth.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv_events::KvEvent> {
        self.kv.take_events()
    }

    /// Forgets every cached prefix; refused while a request holds blocks (as in vLLM).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.running.is_empty() && self.kv.reset_prefix_cache()
    }

    pub fn params(&self) -> &EngineParams {
        &self.params
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn kv_usage(&self) -> f64 {
        self.kv.usage()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// [`Self::add`] for a request the server took at `received`, while a step was running: vLLM
    /// stamps a request's arrival when its API server takes it, so its time to first token
    /// includes the wait for the step under way; the queue time counts from `now`, when the
    /// scheduler sees it.
    pub fn add_received(&mut self, req: EngineRequest, now: f64, received: f64) -> SeqId {
        let id = self.add(req, now);
        if let Some(s) = self.waiting.back_mut() {
            s.received = received.min(now);
        }
        id
    }

    pub fn add(&mut self, req: EngineRequest, now: f64) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let natural_len = 16 + (splitmix(req.seed ^ 0x5eed) % 241) as usize;
        self.waiting.push_back(Seq {
            id,
            tokens: req.prompt.clone(),
            req,
            hashes: Vec::new(),
            registered: 0,
            blocks: Vec::new(),
            computed: 0,
            natural_len,
            text: String::new(),
            cached_tokens: None,
            arrival: now,
            received: now,
            first_scheduled: None,
            first_token: None,
            last_token: now,
            client_gone: false,
        });
        id
    }

    /// Removes a request and frees its blocks; returns false if it was not in the engine.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.kv.free(&s.blocks);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.kv.free(&s.blocks);
            }
        } else {
            return false;
        }
        self.counters.aborted += 1;
        true
    }

    /// Marks a request whose client has gone but which keeps running (no abort): its tokens are
    /// counted as waste.
    pub fn client_gone(&mut self, id: SeqId) {
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            if s.id == id {
                s.client_gone = true;
            }
        }
    }

    /// Runs one forward pass starting at `now`. Returns a zero-duration output when idle.
    pub fn step(&mut self, now: f64) -> StepOutput {
        let scheduled = self.schedule(now);
        if scheduled.is_empty() {
            return StepOutput::default();
        }
        let mut prefill = 0;
        let mut decode = 0;
        let mut context = 0;
        for &(i, n) in &scheduled {
            let s = &self.running[i];
            if n == 1 && s.computed + 1 == s.tokens.len() && s.output_len() > 0 {
                decode += 1;
            } else {
                prefill += n;
            }
            context += s.computed + n;
        }
        let duration = self.params.cost.step_ms(prefill, decode, context) / 1000.0;
        let end = now + duration;
        self.counters.steps += 1;
        self.counters.prefill_tokens_computed += prefill as u64;

        let mut out = StepOutput {
            duration,
            tokens: prefill + decode,
            ..Default::default()
        };
        let mut finished = Vec::new();
        for &(i, n) in &scheduled {
            if self.compute(i, n) && self.next_token(i, end, &mut out) {
                finished.push(i);
            }
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let s = self.running.remove(i);
            self.kv.free(&s.blocks);
        }
        out
    }

    /// Computes `n` more tokens of running sequence `i` and registers the KV blocks they filled;
    /// `true` once its prompt is all computed, so that this step yields a token for it.
    fn compute(&mut self, i: usize, n: usize) -> bool {
        let s = &mut self.running[i];
        s.computed += n;
        // Register the blocks now full and hashed (a block with lookahead tokens is hashed once
        // they exist, which for a prompt's last block is once the first token is out).
        let block = self.kv.block_size();
        self.kv.extend_hashes(&mut s.hashes, &s.tokens);
        let (from, to) = (s.registered, (s.computed / block).min(s.hashes.len()));
        if to > from {
            let parent = from.checked_sub(1).map(|p| s.hashes[p]);
            let ahead = s.tokens.len().min(to * block + self.kv.lookahead());
            self.kv.register(
                &s.blocks[from..to],
                &s.hashes[from..to],
                parent,
                &s.tokens[from * block..ahead],
            );
            s.registered = to;
        }
        s.computed >= s.tokens.len()
    }

    /// Running sequence `i` yields its next token at `end`: counts it, adds its text (or its
    /// finish) to `out`, and says whether the sequence is finished.
    fn next_token(&mut self, i: usize, end: f64, out: &mut StepOutput) -> bool {
        let max_len = self.params.max_model_len;
        let s = &mut self.running[i];
        let k = s.output_len();
        let (token, piece) = self.tokenizer.output_token(s.req.seed, k);
        s.tokens.push(token);
        self.counters.generation_tokens += 1;
        if s.client_gone {
            self.counters.generated_after_disconnect += 1;
        }
        match s.first_token {
            None => {
                s.first_token = Some(end);
                // vLLM counts a prompt's tokens when its prefill yields the first token, not
                // when it is scheduled: a request aborted before then is never counted.
                let (prompt, cached) = (s.req.prompt.len(), s.cached_tokens.unwrap_or(0));
                let c = &mut self.counters;
                c.prompt_tokens += prompt as u64;
                c.prompt_cached += cached as u64;
                c.prompt_recomputed += u64::from(cached + 1 == prompt);
            }
            Some(_) => out.inter_token.push(end - s.last_token),
        }
        s.last_token = end;
        let before = s.text.len();
        s.text.push_str(&piece);
        let k = k + 1;
        let hit_stop = s
            .req
            .stop
            .iter()
            .find_map(|p| s.text.find(p.as_str()).map(|at| (at, p.clone())));
        let (delta, reason, stop) = if let Some((at, p)) = hit_stop {
            s.text.truncate(at);
            (
                s.text[before.min(at)..].to_string(),
                Some(FinishReason::Stop),
                Some(p),
            )
        } else if k >= s.req.max_tokens || s.tokens.len() >= max_len {
            (piece, Some(FinishReason::Length), None)
        } else if !s.req.ignore_eos && k >= s.natural_len.max(s.req.min_tokens) {
            (piece, Some(FinishReason::Stop), None)
        } else {
            (piece, None, None)
        };
        if !delta.is_empty() {
            out.events.push((s.id, Event::Token { text: delta }));
        }
        if let Some(reason) = reason {
            let first_scheduled = s.first_scheduled.unwrap_or(s.arrival);
            out.events.push((
                s.id,
                Event::Finished {
                    reason,
                    stop,
                    prompt_tokens: s.req.prompt.len(),
                    cached_tokens: s.cached_tokens.unwrap_or(0),
                    completion_tokens: k,
                    timings: Timings {
                        queue: first_scheduled - s.arrival,
                        ttft: s.first_token.unwrap_or(end) - s.received,
                        e2e: end - s.received,
                    },
                },
            ));
            true
        } else {
            false
        }
    }

    /// Picks this step's work: `(index into running, tokens to compute)`.
    fn schedule(&mut self, now: f64) -> Vec<(usize, usize)> {
        let mut budget = self.params.max_num_batched_tokens;
        let block = self.kv.block_size();
        let blocks_for = |tokens: usize| tokens.div_ceil(block);
        let mut scheduled: Vec<(usize, usize)> = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let n = (s.tokens.len() - s.computed).min(budget);
            let need = blocks_for(s.computed + n).saturating_sub(s.blocks.len());
            loop {
                if let Some(new) = self.kv.allocate(need) {
                    self.running[i].blocks.extend(new);
                    scheduled.push((i, n));
                    budget -= n;
                    i += 1;
                    break;
                }
                // Out of KV: recompute the youngest running request later.
                let victim = self.running.len() - 1;
                self.preempt(victim);
                scheduled.retain(|&(j, _)| j != victim);
                preempted = true;
                if victim == i {
                    break;
                }
            }
        }
        if preempted {
            return scheduled;
        }
        while budget > 0 && self.running.len() < self.params.max_num_seqs {
            let Some(s) = self.waiting.front_mut() else {
                break;
            };
            {
                self.kv.extend_hashes(&mut s.hashes, &s.tokens);
                // Always compute at least the last token, as vLLM does on a full hit.
                let usable = (s.tokens.len() - 1) / block;
                let hit = self
                    .kv
                    .match_prefix(&s.hashes[..usable.min(s.hashes.len())]);
                let n = (s.tokens.len() - hit.len() * block).min(budget);
                let need = blocks_for(hit.len() * block + n) - hit.len();
                self.kv.touch(&hit);
                let Some(new) = self.kv.allocate(need) else {
                    self.kv.free(&hit);
                    break;
                };
                if s.cached_tokens.is_none() {
                    let cached = hit.len() * block;
                    s.cached_tokens = Some(cached);
                    self.counters.prefix_queries += s.tokens.len() as u64;
                    self.counters.prefix_hits += cached as u64;
                }
                s.computed = hit.len() * block;
                s.registered = hit.len();
                s.blocks = hit;
                s.blocks.extend(new);
                s.first_scheduled.get_or_insert(now);
                budget -= n;
                let s = self.waiting.pop_front().expect("front exists");
                self.running.push(s);
                scheduled.push((self.running.len() - 1, n));
            }
        }
        scheduled
    }

    fn preempt(&mut self, index: usize) {
        let mut s = self.running.remove(index);
        self.kv.free(&s.blocks);
        s.blocks.clear();
        s.computed = 0;
        s.registered = 0;
        self.counters.preemptions += 1;
        self.waiting.push_front(s);
    }
}

/// SplitMix64: a tiny, well-mixed PRNG step.
pub fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
