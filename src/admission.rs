//! Admission control: requests that find every eligible worker at its in-flight cap wait here,
//! first come first served, for a slot to free, bounded in number and in time.
//!
//! A released slot wakes one waiter (`Notify::notify_one` wakes the oldest), and only when
//! someone waits, so the release path of an uncongested gateway costs one atomic load. While
//! anyone waits, newcomers queue behind them rather than taking the slot a waiter was woken for.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use tokio::{sync::Notify, time::Instant};

use crate::config::AdmissionConfig;

/// Shared by a pool and its workers: signalled whenever an in-flight slot is released.
#[derive(Debug, Default)]
pub struct SlotFreed {
    notify: Notify,
    waiting: AtomicUsize,
}

impl SlotFreed {
    /// A slot was released: hand it to the oldest waiter, if any.
    pub fn released(&self) {
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.notify.notify_one();
        }
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
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

/// A waiter's place in the queue; leaving it (admitted, timed out, or the client went away)
/// gives the place back.
struct Place<'a>(&'a SlotFreed);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How often a waiter looks again without being woken: for a slot whose wake-up went to a waiter
/// who could not use it (another model's worker freed it), not the main path.
const RECHECK: Duration = Duration::from_millis(20);

/// Whether a newcomer must queue even though `open` says a slot is free: waiters come first.
pub fn must_queue(freed: &SlotFreed, cfg: &AdmissionConfig) -> bool {
    cfg.queue_size > 0 && freed.waiting() > 0
}

/// Waits until `open()` is true, at most `cfg.max_wait()`. Returns the time waited.
pub async fn wait_for_slot(
    freed: &SlotFreed,
    cfg: &AdmissionConfig,
    mut open: impl FnMut() -> bool,
) -> Result<Duration, Shed> {
    let start = Instant::now();
    // Take a place, if there is one left.
    freed
        .waiting
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < cfg.queue_size).then_some(n + 1)
        })
        .map_err(|_| Shed::QueueFull)?;
    let _place = Place(freed);
    let deadline = start + cfg.max_wait();
    // Registered before the first check, so a release between the check and the wait is not
    // lost; kept across rechecks, so the waiter keeps its place in line.
    let notified = freed.notify.notified();
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
            // The slot is not one this request can use (another model's worker freed it). Not
            // passed on: two such waiters would wake each other in a loop; a waiter that can
            // use it sees it at its next recheck.
            notified.set(freed.notify.notified());
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
            wait_for_slot(&f, &cfg(0, 1000), || false).await,
            Err(Shed::QueueFull)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_times_out_and_gives_its_place_back() {
        let f = SlotFreed::default();
        let r = wait_for_slot(&f, &cfg(1, 300), || false).await;
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
                wait_for_slot(&f, &cfg(4, 10_000), || open.load(Ordering::SeqCst)).await
            })
        };
        while f.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(must_queue(&f, &cfg(4, 10_000)));
        open.store(true, Ordering::SeqCst);
        f.released();
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
                wait_for_slot(&f, &c, || false).await
            }));
        }
        while f.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(wait_for_slot(&f, &c, || false).await, Err(Shed::QueueFull));
        for h in held {
            h.abort();
            let _ = h.await;
        }
        assert_eq!(f.waiting(), 0, "an abandoned waiter gives its place back");
    }
}
