//! Relaying a worker's answer: the request's accounting ([`Tracker`]) and the body that carries
//! it ([`RelayBody`]), frame by frame with no buffering.
//!
//! The tracker holds the worker's in-flight slot and, for a policy that learns, its prefill
//! estimate and what the answer's `usage` says; when it is dropped it releases the slot exactly
//! once, records how the request ended, and tells the policy.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, LazyLock},
    task::{Context, Poll},
    time::Duration,
};

use axum::{body::Body, response::Response};
use bytes::Bytes;
use http::HeaderName;
use http_body::{Body as HttpBody, Frame, SizeHint};
use memchr::memmem;
use tokio::time::{Instant, Sleep};

use super::{http1::UpstreamBody, Route, WORKER_HEADER};
use crate::{
    load::RequestLoad,
    metrics::{Metrics, SeriesRef, WorkerSeries},
    policy::{
        arms::{HeldArm, ARM_HEADER},
        Observed, Selection, Usage,
    },
    routing_key::RequestInfo,
    workers::InflightGuard,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Waiting,
    Streaming,
    Finished,
}

/// What a learning policy needs back from one request.
pub(super) struct Feedback {
    /// The request's arm, whose policy learns from how it ended.
    pub arm: HeldArm,
    pub info: Arc<RequestInfo>,
    pub selection: Selection,
    /// This request's share of the worker's load: its uncached prompt tokens in the pending
    /// prefill until the worker answers, its prompt in the in-flight context until it ends.
    pub load: RequestLoad,
    pub usage: UsageRead,
    /// Which names the answer's usage has: the Responses API's, or completions' and chat's.
    pub names: UsageNames,
    /// A Responses stream's opening still under way ([`Opening`]); `None` for other routes and
    /// once output has begun.
    pub opening: Option<Opening>,
    /// The worker answered with a non-2xx status or failed: it did not take the prompt.
    pub failed: bool,
}

/// One request's accounting; see the module docs.
pub(super) struct Tracker {
    pub slot: InflightGuard,
    /// The worker's series under this request's arm (with the `policy` and `arm` labels).
    pub series: SeriesRef,
    pub started: Instant,
    pub phase: Phase,
    pub feedback: Option<Feedback>,
}

impl Tracker {
    fn worker(&self) -> &str {
        &self.slot.worker().name
    }

    fn series(&self) -> &WorkerSeries {
        self.slot.worker().series_at(&self.series)
    }

    /// The gateway's metrics, reached through the worker rather than a clone of their `Arc` of
    /// its own (one shared reference count fewer per request).
    fn metrics(&self) -> &Metrics {
        &self.slot.worker().metrics
    }

    /// The request failed upstream before a response; the caller answers with an error.
    pub fn failed(mut self, kind: &str) {
        self.upstream_error(kind);
        if let Some(f) = &mut self.feedback {
            f.failed = true;
        }
        self.phase = Phase::Finished;
    }

    fn upstream_error(&self, kind: &str) {
        self.metrics()
            .upstream_errors
            .with_label_values(&[self.worker(), kind])
            .inc();
    }

    pub fn into_response(
        mut self,
        resp: http::Response<UpstreamBody>,
        route: Route,
        idle: Duration,
    ) -> Response {
        let (mut parts, incoming) = resp.into_parts();
        // Borrowed, not cloned: their reference counts are shared by every event loop.
        let worker = self.slot.worker();
        let series = worker.series_at(&self.series);
        // One read of the clock for the first byte's time and the idle timer's start.
        let now = Instant::now();
        series
            .ttfb
            .observe(now.duration_since(self.started).as_secs_f64());
        series.count_request(&worker.metrics, route, parts.status);
        if let Some(f) = &mut self.feedback {
            f.failed = !parts.status.is_success();
        }
        self.phase = if incoming.is_end_stream() {
            Phase::Finished
        } else {
            Phase::Streaming
        };
        let sse = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        // The worker's head becomes the client's: its end-to-end headers (the parse left the
        // hop-by-hop ones out), moved, not copied.
        if let Some(v) = &worker.name_header {
            parts
                .headers
                .insert(HeaderName::from_static(WORKER_HEADER), v.clone());
        }
        if let Some(v) = &series.arm_header {
            parts
                .headers
                .insert(HeaderName::from_static(ARM_HEADER), v.clone());
        }
        let body = RelayBody {
            inner: incoming,
            idle_timer: tokio::time::sleep_until(now + idle),
            relay: Relay {
                idle,
                sse,
                ended: false,
                tracker: (self.phase == Phase::Streaming).then_some(self),
            },
        };
        Response::from_parts(parts, Body::new(body))
    }

    /// A frame of the answer went by: the prefill is over, and it may carry the usage. A frame of
    /// a stream (`sse`) also marks the end of one of the worker's steps. Not while a Responses
    /// stream is still in its opening (`response.created`, `response.in_progress`), which vLLM
    /// sends before the prefill has begun, in as many frames as its size takes.
    ///
    /// `now` is when the frame came (read once for the frame, here and for the idle timer).
    fn saw(&mut self, data: &[u8], sse: bool, now: impl FnOnce() -> Instant) {
        if let Some(f) = &mut self.feedback {
            if sse {
                if let Some(opening) = &mut f.opening {
                    if !opening.output_begins(data) {
                        return;
                    }
                    f.opening = None;
                }
            }
            // The time first: a prompt sent once this one's first token has cleared the pending
            // prefill is sent after it, and cannot have been part of the step that ended now.
            let now = sse.then(|| crate::load::us_at(now().into_std()));
            let cleared = f.load.done();
            if let Some(now) = now {
                let w = self.slot.worker();
                w.steps.frame(now, cleared, || {
                    w.load.pending_prefill() + w.load.peer_tokens().0
                });
            }
            f.usage.read(data, f.names, sse);
        }
    }

    /// Tells the policy how the request ended and counts its prediction against the report.
    fn settle_feedback(&mut self) {
        let Some(mut f) = self.feedback.take() else {
            return;
        };
        f.load.done();
        let result = match (f.failed, self.phase) {
            (true, _) => Observed::Failed,
            (false, Phase::Finished) => Observed::Answered(f.usage.usage()),
            // The client went away: the worker may hold part of the prompt; nothing to learn.
            (false, _) => Observed::Answered(None),
        };
        let worker = self.slot.worker();
        f.arm.policy.observe(worker, &f.info, &f.selection, result);
        let (
            Some(p),
            Observed::Answered(Some(Usage {
                cached_tokens: Some(cached),
                ..
            })),
        ) = (f.selection.prediction, result)
        else {
            return;
        };
        let predicted = u64::from(p.cached_tokens);
        self.series()
            .count_cached(self.metrics(), predicted, cached);
        // Within a tenth of the prompt (the gateway's blocks and the worker's differ) is right.
        let slack = u64::from(p.prompt_tokens / 10).max(16);
        let verdict = if predicted > cached + slack {
            "over"
        } else if cached > predicted + slack {
            "under"
        } else {
            "close"
        };
        self.series().count_verdict(self.metrics(), verdict);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let phase = match self.phase {
            Phase::Finished => None,
            Phase::Waiting => Some("waiting"),
            Phase::Streaming => Some("streaming"),
        };
        if let Some(phase) = phase {
            self.metrics()
                .client_disconnects
                .with_label_values(&[phase])
                .inc();
            self.metrics()
                .upstream_aborts
                .with_label_values(&[self.worker()])
                .inc();
            tracing::debug!(worker = %self.worker(), phase, "client went away; upstream request dropped");
        }
        self.settle_feedback();
        self.series()
            .duration
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// Where a Responses stream stands in its opening events (`response.created`,
/// `response.in_progress`), read across frames.
///
/// vLLM sends the opening before the prefill, and each of its two events carries the whole
/// response object, `instructions` included: tens of kilobytes under a long system prompt, which
/// reach the gateway in several frames. So a frame is not judged alone: the scan follows the
/// stream's lines across frames, keeping no more than the start of the line under way.
#[derive(Debug, Default)]
pub(super) struct Opening {
    /// The start of the line under way, up to [`Opening::KEPT`] bytes.
    line: Vec<u8>,
    /// The event under way was named by an `event:` line (one of the opening's).
    named: bool,
}

impl Opening {
    /// Enough of a line to read any event name vLLM sends, and to tell `data:` lines.
    const KEPT: usize = 96;

    /// Reads the stream's next frame; true once it has begun an event other than the
    /// opening's, or data that no `event:` line named (a stream without event names: output).
    pub(super) fn output_begins(&mut self, data: &[u8]) -> bool {
        for piece in data.split_inclusive(|&b| b == b'\n') {
            let (text, ends) = match piece.strip_suffix(b"\n") {
                Some(text) => (text, true),
                None => (piece, false),
            };
            let room = Self::KEPT.saturating_sub(self.line.len());
            self.line.extend_from_slice(&text[..text.len().min(room)]);
            if !ends {
                continue;
            }
            let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
            if line.is_empty() {
                self.named = false;
            } else if let Some(name) = line.strip_prefix(b"event:") {
                let name = name.trim_ascii();
                if name != b"response.created" && name != b"response.in_progress" {
                    return true;
                }
                self.named = true;
            } else if line.starts_with(b"data:") && !self.named {
                return true;
            }
            self.line.clear();
        }
        false
    }
}

/// The names an answer's `usage` gives its token counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum UsageNames {
    /// Completions and chat: `prompt_tokens`, `completion_tokens`.
    Completions,
    /// The Responses API: `input_tokens`, `output_tokens`.
    Responses,
}

/// The answer's `usage`, read frame by frame.
///
/// Each frame is searched, and so is its seam with the frame before where that one ended inside
/// an event (a stream) or the body is one document (JSON): a worker writes an event whole, but
/// the gateway reads what arrived, and vLLM's Responses events carry the whole response,
/// `instructions` included, so the usage at the end of `response.completed` can fall across
/// two frames. vLLM writes the prompt's count first in a usage, so a frame holding one starts a
/// new usage, and counts found without one complete the usage begun before it.
#[derive(Debug)]
pub(super) struct UsageRead {
    counts: Counts,
    /// The end of the frame before (its first `seam_len` bytes), while the next one continues
    /// it. Held inline: a JSON answer keeps one at every frame, and an allocation a request
    /// would cost more than the search.
    seam: [u8; UsageRead::SEAM],
    seam_len: u8,
}

impl Default for UsageRead {
    fn default() -> Self {
        Self {
            counts: Counts::default(),
            seam: [0; Self::SEAM],
            seam_len: 0,
        }
    }
}

/// The token counts of one usage, as far as they were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    prompt: Option<u64>,
    cached: Option<u64>,
    completion: Option<u64>,
}

impl Counts {
    fn or(self, other: Counts) -> Counts {
        Counts {
            prompt: self.prompt.or(other.prompt),
            cached: self.cached.or(other.cached),
            completion: self.completion.or(other.completion),
        }
    }
}

impl UsageRead {
    /// Bytes of each side of a seam searched: the longest name and its count fit in them.
    const SEAM: usize = 64;

    pub(super) fn read(&mut self, data: &[u8], names: UsageNames, sse: bool) {
        let found = counts_in(data, names);
        let held = usize::from(self.seam_len);
        if held == 0 {
            if found.prompt.is_some() {
                self.counts = found;
            }
        } else {
            let mut seam = [0u8; 2 * Self::SEAM];
            let head = data.len().min(Self::SEAM);
            seam[..held].copy_from_slice(&self.seam[..held]);
            seam[held..held + head].copy_from_slice(&data[..head]);
            let across = counts_in(&seam[..held + head], names);
            self.counts = if found.prompt.is_some() {
                found
            } else if across.prompt.is_some() {
                across.or(found)
            } else {
                self.counts.or(across).or(found)
            };
        }
        let ends_event = sse && (data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n"));
        let tail = if ends_event {
            &[][..]
        } else {
            &data[data.len().saturating_sub(Self::SEAM)..]
        };
        self.seam[..tail.len()].copy_from_slice(tail);
        self.seam_len = tail.len() as u8;
    }

    /// The usage read, once its prompt count was.
    pub(super) fn usage(&self) -> Option<Usage> {
        let c = self.counts;
        Some(Usage {
            prompt_tokens: c.prompt?,
            cached_tokens: c.cached,
            completion_tokens: c.completion,
        })
    }
}

/// Each of a usage's counts that `data` holds whole: the number after the first occurrence of
/// each name.
fn counts_in(data: &[u8], names: UsageNames) -> Counts {
    // Built once: every frame of every answer is searched, and building a searcher costs more
    // than running it over a small frame.
    static ANY: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(TOKENS));
    const TOKENS: &[u8] = b"_tokens\"";
    // Every name searched for ends the same way: one pass finds each ending, and what comes
    // before it tells which name it ends. Most frames of a stream hold none.
    let mut counts = Counts::default();
    // Which names were met: the first occurrence of each decides, found or not.
    let mut met = [false; 3];
    for at in ANY.find_iter(data) {
        let Some(which) = name_ending_at(&data[..at], names) else {
            continue;
        };
        if std::mem::replace(&mut met[which], true) {
            continue;
        }
        let n = number_at(&data[at + TOKENS.len()..]);
        match which {
            0 => counts.prompt = n,
            1 => counts.cached = n,
            _ => counts.completion = n,
        }
        if met == [true; 3] {
            break;
        }
    }
    counts
}

/// Which count's name `before` ends with (its opening quote included): 0 for the prompt's, 1 for
/// the cached tokens', 2 for the completion's. Literal names, so that each comparison is a few
/// loads rather than a call.
fn name_ending_at(before: &[u8], names: UsageNames) -> Option<usize> {
    let is = |name: &[u8]| before.ends_with(name);
    match names {
        UsageNames::Completions if is(b"\"prompt") => Some(0),
        UsageNames::Completions if is(b"\"completion") => Some(2),
        UsageNames::Responses if is(b"\"input") => Some(0),
        UsageNames::Responses if is(b"\"output") => Some(2),
        _ if is(b"\"cached") => Some(1),
        _ => None,
    }
}

/// The number after a colon at the start of `rest`; none where the digits run to the end of
/// `rest`, which may have cut them.
fn number_at(rest: &[u8]) -> Option<u64> {
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() {
        return None;
    }
    rest[..digits].iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

#[derive(Debug, thiserror::Error)]
#[error("worker sent nothing for {0:?}; stream closed")]
struct IdleTimeout(Duration);

pin_project_lite::pin_project! {
    /// The upstream body, relayed frame by frame with no buffering, ended early if the worker
    /// goes silent.
    pub(super) struct RelayBody {
        inner: UpstreamBody,
        // In place, not boxed: the body is boxed once, whole, as the response's.
        #[pin]
        idle_timer: Sleep,
        relay: Relay,
    }
}

/// What [`RelayBody`] knows besides its stream and its timer.
struct Relay {
    idle: Duration,
    /// An SSE stream: a failure mid-stream is told to the client as a last `error` event.
    sse: bool,
    /// The stream was ended by the gateway after such an event.
    ended: bool,
    /// `Some` until the stream ends; dropping it (with the body) settles the accounting.
    tracker: Option<Tracker>,
}

impl Relay {
    /// The worker failed mid-stream: an SSE client gets a final `data: {"error": ...}` event (the
    /// shape vLLM itself sends when generation fails) and a clean end; other bodies end in error.
    fn fail(
        &mut self,
        kind: &str,
        error: axum::BoxError,
        status: http::StatusCode,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let worker = self
            .tracker
            .as_ref()
            .map(|t| t.worker().to_owned())
            .unwrap_or_default();
        self.finish(Some(kind));
        static MID_STREAM: crate::logging::Throttle = crate::logging::Throttle::new(10);
        if let Some(suppressed) = MID_STREAM.allow() {
            tracing::warn!(worker = %worker, kind, error = %error, suppressed, "stream failed mid-way");
        }
        if !self.sse {
            return Poll::Ready(Some(Err(error)));
        }
        self.ended = true;
        let body = serde_json::json!({"error": {
            "message": format!("the worker failed mid-stream: {error}"),
            "type": if status == http::StatusCode::GATEWAY_TIMEOUT { "GatewayTimeoutError" } else { "BadGatewayError" },
            "param": null,
            "code": status.as_u16(),
        }});
        let event = format!("data: {body}\n\ndata: [DONE]\n\n");
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }

    fn finish(&mut self, error_kind: Option<&str>) {
        if let Some(mut t) = self.tracker.take() {
            if let Some(kind) = error_kind {
                t.upstream_error(kind);
                if let Some(f) = &mut t.feedback {
                    f.failed = true;
                }
            }
            t.phase = Phase::Finished;
        }
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let mut this = self.project();
        let relay = this.relay;
        if relay.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut *this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // The clock is read once a frame, when the step clock or the idle timer needs it.
                let mut now = None;
                let mut now = || *now.get_or_insert_with(Instant::now);
                if let (Some(t), Some(data)) = (&mut relay.tracker, frame.data_ref()) {
                    t.saw(data, relay.sse, &mut now);
                }
                if this.inner.is_end_stream() {
                    // hyper may not poll again once the body says it is complete.
                    relay.finish(None);
                } else {
                    this.idle_timer.as_mut().reset(now() + relay.idle);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                relay.fail("body", e.into(), http::StatusCode::BAD_GATEWAY)
            }
            Poll::Ready(None) => {
                relay.finish(None);
                Poll::Ready(None)
            }
            Poll::Pending => {
                if relay.tracker.is_some() && this.idle_timer.as_mut().poll(cx).is_ready() {
                    let e = IdleTimeout(relay.idle).into();
                    return relay.fail("idle_timeout", e, http::StatusCode::GATEWAY_TIMEOUT);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.relay.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether output begins somewhere in these frames, read in order by one scan.
    fn output_in(frames: &[&[u8]]) -> bool {
        let mut opening = Opening::default();
        frames.iter().any(|f| opening.output_begins(f))
    }

    #[test]
    fn a_responses_streams_opening_is_told_from_its_output() {
        let created = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
        let opening = [
            &created[..],
            b"event: response.in_progress\r\ndata: {}\r\n\r\n",
        ]
        .concat();
        assert!(!output_in(&[created]));
        assert!(!output_in(&[&opening]));
        let added = b"event: response.output_item.added\ndata: {}\n\n";
        assert!(output_in(&[&[&opening[..], added].concat()]));
        assert!(output_in(&[
            b"event: response.output_text.delta\ndata: {}\n\n"
        ]));
        // Data no event line named is output; an empty frame is not.
        assert!(output_in(&[b"data: {\"delta\":\"x\"}\n\n"]));
        assert!(!output_in(&[b""]));
    }

    #[test]
    fn an_opening_split_over_frames_is_still_the_opening() {
        // The opening as vLLM sends it under a long system prompt: each event carries the whole
        // response, instructions included, so it comes in pieces of whatever a read took.
        let instructions = "You are helpful. event: response.output_text.delta\\n".repeat(400);
        let response =
            format!(r#"{{"response":{{"id":"resp_1","instructions":"{instructions}"}}}}"#);
        let stream = format!(
            "event: response.created\ndata: {response}\n\n\
             event: response.in_progress\r\ndata: {response}\r\n\r\n\
             event: response.output_item.added\ndata: {{}}\n\n"
        );
        let stream = stream.as_bytes();
        let output_at = stream.len() - "event: response.output_item.added\ndata: {}\n\n".len();
        // Cut anywhere, in pieces of any size, the output begins in the piece holding its first
        // event line's end, and not before.
        let line_end = output_at + "event: response.output_item.added".len();
        for size in [1, 2, 7, 64, 1000, 8192, 16 * 1024] {
            let mut opening = Opening::default();
            let begun = stream
                .chunks(size)
                .enumerate()
                .find(|(_, piece)| opening.output_begins(piece))
                .map(|(i, _)| i);
            assert_eq!(begun, Some(line_end / size), "pieces of {size} bytes");
        }
    }

    /// A Responses stream through the tracker: a worker's pending prefill stays until the first
    /// output event, however many frames the opening took.
    #[test]
    fn the_prefill_is_pending_until_a_responses_streams_output() {
        let worker = Arc::clone(&crate::workers::test_workers(1)[0]);
        let prediction = crate::policy::Prediction {
            prompt_tokens: 4000,
            cached_tokens: 1000,
            matched_blocks: 0,
            fresh: false,
        };
        let arm = HeldArm::only(crate::policy::arms::Arm::new(
            "default",
            Arc::new(crate::policy::CacheAware::new(Default::default())),
        ));
        let mut tracker = Tracker {
            slot: worker.acquire(),
            series: worker.series(arm.policy.name(), "default"),
            started: Instant::now(),
            phase: Phase::Streaming,
            feedback: Some(Feedback {
                arm,
                info: Arc::new(RequestInfo::unkeyed()),
                selection: Selection {
                    prediction: Some(prediction),
                    ..Selection::new(0, crate::policy::Outcome::LongestMatch)
                },
                load: RequestLoad::new(&worker, 3000, 4000),
                usage: UsageRead::default(),
                names: UsageNames::Responses,
                opening: Some(Opening::default()),
                failed: false,
            }),
        };
        let response = format!(
            r#"{{"response":{{"id":"r","instructions":"{}"}}}}"#,
            "x".repeat(30_000)
        );
        let opening = format!(
            "event: response.created\ndata: {response}\n\nevent: response.in_progress\ndata: {response}\n\n"
        );
        for piece in opening.as_bytes().chunks(8192) {
            tracker.saw(piece, true, Instant::now);
            assert_eq!(worker.load.pending_prefill(), 3000);
        }
        tracker.saw(
            b"event: response.output_item.added\ndata: {}\n\n",
            true,
            Instant::now,
        );
        assert_eq!(worker.load.pending_prefill(), 0);
        tracker.phase = Phase::Finished;
    }

    /// The `usage` token counts in an answer's bytes (a JSON body, or an SSE event with usage), if
    /// these bytes have them: `"prompt_tokens": N` (`"input_tokens"` in a Responses answer) and, if
    /// present, `"cached_tokens": N` and `"completion_tokens": N` (`"output_tokens"`).
    fn find_usage(data: &[u8], names: UsageNames) -> Option<Usage> {
        UsageRead {
            counts: counts_in(data, names),
            ..UsageRead::default()
        }
        .usage()
    }

    /// What [`counts_in`] must find, searched name by name: the number after the first
    /// occurrence of each quoted name, then a colon; none where the digits reach the end.
    fn counts_by_name(data: &[u8], names: UsageNames) -> Counts {
        let after = |name: &str| -> Option<u64> {
            let needle = format!("\"{name}_tokens\"");
            let at = data
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())?;
            let rest = std::str::from_utf8(&data[at + needle.len()..]).ok()?;
            let rest = rest.trim_start().strip_prefix(':')?.trim_start();
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == rest.len() {
                return None;
            }
            rest[..digits].parse().ok()
        };
        let (prompt, completion) = match names {
            UsageNames::Completions => ("prompt", "completion"),
            UsageNames::Responses => ("input", "output"),
        };
        Counts {
            prompt: after(prompt),
            cached: after("cached"),
            completion: after(completion),
        }
    }

    proptest::proptest! {
        /// The one pass over a frame finds what a search for each name would: first occurrences,
        /// names that only end like one, counts cut at the end, numbers too large, any spacing.
        #[test]
        fn one_pass_finds_each_count_as_a_search_by_name_would(
            pieces in proptest::collection::vec(proptest::sample::select(vec![
                "\"prompt_tokens\"", "\"cached_tokens\"", "\"completion_tokens\"",
                "\"input_tokens\"", "\"output_tokens\"", "\"total_tokens\"", "_tokens\"",
                "\"prompt", "prompt_tokens\"", ":", " ", "12", "0", "99999999999999999999",
                ",", "{", "}", "null", "x",
            ]), 0..24),
            responses: bool,
        ) {
            let data = pieces.concat();
            let names = if responses { UsageNames::Responses } else { UsageNames::Completions };
            proptest::prop_assert_eq!(
                counts_in(data.as_bytes(), names),
                counts_by_name(data.as_bytes(), names)
            );
        }
    }

    /// The usage read from these frames in order.
    fn usage_over(frames: &[&[u8]], names: UsageNames, sse: bool) -> Option<Usage> {
        let mut read = UsageRead::default();
        for f in frames {
            read.read(f, names, sse);
        }
        read.usage()
    }

    #[test]
    fn a_usage_cut_between_frames_is_read_whole() {
        // vLLM's response.completed carries the whole response, instructions first, usage last.
        let instructions = "Answer briefly. ".repeat(600);
        let completed = format!(
            "event: response.completed\ndata: {{\"response\":{{\"id\":\"resp_1\",\
             \"instructions\":\"{instructions}\",\"usage\":{{\"input_tokens\":1900,\
             \"input_tokens_details\":{{\"cached_tokens\":1640}},\"output_tokens\":32,\
             \"output_tokens_details\":{{\"reasoning_tokens\":0}},\"total_tokens\":1932}}}},\
             \"sequence_number\":40,\"type\":\"response.completed\"}}\n\n"
        );
        let completed = completed.as_bytes();
        let whole = Usage {
            prompt_tokens: 1900,
            cached_tokens: Some(1640),
            completion_tokens: Some(32),
        };
        let usage_at = completed.len() - 220;
        for cut in usage_at..completed.len() {
            let (a, b) = completed.split_at(cut);
            assert_eq!(
                usage_over(&[a, b], UsageNames::Responses, true),
                Some(whole),
                "cut at {} of the usage's bytes",
                cut - usage_at
            );
        }
        // A chat answer's JSON, in three pieces, one cutting a count's digits.
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":1234,"total_tokens":1300,"completion_tokens":66,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
        let at = |s: &str| {
            body.windows(s.len())
                .position(|w| w == s.as_bytes())
                .unwrap()
        };
        let (one, two) = (at("1234") + 2, at("1024") + 1);
        let expected = Some(Usage {
            prompt_tokens: 1234,
            cached_tokens: Some(1024),
            completion_tokens: Some(66),
        });
        let pieces = [&body[..one], &body[one..two], &body[two..]];
        assert_eq!(
            usage_over(&pieces, UsageNames::Completions, false),
            expected
        );
        // Alone, the first piece's cut count is not taken for a shorter one.
        assert_eq!(
            usage_over(&pieces[..1], UsageNames::Completions, false),
            None
        );
    }

    #[test]
    fn the_latest_usage_of_a_stream_is_kept() {
        // Continuous usage: every chunk says how far it has got; the last one counts, here cut
        // inside its first name.
        let chunk = |n: u64| {
            format!(
                r#"data: {{"choices":[{{"text":"a"}}],"usage":{{"prompt_tokens":100,"total_tokens":{},"completion_tokens":{n}}}}}"#,
                100 + n
            ) + "\n\n"
        };
        let (a, b, c) = (chunk(1), chunk(2), chunk(3));
        let (c1, c2) = c.as_bytes().split_at(45);
        let frames = [a.as_bytes(), b.as_bytes(), c1, c2, b"data: [DONE]\n\n"];
        let usage = usage_over(&frames, UsageNames::Completions, true).unwrap();
        assert_eq!(
            (usage.prompt_tokens, usage.completion_tokens),
            (100, Some(3))
        );
    }

    #[test]
    fn usage_is_read_from_a_body_or_an_event() {
        let body = br#"{"id":"x","usage":{"prompt_tokens":1234,"total_tokens":1300,"completion_tokens":66,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
        assert_eq!(
            find_usage(body, UsageNames::Completions),
            Some(Usage {
                prompt_tokens: 1234,
                cached_tokens: Some(1024),
                completion_tokens: Some(66),
            })
        );
        let event = b"data: {\"choices\":[],\"usage\": {\"prompt_tokens\" : 7, \"prompt_tokens_details\": null}}\n\n";
        assert_eq!(
            find_usage(event, UsageNames::Completions),
            Some(Usage {
                prompt_tokens: 7,
                cached_tokens: None,
                completion_tokens: None,
            })
        );
        assert_eq!(
            find_usage(
                b"data: {\"choices\":[{\"text\":\"hi\"}],\"usage\":null}\n\n",
                UsageNames::Completions
            ),
            None
        );
        // A Responses answer's usage, in its response.completed event, under its own names; its
        // input_tokens are no completion's prompt_tokens.
        let completed = br#"event: response.completed
data: {"response":{"id":"resp_1","usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":640},"output_tokens":12,"total_tokens":912}},"type":"response.completed"}"#;
        assert_eq!(
            find_usage(completed, UsageNames::Responses),
            Some(Usage {
                prompt_tokens: 900,
                cached_tokens: Some(640),
                completion_tokens: Some(12),
            })
        );
        assert_eq!(find_usage(completed, UsageNames::Completions), None);
        assert_eq!(find_usage(body, UsageNames::Responses), None);
    }
}
