//! One worker's event feed: a ZMQ SUB socket on its publisher, and a DEALER on its replay
//! socket to recover what the SUB socket missed.
//!
//! The wire, as vLLM's `ZmqEventPublisher` speaks it: every message is three frames, `topic`,
//! an 8-byte big-endian sequence number counting from 0, and the msgpack `EventBatch`. The replay
//! socket is a ROUTER: a request is `["", start]` (8-byte big-endian) and the answer one message
//! `["", seq, batch]` per buffered batch from `start` on, then `["", -1, ""]`.
//!
//! A gap in the sequence is filled from the replay socket; when that is impossible (no replay
//! endpoint, no answer, or the publisher no longer buffers the missing batches) the worker's
//! blocks are dropped, as their state is unknown, and rebuilt from the events that follow. A
//! sequence that goes backwards is a restarted worker: its cache is empty, and so are its blocks.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{decode_batch, WorkerBlocks};

/// Where a worker publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    /// The PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub endpoint: String,
    /// The replay ROUTER endpoint, e.g. `tcp://10.0.0.7:5558`.
    pub replay: Option<String>,
}

/// Where a worker's events are to be found: at endpoints given, or by asking the worker (vLLM's
/// `/kv_event_sources`, [`super::discover`]) for those of its data-parallel rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventsFrom {
    At(EventSource),
    Ask { rank: u32 },
}

/// Counters of one feed, for metrics and tests.
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Batches applied (live or replayed).
    pub batches: AtomicU64,
    pub events: AtomicU64,
    /// Jumps in the sequence seen on the live socket.
    pub gaps: AtomicU64,
    /// Batches applied from the replay socket on joining a publisher that had already sent
    /// some (see `catch_up`).
    pub caught_up: AtomicU64,
    /// Gaps filled from the replay socket.
    pub replays_ok: AtomicU64,
    /// Gaps that could not be filled (the blocks were dropped and rebuilt).
    pub replays_failed: AtomicU64,
    /// The sequence went backwards: the worker restarted.
    pub restarts: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Events of a type this gateway does not know.
    pub unknown_events: AtomicU64,
    /// Events of a known type that could not be read (skipped; their batch applied).
    pub malformed_events: AtomicU64,
}

/// What a feed knows about its worker.
#[derive(Debug)]
pub struct Feed {
    blocks: Mutex<WorkerBlocks>,
    pub stats: FeedStats,
    /// Whether blocks were stored under a LoRA adapter (`WorkerBlocks::adapters` is not empty).
    pub has_adapters: std::sync::atomic::AtomicBool,
}

impl Feed {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            blocks: Mutex::new(WorkerBlocks::new(max_blocks)),
            stats: FeedStats::default(),
            has_adapters: Default::default(),
        }
    }

    pub fn blocks(&self) -> MutexGuard<'_, WorkerBlocks> {
        self.blocks.lock()
    }

    /// Applies one published batch (the message's payload frame).
    pub(crate) fn apply(&self, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                let s = &self.stats;
                s.batches.fetch_add(1, Ordering::Relaxed);
                s.events
                    .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
                s.unknown_events
                    .fetch_add(batch.unknown as u64, Ordering::Relaxed);
                s.malformed_events
                    .fetch_add(batch.malformed as u64, Ordering::Relaxed);
                let mut blocks = self.blocks();
                for e in &batch.events {
                    blocks.apply(e);
                }
                if !blocks.adapters.is_empty() {
                    self.has_adapters.store(true, Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "undecodable KV event batch");
            }
        }
    }
}

/// How long a replay may take before the gap is given up on.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// The replay socket's end-of-replay sequence number.
const END_SEQ: i64 = -1;

/// Follows `source` into `feed` until `shutdown`, reconnecting with backoff.
pub async fn follow(source: EventSource, feed: &Feed, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let run = subscribe(&source, feed);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = run => {
                if let Err(e) = r {
                    tracing::warn!(endpoint = %source.endpoint, error = %e, "KV event feed failed; reconnecting");
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

fn seq_of(frame: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(frame.try_into().ok()?))
}

async fn subscribe(source: &EventSource, feed: &Feed) -> zeromq::ZmqResult<()> {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&source.endpoint).await?;
    sub.subscribe("").await?;
    tracing::info!(endpoint = %source.endpoint, "following KV events");
    let mut last: Option<i64> = None;
    loop {
        let msg = sub.recv().await?;
        let frames = msg.into_vec();
        // [topic, seq, payload]; a topic-less publisher would send two.
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => match seq_of(seq) {
                Some(s) => (s, payload.clone()),
                None => {
                    feed.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            },
            _ => {
                feed.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        match last {
            None if seq > 0 => {
                let n = catch_up(source, feed, seq).await;
                feed.stats.caught_up.fetch_add(n as u64, Ordering::Relaxed);
                tracing::info!(endpoint = %source.endpoint, batches = n, first_live = seq, "caught up from the replay socket");
            }
            Some(l) if seq <= l => {
                // Backwards: the publisher restarted, and with it the worker's cache.
                feed.stats.restarts.fetch_add(1, Ordering::Relaxed);
                feed.blocks().clear();
                if seq > 0 {
                    let n = catch_up(source, feed, seq).await;
                    feed.stats.caught_up.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
            Some(l) if seq > l + 1 => {
                feed.stats.gaps.fetch_add(1, Ordering::Relaxed);
                if fill_gap(source, feed, l + 1, seq).await {
                    feed.stats.replays_ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    feed.stats.replays_failed.fetch_add(1, Ordering::Relaxed);
                    feed.blocks().clear();
                }
            }
            _ => {}
        }
        feed.apply(&payload);
        last = Some(seq);
    }
}

/// Applies the batches `from..until` from the replay socket, in order; false when they could
/// not all be had.
async fn fill_gap(source: &EventSource, feed: &Feed, from: i64, until: i64) -> bool {
    let Some(got) = replay(source, from, until).await else {
        return false;
    };
    // Every missing batch, or none: a partial replay would leave holes in the chains.
    if got.len() as i64 != until - from {
        return false;
    }
    for (_, payload) in got {
        feed.apply(&payload);
    }
    true
}

/// Joining a publisher that has already sent `until` batches (a gateway started after its
/// workers, a new replica, a worker restarted while this feed was away): applies what the replay
/// socket still holds of them, the unbroken run that ends just before `until`, so the feed
/// starts with the worker's current blocks rather than only those stored from now on. What the
/// publisher no longer buffers is missed; blocks whose parents went with it cannot be keyed and
/// are skipped, so the feed knows less, never something false. Returns the batches applied.
async fn catch_up(source: &EventSource, feed: &Feed, until: i64) -> usize {
    let Some(got) = replay(source, 0, until).await else {
        return 0;
    };
    let mut start = got.len();
    while start > 0 && got[start - 1].0 == until - (got.len() - start + 1) as i64 {
        start -= 1;
    }
    let run = &got[start..];
    for (_, payload) in run {
        feed.apply(payload);
    }
    run.len()
}

/// The batches `from..until` the replay socket returns, in order, without duplicates; `None`
/// when there is no replay endpoint or it did not answer in time.
async fn replay(source: &EventSource, from: i64, until: i64) -> Option<Vec<(i64, Bytes)>> {
    let endpoint = source.replay.as_ref()?;
    let ask = async {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await?;
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .expect("two frames");
        dealer.send(request).await?;
        let mut got = Vec::new();
        loop {
            let frames = dealer.recv().await?.into_vec();
            let (seq, payload) = match frames.as_slice() {
                [_, seq, payload] | [seq, payload] => (seq_of(seq), payload.clone()),
                _ => (None, Bytes::new()),
            };
            match seq {
                Some(END_SEQ) | None => break,
                Some(s) if s >= from && s < until => got.push((s, payload)),
                Some(_) => {}
            }
        }
        Ok::<_, zeromq::ZmqError>(got)
    };
    let Ok(Ok(mut got)) = tokio::time::timeout(REPLAY_TIMEOUT, ask).await else {
        return None;
    };
    got.sort_by_key(|(s, _)| *s);
    got.dedup_by_key(|(s, _)| *s);
    Some(got)
}
