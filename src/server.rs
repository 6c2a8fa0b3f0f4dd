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
        arms::{Arm, Arms, HeldArm},
        LeastConn,
    },
    proxy::{http_client, Upstreams},
    routes::{self, AppState},
    tokenize::ModelTokenizer,
    workers::Pool,
};

impl AppState {
    pub fn new(config: Config) -> Result<Self, String> {
        let metrics = Metrics::new();
        let pool = Pool::from_config(&config.workers, &metrics, &config.kv_events)?;
        let auth = crate::auth::Auth::from_config(&config.auth)?;
        let tokenizers = load_tokenizers(&config)?;
        Ok(Self::from_shared(crate::routes::Shared {
            resolver: Arc::new(crate::discovery::SystemResolver),
            arms: Arc::new(arc_swap::ArcSwap::from_pointee(Arms::new(
                &config.policy,
                config.ab.as_ref(),
            ))),
            routing_config: Arc::new(arc_swap::ArcSwap::from_pointee(config.routing())),
            passthrough: HeldArm::only(Arm::new("passthrough", Arc::new(LeastConn::default()))),
            responses: Arc::new(crate::responses::Homes::new(crate::responses::REMEMBERED)),
            here: crate::routes::Here::default(),
            upstreams: Arc::new(Upstreams {
                pool,
                client: http_client(&config),
                connections: crate::proxy::Connections::new(
                    config.timeouts.connect(),
                    config.timeouts.worker_idle(),
                ),
                metrics,
                times: crate::proxy::RequestTimes::of(&config),
                config,
                auth,
                tokenizers,
            }),
        }))
    }
}

/// The configured models' tokenizers, loaded (at start-up, and by `serve --check`), each logged
/// with what its load-time checks allowed.
pub fn load_tokenizers(
    config: &Config,
) -> Result<std::collections::HashMap<String, Arc<ModelTokenizer>>, String> {
    let mut tokenizers = std::collections::HashMap::new();
    for t in &config.tokenizers {
        let loaded = ModelTokenizer::load_with_template(
            &t.tokenizer_json,
            t.tokenizer_config.as_deref(),
            t.chat_template.as_deref(),
        )
        .map_err(|e| format!("tokenizer for model `{}`: {e}", t.model))?
        .with_default_chat_template_kwargs(t.default_chat_template_kwargs.clone());
        tracing::info!(model = %t.model, "tokenizer loaded: {}", loaded.summary());
        tokenizers.insert(t.model.clone(), Arc::new(loaded));
    }
    Ok(tokenizers)
}

/// The gateway's routes.
pub fn app(state: AppState) -> Router {
    let routes = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/models", get(routes::models))
        .route("/v1/responses", post(routes::responses_create))
        .route("/v1/responses/{id}", any(routes::stored_response))
        .route("/v1/responses/{id}/{*rest}", any(routes::stored_response))
        .route("/v1/{*rest}", any(routes::passthrough))
        .merge(vllm_serving_routes())
        .route(
            "/debug/route/v1/completions",
            post(routes::debug_route_completions),
        )
        .route(
            "/debug/route/v1/chat/completions",
            post(routes::debug_route_chat),
        )
        .merge(probe_routes())
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

/// The routes as served: the completion routes directly, the rest through [`app`].
pub fn gateway(state: AppState) -> crate::dispatch::Gateway {
    crate::dispatch::Gateway::new(app(state.clone()), state)
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
/// `source`, when given, when the file changes or `hup` fires, and serves the admin routes on
/// `admin`, when given (see [`spawn_admin`]).
pub async fn serve_reloading(
    listener: TcpListener,
    admin: Option<std::net::TcpListener>,
    loops: usize,
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
        tokio::spawn(crate::reload::run(
            state.clone(),
            source,
            hup,
            reloads.clone(),
        ));
    }
    if let Some(admin) = admin {
        spawn_admin(admin, state.clone(), reloads)?;
    }
    serve_state_on(listener, loops, state, drain, shutdown).await
}

/// vLLM's serving routes outside `/v1/` ([`routes::VLLM_SERVING_PATHS`] and
/// [`routes::VLLM_SERVING_PREFIXES`]), passed through.
fn vllm_serving_routes() -> Router<AppState> {
    let paths = routes::VLLM_SERVING_PATHS.iter().copied();
    let prefixes = routes::VLLM_SERVING_PREFIXES
        .iter()
        .map(|p| format!("{p}{{*rest}}"));
    paths
        .map(str::to_owned)
        .chain(prefixes)
        .fold(Router::new(), |r, path| {
            r.route(&path, any(routes::passthrough))
        })
}

/// `/health`, `/ready` and `/metrics`: on the gateway's listener and on the admin listener.
fn probe_routes() -> Router<AppState> {
    Router::new()
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/metrics", get(routes::metrics))
}

/// The admin routes: `probe_routes` and nothing else.
pub fn admin_app(state: AppState) -> Router {
    probe_routes()
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn(routes::guard))
        .with_state(state)
}

/// Serves [`admin_app`] on `listener` from a thread of its own, with a single-threaded runtime,
/// until `shutdown`. The event loops run each ready connection's task in turn, so a probe that
/// arrives while thousands of streams have bytes to relay waits for all of them there; here it
/// waits for nothing (linkerd2-proxy runs its admin server on its own thread for this reason).
pub fn spawn_admin(
    listener: std::net::TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let limits = state.upstreams.config.limits.clone();
    spawn_on_own_thread("kvroute-admin", listener, move |listener| async move {
        let app = crate::dispatch::Gateway::router_only(admin_app(state));
        crate::listener::serve(listener, app, &limits, shutdown).await
    })
}

/// Runs `serve` on the listener from a thread of its own (named `name`) with a single-threaded
/// runtime, out of reach of whatever else the process's runtimes are busy with; logs its error
/// if it fails.
pub fn spawn_on_own_thread<F, Fut>(
    name: &str,
    listener: std::net::TcpListener,
    serve: F,
) -> std::io::Result<()>
where
    F: FnOnce(TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = std::io::Result<()>>,
{
    listener.set_nonblocking(true)?;
    let what = name.to_string();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .and_then(|rt| {
                    rt.block_on(async move { serve(TcpListener::from_std(listener)?).await })
                });
            if let Err(e) = served {
                tracing::error!(error = %e, thread = %what, "a listener on its own thread failed");
            }
        })?;
    Ok(())
}

pub async fn serve_state(
    listener: TcpListener,
    state: AppState,
    drain: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_state_on(listener, 1, state, drain, shutdown).await
}

/// Serves on `loops` event loops: this one accepts (so the connection cap is exact), runs the
/// background tasks and takes its turn at connections; each other loop is a thread of its own
/// with a single-threaded runtime and its own connection pool to the workers, and is handed
/// connections in turn. A request then lives on one thread from the client's socket to the
/// worker's and back: no work stealing, no cross-thread wake-ups. Policies, the pool and the
/// metrics are shared; the series every request updates are kept per loop and summed when
/// scraped (see `metrics::sharded`), and each loop holds the state, the arms and the worker set
/// through handles of its own (see `loop_copy`). The loops stop and drain together.
pub async fn serve_state_on(
    listener: TcpListener,
    loops: usize,
    state: AppState,
    drain: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    tracing::info!(
        addr = %listener.local_addr()?,
        routing = state.arms.load().describe(),
        workers = state.upstreams.pool.snapshot().len(),
        event_loops = loops.max(1),
        "kvroute gateway listening"
    );
    let limits = state.upstreams.config.limits.clone();
    // This thread is loop 0; each loop updates the per-request metrics in a shard of its own.
    crate::metrics::sharded::pin_thread(0);
    let mut others = Vec::new();
    let mut threads = Vec::new();
    for i in 1..loops.max(1) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (state, limits) = (state.for_loop(), limits.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-loop-{i}"))
            .spawn(move || {
                crate::metrics::sharded::pin_thread(i);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    crate::proxy::use_own_connections(&state.upstreams.config);
                    crate::listener::serve_handed(rx, gateway(state), &limits).await;
                });
                Ok::<_, std::io::Error>(())
            })?;
        others.push(tx);
        threads.push(thread);
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
    tokio::spawn(crate::peers::run(
        state.upstreams.clone(),
        state.arms.clone(),
        background.clone(),
    ));
    let server = async {
        let accepted = crate::listener::serve_spread(
            listener,
            gateway(state.for_loop()),
            &limits,
            others,
            shutdown.clone(),
        )
        .await;
        // The acceptor has stopped and dropped the hand-over channels: the loops drain and end.
        for thread in threads {
            match tokio::task::spawn_blocking(move || thread.join()).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "an event loop failed"),
                _ => tracing::error!("an event loop panicked"),
            }
        }
        accepted
    };
    within_drain(server, drain, &shutdown).await
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
