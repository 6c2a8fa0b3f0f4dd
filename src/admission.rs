//! Admission control: requests that find every eligible worker at its in-flight cap wait here,
//! first come first served, for a slot to free, bounded in number and in time.
//!
//! There is one line per model (the `model` a request names; requests that name none share a
//! line), so requests for a saturated model never hold up, or fill the queue for, requests whose
//! workers have room. A released slot wakes the oldest waiter of each line the worker serves
//! (`Notify::notify_one` wakes the oldest), and only when someone waits anywhere, so the release
//! path of an uncongested gateway costs one atomic load. While anyone waits in a line, newcomers
//! to that line queue behind them rather than taking the slot a waiter was woken for.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use parking_lot::Mutex;

use tokio::{sync::Notify, time::Instant};

use crate::config::AdmissionConfig;

/// The waiters for one model.
#[derive(Debug, Default)]
struct Line {
    notify: Notify,
    waiting: AtomicUsize,
}

/// Shared by a pool and its workers: the wait lines, signalled whenever a slot is released.
#[derive(Debug, Default)]
pub struct SlotFreed {
    /// Waiters over all lines: the release path's only cost when nobody waits.
    waiting: AtomicUsize,
    /// Lines with someone in them, by model (`""`: requests that name no model). A line is
    /// removed when its last waiter leaves, so client-chosen model names cannot grow this.
    lines: Mutex<HashMap<String, Arc<Line>>>,
}

impl SlotFreed {
    /// A slot of a worker serving `models` (empty: every model) was released: hand it to the
    /// oldest waiter of each line that can use it.
    pub fn released(&self, models: &[String]) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let lines = self.lines.lock();
        for (model, line) in lines.iter() {
            if models.is_empty() || model.is_empty() || models.iter().any(|m| m == model) {
                line.notify.notify_one();
            }
        }
    }

    /// Requests waiting now, over all lines.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Requests waiting now for `model`.
    fn waiting_for(&self, model: &str) -> usize {
        if self.waiting() == 0 {
            return 0;
        }
        let lines = self.lines.lock();
        lines
            .get(model)
            .map_or(0, |l| l.waiting.load(Ordering::Relaxed))
    }

    /// Takes a place in `model`'s line if it holds fewer than `size`.
    fn join(&self, model: &str, size: usize) -> Option<Place<'_>> {
        let mut lines = self.lines.lock();
        let line = lines.entry(model.to_owned()).or_default();
        if line.waiting.load(Ordering::Relaxed) >= size {
            if line.waiting.load(Ordering::Relaxed) == 0 {
                lines.remove(model);
            }
            return None;
        }
        line.waiting.fetch_add(1, Ordering::AcqRel);
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Some(Place {
            queues: self,
            model: model.to_owned(),
            line: Arc::clone(line),
        })
    }
}

/// Why a request was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// No queue configured, or the queue was full.
    QueueFull,
    /// Waited `max_wait_seconds` without a slot.
    WaitTimeout,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::WaitTimeout => "wait_timeout",
        }
    }
}

/// A waiter's place in its line; leaving it (admitted, timed out, or the client went away)
/// gives the place back, and the line goes when it is empty.
struct Place<'a> {
    queues: &'a SlotFreed,
    model: String,
    line: Arc<Line>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut lines = self.queues.lines.lock();
        self.queues.waiting.fetch_sub(1, Ordering::AcqRel);
        if self.line.waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
            lines.remove(&self.model);
        }
    }
}

/// How often a waiter looks again without being woken: for a slot whose wake-up went to a waiter
/// who could not use it (another model's worker freed it), not the main path.
const RECHECK: Duration = Duration::from_millis(20);

/// Whether a newcomer for `model` must queue even though `open` says a slot is free: waiters
/// for the same model come first.
pub fn must_queue(freed: &SlotFreed, model: &str, cfg: &AdmissionConfig) -> bool {
    cfg.queue_size > 0 && freed.waiting_for(model) > 0
}

/// Waits in `model`'s line until `open()` is true, at most `cfg.max_wait()`. Returns the time
/// waited.
pub async fn wait_for_slot(
    freed: &SlotFreed,
    model: &str,
    cfg: &AdmissionConfig,
    mut open: impl FnMut() -> bool,
) -> Result<Duration, Shed> {
    let start = Instant::now();
    // Take a place, if there is one left.
    let place = freed.join(model, cfg.queue_size).ok_or(Shed::QueueFull)?;
    let deadline = start + cfg.max_wait();
    // Registered before the first check, so a release between the check and the wait is not
    // lost; kept across rechecks, so the waiter keeps its place in line.
    let notify = &place.line.notify;
    let notified = notify.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    loop {
        if open() {
            return Ok(start.elapsed());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Shed::WaitTimeout);
        }
        let slice = (deadline - now).min(RECHECK);
        if tokio::time::timeout(slice, notified.as_mut()).await.is_ok() {
            if open() {
                return Ok(start.elapsed());
            }
            // Another request took the slot first (a newcomer of another gateway loop, or a
            // waiter of another line that the same worker serves). Not passed on: two such
            // waiters would wake each other in a loop; a waiter that can use it sees it at its
            // next recheck.
            notified.set(notify.notified());
            notified.as_mut().enable();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{atomic::AtomicBool, Arc};

    fn cfg(queue_size: usize, wait_ms: u64) -> AdmissionConfig {
        AdmissionConfig {
            queue_size,
            max_wait_seconds: wait_ms as f64 / 1000.0,
        }
    }

    #[tokio::test]
    async fn a_full_queue_sheds_at_once() {
        let f = SlotFreed::default();
        assert_eq!(
            wait_for_slot(&f, "m", &cfg(0, 1000), || false).await,
            Err(Shed::QueueFull)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_times_out_and_gives_its_place_back() {
        let f = SlotFreed::default();
        let r = wait_for_slot(&f, "m", &cfg(1, 300), || false).await;
        assert_eq!(r, Err(Shed::WaitTimeout));
        assert_eq!(f.waiting(), 0);
    }

    #[tokio::test]
    async fn a_released_slot_admits_the_waiter() {
        let f = Arc::new(SlotFreed::default());
        let open = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (f, open) = (Arc::clone(&f), Arc::clone(&open));
            tokio::spawn(async move {
                wait_for_slot(&f, "m", &cfg(4, 10_000), || open.load(Ordering::SeqCst)).await
            })
        };
        while f.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(must_queue(&f, "m", &cfg(4, 10_000)));
        assert!(
            !must_queue(&f, "other", &cfg(4, 10_000)),
            "lines are per model"
        );
        open.store(true, Ordering::SeqCst);
        f.released(&[]);
        assert!(waiter.await.unwrap().is_ok());
        assert_eq!(f.waiting(), 0);
    }

    #[tokio::test]
    async fn the_queue_holds_at_most_its_size() {
        let f = Arc::new(SlotFreed::default());
        let c = cfg(2, 10_000);
        let mut held = Vec::new();
        for _ in 0..2 {
            let (f, c) = (Arc::clone(&f), c.clone());
            held.push(tokio::spawn(async move {
                wait_for_slot(&f, "m", &c, || false).await
            }));
        }
        while f.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            wait_for_slot(&f, "m", &c, || false).await,
            Err(Shed::QueueFull)
        );
        // Another model's line is not full: its request waits (and, its worker free, is admitted).
        assert!(wait_for_slot(&f, "other", &c, || true).await.is_ok());
        for h in held {
            h.abort();
            let _ = h.await;
        }
        assert_eq!(f.waiting(), 0, "an abandoned waiter gives its place back");
    }
}
