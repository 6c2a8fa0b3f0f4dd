//! The gateway's one error type and the one table that turns it into a status and an OpenAI-style JSON body.
//!
//! The body has vLLM's shape (`{"error": {"message", "type", "param", "code"}}` with `code` the HTTP
//! status), so a client sees the same error format whether the gateway or a worker refused it.

use axum::{
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the request body did not arrive within {0}s")]
    BodyTimeout(f64),
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("no route for {0}")]
    RouteNotFound(String),
    #[error("every worker serving this model is at its in-flight limit and no place is left in the wait queue; retry later")]
    QueueFull,
    #[error("every worker serving this model is at its in-flight limit; retry later")]
    AtCapacity,
    #[error("no worker serving this model had room within {0}s; retry later")]
    QueueTimeout(f64),
    #[error("client `{client}` has {limit} requests in flight, its limit; retry later")]
    QuotaExceeded { client: String, limit: usize },
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("no healthy worker is available")]
    NoWorker,
    #[error("the gateway is out of resources ({0}); retry later")]
    GatewayExhausted(String),
    #[error("worker {worker} could not be reached: {detail}")]
    UpstreamConnect { worker: String, detail: String },
    #[error("worker {worker} failed: {detail}")]
    UpstreamFailed { worker: String, detail: String },
    #[error("worker {worker} did not answer within {seconds}s")]
    UpstreamTimeout { worker: String, seconds: f64 },
}

impl ApiError {
    /// The table: every error's status and OpenAI-style `type`.
    pub fn status_and_type(&self) -> (StatusCode, &'static str) {
        use ApiError::*;
        match self {
            InvalidJson(_) | InvalidRequest(_) => (StatusCode::BAD_REQUEST, "BadRequestError"),
            BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "RequestTooLargeError"),
            BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "RequestTimeoutError"),
            ModelNotFound(_) | RouteNotFound(_) => (StatusCode::NOT_FOUND, "NotFoundError"),
            QuotaExceeded { .. } => (StatusCode::TOO_MANY_REQUESTS, "RateLimitError"),
            Unauthorized(_) => (StatusCode::UNAUTHORIZED, "AuthenticationError"),
            NoWorker | GatewayExhausted(_) | QueueFull | AtCapacity | QueueTimeout(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError")
            }
            UpstreamConnect { .. } | UpstreamFailed { .. } => {
                (StatusCode::BAD_GATEWAY, "BadGatewayError")
            }
            UpstreamTimeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "GatewayTimeoutError"),
        }
    }

    /// The worker the error concerns, when one was chosen (for the `worker` label).
    pub fn worker(&self) -> Option<&str> {
        match self {
            ApiError::UpstreamConnect { worker, .. }
            | ApiError::UpstreamFailed { worker, .. }
            | ApiError::UpstreamTimeout { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// What the client is told: the log line (`Display`) names workers and their addresses and
    /// errors; the response does not.
    fn client_message(&self) -> String {
        match self {
            ApiError::UpstreamConnect { .. } => "no worker could be reached".into(),
            ApiError::UpstreamFailed { .. } => "the worker failed to answer".into(),
            ApiError::UpstreamTimeout { seconds, .. } => {
                format!("the worker did not answer within {seconds}s")
            }
            ApiError::GatewayExhausted(_) => "the gateway is out of resources; retry later".into(),
            other => other.to_string(),
        }
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }
}

/// An OpenAI-style JSON error response (the one writer of error bodies in the gateway).
pub fn error_response(
    status: StatusCode,
    kind: &str,
    message: &str,
    param: Option<&str>,
) -> Response {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}
    });
    let mut resp = (status, axum::Json(body)).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status_and_type();
        error_response(status, kind, &self.client_message(), self.param())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn error_body_has_openai_shape() {
        let resp = ApiError::ModelNotFound("m".into()).into_response();
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap().contains("`m`"));
    }
}
