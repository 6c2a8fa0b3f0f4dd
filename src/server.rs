//! The gateway server: the router, its layers, and serving an already-bound listener until shutdown.

use std::{sync::Arc, time::Duration};

use axum::{
    routing::{any, get, post},
    Router,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_http::trace::TraceLayer;

use crate::{
    config::Config,
    metrics::Metrics,
    policy::{
        arms::{Arm, Arms},
        LeastConn,
    },
    proxy::{http_client, Upstreams},
    routes::{self, AppState},
    workers::Pool,
};

impl AppState {
    pub fn new(config: Config) -> Result<Self, String> {
        let metrics = Metrics::new();
        let pool = Pool::from_config(&config.workers, &metrics)?;
        let auth = crate::auth::Auth::from_config(&config.auth)?;
        Ok(Self::from_shared(crate::routes::Shared {
            resolver: Arc::new(crate::discovery::SystemResolver),
            arms: Arc::new(arc_swap::ArcSwap::from_pointee(Arms::new(
                &config.policy,
                config.ab.as_ref(),
            ))),
            routing_config: Arc::new(arc_swap::ArcSwap::from_pointee(config.routing())),
            passthrough: Arc::new(Arm::new("passthrough", Arc::new(LeastConn::default()))),
            upstreams: Arc::new(Upstreams {
                pool,
                client: http_client(&config),
                metrics,
                config,
                auth,
            }),
        }))
    }
}

/// The gateway's routes.
pub fn app(state: AppState) -> Router {
    let routes = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/models", get(routes::models))
        .route("/v1/{*rest}", any(routes::passthrough))
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed);
    // Client keys cost a layer per request only where they are configured.
    let routes = if state.upstreams.auth.enabled() {
        routes.layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::authenticate,
        ))
    } else {
        routes
    };
    routes
        .layer(axum::middleware::from_fn(routes::guard))
        // Failures are logged once, throttled, where they are understood (routes, proxy).
        .layer(TraceLayer::new_for_http().on_failure(()))
        .with_state(state)
}

/// Serves `listener` until `shutdown` is cancelled, then stops accepting and lets in-flight
/// requests finish for at most the config's drain deadline.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let drain = Duration::from_secs_f64(config.drain_seconds);
    let state = AppState::new(config).map_err(std::io::Error::other)?;
    serve_state(listener, state, drain, shutdown).await
}

/// Like [`serve`] on one event loop per listener (see [`serve_state_on`]), and also reloads
/// `source`, when given, when the file changes or `hup` fires.
pub async fn serve_reloading(
    listeners: Vec<TcpListener>,
    config: Config,
    source: Option<crate::reload::Source>,
    hup: Option<crate::reload::Hangup>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let drain = Duration::from_secs_f64(config.drain_seconds);
    let state = AppState::new(config).map_err(std::io::Error::other)?;
    let reloads = shutdown.child_token();
    let _stop = reloads.clone().drop_guard();
    if let Some(source) = source {
        tokio::spawn(crate::reload::run(state.clone(), source, hup, reloads));
    }
    serve_state_on(listeners, state, drain, shutdown).await
}

pub async fn serve_state(
    listener: TcpListener,
    state: AppState,
    drain: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_state_on(vec![listener], state, drain, shutdown).await
}

/// Serves on one event loop per listener (sockets sharing a port with `SO_REUSEPORT`, from
/// [`crate::listener::bind_many`]): the first on the calling runtime, with the background tasks;
/// each other on a thread of its own with a single-threaded runtime and its own connection pool
/// to the workers. A request then lives on one thread from accept to the worker and back: no
/// work stealing, no cross-thread wake-ups. Policies, the pool and metrics are shared. All loops
/// share the connection cap and stop and drain together.
pub async fn serve_state_on(
    listeners: Vec<TcpListener>,
    state: AppState,
    drain: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let mut listeners = listeners.into_iter();
    let first = listeners
        .next()
        .ok_or_else(|| std::io::Error::other("no listener"))?;
    tracing::info!(
        addr = %first.local_addr()?,
        routing = state.arms.load().describe(),
        workers = state.upstreams.pool.snapshot().len(),
        event_loops = 1 + listeners.len(),
        "kvroute gateway listening"
    );
    let limits = state.upstreams.config.limits.clone();
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut loops = Vec::new();
    for (i, listener) in listeners.enumerate() {
        let listener = listener.into_std()?;
        let (state, shutdown, permits, limits) = (
            state.clone(),
            shutdown.clone(),
            Arc::clone(&permits),
            limits.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-loop-{}", i + 1))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    crate::proxy::use_own_client(&state.upstreams.config);
                    let listener = TcpListener::from_std(listener)?;
                    let server = crate::listener::serve_capped(
                        listener,
                        app(state),
                        &limits,
                        permits,
                        shutdown.clone(),
                    );
                    within_drain(server, drain, &shutdown).await
                })
            })?;
        loops.push(thread);
    }
    // Background tasks stop with the server: their token is a child of the shutdown token.
    let background = shutdown.child_token();
    let _stop_background = background.clone().drop_guard();
    tokio::spawn(crate::health::run(
        state.upstreams.clone(),
        background.clone(),
    ));
    tokio::spawn(crate::load::run(
        state.upstreams.clone(),
        background.clone(),
    ));
    tokio::spawn(crate::discovery::run(
        state.upstreams.clone(),
        state.resolver.clone(),
        background.clone(),
    ));
    let server =
        crate::listener::serve_capped(first, app(state), &limits, permits, shutdown.clone());
    let result = within_drain(server, drain, &shutdown).await;
    for thread in loops {
        let joined = tokio::task::spawn_blocking(move || thread.join()).await;
        match joined {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %e, "an event loop failed"),
            _ => tracing::error!("an event loop panicked"),
        }
    }
    result
}

/// Runs `server` until it ends, or until `drain` after `shutdown` fired.
async fn within_drain(
    server: impl std::future::Future<Output = std::io::Result<()>>,
    drain: Duration,
    shutdown: &CancellationToken,
) -> std::io::Result<()> {
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        r = server => r,
        () = deadline => {
            tracing::warn!(?drain, "drain deadline passed with requests still in flight; exiting");
            Ok(())
        }
    }
}

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutdown signal received; draining");
}

/// Sets `TCP_NODELAY` on every accepted connection. Without it, an SSE event written right after
/// the response head waits for the client's delayed ACK (~40 ms on Linux): Nagle's algorithm
/// holds a small write while an earlier one is unacknowledged.
pub fn no_delay(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    })
}
