//! The admin listener (`--admin-listen`): `kvroute serve` as a process in front of a real upstream
//! over loopback, its probe and metrics routes answered on a second port from the gateway's own
//! state, and nothing else served there.

mod common;

use std::{net::SocketAddr, process::Stdio, time::Duration};

use common::{metric, request, upstream};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The addresses `kvroute serve` announces on stdout: the gateway's, then the admin listener's.
async fn announced(stdout: tokio::process::ChildStdout) -> (SocketAddr, SocketAddr) {
    let mut lines = BufReader::new(stdout).lines();
    let mut addrs = Vec::new();
    for prefix in ["kvroute listening on http://", "kvroute admin on http://"] {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("kvroute announced its listeners")
            .unwrap()
            .expect("a line before stdout closed");
        let addr = line
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("{line:?} does not start with {prefix:?}"));
        addrs.push(addr.parse::<SocketAddr>().unwrap());
    }
    (addrs[0], addrs[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_serves_probes_and_metrics_of_the_gateway_and_no_traffic() {
    let up = upstream("w0", &[]).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--worker",
            &up.url(),
            "--policy",
            "round_robin",
        ])
        .env_remove("KVROUTE_POLICY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (gateway, admin) = announced(child.stdout.take().unwrap()).await;
    assert_ne!(gateway.port(), admin.port());

    let health = request(admin, "GET", "/health", b"").await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json()["status"], "ok");
    let ready = request(admin, "GET", "/ready", b"").await;
    assert_eq!(
        ready.status,
        200,
        "{:?}",
        String::from_utf8_lossy(&ready.body)
    );

    // A completion through the gateway is counted in the metrics the admin port renders: one
    // state behind both listeners.
    let body = br#"{"model":"m","prompt":"hello admin","max_tokens":2}"#;
    let answer = request(gateway, "POST", "/v1/completions", body).await;
    assert_eq!(answer.status, 200);
    let metrics = request(admin, "GET", "/metrics", b"").await;
    assert_eq!(metrics.status, 200);
    assert!(metrics
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/plain")));
    let text = String::from_utf8(metrics.body).unwrap();
    let series = format!(
        "kvroute_requests_total{{arm=\"round_robin\",policy=\"round_robin\",route=\"completions\",status=\"200\",worker=\"{}\"}}",
        up.addr
    );
    assert_eq!(metric(&text, &series), Some(1.0), "{text}");

    // No traffic on the admin port: the completion routes and the pass-through are not there.
    for (method, path) in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ] {
        let refused = request(admin, method, path, body).await;
        assert_eq!(refused.status, 404, "{method} {path}");
        assert!(refused.json()["error"]["message"].is_string());
    }
    assert_eq!(
        up.requests.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the gateway's completion reached the worker"
    );

    // The gateway's own port keeps its probe.
    assert_eq!(request(gateway, "GET", "/health", b"").await.status, 200);
    child.kill().await.unwrap();
}
