//! Seeded request streams: the same seed and parameters give the same requests, whatever the target.
//!
//! Prompts are built from short common English words, each one token under the simulator's
//! tokenizer and, for the words chosen, a single token in the Llama, Mistral and Qwen vocabularies
//! as well, so "L tokens" stays close to L against a real vLLM too.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sim::engine::splitmix;

/// Which workload, and its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Workload {
    /// `prefixes` shared prefixes of `prefix_tokens`, each request one of them (uniformly) plus
    /// `unique_tokens` of its own.
    PrefixRepetition {
        prefixes: usize,
        prefix_tokens: usize,
        unique_tokens: usize,
        output_tokens: usize,
    },
    /// No sharing at all: the cache-hostile control.
    Random {
        input_tokens: usize,
        output_tokens: usize,
    },
    /// Chats whose every turn resends the whole history (system prompt, earlier user turns and
    /// fixed assistant replies) plus a new user message; each conversation has its own system
    /// prompt. A conversation's turns are sent one after another by one client (see
    /// [`Workload::turns`]). `conversations` is kept for old files; it no longer shapes the stream.
    MultiTurn {
        conversations: usize,
        turns: usize,
        system_tokens: usize,
        user_tokens: usize,
        output_tokens: usize,
    },
    /// The common shape of production chat traffic: one system prompt of `system_tokens` shared
    /// by every conversation, each conversation `turns` turns of `user_tokens` user tokens and
    /// `output_tokens` replies, resending its history. Each client (`--concurrency`) is one user
    /// holding one conversation at a time.
    Chat {
        turns: usize,
        system_tokens: usize,
        user_tokens: usize,
        output_tokens: usize,
    },
    /// Like prefix-repetition, but prefix k is picked with probability ∝ 1/(k+1)^exponent.
    Zipf {
        prefixes: usize,
        exponent: f64,
        prefix_tokens: usize,
        unique_tokens: usize,
        output_tokens: usize,
    },
    /// Short/long input × short/long output classes in one stream, each with its own SLO.
    Mixed { classes: Vec<Class> },
    /// A replayed JSONL trace (`--trace`); not a YAML workload.
    #[serde(skip)]
    Trace(super::trace::Trace),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub name: String,
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub weight: f64,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
}

impl Workload {
    pub fn by_name(name: &str) -> Option<Self> {
        Some(match name {
            "prefix-repetition" => Workload::PrefixRepetition {
                prefixes: 8,
                prefix_tokens: 384,
                unique_tokens: 128,
                output_tokens: 128,
            },
            "random" => Workload::Random {
                input_tokens: 512,
                output_tokens: 128,
            },
            "multi-turn" => Workload::MultiTurn {
                conversations: 32,
                turns: 6,
                system_tokens: 256,
                user_tokens: 64,
                output_tokens: 64,
            },
            "chat" => Workload::Chat {
                turns: 8,
                system_tokens: 1024,
                user_tokens: 64,
                output_tokens: 64,
            },
            "zipf" => Workload::Zipf {
                prefixes: 64,
                exponent: 1.1,
                prefix_tokens: 384,
                unique_tokens: 128,
                output_tokens: 128,
            },
            "mixed" => Workload::Mixed {
                classes: vec![
                    class("short-short", 128, 32, 0.4, 500.0, 100.0),
                    class("short-long", 128, 512, 0.2, 500.0, 100.0),
                    class("long-short", 2048, 32, 0.3, 2000.0, 150.0),
                    class("long-long", 2048, 512, 0.1, 2000.0, 150.0),
                ],
            },
            _ => return None,
        })
    }

    pub const NAMES: &'static str = "prefix-repetition, random, multi-turn, chat, zipf, mixed";

    /// Turns per conversation for conversational workloads: request `i` is turn `i % turns` of
    /// conversation `i / turns`, and the load generator sends a conversation's turns in order
    /// from one client, each when the previous one has ended. `None`: requests are independent.
    pub fn turns(&self) -> Option<u64> {
        match self {
            Workload::MultiTurn { turns, .. } | Workload::Chat { turns, .. } => {
                Some((*turns).max(1) as u64)
            }
            _ => None,
        }
    }

    /// Request `i` of the stream seeded by `seed`.
    pub fn request(&self, seed: u64, i: u64) -> RequestSpec {
        let r = splitmix(seed ^ splitmix(i.wrapping_add(1)));
        match self {
            Workload::PrefixRepetition {
                prefixes,
                prefix_tokens,
                unique_tokens,
                output_tokens,
            } => {
                let p = (r % (*prefixes).max(1) as u64) as usize;
                shared(seed, p, *prefix_tokens, r, *unique_tokens, *output_tokens)
            }
            Workload::Zipf {
                prefixes,
                exponent,
                prefix_tokens,
                unique_tokens,
                output_tokens,
            } => {
                let p = zipf_pick(*prefixes, *exponent, unit(r));
                shared(seed, p, *prefix_tokens, r, *unique_tokens, *output_tokens)
            }
            Workload::Random {
                input_tokens,
                output_tokens,
            } => RequestSpec::completion(words(r, *input_tokens), *output_tokens, "random"),
            Workload::MultiTurn {
                turns,
                system_tokens,
                user_tokens,
                output_tokens,
                ..
            } => {
                let turns = (*turns).max(1) as u64;
                let c = splitmix(seed ^ 0xc0de ^ (i / turns));
                let system = words(c, *system_tokens);
                conversation(
                    system,
                    c,
                    i % turns,
                    *user_tokens,
                    *output_tokens,
                    "multi-turn",
                )
            }
            Workload::Chat {
                turns,
                system_tokens,
                user_tokens,
                output_tokens,
            } => {
                let turns = (*turns).max(1) as u64;
                let c = splitmix(seed ^ 0xc4a7 ^ (i / turns));
                let system = words(splitmix(seed ^ 0x5157_e111), *system_tokens);
                conversation(system, c, i % turns, *user_tokens, *output_tokens, "chat")
            }
            Workload::Trace(t) => t.request(seed, i),
            Workload::Mixed { classes } => {
                let total: f64 = classes.iter().map(|c| c.weight).sum();
                let mut x = unit(r) * total;
                let c = classes
                    .iter()
                    .find(|c| {
                        x -= c.weight;
                        x < 0.0
                    })
                    .or(classes.last())
                    .expect("mixed workload has classes");
                let mut spec = RequestSpec::completion(
                    words(splitmix(r), c.input_tokens),
                    c.output_tokens,
                    &c.name,
                );
                spec.slo = Some((c.slo_ttft_ms, c.slo_tpot_ms));
                spec
            }
        }
    }
}

fn class(name: &str, i: usize, o: usize, weight: f64, ttft: f64, tpot: f64) -> Class {
    Class {
        name: name.into(),
        input_tokens: i,
        output_tokens: o,
        weight,
        slo_ttft_ms: ttft,
        slo_tpot_ms: tpot,
    }
}

/// Turn `turn` of the conversation seeded by `c`: the system prompt, every earlier user message
/// with a fixed assistant reply, and the new user message.
fn conversation(
    system: String,
    c: u64,
    turn: u64,
    user_tokens: usize,
    output_tokens: usize,
    class: &str,
) -> RequestSpec {
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..=turn {
        let u = splitmix(c ^ (t + 1));
        messages.push(json!({"role": "user", "content": words(u, user_tokens)}));
        if t < turn {
            messages
                .push(json!({"role": "assistant", "content": words(splitmix(u), output_tokens)}));
        }
    }
    RequestSpec {
        body: json!({"messages": messages, "max_tokens": output_tokens}),
        chat: true,
        output_tokens,
        class: class.into(),
        slo: None,
    }
}

fn shared(seed: u64, p: usize, len: usize, r: u64, unique: usize, out: usize) -> RequestSpec {
    let mut prompt = words(splitmix(seed ^ 0x5eed_0000 ^ p as u64), len);
    prompt.push_str(&words(splitmix(r ^ 0xface), unique));
    let mut spec = RequestSpec::completion(prompt, out, "shared");
    spec.class = format!("prefix-{p}");
    spec
}

/// One request: the JSON body without `model`/`stream` (the generator adds them).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    pub body: Value,
    pub chat: bool,
    pub output_tokens: usize,
    pub class: String,
    /// Per-class SLO (TTFT ms, TPOT ms), overriding the run's.
    pub slo: Option<(f64, f64)>,
}

impl RequestSpec {
    fn completion(prompt: String, output_tokens: usize, class: &str) -> Self {
        Self {
            body: json!({"prompt": prompt, "max_tokens": output_tokens}),
            chat: false,
            output_tokens,
            class: class.into(),
            slo: None,
        }
    }
}

/// Common words that are one token in the simulator and in the major open-model vocabularies.
const WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " is", " it", " you", " was", " for", " on", " are",
    " as", " his", " at", " be", " had", " by", " but", " not", " all", " we", " can", " use",
    " an", " she", " do", " how", " if", " up", " out", " so", " her", " him", " my", " new",
    " now", " way", " day", " may", " see", " two", " get", " sun", " sea", " old", " red", " run",
    " big", " low", " far", " key", " map", " end", " man", " car", " dog", " cat", " box", " top",
    " war", " law", " art", " job",
];

/// `n` words from the stream seeded by `seed`.
pub fn words(seed: u64, n: usize) -> String {
    let mut s = String::with_capacity(n * 4);
    let mut x = seed;
    for _ in 0..n {
        x = splitmix(x);
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    s
}

/// A uniform number in [0, 1) from a hash.
pub fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

fn zipf_pick(n: usize, s: f64, u: f64) -> usize {
    let n = n.max(1);
    let total: f64 = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).sum();
    let mut x = u * total;
    for k in 1..=n {
        x -= 1.0 / (k as f64).powf(s);
        if x < 0.0 {
            return k - 1;
        }
    }
    n - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    fn prompt(s: &RequestSpec) -> String {
        s.body["prompt"].as_str().unwrap().to_string()
    }

    #[test]
    fn prefix_repetition_has_exactly_p_distinct_prefixes_and_unique_tails() {
        let w = Workload::by_name("prefix-repetition").unwrap();
        let reqs: Vec<RequestSpec> = (0..400).map(|i| w.request(7, i)).collect();
        let heads: HashSet<String> = reqs
            .iter()
            .map(|r| prompt(r).split_inclusive(' ').take(385).collect())
            .collect();
        assert_eq!(heads.len(), 8);
        let whole: HashSet<String> = reqs.iter().map(prompt).collect();
        assert_eq!(whole.len(), 400, "every request has its own tail");
        assert!(reqs
            .iter()
            .all(|r| prompt(r).split(' ').count() == 1 + 384 + 128));
    }

    #[test]
    fn the_same_seed_gives_the_same_stream_and_another_seed_another() {
        for name in Workload::NAMES.split(", ") {
            let w = Workload::by_name(name).unwrap();
            let a: Vec<_> = (0..50).map(|i| w.request(1, i)).collect();
            let b: Vec<_> = (0..50).map(|i| w.request(1, i)).collect();
            let c: Vec<_> = (0..50).map(|i| w.request(2, i)).collect();
            assert_eq!(a, b, "{name}");
            assert_ne!(a, c, "{name}");
        }
    }

    #[test]
    fn random_requests_share_nothing() {
        let w = Workload::by_name("random").unwrap();
        let firsts: HashSet<String> = (0..200)
            .map(|i| {
                prompt(&w.request(3, i))
                    .split_inclusive(' ')
                    .take(17)
                    .collect()
            })
            .collect();
        assert_eq!(firsts.len(), 200);
    }

    fn messages(w: &Workload, i: u64) -> Vec<Value> {
        w.request(5, i).body["messages"].as_array().unwrap().clone()
    }

    #[test]
    fn multi_turn_resends_the_whole_history() {
        let w = Workload::by_name("multi-turn").unwrap();
        let turns = w.turns().unwrap();
        assert_eq!(turns, 6);
        for conv in 0..10 {
            for t in 0..turns - 1 {
                let a = messages(&w, conv * turns + t);
                let b = messages(&w, conv * turns + t + 1);
                assert_eq!(
                    b.len(),
                    a.len() + 2,
                    "one assistant reply and one new user turn"
                );
                assert_eq!(&b[..a.len()], &a[..], "history resent unchanged");
            }
        }
        // After the last turn a new conversation starts with a new system prompt.
        let last = messages(&w, turns - 1);
        let fresh = messages(&w, turns);
        assert_eq!(last.len(), 12);
        assert_eq!(fresh.len(), 2);
        assert_ne!(last[0], fresh[0]);
    }

    #[test]
    fn chat_shares_one_system_prompt_and_keeps_conversations_apart() {
        let w = Workload::by_name("chat").unwrap();
        let turns = w.turns().unwrap();
        let systems: HashSet<String> = (0..200).map(|i| messages(&w, i)[0].to_string()).collect();
        assert_eq!(
            systems.len(),
            1,
            "every conversation starts with the same system prompt"
        );
        let system_words = messages(&w, 0)[0]["content"]
            .as_str()
            .unwrap()
            .split(' ')
            .count();
        assert_eq!(system_words, 1 + 1024);
        let first_users: HashSet<String> = (0..50)
            .map(|c| messages(&w, c * turns)[1].to_string())
            .collect();
        assert_eq!(
            first_users.len(),
            50,
            "conversations differ from their first user turn"
        );
        let a = messages(&w, 3);
        let b = messages(&w, 4);
        assert_eq!(
            &b[..a.len()],
            &a[..],
            "a later turn extends the earlier one"
        );
    }

    #[test]
    fn zipf_makes_one_prefix_dominate() {
        let w = Workload::by_name("zipf").unwrap();
        let mut counts: HashMap<String, usize> = HashMap::new();
        for i in 0..2000 {
            *counts.entry(w.request(9, i).class).or_default() += 1;
        }
        let hot = counts["prefix-0"];
        assert!(hot > 2000 / 6, "hot prefix {hot}");
        assert!(counts.values().all(|&c| c <= hot));
        assert!(counts.len() > 20, "a long tail too");
    }

    #[test]
    fn mixed_follows_class_weights_and_carries_slos() {
        let w = Workload::by_name("mixed").unwrap();
        let mut counts: HashMap<String, usize> = HashMap::new();
        for i in 0..4000 {
            let r = w.request(11, i);
            assert!(r.slo.is_some());
            *counts.entry(r.class).or_default() += 1;
        }
        let share = |c: &str| counts[c] as f64 / 4000.0;
        assert!((share("short-short") - 0.4).abs() < 0.04);
        assert!((share("long-long") - 0.1).abs() < 0.03);
    }
}
