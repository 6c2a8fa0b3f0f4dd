//! Per-event-loop handles on state that is swapped whole (the routing arms, the worker set), so
//! that a request can hold the snapshot it started with without writing memory that the other
//! event loops write too.
//!
//! A request keeps the arms and the worker set it was routed with until its response ends, which
//! an `Arc` clone of the shared snapshot does by writing the snapshot's reference count twice.
//! With an event loop per core, every loop does that on every request, and the count's cache line
//! moves between cores each time (about 55 ns a move on the 2-vCPU machines here). These handles
//! took away about half of what a second loop added to a request's user time; most of the rest is
//! the worker's in-flight and load counters, which every loop writes and routing reads
//! (docs/measurements.md, "Writes that both event loops share" and "What a request holds, and
//! the clock").
//!
//! A [`LoopCopy`] belongs to one loop. It hands out a handle of its own, an `Arc` around a clone
//! of the shared snapshot, so a request's clone writes a count that only its loop touches; the
//! shared count is written when the snapshot changes, and when a loop goes from idle to busy. The
//! copy holds its handle weakly: once the loop's last request with it ends, the snapshot is
//! released as it was before, so a worker taken out of the pool is dropped (its series removed
//! from `/metrics`) when its last request ends, whether or not that loop sees another.
//!
//! What a request holds until its answer ends goes the same way: its arm, through the loop's
//! handle on the arms (`HeldArm`), and its worker, through the loop's handle on that worker, kept
//! beside the worker set (`LoopSet`). A request holds its own worker and not the set, so a worker
//! taken out of the pool is not kept by the streams that other workers serve.

use std::{
    marker::PhantomData,
    sync::{Arc, Weak},
};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

/// A snapshot as one event loop's requests hold it: an `Arc` of that loop's own around the
/// shared one (see the module docs).
pub type Handle<T> = Arc<Arc<T>>;

/// What a loop's handle holds: the shared snapshot, and whatever the loop keeps beside it.
pub trait Local<T>: From<Arc<T>> {
    fn shared(&self) -> &Arc<T>;
}

impl<T> Local<T> for Arc<T> {
    fn shared(&self) -> &Arc<T> {
        self
    }
}

/// One event loop's handle on the current snapshot of an `ArcSwap<T>` (see the module docs),
/// held as an `L` (by default the snapshot's `Arc` alone).
pub struct LoopCopy<T, L = Arc<T>> {
    /// The handle the loop's requests hold now, while any does.
    held: Mutex<Weak<L>>,
    _of: PhantomData<fn() -> T>,
}

impl<T, L> Default for LoopCopy<T, L> {
    fn default() -> Self {
        Self {
            held: Mutex::new(Weak::new()),
            _of: PhantomData,
        }
    }
}

impl<T, L: Local<T>> LoopCopy<T, L> {
    /// The current snapshot of `source`, through this loop's handle: the one its requests hold
    /// while it is still current, or a new one.
    pub fn get(&self, source: &ArcSwap<T>) -> Arc<L> {
        let now = source.load();
        let mut held = self.held.lock();
        if let Some(handle) = held.upgrade() {
            if Arc::ptr_eq(L::shared(&handle), &now) {
                return handle;
            }
        }
        let handle = Arc::new(L::from(arc_swap::Guard::into_inner(now)));
        *held = Arc::downgrade(&handle);
        handle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hands_out_one_handle_while_held_and_the_new_snapshot_after_a_swap() {
        let source = ArcSwap::from_pointee(1u32);
        let copy: LoopCopy<u32> = LoopCopy::default();
        let a = copy.get(&source);
        let b = copy.get(&source);
        assert!(
            Arc::ptr_eq(&a, &b),
            "the same handle while a request holds it"
        );
        assert_eq!(Arc::strong_count(&a), 2);
        // The shared snapshot is counted once for the loop, not once per request.
        assert_eq!(Arc::strong_count(&source.load_full()), 3);

        source.store(Arc::new(2));
        let c = copy.get(&source);
        assert_eq!(**c, 2);
        assert_eq!(**a, 1, "a request keeps the snapshot it started with");
    }

    #[test]
    fn releases_the_snapshot_when_its_last_request_ends() {
        let first = Arc::new(1u32);
        let source = ArcSwap::new(Arc::clone(&first));
        let copy: LoopCopy<u32> = LoopCopy::default();
        let held = copy.get(&source);
        source.store(Arc::new(2));
        assert_eq!(Arc::strong_count(&first), 2, "held by the request");
        drop(held);
        assert_eq!(
            Arc::strong_count(&first),
            1,
            "the loop keeps nothing once no request holds it"
        );
        assert_eq!(**copy.get(&source), 2);
    }
}
