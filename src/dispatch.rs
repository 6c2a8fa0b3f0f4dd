//! The service hyper calls for every request: the two completion routes, which carry nearly all
//! of a gateway's traffic, go straight to their handler; every other request goes through the
//! router and its layers.
//!
//! Through axum's router, a request clones the boxed service of every layer it passes (the trace
//! layer, the request guard, the route) and boxes a future for each: about 17 of the 46 heap
//! allocations a proxied completion cost, measured with a uprobe on `malloc`. The direct path
//! makes the same checks as the router's layers ([`crate::routes::guard`]: one `Host` header; a
//! dot segment cannot match the exact paths), opens the same debug span as the trace layer, and
//! calls the same handler. With client keys configured, requests take the router, whose layer
//! holds each client's place until its response has ended.

use std::{convert::Infallible, future::Future, pin::Pin};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
    Router,
};
use http::Request;
use hyper::body::Incoming;
use tower::ServiceExt;
use tracing::Instrument;

use crate::routes::{self, AppState};

/// What serves a connection's requests.
#[derive(Clone)]
pub struct Gateway {
    router: Router,
    /// The handlers' state, when the completion routes may skip the router.
    direct: Option<AppState>,
}

impl Gateway {
    /// `router` for every request, and the completion routes' handlers called directly when
    /// `state` needs none of the router's optional layers.
    pub fn new(router: Router, state: AppState) -> Self {
        let direct = (!state.upstreams.auth.enabled()).then_some(state);
        Self { router, direct }
    }

    /// `router` for every request (a router without the completion routes).
    pub fn router_only(router: Router) -> Self {
        Self {
            router,
            direct: None,
        }
    }
}

pub type Answer = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Gateway {
    type Response = Response;
    type Error = Infallible;
    type Future = Answer;

    fn call(&self, req: Request<Incoming>) -> Answer {
        self.answer(req.map(Body::new))
    }
}

impl Gateway {
    /// The answer to `req`, whichever server read it.
    pub fn answer(&self, req: Request<Body>) -> Answer {
        if let Some(state) = &self.direct {
            if let Some(route) = routes::Completion::of(req.method(), req.uri().path()) {
                return Box::pin(direct(state.clone(), route, req));
            }
        }
        let router = self.router.clone();
        Box::pin(async move { Ok(router.oneshot(req).await.into_response()) })
    }
}

async fn direct(
    state: AppState,
    route: routes::Completion,
    req: Request<Body>,
) -> Result<Response, Infallible> {
    if let Err(refused) = routes::check_head(&req) {
        return Ok(refused.into_response());
    }
    // As the router's trace layer does: a debug span per request, and a line when it is answered.
    let span = tracing::debug_span!(
        "request",
        method = %req.method(),
        uri = %req.uri(),
        version = ?req.version(),
    );
    async move {
        // The clock is read for the line alone, so only when it is written.
        let started = tracing::enabled!(tracing::Level::DEBUG).then(tokio::time::Instant::now);
        let resp = routes::completion(state, route, req).await;
        if let Some(started) = started {
            tracing::debug!(
                latency = ?started.elapsed(),
                status = resp.status().as_u16(),
                "finished processing request"
            );
        }
        Ok(resp)
    }
    .instrument(span)
    .await
}
