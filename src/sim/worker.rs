//! The engine loop of one simulated worker: takes requests from the HTTP side, steps the engine in
//! scaled real time, delivers tokens, and aborts requests whose client went away.
//!
//! Model time runs `time_scale` times faster than the wall clock: a step the preset says costs
//! 20 ms sleeps 2 ms at `--time-scale 10`. Tokio's clock is used throughout, so tests may pause it.
//! Before every step the loop looks for requests whose event receiver is gone (the HTTP response
//! was dropped because the connection closed) and aborts them, so an abandoned request leaves the
//! batch within one step and its blocks are freed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::engine::{Counters, Engine, EngineRequest, Event, SeqId};
use super::metrics::SimMetrics;

enum Command {
    Submit {
        req: EngineRequest,
        events: mpsc::UnboundedSender<Event>,
        /// When the server took it.
        at: Instant,
    },
    /// Drop every cached block; answers whether it could (no block may be in use).
    ResetPrefixCache(oneshot::Sender<bool>),
}

/// The HTTP side's handle on a running engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl EngineHandle {
    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver aborts it.
    pub fn submit(&self, req: EngineRequest) -> Option<mpsc::UnboundedReceiver<Event>> {
        let (events, rx) = mpsc::unbounded_channel();
        let at = Instant::now();
        self.tx.send(Command::Submit { req, events, at }).ok()?;
        Some(rx)
    }

    /// Empties the prefix cache as vLLM's `reset_prefix_cache` does: refused (`false`) while any
    /// request holds blocks.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::ResetPrefixCache(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }
}

pub struct LoopOptions {
    pub time_scale: f64,
    /// vLLM aborts a request when its connection closes; `false` models a server that does not.
    pub abort_on_disconnect: bool,
    /// Where each step's KV cache events go (one batch per step that had any), when the worker
    /// publishes them.
    pub kv_events: Option<mpsc::UnboundedSender<Vec<crate::kv_events::KvEvent>>>,
}

/// Spawns the engine loop; it stops when `cancel` fires.
pub fn spawn(
    engine: Engine,
    metrics: Arc<SimMetrics>,
    opts: LoopOptions,
    cancel: CancellationToken,
) -> (EngineHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(run(engine, rx, metrics, opts, cancel));
    (EngineHandle { tx }, task)
}

async fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Command>,
    metrics: Arc<SimMetrics>,
    opts: LoopOptions,
    cancel: CancellationToken,
) {
    let start = Instant::now();
    let scale = opts.time_scale;
    let model_now = || start.elapsed().as_secs_f64() * scale;
    let model_at = |at: Instant| at.saturating_duration_since(start).as_secs_f64() * scale;
    let mut sinks: HashMap<SeqId, mpsc::UnboundedSender<Event>> = HashMap::new();
    let mut gone: Vec<SeqId> = Vec::new();
    let mut seen = Counters::default();
    // Model time the last step ended, while the engine has had work since.
    let mut busy_until: Option<f64> = None;
    loop {
        // Model time the newest request taken in this turn arrived.
        let mut newest: Option<f64> = None;
        if engine.is_idle() {
            busy_until = None;
            tokio::select! {
                _ = cancel.cancelled() => return,
                cmd = rx.recv() => match cmd {
                    Some(c) => newest = apply(c, &mut engine, &mut sinks, model_at).or(newest),
                    None => return,
                },
            }
        }
        while let Ok(c) = rx.try_recv() {
            newest = apply(c, &mut engine, &mut sinks, model_at).or(newest);
        }
        reap_disconnected(&mut engine, &mut sinks, &mut gone, opts.abort_on_disconnect);

        // A GPU runs its steps back to back. This loop wakes late (the timer's granularity, a
        // host busy with other processes: at time scale 5 a millisecond late is 5 ms of model
        // time), so a busy engine's next step begins where its last one ended, not when the loop
        // woke, and the host's delays do not cost the modelled engine throughput (they had cost
        // it 6-10% at time scale 5, more behind a router that shared the host's cores). A step
        // still never begins before a request it may take arrived, nor ahead of the wall clock.
        let t = match busy_until {
            Some(end) => newest.map_or(end, |arrived| end.max(arrived)),
            None => model_now(),
        };
        let out = engine.step(t);
        metrics.observe_step(out.tokens);
        if out.duration > 0.0 {
            busy_until = Some(t + out.duration);
            // An absolute deadline, so timer rounding does not add up over many short steps; one
            // already past (the loop is catching up) returns at once.
            let end = start + Duration::from_secs_f64((t + out.duration) / scale);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(end) => {}
            }
        } else {
            busy_until = None;
            if !engine.is_idle() {
                // Nothing fit this step (every runner was just preempted): back off instead of
                // spinning.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        if let Some(publish) = &opts.kv_events {
            // As vLLM: a step's events go out with its outputs (a reset's with the next step).
            let events = engine.take_kv_events();
            if !events.is_empty() {
                let _ = publish.send(events);
            }
        }
        metrics.observe_inter_token(&out.inter_token);
        deliver(out.events, &mut sinks, &metrics);
        metrics.update(
            &engine.counters,
            &mut seen,
            engine.num_running(),
            engine.num_waiting(),
            engine.kv_usage(),
        );
    }
}

/// Takes note of the requests whose clients have gone (their event channel closed): aborted, as
/// vLLM does with `abort_on_disconnect`, or else left to run with nobody reading (counted as
/// waste). `gone` is scratch space kept between steps.
fn reap_disconnected(
    engine: &mut Engine,
    sinks: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    gone: &mut Vec<SeqId>,
    abort: bool,
) {
    gone.clear();
    gone.extend(
        sinks
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id),
    );
    for id in gone.iter() {
        if abort {
            engine.abort(*id);
            sinks.remove(id);
        } else {
            engine.client_gone(*id);
        }
    }
}

/// Sends a step's events to their requests; a request's last event closes its channel.
fn deliver(
    events: Vec<(SeqId, Event)>,
    sinks: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    metrics: &SimMetrics,
) {
    for (id, event) in events {
        if let Event::Finished { timings, .. } = &event {
            metrics.observe_finished(timings);
            if let Some(tx) = sinks.remove(&id) {
                let _ = tx.send(event);
            }
        } else if let Some(tx) = sinks.get(&id) {
            let _ = tx.send(event);
        }
    }
}

fn apply(
    cmd: Command,
    engine: &mut Engine,
    sinks: &mut HashMap<SeqId, mpsc::UnboundedSender<Event>>,
    model_at: impl Fn(Instant) -> f64,
) -> Option<f64> {
    match cmd {
        Command::Submit { req, events, at } => {
            // Arrived when the server took it, as vLLM stamps a request's arrival when its API
            // server takes it, not when the engine loop gets round to it.
            let arrived = model_at(at);
            let id = engine.add_received(req, arrived, arrived);
            sinks.insert(id, events);
            Some(arrived)
        }
        Command::ResetPrefixCache(done) => {
            let _ = done.send(engine.reset_prefix_cache());
            None
        }
    }
}
