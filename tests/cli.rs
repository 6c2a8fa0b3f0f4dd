//! The `kvroute` binary's command line: config checking and overrides.

mod common;

use std::process::Command;

fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env_remove("KVROUTE_POLICY")
        .output()
        .unwrap()
}

#[test]
fn every_example_config_passes_check() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let out = kvroute(&["serve", "--config", path.to_str().unwrap(), "--check"]);
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let policy = path.file_stem().unwrap().to_str().unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&format!("policy {policy}")),
            "{} is not the {policy} policy",
            path.display()
        );
        checked += 1;
    }
    assert!(checked >= 3);
}

#[test]
fn a_bad_config_fails_check_with_a_clear_message() {
    let dir = common::TempDir::new("cli");
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "workers: [{url: 'http://a:1'}]\npolicy: {kind: prefix, load_factr: 2}\n",
    )
    .unwrap();
    let out = kvroute(&["serve", "--config", bad.to_str().unwrap(), "--check"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("load_factr"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--check` loads the configured tokenizers as serving would: each is reported with the
/// load-time checks it passed, and a tokenizer file that is missing fails the check (exit code 2,
/// the path named) instead of the start-up.
#[test]
fn check_loads_the_tokenizers_and_says_what_each_passed() {
    let dir = common::TempDir::new("cli-tokenizers");
    let root = env!("CARGO_MANIFEST_DIR");
    let config = |name: &str, entries: &str| {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!("workers: [{{url: 'http://127.0.0.1:9'}}]\ntokenizers:\n{entries}"),
        )
        .unwrap();
        path
    };
    let tiny = format!("'{root}/tests/tokenize/tiny-tokenizer.json'");
    let good = config(
        "good.yaml",
        &format!(
            "  - {{model: chat, tokenizer_json: {tiny}, \
             tokenizer_config: '{root}/tests/vllm/model/tokenizer_config.json'}}\n\
             \x20 - {{model: plain, tokenizer_json: {tiny}}}\n"
        ),
    );
    let out = kvroute(&["serve", "--config", good.to_str().unwrap(), "--check"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        said.contains(
            "tokenizer for model `chat`: chat template, piece cache, heads, byte-level road"
        ),
        "{said}"
    );
    // Without a template there is nothing to render, so no piece cache either.
    assert!(
        said.contains(
            "tokenizer for model `plain`: no chat template, no piece cache, heads, byte-level road"
        ),
        "{said}"
    );
    let missing = format!("{root}/tests/tokenize/no-such-tokenizer.json");
    let bad = config(
        "bad.yaml",
        &format!("  - {{model: chat, tokenizer_json: '{missing}'}}\n"),
    );
    let out = kvroute(&["serve", "--config", bad.to_str().unwrap(), "--check"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("config ok"));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&missing),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn flags_and_env_override_the_policy() {
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--policy",
        "least_conn",
        "--check",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("policy least_conn"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "serve",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/prefix.yaml"),
            "--check",
        ])
        .env("KVROUTE_POLICY", "round_robin")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("policy round_robin"),
        "{out:?}"
    );
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--policy",
        "fastest",
        "--check",
    ]);
    assert!(!out.status.success());
}

/// `--data-parallel-size` makes each `--worker` one worker per rank, and is checked.
#[test]
fn the_workers_data_parallel_ranks_are_workers_and_counted_by_check() {
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "http://127.0.0.1:10",
        "--data-parallel-size",
        "3",
        "--check",
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("6 worker(s)"), "{out:?}");
    let out = kvroute(&[
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--data-parallel-size",
        "0",
        "--check",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("data_parallel_size must be 1 to 256"),
        "{out:?}"
    );
}

/// Starts `kvroute serve` in front of a closed port, with stderr piped; returns the child, the
/// gateway's address (read from its "listening" line), the lines read so far, and the rest of
/// its log once its stderr closes.
fn serve_dead_pool(
    log_format: &str,
) -> (
    std::process::Child,
    String,
    Vec<String>,
    std::sync::mpsc::Receiver<Vec<String>>,
) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--log-format",
            log_format,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker",
            "http://127.0.0.1:1",
            "--policy",
            "round_robin",
        ])
        .env_remove("KVROUTE_POLICY")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut reader = std::io::BufReader::new(child.stderr.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "exited: {lines:?}"
        );
        lines.push(line.clone());
        if let Some(rest) = line.split("127.0.0.1:").nth(1) {
            if line.contains("listening") {
                let port: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                break format!("127.0.0.1:{port}");
            }
        }
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Keep draining so the child never blocks on a full pipe; hand the rest back at the end.
        let _ = tx.send(reader.lines().map_while(Result::ok).collect());
    });
    (child, addr, lines, rx)
}

fn post_completion(addr: &str) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let body = r#"{"prompt":"x"}"#;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out[9..12].parse().unwrap()
}

#[test]
fn failures_are_logged_throttled_as_json_lines_without_colour() {
    let (mut child, addr, mut lines, rest) = serve_dead_pool("json");
    // Failing requests for a little over one second: two throttle windows at least.
    let start = std::time::Instant::now();
    let mut sent = 0;
    while sent < 300 || start.elapsed() < std::time::Duration::from_millis(1200) {
        assert!(matches!(post_completion(&addr), 502 | 503));
        sent += 1;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let rest = rest
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the log's tail once stderr closes");
    lines.extend(rest);
    let lines: Vec<_> = lines.iter().filter(|l| !l.trim().is_empty()).collect();
    for l in &lines {
        assert!(!l.contains('\u{1b}'), "colour code in {l}");
        serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{e}: {l}"));
    }
    // Hundreds of failed requests; at most 10 lines a second per kind of line.
    let failures = lines.iter().filter(|l| l.contains("failed")).count();
    let seconds = start.elapsed().as_secs() + 1;
    assert!(
        failures >= 1 && failures as u64 <= 2 * 10 * seconds,
        "{failures} lines for {sent} requests: {lines:#?}"
    );
    // A line after a throttled burst says how many were held back.
    assert!(lines.iter().any(|l| {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        v["fields"]["suppressed"].as_u64() > Some(0)
    }));
}

#[test]
fn bad_bench_numbers_are_refused_without_a_panic() {
    for bad in [
        "--rate=0",
        "--request-timeout=-1",
        "--rate=NaN",
        "--duration=1e30",
        "--warmup=-3",
        "--output-range=1",
        "--output-range=-0.5",
    ] {
        let args = ["bench", "run", "--url", "http://127.0.0.1:1", bad];
        let out = kvroute(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad:?}");
        assert!(!stderr.contains("panicked"), "{bad:?}: {stderr}");
        assert!(stderr.contains("must be"), "{bad:?}: {stderr}");
    }
    // A trace carries its own output lengths: varying them is refused, not silently ignored.
    let trace = std::env::temp_dir().join(format!("kvroute-range-{}.jsonl", std::process::id()));
    std::fs::write(
        &trace,
        "{\"input_length\": 8, \"output_length\": 4, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let path = trace.to_str().unwrap();
    let args = [
        "bench",
        "run",
        "--url",
        "http://127.0.0.1:1",
        "--trace",
        path,
        "--output-range",
        "0.5",
    ];
    let out = kvroute(&args);
    let _ = std::fs::remove_file(&trace);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--output-range applies to the built-in workloads"),
        "{stderr}"
    );
}

/// `bench compare --seeds` runs the comparison once per seed on fresh simulated pools and ends
/// with each arm's medians over the runs, every run's figure in brackets.
#[test]
fn bench_compare_over_several_seeds_ends_with_the_medians() {
    let out = kvroute(&[
        "bench",
        "compare",
        "--policies",
        "round_robin,least_conn",
        "--workers",
        "1",
        "--time-scale",
        "100",
        "--warmup",
        "0",
        "--duration",
        "0.5",
        "--concurrency",
        "2",
        "--seeds",
        "4,5",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let at = |s: &str| text.find(s).unwrap_or_else(|| panic!("no {s:?} in {text}"));
    assert!(at("== seed 4") < at("== seed 5"));
    let summary = &text[at("== medians over seeds 4, 5")..];
    let rps = summary.lines().find(|l| l.starts_with("| req/s")).unwrap();
    // Two arms, each a median and its two runs.
    assert_eq!(rps.matches('[').count(), 2, "{rps}");
    assert_eq!(rps.matches(", ").count(), 2, "{rps}");
    assert!(summary.contains("median req/s vs round_robin"), "{summary}");
}
