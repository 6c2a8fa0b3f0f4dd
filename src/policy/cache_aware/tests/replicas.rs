//! Beside other gateway replicas (seen in the workers' polled load): the home is presumed to
//! hold what they routed, so replicas sharing nothing keep a conversation on one worker.

use super::*;

#[test]
fn with_another_replica_the_home_is_credited_with_all_of_an_unseen_turn() {
    let ws = test_workers(8);
    // A conversation this replica has not seen: the system prompt (on every worker), then
    // three blocks of its own, 192 tokens.
    let r = convo(9, 4, 3);
    let home = (0..ws.len())
        .max_by_key(|&i| mix(r.block_hashes[4], ws[i].id_hash))
        .unwrap();
    let p = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            miss_weight: 1.0,
            request_cost_tokens: 80.0,
            context_weight: 0.0,
            ..CacheAwareParams::default()
        },
    );
    // Another replica as busy as this one: it sends the turns this one has not seen to the
    // home, so nearly all of the 192 tokens are credited there (`min(1, 2f)` of the rest
    // above `home_affinity`, with `f` just under a half), where alone it would be half.
    let _mine = another_replica_as_busy(&ws);
    // Two more requests on the home, 160 tokens of queue: more than half of the unseen turn,
    // less than all of it. The home keeps the conversation.
    let mut extra: Vec<_> = (0..2).map(|_| ws[home].acquire()).collect();
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    // A third, 240 tokens: more than all of it. The conversation goes elsewhere, so the
    // credit is the unseen turn's, not more.
    extra.push(ws[home].acquire());
    assert_ne!(p.peek(&ws, &r).unwrap().index, home);
}

/// Beside another replica, a prompt nothing of which is known (no shared prefix, no earlier
/// turn) is credited at its home as by one gateway, half of it: it may as well be new.
#[test]
fn with_another_replica_a_prompt_nothing_of_which_is_known_is_credited_half() {
    let (ws, p, r, home) = new_prompt_and_its_home(false);
    let _mine = another_replica_as_busy(&ws);
    // One more request on the home, 80 tokens of queue: less than half of the prompt.
    let mut extra = vec![ws[home].acquire()];
    assert_eq!(p.peek(&ws, &r).unwrap().index, home);
    // Two, 160 tokens: more than half of it, less than all. Elsewhere.
    extra.push(ws[home].acquire());
    assert_ne!(p.peek(&ws, &r).unwrap().index, home);
}

#[test]
fn another_replicas_conversation_is_looked_for_at_its_home() {
    // Replica `a` saw turn 1; replica `b` knows only the shared system prompt (on all workers)
    // and sees turn 2: both must choose the same worker.
    let ws = test_workers(6);
    let (a, b) = two_replicas_knowing_the_system_prompt(&ws);
    let t1 = pick(&a, &ws, &convo(3, 4, 2));
    let t2 = pick(&b, &ws, &convo(3, 4, 4));
    assert_eq!(t1.index, t2.index);
}

#[test]
fn with_other_replicas_in_the_pool_a_spilled_conversation_returns_to_its_home() {
    // Both replicas know the system prompt is on every worker. Replica `a` once sent three
    // turns of conversation 3 to worker `x` (spilled for load); replica `b` never saw it.
    let ws = test_workers(4);
    let replica = |shared_home: bool| {
        let params = CacheAwareParams {
            shared_home,
            ..CacheAwareParams::default()
        };
        knowing_the_system_prompt(&ws, params)
    };
    let (a, b) = (replica(true), replica(true));
    let next = convo(3, 4, 4);
    let home = b.peek(&ws, &next).unwrap().index;
    let x = (home + 1) % ws.len();
    a.index.insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
    // Alone in the pool, `a` knows best: the conversation stays where its history is.
    let alone = a.peek(&ws, &next).unwrap();
    assert_eq!((alone.index, alone.outcome), (x, Outcome::LongestMatch));
    // The workers' polled load shows as many requests again from elsewhere: another replica
    // sends this conversation's turns to its home, so `a` does too, and the two agree.
    let _mine = another_replica_as_busy(&ws);
    let shared = a.peek(&ws, &next).unwrap();
    assert_eq!((shared.index, shared.outcome), (home, Outcome::HashHome));
    assert_eq!(b.peek(&ws, &next).unwrap().index, home);
    // What it predicts is what it knows the home holds, not what it presumed.
    assert_eq!(shared.prediction.unwrap().matched_blocks, 4);
    // With `shared_home` off it follows its own history whatever the others do.
    let own = replica(false);
    own.index
        .insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
    assert_eq!(own.peek(&ws, &next).unwrap().index, x);
}

/// A replica that knows the system prompt on every worker, and sent conversation 3's first
/// `at_home` blocks past it to the home of its next turn (4 blocks) and its first 3 to the
/// worker after it (`x`), for load: the replica, that next turn, the home and `x`.
fn spilled_conversation(
    ws: &[Arc<Worker>],
    at_home: u64,
) -> (CacheAware, RequestInfo, usize, usize) {
    let a = knowing_the_system_prompt(ws, CacheAwareParams::default());
    let next = convo(3, 4, 4);
    let home = a.peek(ws, &next).unwrap().index;
    let x = (home + 1) % ws.len();
    a.index
        .insert(&convo(3, 4, at_home).block_hashes, ws[home].id_hash);
    a.index.insert(&convo(3, 4, 3).block_hashes, ws[x].id_hash);
    (a, next, home, x)
}

#[test]
fn a_spilled_conversation_returns_to_a_home_that_holds_most_of_it_when_others_route_a_third() {
    // Replica `a` sent the first two turns of conversation 3 home, then one turn to `x` for
    // load: the home lacks one block of what `x` holds.
    let ws = test_workers(4);
    let (a, next, home, _) = spilled_conversation(&ws, 2);
    // Other replicas route a third of the pool's requests: the home is presumed to hold the
    // block it lacks, and that, with its share of the new block, outweighs the one block `x`
    // holds beyond it. A presumption of a share of everything `x` holds (two thirds: 299
    // tokens) would be less than the home holds already (384), crediting nothing, and the
    // conversation would stay split.
    let _mine = polled_beside_four_of_ours(&ws, 6.0);
    let back = a.peek(&ws, &next).unwrap();
    assert_eq!((back.index, back.outcome), (home, Outcome::HashHome));
    // What it predicts there is what it knows the home holds.
    assert_eq!(back.prediction.unwrap().matched_blocks, 6);
}

/// Where other replicas route a fifth of the pool's requests, a conversation whose last two
/// turns this replica moved for load still goes back home: the others send its turns there
/// whatever their share, and a presumption of `min(1, 2f)` (two fifths) of what the home lacks
/// would leave it where this replica's own record has it, each replica following its own turns.
#[test]
fn a_spilled_conversation_returns_home_where_other_replicas_route_a_fifth() {
    let ws = test_workers(4);
    let (a, next, home, x) = spilled_conversation(&ws, 1);
    // Alone, it follows its own record.
    let alone = a.peek(&ws, &next).unwrap();
    assert_eq!((alone.index, alone.outcome), (x, Outcome::LongestMatch));
    let _mine = polled_beside_four_of_ours(&ws, 5.0);
    let back = a.peek(&ws, &next).unwrap();
    assert_eq!((back.index, back.outcome), (home, Outcome::HashHome));
    assert_eq!(back.prediction.unwrap().matched_blocks, 5);
}

#[test]
fn a_conversation_on_two_workers_keeps_its_home_on_every_replica() {
    // The system prompt is on all four workers. Replica `a` also put the first turns of each
    // conversation on two workers (its home and one it spilled to); replica `b` knows
    // nothing of them. With the other replica's traffic showing in the polled load, both
    // send every conversation's next turn to the same worker.
    let ws = test_workers(4);
    let (a, b) = two_replicas_knowing_the_system_prompt(&ws);
    let _mine = another_replica_as_busy(&ws);
    for c in 0..32u64 {
        let next = convo(c, 4, 4);
        let home = b.peek(&ws, &next).unwrap().index;
        let earlier = convo(c, 4, 3);
        a.index.insert(&earlier.block_hashes, ws[home].id_hash);
        a.index
            .insert(&earlier.block_hashes, ws[(home + 1) % 4].id_hash);
        assert_eq!(a.peek(&ws, &next).unwrap().index, home, "conversation {c}");
    }
    assert_eq!(kth_largest([5, 9, 1, 9].into_iter(), 3), 5);
    assert_eq!(kth_largest([5, 9].into_iter(), 3), 0);
}

/// Another replica's requests on a worker are taken to be as far from starting as this
/// gateway's there: four requests in all behind one of ours with 200 tokens to prefill are
/// priced as 800 pending, more than the 400 of a worker where all four are ours.
#[test]
fn another_replicas_requests_count_as_much_pending_prefill_as_ours_there() {
    let ws = test_workers(2);
    let p = unit();
    let mut held: Vec<_> = (0..4).map(|_| hold(&ws[0], 100, 0)).collect();
    held.push(hold(&ws[1], 200, 0));
    let polled = crate::load::Polled {
        running: 4.0,
        ..Default::default()
    };
    ws[0].polled(Some(polled), 4, 0);
    ws[1].polled(Some(polled), 1, 0);
    // Both have four requests queued; a one-block prompt (64 tokens) is new to both, so
    // besides the pending prefill only the home's credit (under 64 tokens) separates them.
    for c in 0..8 {
        let s = p.peek(&ws, &convo(900 + c, 0, 1)).unwrap();
        assert_eq!(s.index, 0, "prompt {c}: {s:?}");
    }
}

#[test]
fn with_other_replicas_in_the_pool_a_question_under_a_shared_prefix_goes_home() {
    // As above, but the polled load shows as much traffic again from another replica, which
    // sends this conversation's next turn to its home: this replica does too.
    let ws = test_workers(4);
    let (p, other) = two_replicas_knowing_the_system_prompt(&ws);
    let question = convo(5, 4, 2);
    let home = p.peek(&ws, &question).unwrap().index;
    let _mine = another_replica_as_busy(&ws);
    let _held = hold(&ws[home], 256, 256);
    assert_eq!(p.peek(&ws, &question).unwrap().index, home);
    assert_eq!(other.peek(&ws, &convo(5, 4, 4)).unwrap().index, home);
}

/// At light load one poll finds another replica's requests and the next finds none. A replica
/// that decided by the last poll alone would place a question under the shared prefix as a lone
/// gateway does, by pending prefill, on every poll that found the pool idle, while the other
/// replica sends the conversation's next turn home; it reads the pool's traffic over many polls
/// instead and keeps to the home. Workers that have only ever carried this gateway's traffic
/// read it alone.
#[test]
fn a_poll_that_finds_the_pool_idle_does_not_make_a_replica_decide_alone() {
    let idle = crate::load::Polled::default();
    let question = convo(5, 4, 2);
    let ws = test_workers(4);
    let (p, other) = two_replicas_knowing_the_system_prompt(&ws);
    let home = p.peek(&ws, &question).unwrap().index;
    drop(another_replica_as_busy(&ws));
    for w in &ws {
        w.polled(Some(idle), 0, 0);
    }
    let _held = hold(&ws[home], 256, 256);
    assert_eq!(p.peek(&ws, &question).unwrap().index, home);
    assert_eq!(other.peek(&ws, &convo(5, 4, 4)).unwrap().index, home);
    // The same polls with nothing ever beyond this gateway's own: alone, by pending prefill.
    let lone = test_workers(4);
    let p = knowing_the_system_prompt(&lone, CacheAwareParams::default());
    drop(polled_beside_four_of_ours(&lone, 4.0));
    for w in &lone {
        w.polled(Some(idle), 0, 0);
    }
    let _held = hold(&lone[home], 256, 256);
    let placed = p.peek(&lone, &question).unwrap().index;
    assert_ne!(placed, home);
    assert_eq!(lone[placed].load.pending_prefill(), 0);
}

/// With `fade_by_continuation`, a replica whose requests past the shared prefix never continue
/// anything (questions each new) places such a question by pending prefill as a lone gateway
/// does, though other replicas share the pool; one whose requests do continue their earlier
/// turns keeps the question at its home, where another replica would send its next turn.
#[test]
fn with_other_replicas_questions_that_never_continue_go_where_no_prefill_is_pending() {
    let ws = test_workers(4);
    let params = CacheAwareParams {
        fade_by_continuation: true,
        ..CacheAwareParams::default()
    };
    let new_questions = knowing_the_system_prompt(&ws, params.clone());
    let conversations = knowing_the_system_prompt(&ws, params);
    for c in 0..200 {
        pick(&new_questions, &ws, &convo(100 + c, 4, 2));
        pick(&conversations, &ws, &convo(100 + c, 4, 2));
        pick(&conversations, &ws, &convo(100 + c, 4, 4));
    }
    assert!(new_questions.continuing_now() < 0.1);
    assert!(conversations.continuing_now() > 0.4);
    let question = convo(5, 4, 2);
    let home = new_questions.peek(&ws, &question).unwrap().index;
    assert_eq!(conversations.peek(&ws, &question).unwrap().index, home);
    let _mine = another_replica_as_busy(&ws);
    let _held = hold(&ws[home], 256, 256);
    let placed = new_questions.peek(&ws, &question).unwrap().index;
    assert_ne!(placed, home);
    assert_eq!(ws[placed].load.pending_prefill(), 0);
    assert_eq!(conversations.peek(&ws, &question).unwrap().index, home);
}

#[test]
fn the_continuation_share_is_reported_only_while_fade_by_continuation_is_on() {
    let ws = test_workers(4);
    let on = knowing_the_system_prompt(&ws, CacheAwareParams::default());
    assert_eq!(Policy::continuing_share(&on), Some(1.0));
    for c in 0..200 {
        pick(&on, &ws, &convo(100 + c, 4, 2));
    }
    let share = Policy::continuing_share(&on).unwrap();
    assert!(
        share < 0.1,
        "share {share} after questions that never continue"
    );
    let off = knowing_the_system_prompt(
        &ws,
        CacheAwareParams {
            fade_by_continuation: false,
            ..CacheAwareParams::default()
        },
    );
    assert_eq!(Policy::continuing_share(&off), None);
}

#[test]
fn a_peers_placement_is_followed_like_this_gateways_own() {
    let p = policy();
    let ws = crate::workers::test_workers(4);
    let first = convo(7, 4, 4);
    let next = convo(7, 4, 8);
    p.learn_placement(&ws[2], &first.block_hashes, 800);
    let s = pick(&p, &ws, &next);
    assert_eq!(s.index, 2, "{s:?}");
    assert!(s.prediction.unwrap().cached_tokens > 0, "{s:?}");
}
