//! `kvroute sim` and `kvroute demo` as a newcomer runs them: real processes, free ports, a real
//! streaming request through what they print.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// Kills the child when the test ends, pass or fail.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str]) -> (Running, impl Iterator<Item = String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env_remove("KVROUTE_POLICY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok);
    (Running(child), lines)
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

#[tokio::test]
async fn sim_with_port_zero_prints_one_url_a_line_and_each_answers() {
    let (_child, mut lines) =
        spawn(&["sim", "--workers", "3", "--port", "0", "--time-scale", "50"]);
    let urls: Vec<String> = lines.by_ref().take(3).collect();
    assert_eq!(urls.len(), 3);
    let mut ports = std::collections::HashSet::new();
    for url in &urls {
        let addr = addr_of(url);
        assert!(addr.ip().is_loopback());
        ports.insert(addr.port());
        let r = common::request(addr, "GET", "/v1/models", b"").await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(ports.len(), 3, "independent workers on distinct ports");
}

#[test]
fn sim_rejects_an_unknown_preset_naming_the_known_ones() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["sim", "--preset", "h100-dreams"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("h100-dreams") && err.contains("l4-qwen2.5-7b"),
        "{err}"
    );
}

#[tokio::test]
async fn demo_prints_a_curl_that_streams_through_the_gateway() {
    let (_child, mut lines) = spawn(&["demo", "--listen", "127.0.0.1:0", "--time-scale", "20"]);
    let first = lines.next().unwrap();
    let url = first.split_whitespace().nth(1).unwrap().to_string();
    let curl = lines
        .find(|l| l.starts_with("curl -N"))
        .expect("a curl line");
    // Run the printed request body as curl would send it.
    let body = curl.split(" -d '").nth(1).unwrap().trim_end_matches('\'');
    let r = common::request(
        addr_of(&url),
        "POST",
        "/v1/chat/completions",
        body.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.header("x-kvroute-worker").is_some());
    let text = String::from_utf8_lossy(&r.body);
    assert!(text.contains("chat.completion.chunk"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // It runs the gateway's default policy, as `serve` would.
    let m = common::request(addr_of(&url), "GET", "/metrics", b"").await;
    let metrics = String::from_utf8_lossy(&m.body);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_routing_decisions_total{")
                && l.contains("policy=\"cache_aware\"")),
        "{metrics}"
    );
}

#[tokio::test]
async fn sim_reads_a_config_file_and_flags_override_it() {
    let dir = common::TempDir::new("sim");
    let file = dir.join("sim.yaml");
    std::fs::write(
        &file,
        "workers: 4\nport: 0\ntime_scale: 50\npreset: l4-qwen2.5-7b\nfaults:\n  error_rate: 1.0\nfault_worker: 1\n",
    )
    .unwrap();
    let (_child, lines) = spawn(&[
        "sim",
        "--sim-config",
        file.to_str().unwrap(),
        "--workers",
        "2",
    ]);
    let urls: Vec<String> = lines.take(2).collect();
    assert_eq!(urls.len(), 2);
    let body = br#"{"prompt": "hi", "max_tokens": 1}"#;
    let ok = common::request(addr_of(&urls[0]), "POST", "/v1/completions", body).await;
    assert_eq!(ok.status, 200);
    assert_eq!(
        ok.json()["model"],
        "Qwen/Qwen2.5-7B-Instruct",
        "preset from the file"
    );
    let faulty = common::request(addr_of(&urls[1]), "POST", "/v1/completions", body).await;
    assert_eq!(faulty.status, 500, "faults from the file, on worker 1 only");
}

#[tokio::test]
async fn healthcheck_exits_zero_only_for_a_healthy_url() {
    let (_child, mut lines) = spawn(&["sim", "--workers", "1", "--port", "0"]);
    let url = lines.next().unwrap();
    let check = |u: String| {
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["healthcheck", "--url", &u])
            .output()
            .unwrap()
            .status
    };
    assert!(check(format!("{url}/health")).success());
    assert!(
        !check(format!("{url}/no-such-path")).success(),
        "404 is not healthy"
    );
    // A port nothing listens on: bind one, then close it.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    assert!(!check(format!("http://{closed}/health")).success());
}

#[tokio::test]
async fn serve_reloads_its_config_on_sighup() {
    let (_sim, mut lines) = spawn(&["sim", "--workers", "2", "--port", "0", "--time-scale", "50"]);
    let workers: Vec<String> = lines.by_ref().take(2).collect();
    let dir = common::TempDir::new("hup");
    let path = dir.join("kvroute.yaml");
    let write = |policy: &str| {
        let list: String = workers.iter().map(|w| format!("  - url: {w}\n")).collect();
        std::fs::write(
            &path,
            format!("listen: 127.0.0.1:0\npolicy:\n  kind: {policy}\nworkers:\n{list}"),
        )
        .unwrap();
    };
    write("round_robin");
    let (gw, mut out) = spawn(&["serve", "--config", path.to_str().unwrap()]);
    let first = out.next().expect("the listening line");
    let addr = addr_of(first.rsplit(' ').next().unwrap());
    // New content, old modification time: only the signal can trigger this reload.
    let before = std::fs::metadata(&path).unwrap().modified().unwrap();
    write("prefix");
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(before)
        .unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &gw.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let applied = "kvroute_config_reloads_total{result=\"applied\"}";
    let got = common::wait_metric(addr, applied, 1.0, std::time::Duration::from_secs(5)).await;
    assert_eq!(got, Some(1.0));
    let body = br#"{"prompt": "x", "max_tokens": 1}"#;
    let r = common::request(addr, "POST", "/v1/completions", body).await;
    assert_eq!(r.header("x-kvroute-arm"), Some("prefix"));
}
