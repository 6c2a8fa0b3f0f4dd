//! The checks every request passes before a handler: a well-formed head, no dot segments, the
//! client's key where one is needed; and the answers for what no route matches.

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
};
use http_body_util::BodyExt;

use super::{needs_client_key, AppState};
use crate::error::{error_response, ApiError};

/// Refuses what no route should see: an HTTP/1.1 request without exactly one `Host` header
/// (RFC 9112 §3.2) and a path with dot segments (`.`/`..`, also percent-encoded), which a worker
/// or a proxy behind it might resolve to another path than the one routed.
pub async fn guard(req: Request, next: axum::middleware::Next) -> Response {
    if let Err(refused) = check_head(&req) {
        return refused.into_response();
    }
    // Only a segment with a `.` or `%` can be one; the rest cost no allocation.
    let dotted = req.uri().path().split('/').any(|seg| {
        seg.contains(['.', '%']) && {
            let seg = seg.to_ascii_lowercase().replace("%2e", ".");
            seg == "." || seg == ".."
        }
    });
    if dotted {
        return ApiError::InvalidRequest(
            "dot segments (`.` or `..`) are not allowed in the path".into(),
        )
        .into_response();
    }
    next.run(req).await
}

/// An HTTP/1.1 request names exactly one `Host` (RFC 9112 §3.2); a 400 otherwise.
pub fn check_head<B>(req: &http::Request<B>) -> Result<(), ApiError> {
    let hosts = req.headers().get_all(header::HOST).iter().count();
    if req.version() == http::Version::HTTP_11 && hosts != 1 {
        let msg = if hosts == 0 {
            "missing Host header"
        } else {
            "more than one Host header"
        };
        return Err(ApiError::InvalidRequest(msg.into()));
    }
    Ok(())
}

/// With client keys configured, a request the gateway proxies ([`needs_client_key`]) needs a
/// valid one (401) and room in its client's quota (429); the client's place is held until its
/// response body has ended.
pub async fn authenticate(
    State(s): State<AppState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let auth = &s.upstreams.auth;
    let path = req.uri().path();
    if !auth.enabled() || !needs_client_key(path) {
        return next.run(req).await;
    }
    let permit = match auth.admit(req.headers()) {
        Ok(p) => p,
        Err(e) => {
            if matches!(e, ApiError::QuotaExceeded { .. }) {
                s.upstreams
                    .metrics
                    .shed
                    .with_label_values(&["client_quota"])
                    .inc();
            }
            return e.into_response();
        }
    };
    s.upstreams
        .metrics
        .client_requests
        .with_label_values(&[permit.client()])
        .inc();
    let resp = next.run(req).await;
    // The permit lives in the body's frame mapper: dropped when the body is done or dropped.
    resp.map(|body| {
        Body::new(body.map_frame(move |frame| {
            let _held = &permit;
            frame
        }))
    })
}

pub async fn not_found(req: Request) -> Response {
    ApiError::RouteNotFound(req.uri().path().to_owned()).into_response()
}

pub async fn method_not_allowed(req: Request) -> Response {
    let msg = format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    );
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowedError",
        &msg,
        None,
    )
}
