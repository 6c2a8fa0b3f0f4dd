//! The policy's unit tests, by concern in the files below: small pools, requests of chained block
//! hashes, and the proxy's in-flight accounting held by hand. This file holds the shared helpers
//! and the tests of the cost's terms and of learning.

mod conversations;
mod events;
mod hot;
mod large_pool;
mod replicas;

use super::{
    known::kth_largest,
    pass::{mix, NOTED},
    *,
};
use crate::{policy::Usage, workers::test_workers};

pub(super) fn policy() -> CacheAware {
    CacheAware::new(CacheAwareParams::default())
}

/// Weights 1 and 64 tokens per queued request whatever its context, so the arithmetic in
/// the comments is plain tokens.
pub(super) fn unit() -> CacheAware {
    CacheAware::new(CacheAwareParams {
        miss_weight: 1.0,
        pending_weight: 1.0,
        request_cost_tokens: 64.0,
        context_weight: 0.0,
        ..CacheAwareParams::default()
    })
}

/// A request in flight on `w` as the proxy accounts it: its slot, `pending` uncached tokens
/// until it answers and a `context`-token prompt until it ends.
pub(super) fn hold(
    w: &Arc<Worker>,
    pending: u64,
    context: u64,
) -> (crate::workers::InflightGuard, crate::load::RequestLoad) {
    (
        w.acquire(),
        crate::load::RequestLoad::new(w, pending, context),
    )
}

/// Places `requests` one after another, each held in flight unstarted (`pending` tokens to
/// prefill, `context` in all) as the proxy would hold it: how many went to each worker.
pub(super) fn arrive_together(
    p: &CacheAware,
    ws: &[Arc<Worker>],
    requests: impl Iterator<Item = RequestInfo>,
    (pending, context): (u64, u64),
) -> Vec<usize> {
    let mut held = Vec::new();
    let mut per_worker = vec![0; ws.len()];
    for r in requests {
        let s = pick(p, ws, &r);
        per_worker[s.index] += 1;
        held.push(hold(&ws[s.index], pending, context));
    }
    per_worker
}

/// Times `w`'s steps as `base` plus `per_token` microseconds per prefill token over 40 steps,
/// its last burst `ago` microseconds before `now` (as [`crate::load::StepClock`] sees a worker's
/// streams).
pub(super) fn timed(w: &Worker, now: u64, ago: u64, (base, per_token): (u64, u64)) {
    let prefills = [0u64, 128, 0, 512, 256, 0, 0, 1024];
    let total: u64 = (0..40).map(|i| base + per_token * prefills[i % 8]).sum();
    let mut t = now - ago - total;
    for i in 0..40 {
        let x = prefills[i % 8];
        t += base + per_token * x;
        w.steps.frame(t, x, || 0);
        w.steps.frame(t + 100, 0, || 0);
    }
    assert_eq!(t, now - ago);
}

/// A conversation: `shared` blocks common to all, then `own` blocks of conversation `c`.
pub(super) fn convo(c: u64, shared: u64, own: u64) -> RequestInfo {
    let hashes = (0..shared)
        .chain((0..own).map(|i| (c + 1) << 32 | i))
        .collect();
    RequestInfo::keyed(hashes, 256)
}

pub(super) fn pick(p: &CacheAware, ws: &[Arc<Worker>], r: &RequestInfo) -> Selection {
    p.select(ws, r).unwrap()
}

/// Workers that all publish events and hold none of 4-token blocks of unrelated tokens.
pub(super) fn workers_with_events(n: usize) -> Vec<Arc<Worker>> {
    workers_storing(n, vec![7], vec![u32::MAX; 4])
}

/// Workers that all publish events, each of which stored `tokens` as blocks of 4 tokens.
pub(super) fn workers_storing(
    n: usize,
    block_hashes: Vec<u64>,
    tokens: Vec<u32>,
) -> Vec<Arc<Worker>> {
    use crate::kv_events::{Feed, KvEvent};
    let metrics = crate::metrics::Metrics::new();
    (0..n)
        .map(|i| {
            let cfg =
                crate::config::WorkerConfig::from_url(format!("http://127.0.0.1:{}", 12000 + i));
            let mut w = Worker::new(&cfg, &metrics).unwrap();
            let feed = Feed::new(1000);
            feed.blocks().apply(&KvEvent::BlockStored {
                block_hashes: block_hashes.clone(),
                parent_block_hash: None,
                token_ids: tokens.clone(),
                block_size: 4,
                lora_id: None,
                lora_name: None,
                medium: None,
                group: Default::default(),
                block_keys: Vec::new(),
                lookahead: Vec::new(),
            });
            w.events = Some(Arc::new(feed));
            Arc::new(w)
        })
        .collect()
}

/// A gateway whose index holds the 4-block system prompt on every worker.
pub(super) fn knowing_the_system_prompt(
    ws: &[Arc<Worker>],
    params: CacheAwareParams,
) -> CacheAware {
    let p = CacheAware::new(params);
    for w in ws {
        p.index.insert(&[0, 1, 2, 3], w.id_hash);
    }
    p
}

/// Two replicas whose indexes hold the 4-block system prompt on every worker.
pub(super) fn two_replicas_knowing_the_system_prompt(
    ws: &[Arc<Worker>],
) -> (CacheAware, CacheAware) {
    let knowing = || knowing_the_system_prompt(ws, CacheAwareParams::default());
    (knowing(), knowing())
}

/// Four requests of this gateway's in flight on every worker, and a poll that saw as many
/// again from elsewhere (another replica's). The guards hold this gateway's requests.
pub(super) fn another_replica_as_busy(ws: &[Arc<Worker>]) -> Vec<crate::workers::InflightGuard> {
    polled_beside_four_of_ours(ws, 8.0)
}

/// Four requests of this gateway's in flight on every worker, and a poll that saw `running`
/// there in all (the rest other replicas'). The guards hold this gateway's requests.
pub(super) fn polled_beside_four_of_ours(
    ws: &[Arc<Worker>],
    running: f64,
) -> Vec<crate::workers::InflightGuard> {
    let mut mine = Vec::new();
    for w in ws {
        mine.extend((0..4).map(|_| w.acquire()));
        let polled = crate::load::Polled {
            running,
            ..Default::default()
        };
        w.polled(Some(polled), 4, 0);
    }
    mine
}

#[test]
fn the_default_weighs_a_miss_three_times_its_tokens_and_a_queued_request_by_its_context() {
    // A 576-token request whose first 512 tokens its holder holds: 192 weighted tokens of
    // prefill there, 1,728 elsewhere, and up to 96 of credit (3 × 0.5 × its 64 unknown tokens)
    // on whichever worker is the home of its last block. A queued request costs 4 + 0.04 × its
    // prompt tokens. The prefix is not hot (other traffic came between its requests), so an
    // idle worker gets no credit for it.
    let ws = test_workers(3);
    let other_traffic = |p: &CacheAware| {
        for k in 0..ws.len() as u64 {
            p.index.insert(&[1 << 60 | k], ws[0].id_hash);
        }
    };
    let p = policy();
    let holder = pick(&p, &ws, &convo(0, 8, 0)).index;
    other_traffic(&p);
    // 512-token requests in flight cost 24.48 each: it stays at 58 (1,612) ...
    let mut held: Vec<_> = (0..58).map(|_| hold(&ws[holder], 0, 512)).collect();
    assert_eq!(pick(&p, &ws, &convo(5, 8, 1)).index, holder);
    other_traffic(&p);
    // ... and is copied at 67 (1,832).
    held.extend((0..9).map(|_| hold(&ws[holder], 0, 512)));
    assert_ne!(pick(&p, &ws, &convo(6, 8, 1)).index, holder);
    drop(held);
    // 2,048-token conversations in flight cost 85.92 each: it stays at 15 (1,481) and is
    // copied at 20 (1,910). (A fresh policy: the first one now knows a copy.)
    let p = policy();
    let holder = pick(&p, &ws, &convo(0, 8, 0)).index;
    other_traffic(&p);
    let mut held: Vec<_> = (0..15).map(|_| hold(&ws[holder], 0, 2048)).collect();
    assert_eq!(pick(&p, &ws, &convo(7, 8, 1)).index, holder);
    other_traffic(&p);
    held.extend((0..5).map(|_| hold(&ws[holder], 0, 2048)));
    assert_ne!(pick(&p, &ws, &convo(8, 8, 1)).index, holder);
    drop(held);
}

#[test]
fn simultaneous_arrivals_spread_instead_of_herding() {
    let ws = test_workers(4);
    let p = policy();
    let per_worker = arrive_together(&p, &ws, (0..40).map(|c| convo(100 + c, 0, 4)), (256, 256));
    // Each new prompt's home is credited its unknown 256 tokens × 0.5 × 3 = 384 tokens; each
    // request placed costs 0.5 × 256 pending + 4 + 0.04 × 256 = 142: no worker gets more
    // than three requests ahead of the least loaded.
    let (min, max) = (per_worker.iter().min(), per_worker.iter().max());
    assert!(
        max.zip(min).is_some_and(|(a, b)| a - b <= 3),
        "{per_worker:?}"
    );
}

#[test]
fn a_failed_request_takes_back_only_what_it_added() {
    let ws = test_workers(2);
    let p = policy();
    let s1 = pick(&p, &ws, &convo(1, 2, 1));
    let r2 = convo(1, 2, 4);
    let s2 = pick(&p, &ws, &r2);
    assert_eq!(s2.index, s1.index);
    p.observe(&ws[s2.index], &r2, &s2, Observed::Failed);
    let m = p.index.matches(&r2.block_hashes, 2, 0.0);
    assert_eq!(m.depth_of(ws[s1.index].id_hash), 3, "turn 1's blocks stay");
}

#[test]
fn usage_teaches_bytes_per_token_and_trust() {
    let ws = test_workers(2);
    let p = policy();
    let r = convo(1, 4, 0); // 1,024 bytes
    let s = pick(&p, &ws, &r);
    let w = &ws[s.index];
    for _ in 0..100 {
        let s = pick(&p, &ws, &r);
        p.observe(
            w,
            &r,
            &s,
            Observed::Answered(Some(Usage {
                prompt_tokens: 512,
                cached_tokens: Some(0),
                completion_tokens: None,
            })),
        );
    }
    assert!(
        (p.bytes_per_token() - 2.0).abs() < 0.05,
        "{}",
        p.bytes_per_token()
    );
    assert!(w.load.cache_trust() < 0.05, "{}", w.load.cache_trust());
}

#[test]
fn unusable_workers_are_never_chosen_and_no_key_means_least_work() {
    let ws = test_workers(3);
    let p = policy();
    ws[1].eject_for(std::time::Duration::from_secs(60));
    let _busy = ws[0].acquire();
    let s = p.select(&ws, &RequestInfo::unkeyed()).unwrap();
    assert_eq!((s.index, s.outcome), (2, Outcome::Fallback));
    for c in 0..50 {
        assert_ne!(pick(&p, &ws, &convo(c, 1, 2)).index, 1);
    }
    ws[0].eject_for(std::time::Duration::from_secs(60));
    ws[2].eject_for(std::time::Duration::from_secs(60));
    assert!(p.select(&ws, &convo(1, 1, 1)).is_none());
}

/// Eight workers, a policy whose queued request costs 80 tokens (`new_prompt_by_reuse` as
/// given; `fresh_by_writes` off, so the credit goes to the home whatever was written where), a
/// 192-token prompt nothing of which is known, and its home (by rendezvous over its first
/// block).
pub(super) fn new_prompt_and_its_home(
    new_prompt_by_reuse: bool,
) -> (Vec<Arc<Worker>>, CacheAware, RequestInfo, usize) {
    new_prompt_and_its_home_with(CacheAwareParams {
        new_prompt_by_reuse,
        fresh_by_writes: false,
        ..CacheAwareParams::default()
    })
}

/// As [`new_prompt_and_its_home`], with the policy's other params from `params`.
pub(super) fn new_prompt_and_its_home_with(
    params: CacheAwareParams,
) -> (Vec<Arc<Worker>>, CacheAware, RequestInfo, usize) {
    let ws = test_workers(8);
    let r = convo(9, 0, 3);
    let home = (0..ws.len())
        .max_by_key(|&i| mix(r.block_hashes[0], ws[i].id_hash))
        .unwrap();
    let p = CacheAware::new(CacheAwareParams {
        miss_weight: 1.0,
        request_cost_tokens: 80.0,
        context_weight: 0.0,
        ..params
    });
    (ws, p, r, home)
}

/// Four workers rated as an L4 pair beside an L40S pair: workers 0 and 1 take three times as
/// long a step and a prefill token as 2 and 3, their last steps long over.
fn unlike_pool() -> Vec<Arc<Worker>> {
    let ws = test_workers(4);
    let now = crate::load::now_us();
    for (i, w) in ws.iter().enumerate() {
        let speed = if i < 2 { (120_000, 30) } else { (40_000, 10) };
        timed(w, now, 10_000_000, speed);
    }
    // Rated over enough polls to settle, with a request of this gateway's in flight on each
    // (workers are rated only while there is load, and it is this gateway's).
    let inflight: Vec<_> = ws.iter().map(|w| w.acquire()).collect();
    for _ in 0..150 {
        crate::load::rate_speeds(&ws);
    }
    drop(inflight);
    let slowness: Vec<f64> = ws.iter().map(|w| w.steps.slowness()).collect();
    assert!(
        (slowness[0] / slowness[2] - 3.0).abs() < 0.1 && slowness[0] == slowness[1],
        "{slowness:?}"
    );
    ws
}

#[test]
fn in_a_pool_of_unlike_gpus_each_worker_is_priced_in_its_own_time() {
    // An L4 pair beside an L40S pair; eight new prompts arrive together, each held unstarted.
    let ws = unlike_pool();
    let prompts = || (0..8).map(|c| convo(100 + c, 0, 4));
    // Placed by cost alone (no home's credit): by tokens the four are alike, two each.
    let by_cost = |price_by_speed| {
        CacheAware::new(CacheAwareParams {
            home_affinity: 0.0,
            fresh_by_writes: false,
            price_by_speed,
            ..CacheAwareParams::default()
        })
    };
    let even = arrive_together(&by_cost(false), &ws, prompts(), (256, 256));
    assert_eq!(even, [2, 2, 2, 2]);
    // In each worker's time (the median per token is 20 us: the slow ones 1.5 times it, the
    // fast ones 0.5), a prompt's prefill and the queue in front of it take a third as long on a
    // fast worker. Its 256 tokens missed cost 768 (three times), each prompt queued ahead about
    // 142 more (half its pending prefill, 4 for the request, 0.04 of its context): a fast worker
    // with k queued, (768 + 142 k) × 0.5, is cheaper than an idle slow one, 768 × 1.5, up to
    // k = 10. So all eight go to the fast two.
    let timed_pool = arrive_together(&by_cost(true), &ws, prompts(), (256, 256));
    assert_eq!(timed_pool, [0, 0, 4, 4]);
}

#[test]
fn workers_are_homes_in_proportion_to_their_speed() {
    let ws = test_workers(4);
    let homes = |slowness: [f64; 4], key: u64| {
        (0..4)
            .map(|i| (pass::home_rank(mix(key, ws[i].id_hash), slowness[i]), i))
            .fold(
                (f64::NEG_INFINITY, 4),
                |top, x| if x.0 > top.0 { x } else { top },
            )
            .1
    };
    let keys = (0..40_000u64).map(|k| xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes()));
    let (mut share, mut plain, mut agree) = ([0usize; 4], 0, 0);
    for key in keys {
        let home = homes([1.5, 1.5, 0.5, 0.5], key);
        share[home] += 1;
        // Rated alike, the highest score: the plain rendezvous home.
        let top = (0..4).max_by_key(|&i| mix(key, ws[i].id_hash)).unwrap();
        plain += usize::from(homes([1.0; 4], key) == top);
        // Another replica's ratings of the same workers, each a little off.
        agree += usize::from(homes([1.4, 1.6, 0.45, 0.55], key) == home);
    }
    // Weights 1/1.5 and 1/0.5: an eighth of the keys each, and three eighths.
    for (got, want) in share.iter().zip([0.125, 0.125, 0.375, 0.375]) {
        assert!((*got as f64 / 40_000.0 - want).abs() < 0.01, "{share:?}");
    }
    assert_eq!(plain, 40_000);
    assert!(agree > 36_000, "{agree} of 40,000");
    // The rank rises with the score (to the float's precision) across a power of two, and is
    // about `slowness × log2(u)`.
    let rank = |score| pass::home_rank(score, 1.0);
    assert!(rank(0) < rank(1) && rank((1 << 63) - (1 << 12)) < rank(1 << 63));
    assert!(rank(u64::MAX - (1 << 12)) < rank(u64::MAX) && rank(u64::MAX) <= 0.0);
    assert!((pass::home_rank(3 << 61, 2.0) - 2.0 * (0.375f64).log2()).abs() < 0.02);
}

#[test]
fn in_a_pool_of_unlike_gpus_new_prompts_start_on_homes_where_the_capacity_is() {
    // With the home's credit as large as the prompt's cost, each new prompt goes to its home
    // on an idle pool: 400 of them, one after another, show where the homes are.
    let ws = unlike_pool();
    let placed = |home_by_speed| {
        let p = CacheAware::new(CacheAwareParams {
            home_affinity: 1.0,
            new_prompt_by_reuse: false,
            fresh_by_writes: false,
            home_by_speed,
            ..CacheAwareParams::default()
        });
        let mut per_worker = [0; 4];
        for c in 0..400 {
            let s = pick(&p, &ws, &convo(1_000 + c, 0, 4));
            assert_eq!(s.outcome, Outcome::HashHome);
            per_worker[s.index] += 1;
        }
        per_worker
    };
    // An eighth each on the slow pair and three eighths each on the fast one, against a quarter
    // each by the plain hash.
    let by_speed = placed(true);
    assert!(by_speed[0] + by_speed[1] < 140, "{by_speed:?}");
    let plain = placed(false);
    assert!(plain[0] + plain[1] > 160, "{plain:?}");
}
