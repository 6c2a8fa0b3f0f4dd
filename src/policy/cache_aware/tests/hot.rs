//! Hot prefixes: copied when their holder is busy or a worker idles, spread by pending prefill
//! once most workers hold them, and presumed everywhere past a full holder list.

use super::*;

#[test]
fn a_hot_prefix_is_copied_when_its_holder_is_busy() {
    // The cost alone: without the idle workers' credit for a copy (tested below), which at a
    // mean of 2 in flight would copy the prefix sooner.
    let ws = test_workers(3);
    let p = CacheAware::new(CacheAwareParams {
        amortize_hot_copies: false,
        ..unit().params
    });
    let shared = convo(0, 8, 0); // 2,048 bytes: ~512 tokens at 4 bytes per token
    let home = pick(&p, &ws, &shared).index;
    // 6 requests in flight (384 tokens) cost less than recomputing the prefix elsewhere: it stays.
    let held: Vec<_> = (0..6).map(|_| ws[home].acquire()).collect();
    let s = pick(&p, &ws, &convo(5, 8, 1));
    assert_eq!((s.index, s.outcome), (home, Outcome::LongestMatch));
    // 9 (576 tokens) cost more: a copy goes to another worker.
    let more: Vec<_> = (0..3).map(|_| ws[home].acquire()).collect();
    let s = pick(&p, &ws, &convo(6, 8, 1));
    assert_ne!(s.index, home);
    assert_eq!(s.outcome, Outcome::Replicated);
    drop((held, more));
    // Now two workers hold the prefix, and each conversation sticks to where it went.
    assert_eq!(
        p.index.matches(&shared.block_hashes, 4, 0.0).depths.len(),
        2
    );
    assert_eq!(pick(&p, &ws, &convo(6, 8, 2)).index, s.index);
    assert_eq!(pick(&p, &ws, &convo(5, 8, 2)).index, home);
}

#[test]
fn with_a_load_bound_a_worker_without_the_shared_prefix_is_not_left_idle() {
    // Three workers hold a shared 512-token prefix and have 10 requests each; the fourth
    // holds nothing and has none. By cost alone (without spreading a popular prefix, which
    // this prefix, all of the index's traffic, would be; see the tests at the end), waiting
    // behind 10 requests (160 tokens at 16 each) is cheaper than copying the prefix (512
    // tokens): it stays with a holder. The bound (1.25 × 31 / 4, rounded up: 10) passes over
    // the three and sends it to the fourth.
    let ws = test_workers(4);
    let shared = convo(0, 8, 0);
    let run = |bound: f64| {
        let p = CacheAware::new(CacheAwareParams {
            load_bound: bound,
            request_cost_tokens: 16.0,
            amortize_hot_copies: false,
            spread_share: 0.0, // the prefix is all of this fresh index's traffic
            ..unit().params
        });
        for w in &ws[..3] {
            p.index.insert(&shared.block_hashes, w.id_hash);
        }
        let held: Vec<_> = ws[..3]
            .iter()
            .flat_map(|w| (0..10).map(|_| w.acquire()))
            .collect();
        let s = pick(&p, &ws, &convo(9, 8, 1));
        drop(held);
        s
    };
    let unbounded = run(0.0);
    assert!(unbounded.index < 3, "{unbounded:?}");
    assert_eq!(unbounded.outcome, Outcome::LongestMatch);
    let bounded = run(1.25);
    assert_eq!((bounded.index, bounded.outcome), (3, Outcome::Replicated));
    // Under the bound the cost decides as before: one fewer in flight on a holder, and it
    // takes the request.
    let p = CacheAware::new(CacheAwareParams {
        load_bound: 1.25,
        request_cost_tokens: 16.0,
        amortize_hot_copies: false,
        spread_share: 0.0,
        ..unit().params
    });
    for w in &ws[..3] {
        p.index.insert(&shared.block_hashes, w.id_hash);
    }
    let mut held: Vec<_> = ws[..3]
        .iter()
        .flat_map(|w| (0..10).map(|_| w.acquire()))
        .collect();
    held.pop(); // the third holder is down to 9 (cap: 1.25 × 30 / 4, rounded up: 10)
    let s = pick(&p, &ws, &convo(9, 8, 1));
    assert_eq!((s.index, s.outcome), (2, Outcome::LongestMatch));
}

#[test]
fn a_copy_of_a_hot_prefix_is_shared_by_the_requests_an_idle_worker_will_take() {
    // Three workers hold a shared 512-token prefix and have `busy` requests each; the fourth
    // has `idle` and holds `part` blocks of it. Each queued request costs 16 tokens.
    let ws = test_workers(4);
    let shared = convo(0, 8, 0);
    let run_spreading = |spread_share: f64, amortize: bool, busy: usize, idle, part| {
        let p = CacheAware::new(CacheAwareParams {
            request_cost_tokens: 16.0,
            amortize_hot_copies: amortize,
            spread_share,
            ..unit().params
        });
        for w in &ws[..3] {
            p.index.insert(&shared.block_hashes, w.id_hash);
        }
        if part > 0 {
            p.index.insert(&shared.block_hashes[..part], ws[3].id_hash);
        }
        let held: Vec<_> = ws[..3]
            .iter()
            .flat_map(|w| (0..busy).map(|_| w.acquire()))
            .chain((0..idle).map(|_| ws[3].acquire()))
            .collect();
        let s = pick(&p, &ws, &convo(9, 8, 1));
        drop(held);
        s
    };
    // The idle credit alone: the prefix here is all of the index's traffic, which spreading
    // a popular prefix would copy anyway (checked last).
    let run = |amortize, busy, idle, part| run_spreading(0.0, amortize, busy, idle, part);
    // Priced in full, the copy (512 tokens) costs more than waiting behind 12 (192 tokens):
    // the idle worker would stay idle.
    let full = run(false, 12, 0, 0);
    assert!(full.index < 3, "{full:?}");
    // Amortized: to an idle worker the hot prefix is priced as held, since every later
    // request there shares the copy: it costs the 64 tokens the holders would prefill too,
    // against their 192 of waiting (or 160 after the home's credit).
    let shared_copy = run(true, 12, 0, 0);
    assert_eq!(
        (shared_copy.index, shared_copy.outcome),
        (3, Outcome::Replicated)
    );
    // A worker that is not idle pays for the copy in full, however far below the mean (it
    // has 2, the mean is 9.5): locality is unchanged where loads are merely uneven.
    let busy = run(true, 12, 2, 0);
    assert!(busy.index < 3, "{busy:?}");
    // A worker that holds part of the prompt is priced by what it holds, as before: a
    // conversation does not scatter to workers that hold only its start.
    let partial = run(true, 12, 0, 2);
    assert!(partial.index < 3, "{partial:?}");
    // Spreading popular prefixes (the default): a prefix that is every request, with 36 in
    // flight on three holders busier than the pool's mean, is presumed on the fourth worker
    // too, busy or not, and goes there as a copy.
    let spread = CacheAwareParams::default().spread_share;
    for idle in [0, 2] {
        let s = run_spreading(spread, true, 12, idle, 0);
        assert_eq!((s.index, s.outcome), (3, Outcome::Replicated), "{idle}");
    }
    // A prefix only one worker holds and that no recent request went through is not hot:
    // its holder keeps it until its queue costs more than a copy, however idle the others.
    let p = CacheAware::new(CacheAwareParams {
        request_cost_tokens: 16.0,
        ..unit().params
    });
    p.index.insert(&shared.block_hashes, ws[0].id_hash);
    for k in 0..4 {
        p.index.insert(&[1 << 60 | k], ws[0].id_hash); // other traffic since
    }
    let held: Vec<_> = (0..12).map(|_| ws[0].acquire()).collect(); // 192 < 512 tokens
    let s = pick(&p, &ws, &convo(9, 8, 1));
    assert_eq!((s.index, s.outcome), (0, Outcome::LongestMatch));
    drop(held);
}

/// At light load, one long system prompt shared by every conversation (the bench's `chat` at
/// a few requests a second): whichever worker took the first request holds it, and pricing
/// a copy against one request's wait kept every later request there, with three workers
/// idle and every answer decoding beside all the others (e2e 1.3x round-robin's).
#[test]
fn a_prefix_every_request_shares_spreads_to_idle_workers_though_one_worker_holds_it() {
    let ws = test_workers(4);
    // 16 blocks of 256 bytes: 1,024 tokens of system prompt, then a 64-token question.
    let question = |c| convo(c, 16, 1);
    let p = policy();
    let first = pick(&p, &ws, &question(0)).index;
    // Twelve conversations in flight there (1,300 tokens each), one more arriving: the mean
    // in flight is over 1 and the others are idle.
    let held: Vec<_> = (0..12).map(|_| hold(&ws[first], 0, 1300)).collect();
    let s = pick(&p, &ws, &question(1));
    assert_ne!(s.index, first, "{s:?}");
    assert_eq!(s.outcome, Outcome::Replicated);
    // A conversation already on the holder stays: the idle worker would have to prefill its
    // earlier turns, which no recent request shares.
    p.index
        .insert(&convo(2, 16, 8).block_hashes, ws[first].id_hash);
    for c in 10..14 {
        pick(&p, &ws, &question(c)); // traffic since: the system prompt stays hot
    }
    assert_eq!(pick(&p, &ws, &convo(2, 16, 9)).index, first);
    drop(held);
    // Five in flight (a mean of 1.25; about 1.6 requests a second in the bench): a copy
    // still, where the mean had to be over 2 before and one worker took nearly all of them.
    let p = policy();
    let first = pick(&p, &ws, &question(0)).index;
    let mut held: Vec<_> = (0..4).map(|_| hold(&ws[first], 0, 1300)).collect();
    // With four (a mean of 1), no copy: see the next test for why the credit waits for that.
    assert_eq!(pick(&p, &ws, &question(1)).index, first);
    held.push(hold(&ws[first], 0, 1300));
    assert_ne!(pick(&p, &ws, &question(2)).index, first);
    drop(held);
}

/// What the credit must not do: its sample of hot prefixes cannot tell a system prompt that
/// many conversations share from one conversation's own earlier turns, which are among the
/// last `n` requests whenever there are about `n` conversations or fewer. Those are also at
/// most one request in flight per worker on average, so the credit waits for more: such a
/// conversation would otherwise move to an idle worker and prefill its history again. (A
/// lone one also stays by its home's tie-break, so the first part passes without the
/// threshold; the second, four at a time, fails without it.)
#[test]
fn up_to_one_conversation_per_worker_is_not_copied_to_an_idle_worker() {
    let ws = test_workers(4);
    let p = policy();
    let first = pick(&p, &ws, &convo(1, 16, 4)).index;
    // Its next turns, one after another: each finds its own last turn hot and every worker
    // idle.
    for turn in 5..10 {
        let s = pick(&p, &ws, &convo(1, 16, turn));
        assert_eq!(
            (s.index, s.outcome),
            (first, Outcome::LongestMatch),
            "turn {turn}"
        );
    }
    // Four conversations at a time, each with its next turn in flight while the others
    // arrive. All four start on the system prompt's first holder (nothing else is known),
    // so that worker has four in flight and the others none: a mean of 1, and every
    // conversation stays with its history rather than being copied to an idle worker.
    let p = policy();
    let homes: Vec<usize> = (10..14)
        .map(|c| pick(&p, &ws, &convo(c, 16, 4)).index)
        .collect();
    assert!(homes.iter().all(|&h| h == homes[0]), "{homes:?}");
    for turn in 5..8 {
        let mut held = Vec::new();
        for (c, &home) in (10..14).zip(&homes) {
            let s = pick(&p, &ws, &convo(c, 16, turn));
            assert_eq!(s.index, home, "conversation {c}, turn {turn}");
            held.push(hold(&ws[s.index], 0, 1300));
        }
    }
}

#[test]
fn under_a_prefix_every_worker_holds_a_request_goes_where_no_prefill_is_pending() {
    // The 4-block system prompt is on every worker; a new question under it is known no
    // further, so every worker would prefill the same.
    let ws = test_workers(4);
    let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
    let question = convo(5, 4, 2);
    let home = p.peek(&ws, &question).unwrap().index;
    // One 256-token prompt sent to the home and not started: by its hash alone (the old
    // weighting) the home would still take the question ...
    let held = hold(&ws[home], 256, 256);
    let by_hash = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            hot_pending_weight: 0.0,
            ..CacheAwareParams::default()
        },
    );
    assert_eq!(by_hash.peek(&ws, &question).unwrap().index, home);
    // ... but its prefill would run in the same step: it goes where nothing is pending.
    let s = p.peek(&ws, &question).unwrap();
    assert_ne!(s.index, home);
    assert_eq!(s.outcome, Outcome::LongestMatch);
    drop(held);
    // Eight questions arriving together, none answered yet: two on each worker.
    let questions = (0..8).map(|c| convo(10 + c, 4, 2));
    assert_eq!(
        arrive_together(&p, &ws, questions, (128, 1152)),
        [2, 2, 2, 2]
    );
}

/// Times `w`'s steps as 200 ms plus 10 us per prefill token, its last burst `ago` microseconds
/// before `now` (as [`crate::load::StepClock`] sees a worker's streams).
fn stepping(w: &Worker, now: u64, ago: u64) {
    super::timed(w, now, ago, (200_000, 10));
}

#[test]
fn with_step_phase_a_question_goes_where_the_step_under_way_ends_soonest() {
    // The system prompt is on every worker and nothing is pending anywhere: by load the four are
    // alike, and the question goes to its home. With `step_phase` (the default), the home's step
    // has only just begun (its streams' frames came this instant): 200 ms, 20,000 tokens' worth
    // of prefill, stand before the question's own prefill there; one worker is 190 ms into its
    // step, the others 20 ms into theirs.
    let ws = test_workers(4);
    let question = convo(5, 4, 2);
    let off = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            step_phase: false,
            ..CacheAwareParams::default()
        },
    );
    let home = off.peek(&ws, &question).unwrap().index;
    let soonest = (home + 2) % ws.len();
    let now = crate::load::now_us();
    for (i, w) in ws.iter().enumerate() {
        let ago = if i == home {
            0
        } else if i == soonest {
            190_000
        } else {
            20_000
        };
        stepping(w, now, ago);
    }
    assert_eq!(off.peek(&ws, &question).unwrap().index, home);
    // For every question, as if none were continued (see the next test for what lasts).
    let on = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            step_transient_only: false,
            ..CacheAwareParams::default()
        },
    );
    let s = on.peek(&ws, &question).unwrap();
    assert_eq!((s.index, s.outcome), (soonest, Outcome::LongestMatch));
}

#[test]
fn in_a_pool_larger_than_a_blocks_holder_list_new_conversations_have_their_own_homes() {
    // Sixteen workers hold the system prompt; its blocks list the last 8. Those 8 must count
    // as "most workers", or every conversation keys on the system prompt's first block and
    // all of them share one home.
    let ws = test_workers(16);
    let params = CacheAwareParams {
        hot_pending_weight: 0.0, // the home decides, not the pending prefill
        ..CacheAwareParams::default()
    };
    let p = knowing_the_system_prompt(&ws, params);
    let homes: std::collections::HashSet<usize> = (0..32)
        .map(|c| p.peek(&ws, &convo(10 + c, 4, 2)).unwrap().index)
        .collect();
    assert!(homes.len() > 1, "all on {homes:?}");
}

#[test]
fn a_prefix_on_more_workers_than_its_holder_list_is_priced_as_held_by_every_worker() {
    // Sixteen workers were sent the system prompt; its blocks list the last 8. A worker the
    // list crowded out (or that another replica sent it to) holds it as well: priced cold,
    // it would lose every conversation homed there to the 8 listed workers.
    let ws = test_workers(16);
    let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
    let listed: Vec<usize> = (8..16).collect();
    for c in 0..64u64 {
        let turn = convo(c, 4, 4);
        let key = turn.block_hashes[4];
        let home = (0..16).max_by_key(|&i| mix(key, ws[i].id_hash)).unwrap();
        let s = pick(&p, &ws, &turn);
        assert_eq!(s.index, home, "conversation {c}");
        assert_eq!(s.prediction.unwrap().matched_blocks, 4);
        if !listed.contains(&home) {
            return;
        }
    }
    panic!("no conversation was homed on an unlisted worker");
}

#[test]
fn past_a_prefix_on_a_full_holder_list_a_conversation_follows_its_own_blocks() {
    // As above: every worker is priced as holding the system prompt. A conversation's own
    // blocks past it are still looked up, and its next turn goes where they are.
    let ws = test_workers(16);
    let p = knowing_the_system_prompt(&ws, CacheAwareParams::default());
    for c in 0..16u64 {
        let first = pick(&p, &ws, &convo(100 + c, 4, 4));
        let next = pick(&p, &ws, &convo(100 + c, 4, 6));
        assert_eq!(
            (next.index, next.outcome),
            (first.index, Outcome::LongestMatch),
            "conversation {c}"
        );
        assert_eq!(next.prediction.unwrap().matched_blocks, 8);
    }
}

/// Routes `rounds` passes over `prefixes` prefixes (6 blocks each, then a block of the request's
/// own), each request held in flight, its prefill pending, for the next `inflight` decisions:
/// the workers each prefix went to, and how many decisions were copies. Each prefix's first
/// request goes to its hash home (`fresh_by_writes` off), so that the prefixes start unevenly
/// spread, as they do where other replicas place them.
fn spread_over(
    spread_share: f64,
    prefixes: u64,
    rounds: u64,
    inflight: usize,
) -> (Vec<usize>, usize) {
    let ws = test_workers(4);
    let p = CacheAware::new(CacheAwareParams {
        spread_share,
        fresh_by_writes: false,
        ..CacheAwareParams::default()
    });
    let mut went = vec![std::collections::BTreeSet::new(); prefixes as usize];
    let mut held = std::collections::VecDeque::new();
    let mut copies = 0;
    for i in 0..rounds * prefixes {
        let prefix = i % prefixes;
        let r = RequestInfo::keyed(
            (0..6)
                .map(|b| prefix << 32 | b)
                .chain([1 << 60 | i])
                .collect(),
            256,
        );
        let s = pick(&p, &ws, &r);
        went[prefix as usize].insert(s.index);
        if s.outcome == Outcome::Replicated {
            copies += 1;
            let cached = s.prediction.map(|p| p.cached_tokens);
            assert_eq!(cached, Some(0), "a copy is not predicted cached");
        }
        held.push_back(hold(&ws[s.index], 64, 448));
        if held.len() > inflight {
            held.pop_front();
        }
    }
    (went.iter().map(|w| w.len()).collect(), copies)
}

#[test]
fn a_popular_prefix_spreads_over_every_worker_and_a_rare_one_stays_on_its_first() {
    // Eight prefixes of one request in eight each, 32 requests in flight (8 a worker, 4 of
    // each prefix): a holder would take half a worker's load from one prefix alone, so each
    // spreads to all four workers, once per worker.
    let (workers, copies) = spread_over(0.125, 8, 50, 32);
    assert_eq!(workers, vec![4; 8], "every prefix on every worker");
    assert_eq!(copies, 8 * 3, "three copies a prefix, each paid once");
    // Without the flag a copy is priced against one request's wait: at 8 a worker some
    // prefixes get a second worker, none more; at 3 a worker each keeps its first.
    let (workers, _) = spread_over(0.0, 8, 50, 32);
    assert!(workers.iter().all(|&w| w <= 2), "{workers:?}");
    assert!(workers.contains(&2), "{workers:?}");
    let (workers, copies) = spread_over(0.0, 8, 50, 12);
    assert_eq!((workers, copies), (vec![1; 8], 0));
    // 200 prefixes, one request in 200 each: none is copied.
    let (workers, copies) = spread_over(0.125, 200, 3, 32);
    assert_eq!((workers.iter().max(), copies), (Some(&1), 0));
}

/// Eight new prefixes (6 blocks each) one after another, each held in flight with its prefill
/// under way (none pending): how many went to each of 4 workers.
fn new_prefixes_per_worker(params: CacheAwareParams) -> [usize; 4] {
    let ws = test_workers(4);
    let p = CacheAware::new(params);
    let mut held = Vec::new();
    let mut per_worker = [0; 4];
    for prefix in 0..8u64 {
        let r = RequestInfo::keyed((0..6).map(|b| prefix << 32 | b).collect(), 256);
        let s = pick(&p, &ws, &r);
        per_worker[s.index] += 1;
        held.push(hold(&ws[s.index], 0, 448));
    }
    per_worker
}

#[test]
fn with_fresh_by_writes_new_prefixes_start_two_a_worker_where_their_hashes_do_not() {
    let on = new_prefixes_per_worker(CacheAwareParams::default());
    assert_eq!(on, [2; 4]);
    let off = new_prefixes_per_worker(CacheAwareParams {
        fresh_by_writes: false,
        ..CacheAwareParams::default()
    });
    assert_ne!(
        off, [2; 4],
        "by hash, the home's credit outweighs a request's queue"
    );
}

#[test]
fn a_prefix_spreads_only_as_far_as_its_requests_overlap() {
    // The same eight prefixes with 12 requests in flight: one and a half of each prefix at a
    // time, for which two holders are enough. Every prefix gets a second worker, none a third.
    let (workers, copies) = spread_over(0.125, 8, 50, 12);
    assert_eq!(workers, vec![2; 8]);
    assert_eq!(copies, 8);
    // With 4 in flight (one request a worker), no prefix has two of its requests in flight at
    // once, and none is copied: at light load a prefix never queues behind itself.
    let (workers, copies) = spread_over(0.125, 8, 50, 4);
    assert_eq!((workers, copies), (vec![1; 8], 0));
}

/// A conversation is one request at a time: however much of a small stream it is, its turns
/// never queue behind each other, so spreading leaves it where its history is. Each of four
/// conversations, alone in the index, sends its turns one after another, each turn's request
/// still in flight while the next three conversations' arrive (a mean of one per worker).
#[test]
fn a_conversation_that_is_most_of_the_traffic_is_not_spread() {
    let ws = test_workers(4);
    let p = CacheAware::new(CacheAwareParams {
        spread_share: 0.125,
        ..CacheAwareParams::default()
    });
    let homes: Vec<usize> = (20..24)
        .map(|c| pick(&p, &ws, &convo(c, 0, 4)).index)
        .collect();
    let mut held = std::collections::VecDeque::new();
    for turn in 5..12 {
        for (c, &home) in (20..24).zip(&homes) {
            let s = pick(&p, &ws, &convo(c, 0, turn));
            assert_eq!(
                (s.index, s.outcome),
                (home, Outcome::LongestMatch),
                "conversation {c}, turn {turn}"
            );
            held.push_back(hold(&ws[s.index], 64, 1300));
            if held.len() > 4 {
                held.pop_front();
            }
        }
    }
}

#[test]
fn with_step_transient_only_the_step_places_only_what_does_not_last() {
    // The home of conversation 7's first turn has just begun a 200 ms step (20,000 tokens' worth
    // of prefill ahead); another worker is 190 ms into its step, the other two 20 ms.
    let ws = test_workers(4);
    let params = |transient: bool| CacheAwareParams {
        step_transient_only: transient,
        ..CacheAwareParams::default()
    };
    let (every, transient) = (
        knowing_the_system_prompt(&ws, params(false)),
        knowing_the_system_prompt(&ws, params(true)),
    );
    let first = pick(&transient, &ws, &convo(7, 4, 1)).index;
    assert_eq!(pick(&every, &ws, &convo(7, 4, 1)).index, first);
    let soonest = (first + 1) % ws.len();
    let now = crate::load::now_us();
    for (i, w) in ws.iter().enumerate() {
        let ago = match i {
            _ if i == first => 0,
            _ if i == soonest => 190_000,
            _ => 20_000,
        };
        stepping(w, now, ago);
    }
    // Its next turn holds two blocks (128 tokens) more at its home than anywhere else. Priced
    // with the step, it would move for a wait shorter than a step and leave its history behind;
    // without, it stays.
    let next = convo(7, 4, 3);
    let moved = every.peek(&ws, &next).unwrap();
    assert_eq!((moved.index, moved.outcome), (soonest, Outcome::Spilled));
    let kept = transient.peek(&ws, &next).unwrap();
    assert_eq!((kept.index, kept.outcome), (first, Outcome::LongestMatch));
    // A new question under the system prompt, where questions have so far gone on to be continued
    // (the share starts at 1), goes by load alone: to the same worker as with the step off.
    let off = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            step_phase: false,
            ..CacheAwareParams::default()
        },
    );
    let (question, by_load) = (8..64)
        .map(|c| convo(c, 4, 1))
        .map(|q| {
            let i = off.peek(&ws, &q).unwrap().index;
            (q, i)
        })
        .find(|&(_, i)| i != soonest)
        .unwrap();
    assert_eq!(transient.peek(&ws, &question).unwrap().index, by_load);
    // Once most such questions are never continued, a question's place does not last, and it
    // goes where the step under way ends soonest.
    for c in 0..200 {
        transient.select(&ws, &convo(1_000 + c, 4, 1)).unwrap();
    }
    assert_eq!(transient.peek(&ws, &question).unwrap().index, soonest);
    // A prompt of which nothing is known: while prompts start with something known (all of them
    // so far), it goes by load, as with the step off; once most are new, by the step.
    let fresh = |c: u64| RequestInfo::keyed((0..2).map(|i| (5_000 + c) << 32 | i).collect(), 256);
    let by_load = off.peek(&ws, &fresh(0)).unwrap().index;
    assert_ne!(
        by_load, soonest,
        "the test needs load and the step to disagree"
    );
    assert_eq!(transient.peek(&ws, &fresh(0)).unwrap().index, by_load);
    for c in 1..200 {
        transient.select(&ws, &fresh(c)).unwrap();
    }
    assert_eq!(transient.peek(&ws, &fresh(0)).unwrap().index, soonest);
}
