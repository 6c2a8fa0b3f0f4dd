//! The Responses API's handlers: a new response routed as a chat is, and a stored one (or its
//! continuation) sent to the worker that holds it.

use std::sync::Arc;

use axum::{
    body::Body,
    extract::{Request, State},
    response::Response,
};
use bytes::Bytes;
use http_body_util::BodyExt;

use super::{key, named_model, read_body, respond, AppState};
use crate::{
    error::ApiError,
    policy::arms::{Arms, HeldArm},
    proxy::{forward, forward_to, Route, WORKER_HEADER},
    responses,
    routing_key::{PromptField, RequestInfo},
};

/// `POST /v1/responses`: keyed on its instructions and input and routed as a chat is; one that
/// continues a stored response (`previous_response_id`) goes to the worker that holds it
/// ([`crate::responses`]), and is left for that worker to judge. The worker that makes a
/// response is remembered as its home.
pub async fn responses_create(State(s): State<AppState>, req: Request) -> Response {
    let up = &s.upstreams;
    let arms = s.arms_now();
    let (parts, body) = req.into_parts();
    let body = match read_body(&parts.headers, body, up).await {
        Ok(b) => b,
        Err(e) => return respond(&s, Route::Responses, arms.unpicked_labels(), Err(e)),
    };
    // Outside the match: the labels borrow from it.
    let arm: HeldArm;
    let (labels, result) = match responses::previous_response_id(&body) {
        Some(id) => {
            let info = RequestInfo {
                model: named_model(&parts.headers, &body),
                ..RequestInfo::unkeyed()
            };
            let result = follow(&s, &id, Route::Responses, &parts, body, info).await;
            ((s.passthrough.policy.name(), &*s.passthrough.name), result)
        }
        None => match key(up, &body, PromptField::Input).await {
            Ok(info) => {
                arm = Arms::pick_held(&arms, &parts.headers, &info);
                let workers = s.workers_now();
                let result =
                    forward(up, &workers, &arm, Route::Responses, &parts, body, info).await;
                ((arm.policy.name(), &*arm.name), result)
            }
            Err(e) => (arms.unpicked_labels(), Err(e)),
        },
    };
    respond(
        &s,
        Route::Responses,
        labels,
        result.map(|r| learn_home(&s, r)),
    )
}

/// `/v1/responses/{id}` and the routes under it (`cancel`, `input_items`), any method: to the
/// worker that holds that response.
pub async fn stored_response(State(s): State<AppState>, req: Request) -> Response {
    let up = &s.upstreams;
    let (parts, body) = req.into_parts();
    let result = async {
        let body = read_body(&parts.headers, body, up).await?;
        let path = parts.uri.path();
        let id =
            responses::id_in_path(path).ok_or_else(|| ApiError::RouteNotFound(path.to_owned()))?;
        let info = RequestInfo::unkeyed();
        follow(&s, id, Route::Passthrough, &parts, body, info).await
    }
    .await;
    let labels = (s.passthrough.policy.name(), &*s.passthrough.name);
    respond(&s, Route::Passthrough, labels, result)
}

/// Sends a request for stored response `id` to the worker remembered for it, or found holding
/// it; where none is, to the least-loaded worker, whose answer (vLLM's 404) is the client's.
async fn follow(
    s: &AppState,
    id: &str,
    route: Route,
    parts: &http::request::Parts,
    body: Bytes,
    info: RequestInfo,
) -> Result<Response, ApiError> {
    let up = &s.upstreams;
    let snapshot = s.workers_now();
    let workers = crate::workers::eligible(&snapshot, info.model.as_deref())?;
    let named = |name: &str| workers.iter().find(|w| w.name == name);
    let remembered = s.responses.home(id).and_then(|home| named(&home));
    let (home, how) = match remembered {
        Some(home) => (Some(home), "remembered"),
        None => match responses::locate(up, &workers, id).await {
            Some(found) => {
                s.responses.remember(id, &found);
                (named(&found), "found")
            }
            None => (None, "unknown"),
        },
    };
    up.metrics
        .responses_followed
        .with_label_values(&[how])
        .inc();
    match home {
        Some(home) => {
            forward_to(
                up,
                &s.passthrough,
                route,
                parts,
                body,
                info,
                &snapshot,
                home,
            )
            .await
        }
        None => forward(up, &snapshot, &s.passthrough, route, parts, body, info).await,
    }
}

/// Remembers the worker that answered a Responses request as the home of the response it made,
/// whose id is in the answer's first bytes (its JSON, or its stream's `response.created` event).
fn learn_home(s: &AppState, resp: Response) -> Response {
    let worker = resp
        .headers()
        .get(WORKER_HEADER)
        .and_then(|v| v.to_str().ok());
    let Some(worker) = worker.filter(|_| resp.status().is_success()) else {
        return resp;
    };
    let worker: Arc<str> = worker.into();
    let homes = Arc::clone(&s.responses);
    // The id comes in the first frame or two; later frames are not searched.
    let mut frames_left = 2u8;
    resp.map(|body| {
        Body::new(body.map_frame(move |frame| {
            if frames_left > 0 {
                if let Some(data) = frame.data_ref() {
                    frames_left -= 1;
                    if let Some(id) = responses::response_id_in(data) {
                        homes.remember(id, &worker);
                        frames_left = 0;
                    }
                }
            }
            frame
        }))
    })
}
