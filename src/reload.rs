//! Hot reload: on SIGHUP or when the config file changes, re-read it and swap the routing policy
//! (with its parameters) and the static worker list, without touching requests in flight.
//!
//! A file that does not parse or validate is rejected and logged, and the running config stays.
//! Flags and `KVROUTE_POLICY` keep their precedence over the file on every reload. Other keys
//! (listen address, timeouts, limits, health, discovery) take effect at the next restart; a reload
//! that changes them says so in the log.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::config::{Config, DiscoveryConfig, Overrides};
use crate::discovery;
use crate::policy::arms::Arms;
use crate::routes::AppState;

/// Where the running config came from, so it can be read again.
#[derive(Clone, Debug)]
pub struct Source {
    pub path: PathBuf,
    pub overrides: Overrides,
    /// How often the file's modification time is checked; zero relies on SIGHUP alone.
    pub poll: Duration,
    /// The file's modification time when the running config was read.
    loaded: Option<SystemTime>,
}

impl Source {
    /// Call right after loading the config from `path`, so a change made after that is seen.
    pub fn new(path: PathBuf, overrides: Overrides, poll: Duration) -> Self {
        // Called at start-up, before the server runs: a blocking read is fine here.
        let loaded = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        Self {
            path,
            overrides,
            poll,
            loaded,
        }
    }
}

/// A registered SIGHUP handler. Install it before announcing the server: until it exists, SIGHUP
/// has its default action and ends the process.
#[cfg(unix)]
pub type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
pub type Hangup = ();

/// Registers the SIGHUP handler (must run inside the Tokio runtime).
pub fn install_hangup() -> Option<Hangup> {
    #[cfg(unix)]
    {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| tracing::warn!("cannot listen for SIGHUP: {e}"))
            .ok()
    }
    #[cfg(not(unix))]
    None
}

/// Reloads on `hup` or a changed file until `cancel` fires.
pub async fn run(
    state: AppState,
    source: Source,
    mut hup: Option<Hangup>,
    cancel: CancellationToken,
) {
    let mut seen = source.loaded;
    let poll = if source.poll.is_zero() {
        Duration::from_secs(3600)
    } else {
        source.poll
    };
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let signalled = async {
            match hup.as_mut() {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let signalled = {
            let _ = &mut hup;
            std::future::pending::<Option<()>>()
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = signalled => {
                tracing::info!(path = %source.path.display(), "SIGHUP: reloading config");
            }
            _ = tick.tick() => {
                let now = modified(&source.path).await;
                if now == seen || source.poll.is_zero() {
                    continue;
                }
                seen = now;
                tracing::info!(path = %source.path.display(), "config file changed: reloading");
            }
        }
        // The file is read on a blocking thread, never on the runtime's workers.
        let (path, overrides) = (source.path.clone(), source.overrides.clone());
        let loaded = tokio::task::spawn_blocking(move || Config::load(Some(&path), overrides))
            .await
            .unwrap_or_else(|e| Err(crate::config::ConfigError::Invalid(e.to_string())));
        apply_loaded(&state, loaded);
    }
}

async fn modified(path: &std::path::Path) -> Option<SystemTime> {
    tokio::fs::metadata(path)
        .await
        .and_then(|m| m.modified())
        .ok()
}

/// Reads the file again and applies what can change live; returns whether it was applied.
pub fn apply(state: &AppState, source: &Source) -> bool {
    apply_loaded(
        state,
        Config::load(Some(&source.path), source.overrides.clone()),
    )
}

fn apply_loaded(state: &AppState, loaded: Result<Config, crate::config::ConfigError>) -> bool {
    let up = &state.upstreams;
    let new = match loaded {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "config reload rejected; keeping the running config");
            up.metrics
                .config_reloads
                .with_label_values(&["rejected"])
                .inc();
            return false;
        }
    };
    let old = &up.config;
    let restart_only = Config {
        policy: old.policy.clone(),
        ab: old.ab.clone(),
        workers: old.workers.clone(),
        ..new.clone()
    };
    if &restart_only != old {
        tracing::warn!("the reloaded config changes keys other than policy, ab and workers; those take effect at the next restart");
    }
    let routing = new.routing();
    if routing != **state.routing_config.load() {
        let arms = Arms::new(&routing.policy, routing.ab.as_ref());
        tracing::info!(routing = arms.describe(), "routing swapped");
        state.arms.store(std::sync::Arc::new(arms));
        state.routing_config.store(std::sync::Arc::new(routing));
    }
    if new.discovery == DiscoveryConfig::Static {
        discovery::apply(up, "reload", &new.workers);
    }
    up.metrics
        .config_reloads
        .with_label_values(&["applied"])
        .inc();
    true
}
