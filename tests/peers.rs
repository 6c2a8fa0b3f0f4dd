//! Peer replicas over real UDP on loopback: a request one replica sends is priced by the other
//! before any load poll, and leaves its price when it ends.

mod common;

use std::{net::SocketAddr, time::Duration};

use common::*;
use kvroute::config::{Config, PolicyConfig};

fn replica(workers: &[&Upstream], me: Option<SocketAddr>, all: &[SocketAddr]) -> Config {
    let mut c = config_for(workers, "cache_aware");
    // No poll reaches these upstreams (they serve no /metrics): what one replica knows of the
    // other's requests is only what the peers' datagrams say.
    c.load_signals.interval_seconds = 0.0;
    c.peers.bind = me;
    c.peers.addresses = all.iter().map(ToString::to_string).collect();
    c
}

/// `n` UDP sockets on loopback, handed over for the gateways whose `peers.bind` they are.
fn peer_sockets(n: usize) -> Vec<SocketAddr> {
    (0..n)
        .map(|_| {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            kvroute::peers::hand_over(s).unwrap()
        })
        .collect()
}

fn completion(prompt: &str) -> serde_json::Value {
    serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1})
}

/// What the gateway at `gw` would do with `body` now (`/debug/route` changes nothing).
async fn peek(gw: SocketAddr, body: &serde_json::Value) -> serde_json::Value {
    let d = request(
        gw,
        "POST",
        "/debug/route/v1/completions",
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(d.status, 200, "{}", String::from_utf8_lossy(&d.body));
    d.json()
}

/// Where the gateway at `gw` would send `body` now.
async fn route(gw: SocketAddr, body: &serde_json::Value) -> String {
    peek(gw, body).await["worker"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_prices_its_peers_requests_at_once_and_drops_them_when_they_end() {
    let (wa, wb) = (upstream("wa", &[]).await, upstream("wb", &[]).await);
    let sockets = peer_sockets(2);
    // A prompt of which nothing is known goes home here, not to the worker least written to,
    // so that what moves B's choice below is A's load and not A's placement (which B learns too).
    let by_load = |me, all: &[SocketAddr]| {
        let mut c = replica(&[&wa, &wb], me, all);
        if let PolicyConfig::CacheAware(p) = &mut c.policy {
            p.fresh_by_writes = false;
        }
        c
    };
    let a = gateway(by_load(Some(sockets[0]), &sockets)).await;
    let b = gateway(by_load(Some(sockets[1]), &sockets)).await;
    // The control: a replica with no peers, in front of the same workers.
    let alone = gateway(by_load(None, &[])).await;

    // A long prompt, held by its worker without an answer: its prefill stays pending on A.
    let long = "a long document to read ".repeat(400);
    let held =
        serde_json::json!({"model": "m", "prompt": long, "max_tokens": 1, "delay_ms": 30_000});
    let x = route(a.addr, &held).await;
    // A short prompt that B, with the pool idle, would send to the same worker.
    let mut q = None;
    for k in 0..64 {
        let body = completion(&format!("question {k}"));
        if route(b.addr, &body).await == x {
            q = Some(body);
            break;
        }
    }
    let q = q.expect("one of 64 prompts has its home on the held prompt's worker");

    let mut conn = send(
        a.addr,
        "POST",
        "/v1/completions",
        held.to_string().as_bytes(),
    )
    .await;
    let requests = format!("kvroute_worker_peer_load{{what=\"requests\",worker=\"{x}\"}}");
    assert_eq!(
        wait_metric(b.addr, &requests, 1.0, Duration::from_secs(10)).await,
        Some(1.0),
        "B never heard of A's request"
    );
    let pending =
        format!("kvroute_worker_peer_load{{what=\"pending_prefill_tokens\",worker=\"{x}\"}}");
    let tokens = metric(&metrics_text(b.addr).await, &pending).unwrap();
    assert!(
        tokens > 1_000.0,
        "A's pending prefill as B heard it: {tokens}"
    );
    assert_eq!(
        metric(&metrics_text(b.addr).await, "kvroute_peers"),
        Some(1.0)
    );

    // B now sends the short prompt to the other worker; the replica without peers still to X.
    assert_ne!(route(b.addr, &q).await, x, "B priced A's pending prefill");
    assert_eq!(
        route(alone.addr, &q).await,
        x,
        "the control knows nothing of it"
    );

    // A's client goes away: A aborts the request, tells B, and B's home for the prompt is back.
    use tokio::io::AsyncWriteExt as _;
    conn.shutdown().await.unwrap();
    drop(conn);
    assert_eq!(
        wait_metric(b.addr, &requests, 0.0, Duration::from_secs(10)).await,
        Some(0.0),
        "B never heard that A's request ended"
    );
    assert_eq!(route(b.addr, &q).await, x);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_learns_where_its_peer_placed_a_prompt() {
    let (wa, wb) = (upstream("wa", &[]).await, upstream("wb", &[]).await);
    let sockets = peer_sockets(2);
    let a = gateway(replica(&[&wa, &wb], Some(sockets[0]), &sockets)).await;
    let b = gateway(replica(&[&wa, &wb], Some(sockets[1]), &sockets)).await;
    let alone = gateway(replica(&[&wa, &wb], None, &[])).await;

    // Each has heard the other: their senders run.
    for gw in [&a, &b] {
        let peers = wait_metric(gw.addr, "kvroute_peers", 1.0, Duration::from_secs(10)).await;
        assert_eq!(peers, Some(1.0));
    }
    // A conversation's first turn through A, answered at once.
    let history = "a conversation's first turn, long enough for several blocks. ".repeat(40);
    let first = completion(&history);
    let r = request(
        a.addr,
        "POST",
        "/v1/completions",
        first.to_string().as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    let x = r.header("x-kvroute-worker").unwrap().to_owned();
    // Its next turn, asked of B: B has seen none of it, but heard where A placed it.
    let next = completion(&format!("{history} and the second turn"));
    until_routed_to(b.addr, &next, &x, 1, Duration::from_secs(10)).await;
    // The replica without peers knows nothing of the history.
    let d = peek(alone.addr, &next).await;
    assert_eq!(d["predicted_cached_tokens"].as_u64(), Some(0), "{d}");
}
