//! A/B arms: a weighted split of traffic between routing policies, sticky per client.
//!
//! Algorithm: the client's key is the value of the sticky header (e.g. a session or user id) when
//! the request carries it, else the hash of the prompt's first routing block, so one conversation or
//! one shared prefix stays in one arm. The key's xxh3 hash, scaled to [0, total weight), falls into
//! one arm's weight interval. Deterministic, so gateway replicas agree with no shared state.
//! Complexity: O(arms) per request. Without an `ab` section the gateway runs one arm named after its
//! policy.

use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{build, Policy};
use crate::config::{AbConfig, PolicyConfig};
use crate::loop_copy::Handle;
use crate::routing_key::RequestInfo;

/// Response header naming the arm that routed the request.
pub const ARM_HEADER: &str = "x-kvroute-arm";

const ARM_SEED: u64 = 0x6b76_726f_7574_6561;

pub struct Arm {
    /// The `arm` label on metrics.
    pub name: Arc<str>,
    pub policy: Arc<dyn Policy>,
    weight: f64,
    /// `routing_decisions` by outcome (`Outcome as usize`), looked up on first use.
    decisions: [std::sync::OnceLock<crate::metrics::sharded::Counter>; super::Outcome::COUNT],
}

impl Arm {
    pub fn new(name: &str, policy: Arc<dyn Policy>) -> Self {
        Self {
            name: name.into(),
            policy,
            weight: 1.0,
            decisions: Default::default(),
        }
    }

    /// Counts one routing decision of this arm.
    pub fn count_decision(&self, metrics: &crate::metrics::MetricSet, outcome: super::Outcome) {
        let labels = || {
            metrics.routing_decisions.with_label_values(&[
                self.policy.name(),
                &self.name,
                outcome.as_str(),
            ])
        };
        // An outcome past `Outcome::COUNT` (one added without updating it) is looked up by its
        // labels, never indexed out of bounds.
        match self.decisions.get(outcome as usize) {
            Some(counter) => counter.get_or_init(labels).inc(),
            None => labels().inc(),
        }
    }
}

pub struct Arms {
    arms: Vec<Arm>,
    total: f64,
    header: Option<HeaderName>,
}

impl Arms {
    pub fn new(policy: &PolicyConfig, ab: Option<&AbConfig>) -> Self {
        let Some(ab) = ab else {
            return Self {
                arms: vec![Arm::new(policy.name(), build(policy))],
                total: 1.0,
                header: None,
            };
        };
        let arms: Vec<Arm> = ab
            .arms
            .iter()
            .map(|a| Arm {
                weight: a.weight,
                ..Arm::new(&a.name, build(&a.policy))
            })
            .collect();
        Self {
            total: arms.iter().map(|a| a.weight).sum(),
            arms,
            header: ab
                .sticky_header
                .as_deref()
                .and_then(|h| HeaderName::try_from(h).ok()),
        }
    }

    /// Arms of one arm, `arm`.
    pub fn single(arm: Arm) -> Self {
        Self {
            arms: vec![arm],
            total: 1.0,
            header: None,
        }
    }

    pub fn pick(&self, headers: &HeaderMap, info: &RequestInfo) -> &Arm {
        &self.arms[self.pick_index(headers, info)]
    }

    /// The arm a request holds until it ends, picked as [`Arms::pick`] does, held through `arms`
    /// (an event loop's handle on the arms).
    pub fn pick_held(arms: &Handle<Arms>, headers: &HeaderMap, info: &RequestInfo) -> HeldArm {
        HeldArm {
            index: arms.pick_index(headers, info),
            arms: Arc::clone(arms),
        }
    }

    fn pick_index(&self, headers: &HeaderMap, info: &RequestInfo) -> usize {
        if self.arms.len() == 1 {
            return 0;
        }
        let key = match self.header.as_ref().and_then(|h| headers.get(h)) {
            Some(v) => xxh3_64_with_seed(v.as_bytes(), ARM_SEED),
            None => xxh3_64_with_seed(&info.key_at_depth(1).unwrap_or(0).to_le_bytes(), ARM_SEED),
        };
        let mut x = (key >> 11) as f64 / (1u64 << 53) as f64 * self.total;
        for (i, arm) in self.arms.iter().enumerate() {
            x -= arm.weight;
            if x < 0.0 {
                return i;
            }
        }
        self.arms.len() - 1
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arm> {
        self.arms.iter()
    }

    /// `(policy, arm)` labels for a request that failed before an arm was picked.
    pub fn unpicked_labels(&self) -> (&str, &str) {
        match self.arms.as_slice() {
            [only] => (only.policy.name(), &only.name),
            _ => ("none", "none"),
        }
    }

    /// Describes the arms for the log, e.g. `prefix` or `a=round_robin:1, b=prefix:1`.
    pub fn describe(&self) -> String {
        if let [only] = self.arms.as_slice() {
            return only.policy.name().to_string();
        }
        self.arms
            .iter()
            .map(|a| format!("{}={}:{}", a.name, a.policy.name(), a.weight))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An arm that a request holds until its answer ends (what its policy learns from is told then).
///
/// Held through an event loop's handle on the arms, whose count only that loop writes: a clone
/// of the policy's own `Arc` would write a count that every loop's requests write
/// ([`crate::loop_copy`]).
#[derive(Clone)]
pub struct HeldArm {
    arms: Handle<Arms>,
    index: usize,
}

impl HeldArm {
    /// The only arm of `arms`, held through a handle of its own.
    pub fn only(arm: Arm) -> Self {
        Self {
            arms: Arc::new(Arc::new(Arms::single(arm))),
            index: 0,
        }
    }

    /// The same arm through a handle for one more event loop.
    pub fn for_loop(&self) -> Self {
        Self {
            arms: Arc::new(Arc::clone(&*self.arms)),
            index: self.index,
        }
    }
}

impl std::ops::Deref for HeldArm {
    type Target = Arm;

    fn deref(&self) -> &Arm {
        &self.arms.arms[self.index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ArmConfig, PrefixParams};

    fn ab(weights: &[f64]) -> Arms {
        let arms = weights
            .iter()
            .enumerate()
            .map(|(i, w)| ArmConfig {
                name: format!("arm{i}"),
                weight: *w,
                policy: PolicyConfig::Prefix(PrefixParams::default()),
            })
            .collect();
        let cfg = AbConfig {
            arms,
            sticky_header: Some("x-session-id".into()),
        };
        Arms::new(&PolicyConfig::RoundRobin, Some(&cfg))
    }

    fn session(id: u64) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-session-id", id.to_string().parse().unwrap());
        h
    }

    #[test]
    fn a_session_always_gets_the_same_arm_and_weights_hold() {
        let arms = ab(&[1.0, 3.0]);
        let info = RequestInfo::unkeyed();
        let mut first = 0;
        for id in 0..4000 {
            let a = arms.pick(&session(id), &info).name.clone();
            assert_eq!(arms.pick(&session(id), &info).name, a);
            if &*a == "arm0" {
                first += 1;
            }
        }
        let share = first as f64 / 4000.0;
        assert!((share - 0.25).abs() < 0.03, "{share}");
    }

    #[test]
    fn without_the_header_the_prompt_prefix_decides() {
        let arms = ab(&[1.0, 1.0]);
        let info = |k: u64| RequestInfo::keyed(vec![k, k + 1], 256);
        let seen: std::collections::HashSet<_> = (0..64)
            .map(|k| arms.pick(&HeaderMap::new(), &info(k)).name.clone())
            .collect();
        assert_eq!(seen.len(), 2, "prefixes spread over both arms");
        for k in 0..64 {
            let a = arms.pick(&HeaderMap::new(), &info(k)).name.clone();
            assert_eq!(arms.pick(&HeaderMap::new(), &info(k)).name, a);
        }
    }
}
