//! Pools larger than [`PRICE_ALL_UP_TO`], priced on a sample that keeps every holder and the home.

use super::*;

/// A pool larger than [`PRICE_ALL_UP_TO`]: a decision prices a sample for load, but always
/// the workers holding the prompt, wherever the sample falls.
#[test]
fn in_a_large_pool_a_conversation_follows_its_holder_whatever_the_sample() {
    let ws = test_workers(1024);
    let p = unit();
    let home = pick(&p, &ws, &convo(1, 0, 1)).index;
    p.index
        .remove(&convo(1, 0, 1).block_hashes, ws[home].id_hash);
    // The home busy (20 × 64 tokens against half its 256 unknown tokens of credit): the first
    // turn goes to some idle worker, not the home.
    let _busy: Vec<_> = (0..20).map(|_| ws[home].acquire()).collect();
    let holder = pick(&p, &ws, &convo(1, 0, 4)).index;
    assert_ne!(holder, home);
    // Each later turn is cheapest on the holder (it misses only the new turn); the sample
    // rotates through all 1,024 workers over these 16 decisions, and holds it in one.
    for turn in 2..=17 {
        let s = pick(&p, &ws, &convo(1, 0, 4 * turn));
        assert_eq!(s.index, holder, "turn {turn}: {s:?}");
        assert_eq!(s.outcome, Outcome::LongestMatch);
    }
}

/// In a large idle pool every new prompt goes to its rendezvous home among all the workers,
/// as it does in a small pool where all are priced: replicas agree on it.
#[test]
fn in_a_large_pool_a_new_prompt_goes_to_its_home_among_all_workers() {
    let ws = test_workers(1024);
    let p = policy();
    for c in 0..32 {
        let r = convo(500 + c, 0, 2);
        let key = r.block_hashes[0];
        let home = (0..ws.len())
            .max_by_key(|&i| mix(key, ws[i].id_hash))
            .unwrap();
        let s = p.peek(&ws, &r).unwrap();
        assert_eq!(
            (s.index, s.outcome),
            (home, Outcome::HashHome),
            "prompt {c}"
        );
    }
}

/// What sampling gives up, stated: in a large pool a lone idle worker is found when the
/// rotating sample holds it (one decision in 16 at 1,024 workers: twice in 32), and otherwise
/// the home takes the request at one request in flight, like every other sampled worker.
#[test]
fn in_a_large_pool_a_lone_idle_worker_is_found_once_per_turn_of_the_sample() {
    let ws = test_workers(1024);
    let p = unit();
    let r = convo(9, 0, 1);
    let home = p.peek(&ws, &r).unwrap().index;
    let idle = if home == 5 { 6 } else { 5 };
    let _busy: Vec<_> = (0..ws.len())
        .filter(|&i| i != idle)
        .map(|i| ws[i].acquire())
        .collect();
    // The home costs 64 + 64 - 32 (half its unknown 64 tokens credited), the idle worker
    // 64, every other 128.
    let choices: Vec<usize> = (0..32).map(|_| p.peek(&ws, &r).unwrap().index).collect();
    let found = choices.iter().filter(|&&i| i == idle).count();
    assert_eq!(found, 2, "{choices:?}");
    assert!(
        choices.iter().all(|&i| i == idle || i == home),
        "{choices:?}"
    );
    // In a pool small enough to price every worker, it is found every time.
    let small = &ws[..PRICE_ALL_UP_TO];
    assert!((0..4).all(|_| p.peek(small, &r).unwrap().index == idle));
}

/// The light pass notes the workers whose bit is among the holders' and looks them up after
/// it; past [`NOTED`] of them it searches the pool again. Either way every holder is priced:
/// a conversation whose prefix seven workers hold goes to the one of them that is idle.
#[test]
fn in_a_large_pool_every_holder_is_priced_however_many_workers_share_their_bits() {
    for n in [1024, 4096] {
        let ws = test_workers(n);
        // Not spreading: the prefix, all of this fresh index's traffic on seven holders with
        // 30 in flight each, would be presumed on every worker, and this is about the holders.
        let p = CacheAware::new(CacheAwareParams {
            spread_share: 0.0,
            ..unit().params
        });
        let r = convo(3, 0, 8);
        let holders: Vec<usize> = (0..7).map(|k| (k * 577 + 13) % n).collect();
        for &h in &holders {
            p.index.insert(&r.block_hashes[..4], ws[h].id_hash);
        }
        let bits = holders
            .iter()
            .fold(0u64, |m, &h| m | 1 << (ws[h].id_hash & 63));
        let sharing = ws
            .iter()
            .filter(|w| bits & 1 << (w.id_hash & 63) != 0)
            .count();
        // 1,024 workers take the noted path, 4,096 the search.
        assert_eq!(
            sharing > NOTED,
            n > 1024,
            "{n} workers: {sharing} share a bit"
        );
        let idle = holders[4];
        let _busy: Vec<_> = holders
            .iter()
            .filter(|&&h| h != idle)
            .flat_map(|&h| (0..30).map(move |_| h))
            .map(|h| ws[h].acquire())
            .collect();
        // The idle holder misses 4 of 8 blocks; any other idle worker all 8, less the home's
        // credit for half of the unknown 4.
        for _ in 0..8 {
            let s = p.peek(&ws, &r).unwrap();
            assert_eq!(
                (s.index, s.outcome),
                (idle, Outcome::LongestMatch),
                "{n} workers"
            );
        }
    }
}

/// The light pass reads usability only for the highest score: when that worker is down, a
/// new prompt goes to the usable worker with the next highest, as pricing all of them does.
#[test]
fn in_a_large_pool_a_new_prompt_whose_home_is_down_goes_to_the_next_highest_score() {
    let ws = test_workers(1024);
    let p = policy();
    for c in 0..8 {
        let r = convo(700 + c, 0, 2);
        let score = |i: &usize| mix(r.block_hashes[0], ws[*i].id_hash);
        let home = (0..ws.len()).max_by_key(score).unwrap();
        ws[home].set_down(true);
        let next = (0..ws.len())
            .filter(|&i| i != home)
            .max_by_key(score)
            .unwrap();
        let s = p.peek(&ws, &r).unwrap();
        assert_eq!(
            (s.index, s.outcome),
            (next, Outcome::HashHome),
            "prompt {c}"
        );
        ws[home].set_down(false);
    }
}
