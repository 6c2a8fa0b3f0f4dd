//! External arms of `bench compare`: another router, started from a command template in front of
//! each fresh pool and stopped after, so kvroute is measured beside it on the same load.
//!
//! An arm `NAME=COMMAND` (e.g. `smg=smg launch --host 127.0.0.1 --port {port} --worker-urls
//! {workers} --policy cache_aware`) is split on whitespace (no shell); `{port}` becomes a free
//! loopback port, a word `{workers}` the worker URLs as separate words, and `{workers_csv}` the
//! same joined by commas. The router counts as ready when `GET /v1/models` or `GET /health`
//! answers 200.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::BenchError;

/// How long a router may take to start.
const READY_WITHIN: Duration = Duration::from_secs(180);

/// `NAME=COMMAND`, when `arm` is one (a policy name or a config path has no `=` followed by a
/// command with spaces).
pub fn parse(arm: &str) -> Option<(&str, &str)> {
    let (name, cmd) = arm.split_once('=')?;
    (!name.is_empty() && !name.contains(' ') && cmd.trim().contains(' ')).then_some((name, cmd))
}

/// A started router process; killed (and reaped) on drop, its output file removed.
pub struct Router {
    pub url: String,
    child: Child,
    /// Where its stdout and stderr go, so a failed start can say why.
    log: std::path::PathBuf,
}

impl Router {
    /// The last lines the router printed.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// The argument vector of `template` for this pool.
pub fn expand(template: &str, port: u16, workers: &[String]) -> Vec<String> {
    let mut argv = Vec::new();
    for word in template.split_whitespace() {
        if word == "{workers}" {
            argv.extend(workers.iter().cloned());
        } else {
            argv.push(
                word.replace("{port}", &port.to_string())
                    .replace("{workers_csv}", &workers.join(",")),
            );
        }
    }
    argv
}

/// Where the kernel's ephemeral ports start (`ip_local_port_range`), when it can be read.
fn ephemeral_range_start() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// The lowest port [`free_port_below_ephemeral`] draws from.
const FIRST_PORT: u16 = 10_000;

/// A loopback port that is free now, for a process that will bind it itself. It is drawn from
/// below the kernel's ephemeral range: a port found with `bind(0)` and released lies in that
/// range, which every `bind(0)` and outgoing connection draws from, so it can be taken before
/// the router binds it. Where the range cannot be read, or nothing below it is free, it falls
/// back to `bind(0)`.
fn free_port_below_ephemeral() -> std::io::Result<u16> {
    if let Some(low) = ephemeral_range_start().filter(|&low| low > FIRST_PORT) {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()) << 32;
        for attempt in 0..64u64 {
            let r = xxhash_rust::xxh3::xxh3_64(&(seed ^ attempt).to_le_bytes());
            let port = FIRST_PORT + (r % u64::from(low - FIRST_PORT)) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `template` in front of `workers` and waits until it answers.
pub async fn start(name: &str, template: &str, workers: &[String]) -> Result<Router, BenchError> {
    let setup = |e: String| BenchError::Setup(format!("arm {name}: {e}"));
    let port = free_port_below_ephemeral().map_err(|e| setup(e.to_string()))?;
    let argv = expand(template, port, workers);
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| setup("empty command".into()))?;
    let log = std::env::temp_dir().join(format!("kvroute-bench-{name}-{port}.log"));
    let out = std::fs::File::create(&log).map_err(|e| setup(format!("{}: {e}", log.display())))?;
    let err = out.try_clone().map_err(|e| setup(e.to_string()))?;
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| setup(format!("cannot start `{program}`: {e}")))?;
    let mut router = Router {
        url: format!("http://127.0.0.1:{port}"),
        child,
        log,
    };
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        for path in ["/v1/models", "/health"] {
            let Ok(uri) = format!("{}{path}", router.url).parse::<http::Uri>() else {
                continue;
            };
            let ask = tokio::time::timeout(Duration::from_secs(2), client.get(uri)).await;
            if matches!(ask, Ok(Ok(ref r)) if r.status().is_success()) {
                return Ok(router);
            }
        }
        if let Ok(Some(status)) = router.child.try_wait() {
            return Err(setup(format!(
                "`{program}` exited before it was ready ({status}); it said:\n{}",
                router.log_tail()
            )));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(setup(format!(
                "not ready within {READY_WITHIN:?}; it said:\n{}",
                router.log_tail()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routers_port_is_free_and_outside_the_ephemeral_range() {
        let port = free_port_below_ephemeral().unwrap();
        std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port was handed out free");
        if let Some(low) = ephemeral_range_start().filter(|&low| low > FIRST_PORT) {
            assert!((FIRST_PORT..low).contains(&port), "{port} not below {low}");
        }
    }

    #[test]
    fn templates_expand_port_and_workers() {
        let w = vec!["http://a:1".to_string(), "http://b:2".to_string()];
        assert_eq!(
            expand(
                "smg launch --port {port} --worker-urls {workers} --x={workers_csv}",
                9,
                &w
            ),
            [
                "smg",
                "launch",
                "--port",
                "9",
                "--worker-urls",
                "http://a:1",
                "http://b:2",
                "--x=http://a:1,http://b:2"
            ]
        );
    }

    #[test]
    fn only_name_equals_command_is_an_external_arm() {
        assert_eq!(
            parse("smg=smg launch --port {port}"),
            Some(("smg", "smg launch --port {port}"))
        );
        assert_eq!(parse("prefix"), None);
        assert_eq!(parse("config/a=b.yaml"), None);
        assert_eq!(parse("=x y"), None);
    }
}
