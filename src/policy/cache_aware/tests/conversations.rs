//! One gateway: a conversation follows its deepest blocks, a new prefix goes home, and new
//! prompts keep or lose the home's credit by how often prompts are reused.

use super::*;

#[test]
fn a_conversation_follows_its_deepest_blocks_although_all_share_the_first() {
    let ws = test_workers(4);
    let p = unit();
    // Two conversations with the same 4-block system prompt, placed on different workers by load.
    let first = pick(&p, &ws, &convo(1, 4, 1));
    // 6 in flight cost 384 tokens: more than the 320-token prompt would cost elsewhere.
    let busy: Vec<_> = (0..6).map(|_| ws[first.index].acquire()).collect();
    let other = pick(&p, &ws, &convo(2, 4, 1));
    assert_ne!(first.index, other.index);
    drop(busy);
    // Their next turns go back to where each one's history is, not to one system-prompt home
    // (nor to the conversation's home, credited with half of the new block).
    let next1 = pick(&p, &ws, &convo(1, 4, 2));
    let next2 = pick(&p, &ws, &convo(2, 4, 2));
    assert_eq!(
        (next1.index, next1.outcome),
        (first.index, Outcome::LongestMatch)
    );
    assert_eq!(
        (next2.index, next2.outcome),
        (other.index, Outcome::LongestMatch)
    );
    assert_eq!(next2.prediction.unwrap().matched_blocks, 5);
}

/// On a lone gateway with `reuse_affinity: 1`, a conversation's next turn is credited at its
/// home with all of its new text, a new prompt with half of it (`home_affinity`): through the
/// same load gap the first stays where its next turns will look for it and the second goes to
/// an idle worker. Unset, the next turn is credited like a new prompt and moves too, and so
/// does a turn whose prefix one of the last few requests went through, whether or not hot
/// copies are amortized (which also read the last few requests).
#[test]
fn with_reuse_affinity_a_next_turn_keeps_its_home_through_a_gap_that_moves_new_and_hot_prompts() {
    for amortize_hot_copies in [true, false] {
        reuse_affinity_through_a_gap(amortize_hot_copies);
    }
}

fn reuse_affinity_through_a_gap(amortize_hot_copies: bool) {
    let ws = test_workers(4);
    // The first turn at its hash home, which both policies below share a pool to find.
    let half = CacheAware::new(CacheAwareParams {
        amortize_hot_copies,
        fresh_by_writes: false,
        ..unit().params
    });
    let p = CacheAware::new(CacheAwareParams {
        reuse_affinity: Some(1.0),
        ..half.params.clone()
    });
    let first = pick(&p, &ws, &convo(1, 0, 1));
    assert_eq!(first.outcome, Outcome::HashHome);
    let home = first.index;
    assert_eq!(pick(&half, &ws, &convo(1, 0, 1)).index, home);
    // Other users' requests since (without them the conversation's own last turn would make
    // its prefix look like one that everyone is using).
    for c in 10..14 {
        pick(&p, &ws, &convo(c, 0, 1));
        pick(&half, &ws, &convo(c, 0, 1));
    }
    // Another 2-block prompt with the same home, found by a policy that has seen nothing.
    let probe = CacheAware::new(CacheAwareParams {
        fresh_by_writes: false,
        ..unit().params
    });
    let new = (100..)
        .map(|c| convo(c, 0, 2))
        .find(|r| pick(&probe, &ws, r).index == home)
        .unwrap();
    // One request with 40 tokens of prefill pending: 104 tokens of queue on the home.
    let _busy = hold(&ws[home], 40, 0);
    // Next turn, 128 tokens: 64 held at home, 64 new. Home 64 + 104 - 64 = 104; idle 128.
    let next = pick(&p, &ws, &convo(1, 0, 2));
    assert_eq!((next.index, next.outcome), (home, Outcome::LongestMatch));
    // New, 128 tokens: home 128 + 104 - 64 = 168; idle 128.
    let moved = pick(&p, &ws, &new);
    assert_ne!(moved.index, home);
    assert_eq!(moved.outcome, Outcome::Spilled);
    // Unset, the next turn's new text is credited as a new prompt's and it moves: 136 > 128.
    assert_ne!(pick(&half, &ws, &convo(1, 0, 2)).index, home);
    // A prefix one of the last 4 requests went through may be a document many questions
    // share, whose new text comes once: its turn 3, with one more request queued at home
    // (168), is credited half: 64 + 168 - 32 = 200 against 192 on an idle worker.
    let _more = hold(&ws[home], 0, 0);
    let after = pick(&p, &ws, &convo(1, 0, 3));
    assert_ne!(
        after.index, home,
        "amortize_hot_copies: {amortize_hot_copies}"
    );
}

#[test]
fn a_new_prefix_goes_home_and_replicas_agree_on_the_home() {
    // Each replica has its own view of the workers (what it had them write, among the rest).
    let (ours, theirs) = (test_workers(8), test_workers(8));
    let (a, b) = (policy(), policy());
    let r = convo(7, 0, 6);
    let sa = pick(&a, &ours, &r);
    assert_eq!(sa.outcome, Outcome::HashHome);
    assert_eq!(sa.index, pick(&b, &theirs, &r).index);
}

/// Routes `n` prompts that are each new (first blocks never seen) and end at once.
fn route_never_reused(p: &CacheAware, ws: &[Arc<Worker>], n: u64) {
    for c in 0..n {
        pick(p, ws, &convo(1_000 + c, 0, 2));
    }
}

#[test]
fn where_prompts_are_never_reused_a_new_one_is_placed_by_cost_not_by_its_hash() {
    let (ws, p, r, home) = new_prompt_and_its_home(true);
    // One request on the home (80 tokens of queue) against half of the prompt's 192: home.
    let _extra = ws[home].acquire();
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    // After 300 prompts none of which started with anything known, the share is about 1%
    // (0.98^300), the credit about a token: the idle workers are cheaper.
    route_never_reused(&p, &ws, 300);
    assert!(p.reuse_share_now() < 0.02, "share {}", p.reuse_share_now());
    let chosen = p.peek(&ws, &r).unwrap().index;
    assert_ne!(chosen, home);
    assert_eq!(ws[chosen].inflight(), 0, "an idle worker is the cheapest");
}

#[test]
fn where_most_prompts_start_with_something_known_a_new_one_keeps_all_of_its_home_credit() {
    let (ws, p, r, home) = new_prompt_and_its_home(true);
    let _extra = ws[home].acquire();
    // Three questions under one system prompt for every two new prompts: a share of about
    // 0.6, enough for the whole credit (96 tokens against the home's 80 of queue). Scaled by
    // the share itself, the credit would be about 58 and the prompt would go elsewhere.
    for c in 0..300 {
        let own = convo(2_000 + c, 0, 2);
        let request = if c % 5 < 3 {
            convo(1_000 + c, 2, 1)
        } else {
            own
        };
        pick(&p, &ws, &request);
    }
    let share = p.reuse_share_now();
    assert!((0.5..0.75).contains(&share), "share {share}");
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
}

#[test]
fn beside_another_replica_a_new_prompt_keeps_its_home_credit_however_rare_reuse_is() {
    // The other replica's conversations reach this one with nothing known: they still have
    // to meet at the home, so its share of the traffic (a half here) restores the credit.
    let (ws, p, r, home) = new_prompt_and_its_home(true);
    let _theirs = another_replica_as_busy(&ws);
    route_never_reused(&p, &ws, 300);
    assert!(p.reuse_share_now() < 0.02, "share {}", p.reuse_share_now());
    let _extra = ws[home].acquire();
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
}

/// Routes `n` prompts that are each new (two blocks, 128 tokens; conversations `from` on) and
/// reports for each that the worker it went to had cached `cached` tokens of it.
fn route_new_and_report(p: &CacheAware, ws: &[Arc<Worker>], from: u64, n: u64, cached: u64) {
    for c in from..from + n {
        let r = convo(c, 0, 2);
        let s = pick(p, ws, &r);
        let usage = Usage {
            prompt_tokens: 128,
            cached_tokens: Some(cached),
            completion_tokens: Some(1),
        };
        p.observe(&ws[s.index], &r, &s, Observed::Answered(Some(usage)));
    }
}

#[test]
fn beside_another_replica_new_prompts_the_workers_never_held_are_placed_by_cost() {
    // As above, but every new prompt's worker reports none of it cached: the other replica's
    // traffic is not conversations reaching this one unseen, and the credit fades after all.
    let (ws, p, r, home) = new_prompt_and_its_home(true);
    let _theirs = another_replica_as_busy(&ws);
    route_new_and_report(&p, &ws, 1_000, 300, 0);
    assert!(
        p.unseen_reuse_now() < 0.02,
        "share {}",
        p.unseen_reuse_now()
    );
    assert_eq!(Policy::unseen_reuse_share(&p), Some(p.unseen_reuse_now()));
    let _extra = ws[home].acquire();
    assert_ne!(p.peek(&ws, &r).unwrap().index, home);
}

#[test]
fn beside_another_replica_new_prompts_the_workers_held_in_part_keep_their_home_credit() {
    // Each new prompt's worker held its first block (64 of its 128 tokens): another replica sent
    // its beginning there, so the home still meets the other replica's turns.
    let (ws, p, r, home) = new_prompt_and_its_home(true);
    let _theirs = another_replica_as_busy(&ws);
    route_new_and_report(&p, &ws, 1_000, 300, 64);
    assert!(p.reuse_share_now() < 0.02, "share {}", p.reuse_share_now());
    assert_eq!(p.unseen_reuse_now(), 1.0);
    let _extra = ws[home].acquire();
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    // Less than a block cached (a chat template's first tokens, say) is no sign of reuse.
    route_new_and_report(&p, &ws, 2_000, 300, 16);
    assert!(
        p.unseen_reuse_now() < 0.02,
        "share {}",
        p.unseen_reuse_now()
    );
    assert_ne!(p.peek(&ws, &r).unwrap().index, home);
}

#[test]
fn a_block_is_judged_by_the_part_of_the_prompt_the_key_covers() {
    // A prompt ten times longer than its two-block key (1,280 tokens, the key's 512 bytes 128 of
    // them): one block is 64 tokens, not 640. A worker that held 64 held a block; 32 is less.
    let p = policy();
    let ws = test_workers(4);
    let held = |c: u64, cached: u64| {
        let mut r = convo(c, 0, 2);
        r.prompt_bytes *= 10;
        let s = pick(&p, &ws, &r);
        let usage = Usage {
            prompt_tokens: 1_280,
            cached_tokens: Some(cached),
            completion_tokens: Some(1),
        };
        p.observe(&ws[s.index], &r, &s, Observed::Answered(Some(usage)));
    };
    for c in 0..300 {
        held(1_000 + c, 32);
    }
    assert!(
        p.unseen_reuse_now() < 0.02,
        "share {}",
        p.unseen_reuse_now()
    );
    for c in 0..300 {
        held(2_000 + c, 64);
    }
    assert!(
        p.unseen_reuse_now() > 0.98,
        "share {}",
        p.unseen_reuse_now()
    );
}

#[test]
fn without_reuse_from_usage_other_replicas_restore_the_credit_whatever_the_workers_report() {
    let (ws, p, r, home) = new_prompt_and_its_home_with(CacheAwareParams {
        reuse_from_usage: false,
        ..CacheAwareParams::default()
    });
    let _theirs = another_replica_as_busy(&ws);
    route_new_and_report(&p, &ws, 1_000, 300, 0);
    assert_eq!(Policy::unseen_reuse_share(&p), None);
    let _extra = ws[home].acquire();
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
}

#[test]
fn without_the_flag_the_reuse_share_is_not_kept_and_a_new_prompt_goes_home() {
    let ws = test_workers(8);
    let p = CacheAware::new(CacheAwareParams {
        new_prompt_by_reuse: false,
        fresh_by_writes: false,
        ..CacheAwareParams::default()
    });
    route_never_reused(&p, &ws, 300);
    assert_eq!(p.reuse_share_now(), 1.0);
    assert_eq!(
        Policy::reuse_share(&p),
        None,
        "no share to export without the flag"
    );
    let r = convo(9, 0, 3);
    assert_eq!(pick(&p, &ws, &r).outcome, Outcome::HashHome);
}

#[test]
fn with_fresh_by_writes_a_lone_gateway_starts_a_new_prompt_where_least_was_written_lately() {
    let (ws, p, r, home) = new_prompt_and_its_home_with(CacheAwareParams {
        fresh_by_writes: true,
        ..CacheAwareParams::default()
    });
    let light = (home + 3) % ws.len();
    for (i, w) in ws.iter().enumerate() {
        if i != light {
            w.kv.add(1_000);
        }
    }
    let s = p.peek(&ws, &r).unwrap();
    assert_eq!(
        (s.index, s.outcome),
        (light, Outcome::LeastWritten),
        "home {home}"
    );
    // A prompt already waiting to prefill there: this one goes to its hash home, or a burst of
    // new prompts would all go to the lightest.
    let waiting = hold(&ws[light], 40, 0);
    let s = p.peek(&ws, &r).unwrap();
    assert_eq!((s.index, s.outcome), (home, Outcome::HashHome));
    drop(waiting);
    // The credit is the home's: one request's queue (80 tokens) is within it (96), two are not.
    let _one = ws[light].acquire();
    assert_eq!(p.peek(&ws, &r).unwrap().index, light);
    let _two = ws[light].acquire();
    assert_ne!(p.peek(&ws, &r).unwrap().index, light);
    drop((_one, _two));
    // Beside another replica, which sends this conversation's later turns to the hash home.
    let _theirs = another_replica_as_busy(&ws);
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
}
