//! Logging: the subscriber (text or JSON lines on stderr, colour only on a terminal) and a
//! throttle that keeps one failing worker from flooding the log with a line per request.

use std::{
    io::IsTerminal,
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// Installs the global subscriber; `RUST_LOG` filters (default `info`).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,tower_http=warn".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    // Already installed (a test harness or an embedding program): keep theirs.
    drop(result);
}

/// At most `per_second` lines a second from one call site; the next line allowed says how many
/// were held back. Use one `static` per kind of line.
pub struct Throttle {
    per_second: u64,
    /// Second of the current window and lines logged in it, packed: `second << 20 | count`.
    window: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    pub const fn new(per_second: u64) -> Self {
        Self {
            per_second,
            window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when this line may be logged.
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.allow_at(now)
    }

    fn allow_at(&self, second: u64) -> Option<u64> {
        let ok = self
            .window
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                if w >> 20 != second {
                    Some(second << 20 | 1)
                } else if w & 0xfffff < self.per_second {
                    Some(w + 1)
                } else {
                    None
                }
            })
            .is_ok();
        if ok {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_cut_to_the_rate_and_the_next_line_counts_what_was_held() {
        let t = Throttle::new(3);
        let allowed: Vec<_> = (0..10).map(|_| t.allow_at(100)).collect();
        assert_eq!(allowed.iter().filter(|a| a.is_some()).count(), 3);
        assert_eq!(t.allow_at(101), Some(7));
        assert_eq!(t.allow_at(101), Some(0));
    }
}
