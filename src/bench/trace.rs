//! Trace replay: a JSONL file of requests, each sent at its own timestamp (scaled by a speed-up).
//!
//! Two line formats, told apart per line:
//! - Mooncake's public traces: `{"timestamp": ms, "input_length": n, "output_length": m,
//!   "hash_ids": [..]}`. Each hash id stands for one 512-token block of the prompt; equal ids give
//!   equal blocks (words seeded by the id), so requests share exactly the prefixes the trace says
//!   they share. The last block is cut so the prompt is `input_length` tokens.
//! - A request log: OpenAI request bodies (`prompt` or `messages`, `max_tokens`...), with an
//!   optional `timestamp` in ms. `model` and `stream` are set by the load generator.
//!
//! When every line has a timestamp the replay is open loop at those times; otherwise the run's
//! arrival process (closed loop or `--rate`) sends the lines in order.

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};

use super::workload::{words, RequestSpec};
use crate::sim::engine::splitmix;

/// Tokens a Mooncake hash id stands for.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

#[derive(Clone, PartialEq)]
pub struct Trace {
    entries: Arc<Vec<Entry>>,
    /// Send times in seconds from the first line, when every line has one.
    times: Option<Arc<Vec<f64>>>,
    pub source: String,
    /// Timed replays run this many times faster than the trace's clock.
    pub speedup: f64,
}

#[derive(Clone, Debug, PartialEq)]
enum Entry {
    Mooncake {
        input_length: usize,
        output_length: usize,
        hash_ids: Vec<u64>,
    },
    Body(Value),
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Trace {{ {}: {} requests, {} }}",
            self.source,
            self.entries.len(),
            if self.times.is_some() {
                format!("replayed at their timestamps, speed-up {}", self.speedup)
            } else {
                "untimed".to_string()
            }
        )
    }
}

impl Trace {
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, source: &str) -> Result<Self, String> {
        let mut entries = Vec::new();
        let mut stamps = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let at = |e: String| format!("{source} line {}: {e}", n + 1);
            let mut v: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
            let Some(obj) = v.as_object_mut() else {
                return Err(at("not a JSON object".into()));
            };
            let ts = obj.remove("timestamp").and_then(|t| t.as_f64());
            stamps.push(ts);
            let entry = if obj.contains_key("hash_ids") {
                let num = |k: &str| {
                    obj.get(k)
                        .and_then(Value::as_u64)
                        .map(|x| x as usize)
                        .ok_or_else(|| at(format!("`{k}` must be a whole number")))
                };
                let hash_ids = obj["hash_ids"]
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                    .ok_or_else(|| at("`hash_ids` must be a list of whole numbers".into()))?;
                Entry::Mooncake {
                    input_length: num("input_length")?,
                    output_length: num("output_length")?.max(1),
                    hash_ids,
                }
            } else if obj.contains_key("prompt") || obj.contains_key("messages") {
                obj.remove("model");
                obj.remove("stream");
                obj.remove("stream_options");
                Entry::Body(v)
            } else {
                return Err(at(
                    "neither a Mooncake line (hash_ids) nor a request body (prompt or messages)"
                        .into(),
                ));
            };
            entries.push(entry);
        }
        if entries.is_empty() {
            return Err(format!("{source}: no requests"));
        }
        let times = stamps
            .iter()
            .copied()
            .collect::<Option<Vec<f64>>>()
            .map(|ts| {
                let first = ts.iter().copied().fold(f64::INFINITY, f64::min);
                Arc::new(ts.iter().map(|t| (t - first) / 1000.0).collect())
            });
        Ok(Self {
            entries: Arc::new(entries),
            times,
            source: source.into(),
            speedup: 1.0,
        })
    }

    /// When line `i` is due, in seconds from the start at the replay's speed-up; `None` when
    /// the trace has no timestamps or `i` is past its end.
    pub fn send_time(&self, i: u64) -> Option<f64> {
        let t = self.times.as_ref()?.get(i as usize).copied()?;
        Some(t / self.speedup.max(f64::MIN_POSITIVE))
    }

    pub fn is_timed(&self) -> bool {
        self.times.is_some()
    }

    /// Request `i` (the trace wraps around when an untimed run outlasts it).
    pub fn request(&self, seed: u64, i: u64) -> RequestSpec {
        match &self.entries[i as usize % self.entries.len()] {
            Entry::Mooncake {
                input_length,
                output_length,
                hash_ids,
            } => {
                let mut prompt = String::new();
                let mut left = *input_length;
                for h in hash_ids {
                    if left == 0 {
                        break;
                    }
                    let n = left.min(MOONCAKE_BLOCK_TOKENS);
                    prompt.push_str(&words(splitmix(seed ^ 0x7ace_b10c ^ h), n));
                    left -= n;
                }
                if left > 0 {
                    // More input than the listed blocks cover: a tail of this request's own.
                    prompt.push_str(&words(splitmix(seed ^ 0x7a11 ^ i), left));
                }
                RequestSpec {
                    body: json!({"prompt": prompt, "max_tokens": output_length}),
                    chat: false,
                    output_tokens: *output_length,
                    class: "trace".into(),
                    slo: None,
                }
            }
            Entry::Body(body) => {
                let output_tokens = body["max_tokens"]
                    .as_u64()
                    .or(body["max_completion_tokens"].as_u64())
                    .unwrap_or(0) as usize;
                RequestSpec {
                    body: body.clone(),
                    chat: body.get("messages").is_some(),
                    output_tokens,
                    class: "trace".into(),
                    slo: None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(t: &Trace, i: u64) -> String {
        t.request(1, i).body["prompt"].as_str().unwrap().to_owned()
    }

    #[test]
    fn equal_mooncake_hash_ids_give_equal_prompt_blocks() {
        let t = Trace::parse(
            concat!(
                r#"{"timestamp": 1000, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 3]}"#,
                "\n",
                r#"{"timestamp": 1500, "input_length": 700, "output_length": 4, "hash_ids": [1, 9]}"#,
                "\n",
                r#"{"timestamp": 3000, "input_length": 512, "output_length": 4, "hash_ids": [7]}"#,
            ),
            "t",
        )
        .unwrap();
        let tokens = |s: &str| s.split_whitespace().count();
        let (a, b, c) = (prompt(&t, 0), prompt(&t, 1), prompt(&t, 2));
        assert_eq!((tokens(&a), tokens(&b), tokens(&c)), (1100, 700, 512));
        let block = |s: &str, k: usize| -> String {
            s.split_whitespace()
                .skip(k * MOONCAKE_BLOCK_TOKENS)
                .take(MOONCAKE_BLOCK_TOKENS)
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(block(&a, 0), block(&b, 0), "hash id 1 in both");
        assert_ne!(
            block(&a, 1)[..100],
            block(&b, 1)[..100],
            "ids 2 and 9 differ"
        );
        assert_ne!(block(&a, 0), block(&c, 0));
        assert_eq!(t.request(1, 0).output_tokens, 8);
        assert_eq!(t.send_time(0), Some(0.0));
        assert_eq!(t.send_time(1), Some(0.5));
        assert_eq!(t.send_time(2), Some(2.0));
        assert_eq!(t.send_time(3), None);
    }

    #[test]
    fn request_log_lines_keep_their_body_and_drop_model_and_stream() {
        let t = Trace::parse(
            concat!(
                r#"{"model": "x", "stream": false, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}"#,
                "\n\n",
                r#"{"prompt": "hello", "max_tokens": 3, "temperature": 0}"#,
            ),
            "log",
        )
        .unwrap();
        assert!(
            !t.is_timed(),
            "no timestamps: the run's arrival process sends them"
        );
        let chat = t.request(0, 0);
        assert!(chat.chat);
        assert_eq!(chat.output_tokens, 5);
        assert!(chat.body.get("model").is_none() && chat.body.get("stream").is_none());
        let completion = t.request(0, 1);
        assert!(!completion.chat);
        assert_eq!(completion.body["temperature"], 0);
        assert_eq!(t.request(0, 2), chat, "wraps around");
    }

    #[test]
    fn bad_lines_are_named() {
        let e = Trace::parse("{\"prompt\": \"a\"}\n{\"foo\": 1}\n", "f.jsonl").unwrap_err();
        assert!(e.contains("f.jsonl line 2"), "{e}");
        assert!(Trace::parse("\n", "empty").is_err());
    }
}
