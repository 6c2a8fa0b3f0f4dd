//! Peer replicas: what each replica of the gateway has in flight on every worker, told to the
//! others over UDP so that each prices the others' requests as its own.
//!
//! Without it a replica knows another's requests only from the load poll: as a count, up to a
//! poll interval old, with their prompts' prefill unknown. So two replicas that each see a worker
//! idle both send it a long prompt in the same step, where one gateway would have priced the first
//! as pending prefill and sent the second elsewhere. With peers, each replica sends what changed
//! of its own figures per worker (requests in flight, prefill not yet answered, prompt context),
//! and all of them each second; the others add it to the worker's load ([`crate::load::Load::set_peers`]) until it is replaced or expires. Workers are named by
//! their rendezvous identity ([`crate::workers::Worker::id_hash`]), equal on every replica.
//!
//! A change wakes the sender at once ([`changed`]): what a replica does right after a step ends
//! (its clients' next requests, sent as the last answers came) reaches the others within the
//! send, not a tick later. Under load the sender then waits `interval_seconds` before it looks
//! again, so a burst of changes costs a datagram an interval.
//!
//! Placements go the same way: each `cache_aware` decision queues its prompt's block hashes in
//! the chosen worker's [`Outbox`], and the peers insert them into their index
//! ([`crate::policy::Policy::learn_placement`]). A decision made before this gateway's sender
//! first ran (the moment after start) is not told.
//!
//! A datagram is a 24-byte head (`KVRP`, version 1, its kind, two zero bytes, the sender's
//! random id, its sequence number; little-endian throughout) and, for load (kind 0), up to
//! [`PER_DATAGRAM`] entries of 20 bytes (worker id, requests in flight, pending prefill tokens,
//! context tokens). Each entry is absolute, so a lost datagram costs only the time to the next
//! change or second. For placements (kind 1, sequence 0): runs of a worker id, the tokens to
//! prefill, a count and two zero bytes, then that many block hashes, within 1,400 bytes. A lost
//! placement is a prompt the peers do not know of, as without peers.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{net::UdpSocket, time::MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::{proxy::Upstreams, workers::Worker};

const MAGIC: &[u8; 4] = b"KVRP";
const VERSION: u8 = 1;
const HEAD: usize = 24;
const ENTRY: usize = 20;
/// Datagram kinds: a replica's load on workers, and prompts it placed.
const LOAD: u8 = 0;
const PLACED: u8 = 1;
/// Entries a datagram carries at most: 1,304 bytes, within an Ethernet frame.
pub const PER_DATAGRAM: usize = 64;
/// How often every figure is sent, changed or not: what keeps a quiet replica heard.
const FULL_EVERY: Duration = Duration::from_secs(1);

/// One replica's figures for one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub worker: u64,
    pub inflight: u32,
    pub pending: u32,
    pub context: u32,
}

impl Entry {
    /// This gateway's own figures for `w` (saturated to 32 bits).
    pub fn of(w: &Worker) -> Self {
        let sat = |v: u64| v.min(u64::from(u32::MAX)) as u32;
        Self {
            worker: w.id_hash,
            inflight: sat(w.inflight() as u64),
            pending: sat(w.load.pending_prefill()),
            context: sat(w.load.context_tokens()),
        }
    }
}

/// The datagrams that carry `entries` from `sender` under sequence number `seq`.
pub fn encode(sender: u64, seq: u64, entries: &[Entry]) -> Vec<Vec<u8>> {
    entries
        .chunks(PER_DATAGRAM)
        .map(|chunk| {
            let mut d = Vec::with_capacity(HEAD + ENTRY * chunk.len());
            d.extend_from_slice(MAGIC);
            d.extend_from_slice(&[VERSION, LOAD, 0, 0]);
            d.extend_from_slice(&sender.to_le_bytes());
            d.extend_from_slice(&seq.to_le_bytes());
            for e in chunk {
                d.extend_from_slice(&e.worker.to_le_bytes());
                d.extend_from_slice(&e.inflight.to_le_bytes());
                d.extend_from_slice(&e.pending.to_le_bytes());
                d.extend_from_slice(&e.context.to_le_bytes());
            }
            d
        })
        .collect()
}

/// A datagram's sender, sequence number and entries; `None` if it is not a peer datagram of
/// this version.
pub fn decode(d: &[u8]) -> Option<(u64, u64, Vec<Entry>)> {
    if kind(d) != Some(LOAD) || (d.len() - HEAD) % ENTRY != 0 {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(d[i..i + 4].try_into().expect("4 bytes"));
    let entries = (HEAD..d.len())
        .step_by(ENTRY)
        .map(|i| Entry {
            worker: u64_at(i),
            inflight: u32_at(i + 8),
            pending: u32_at(i + 12),
            context: u32_at(i + 16),
        })
        .collect();
    Some((u64_at(8), u64_at(16), entries))
}

/// The kind of a peer datagram of this version (its sixth byte), `None` if it is none.
fn kind(d: &[u8]) -> Option<u8> {
    (d.len() >= HEAD && &d[..4] == MAGIC && d[4] == VERSION).then(|| d[5])
}

/// A prompt a replica sent a worker: the chained hashes of its blocks (all of them, or a run of
/// them when a long prompt's did not fit one datagram) and the tokens of it the replica expected
/// the worker to prefill (0 in the runs after the first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub worker: u64,
    pub uncached: u32,
    pub hashes: Vec<u64>,
}

/// Bytes a placement datagram carries at most: its head and its placements' (16 bytes each
/// and 8 a hash).
const PLACED_MAX: usize = 1_400;
/// Hashes one placement carries at most.
const PLACED_HASHES: usize = (PLACED_MAX - HEAD - 16) / 8;

/// The datagrams that carry `placed` from `sender`.
pub fn encode_placed(sender: u64, placed: &[Placed]) -> Vec<Vec<u8>> {
    let head = |d: &mut Vec<u8>| {
        d.extend_from_slice(MAGIC);
        d.extend_from_slice(&[VERSION, PLACED, 0, 0]);
        d.extend_from_slice(&sender.to_le_bytes());
        d.extend_from_slice(&0u64.to_le_bytes());
    };
    let mut out = Vec::new();
    let mut d = Vec::with_capacity(PLACED_MAX);
    head(&mut d);
    for p in placed {
        for (k, run) in p.hashes.chunks(PLACED_HASHES).enumerate() {
            if d.len() + 16 + 8 * run.len() > PLACED_MAX {
                out.push(std::mem::replace(&mut d, Vec::with_capacity(PLACED_MAX)));
                head(&mut d);
            }
            d.extend_from_slice(&p.worker.to_le_bytes());
            d.extend_from_slice(&(if k == 0 { p.uncached } else { 0 }).to_le_bytes());
            d.extend_from_slice(&(run.len() as u16).to_le_bytes());
            d.extend_from_slice(&[0, 0]);
            for h in run {
                d.extend_from_slice(&h.to_le_bytes());
            }
        }
    }
    if d.len() > HEAD {
        out.push(d);
    }
    out
}

/// A placement datagram's sender and placements; `None` if it is not one, or is torn.
pub fn decode_placed(d: &[u8]) -> Option<(u64, Vec<Placed>)> {
    if kind(d) != Some(PLACED) {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(d[i..i + 8].try_into().expect("8 bytes"));
    let mut placed = Vec::new();
    let mut i = HEAD;
    while i < d.len() {
        if i + 16 > d.len() {
            return None;
        }
        let n = usize::from(u16::from_le_bytes([d[i + 12], d[i + 13]]));
        let end = i + 16 + 8 * n;
        if end > d.len() {
            return None;
        }
        placed.push(Placed {
            worker: u64_at(i),
            uncached: u32::from_le_bytes(d[i + 8..i + 12].try_into().expect("4 bytes")),
            hashes: (i + 16..end).step_by(8).map(u64_at).collect(),
        });
        i = end;
    }
    Some((u64_at(8), placed))
}

/// A worker's placements for the peers, queued by the policy as it decides and taken by the
/// sender: filled only once a sender of this gateway has opened it, and bounded, so a sender
/// that falls behind drops placements rather than memory.
#[derive(Debug, Default)]
pub struct Outbox {
    open: std::sync::atomic::AtomicBool,
    placed: parking_lot::Mutex<Vec<(Vec<u64>, u32)>>,
}

/// Placements a worker's outbox holds at most.
const OUTBOX_MAX: usize = 1_024;

impl Outbox {
    /// A prompt through `hashes` was sent to the worker, `uncached` tokens of it to prefill.
    #[inline]
    pub fn placed(&self, hashes: &[u64], uncached: u64) {
        if !self.open.load(std::sync::atomic::Ordering::Relaxed) || hashes.is_empty() {
            return;
        }
        let mut q = self.placed.lock();
        if q.len() < OUTBOX_MAX {
            q.push((hashes.to_vec(), uncached.min(u64::from(u32::MAX)) as u32));
        }
        drop(q);
        WAKE.notify_one();
    }

    fn open(&self) {
        self.open.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn take(&self) -> Vec<(Vec<u64>, u32)> {
        std::mem::take(&mut *self.placed.lock())
    }
}

/// What peers said, per peer and worker, with when; and their sums per worker.
#[derive(Debug, Default)]
pub struct Heard {
    peers: HashMap<u64, Peer>,
}

#[derive(Debug)]
struct Peer {
    seq: u64,
    at: Instant,
    workers: HashMap<u64, (Entry, Instant)>,
}

/// What one datagram changed for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub worker: u64,
    /// Tokens by which the peer's pending prefill there fell: its prompts' first tokens came.
    pub cleared: u64,
    /// The peer had no pending prefill there and now has: it sent a prompt.
    pub sent: bool,
}

impl Heard {
    /// Takes in a datagram's entries from `sender`; returns what changed, worker by worker, or
    /// `None` for a datagram older than one already taken from that sender.
    pub fn take(
        &mut self,
        sender: u64,
        seq: u64,
        entries: &[Entry],
        now: Instant,
    ) -> Option<Vec<Change>> {
        let peer = self.peers.entry(sender).or_insert_with(|| Peer {
            seq,
            at: now,
            workers: HashMap::new(),
        });
        if seq < peer.seq {
            return None;
        }
        peer.seq = seq;
        peer.at = now;
        let mut changed = Vec::new();
        for e in entries {
            let old = peer.workers.insert(e.worker, (*e, now)).map(|(old, _)| old);
            if old != Some(*e) {
                let before = old.map_or(0, |o| o.pending);
                changed.push(Change {
                    worker: e.worker,
                    cleared: u64::from(before.saturating_sub(e.pending)),
                    sent: before == 0 && e.pending > 0,
                });
            }
        }
        Some(changed)
    }

    /// Forgets what is older than `after`; returns the workers whose sums changed.
    pub fn expire(&mut self, now: Instant, after: Duration) -> Vec<u64> {
        let mut changed = Vec::new();
        self.peers.retain(|_, peer| {
            peer.workers.retain(|&worker, (_, at)| {
                let keep = now.saturating_duration_since(*at) < after;
                if !keep {
                    changed.push(worker);
                }
                keep
            });
            now.saturating_duration_since(peer.at) < after
        });
        changed
    }

    /// Peers heard from and not yet expired.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// The peers' requests in flight, pending prefill and context on `worker`, summed.
    pub fn sum(&self, worker: u64) -> (u32, u64, u64) {
        self.peers
            .values()
            .filter_map(|p| p.workers.get(&worker))
            .fold((0u32, 0u64, 0u64), |(n, p, c), (e, _)| {
                (
                    n.saturating_add(e.inflight),
                    p + u64::from(e.pending),
                    c + u64::from(e.context),
                )
            })
    }
}

/// Gateways in this process exchanging load with peers; while none, [`changed`] is one load.
static TELLING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static WAKE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// This gateway's load on a worker changed (a request chosen, answered, ended): wakes the
/// sender of a gateway with peers. Several gateways in one process (the bench's replicas) wake
/// each other too; a sender that finds nothing changed sends nothing.
#[inline]
pub fn changed() {
    if TELLING.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        WAKE.notify_one();
    }
}

/// Sockets bound before the gateway starts, by address, for [`run`] to take rather than bind
/// (the bench binds each replica's on port 0 and tells every replica all of their addresses).
static HANDED: parking_lot::Mutex<Vec<std::net::UdpSocket>> = parking_lot::Mutex::new(Vec::new());

/// Hands a bound socket to the gateway whose `peers.bind` is its address; returns that address.
pub fn hand_over(socket: std::net::UdpSocket) -> std::io::Result<SocketAddr> {
    let addr = socket.local_addr()?;
    socket.set_nonblocking(true)?;
    HANDED.lock().push(socket);
    Ok(addr)
}

fn handed(addr: SocketAddr) -> Option<std::net::UdpSocket> {
    let mut handed = HANDED.lock();
    let i = handed
        .iter()
        .position(|s| s.local_addr().ok() == Some(addr))?;
    Some(handed.swap_remove(i))
}

/// Exchanges load with the peers until `cancel` fires; returns at once without `peers.bind`.
pub async fn run(
    up: Arc<Upstreams>,
    arms: Arc<arc_swap::ArcSwap<crate::policy::arms::Arms>>,
    cancel: CancellationToken,
) {
    let cfg = up.config.peers.clone();
    let Some(bind) = cfg.bind else {
        return;
    };
    let socket = match handed(bind) {
        Some(s) => UdpSocket::from_std(s),
        None => UdpSocket::bind(bind).await,
    };
    let socket = match socket {
        Ok(s) => Arc::new(s),
        Err(e) => {
            tracing::error!(%bind, error = %e, "peers: cannot bind; this replica neither tells nor hears its peers");
            return;
        }
    };
    let id = xxhash_rust::xxh3::xxh3_64(
        format!(
            "{}:{:?}:{:?}",
            std::process::id(),
            std::time::SystemTime::now(),
            socket.local_addr().ok()
        )
        .as_bytes(),
    );
    tracing::info!(%bind, addresses = ?cfg.addresses, "peers: telling and hearing other replicas' load");
    tokio::join!(
        tell(&up, &socket, id, &cfg, &cancel),
        hear(&up, &arms, &socket, id, &cfg, &cancel)
    );
}

/// Sends what changed of this gateway's figures to every peer address as soon as something
/// changes, then again an interval later, then waits for the next change (or the second's full
/// send).
async fn tell(
    up: &Upstreams,
    socket: &UdpSocket,
    id: u64,
    cfg: &crate::config::PeersConfig,
    cancel: &CancellationToken,
) {
    use std::sync::atomic::Ordering;
    TELLING.fetch_add(1, Ordering::Relaxed);
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            TELLING.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let _stop = Stop;
    let interval = Duration::from_secs_f64(cfg.interval_seconds);
    let mut teller = Teller {
        up,
        socket,
        id,
        resolve_every: Duration::from_secs_f64(cfg.resolve_seconds),
        addresses: &cfg.addresses,
        targets: Vec::new(),
        resolved: None,
        set: up.pool.snapshot(),
        last: Vec::new(),
        full_at: tokio::time::Instant::now(),
        seq: 0,
        sent: up.metrics.peer_datagrams.with_label_values(&["sent"]),
    };
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = WAKE.notified() => {}
            _ = tokio::time::sleep_until(teller.full_at) => {}
        }
        teller.send().await;
        // Changes made meanwhile (a request's slot released after its load) go a moment later.
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        teller.send().await;
    }
}

/// The sender's state: where to, and what it last sent.
struct Teller<'a> {
    up: &'a Upstreams,
    socket: &'a UdpSocket,
    id: u64,
    resolve_every: Duration,
    addresses: &'a [String],
    targets: Vec<SocketAddr>,
    resolved: Option<Instant>,
    /// The worker set `last` is aligned with: this gateway's figures as last sent, worker by
    /// worker.
    set: Arc<Vec<Arc<Worker>>>,
    last: Vec<Option<Entry>>,
    full_at: tokio::time::Instant,
    seq: u64,
    sent: prometheus::IntCounter,
}

impl Teller<'_> {
    /// Sends what changed since the last send (everything, once a second) to every peer.
    async fn send(&mut self) {
        let now = Instant::now();
        if self
            .resolved
            .is_none_or(|at| now.duration_since(at) >= self.resolve_every)
        {
            self.resolved = Some(now);
            if let Some(found) = resolve(self.addresses).await {
                self.targets = found;
            }
        }
        let set = self.up.pool.snapshot();
        if !Arc::ptr_eq(&set, &self.set) || self.last.len() != set.len() {
            self.set = set;
            self.last = vec![None; self.set.len()];
            // The workers of a new set queue their placements from now on.
            for w in self.set.iter() {
                w.peer_outbox.open();
            }
        }
        let placed: Vec<Placed> = self
            .set
            .iter()
            .flat_map(|w| {
                w.peer_outbox
                    .take()
                    .into_iter()
                    .map(|(hashes, uncached)| Placed {
                        worker: w.id_hash,
                        uncached,
                        hashes,
                    })
            })
            .collect();
        if !placed.is_empty() {
            for d in encode_placed(self.id, &placed) {
                for t in &self.targets {
                    if self.socket.send_to(&d, t).await.is_ok() {
                        self.sent.inc();
                    }
                }
            }
        }
        let tick = tokio::time::Instant::now();
        if tick >= self.full_at {
            self.full_at = tick + FULL_EVERY;
            self.last.fill(None);
        }
        let entries: Vec<Entry> = self
            .set
            .iter()
            .zip(self.last.iter_mut())
            .filter_map(|(w, l)| {
                let e = Entry::of(w);
                (l.replace(e) != Some(e)).then_some(e)
            })
            .collect();
        if entries.is_empty() || self.targets.is_empty() {
            return;
        }
        self.seq += 1;
        for d in encode(self.id, self.seq, &entries) {
            for t in &self.targets {
                if self.socket.send_to(&d, t).await.is_ok() {
                    self.sent.inc();
                }
            }
        }
    }
}

/// Every address `addresses` resolve to; `None` when none resolves (the last ones are kept).
async fn resolve(addresses: &[String]) -> Option<Vec<SocketAddr>> {
    let mut found = Vec::new();
    for a in addresses {
        match tokio::net::lookup_host(a.as_str()).await {
            Ok(addrs) => found.extend(addrs),
            Err(e) => tracing::debug!(address = %a, error = %e, "peers: address not resolved"),
        }
    }
    found.sort();
    found.dedup();
    (!found.is_empty()).then_some(found)
}

/// Takes in the peers' datagrams, writing their sums into each worker's load, and forgets what
/// a peer has not repeated within `expire_seconds`.
async fn hear(
    up: &Upstreams,
    arms: &arc_swap::ArcSwap<crate::policy::arms::Arms>,
    socket: &UdpSocket,
    id: u64,
    cfg: &crate::config::PeersConfig,
    cancel: &CancellationToken,
) {
    let after = Duration::from_secs_f64(cfg.expire_seconds);
    let mut sweep = tokio::time::interval(after / 4);
    sweep.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut heard = Heard::default();
    let mut buf = vec![0u8; 65_536];
    let received = up.metrics.peer_datagrams.with_label_values(&["received"]);
    let rejected = up.metrics.peer_datagrams.with_label_values(&["rejected"]);
    // The workers by identity, rebuilt when the set changes (and then every sum rewritten: a
    // worker new to the set starts with none).
    let mut set = up.pool.snapshot();
    let mut by_id = index(&set);
    loop {
        let changed = tokio::select! {
            _ = cancel.cancelled() => return,
            _ = sweep.tick() => heard.expire(Instant::now(), after),
            r = socket.recv_from(&mut buf) => {
                let Ok((n, _)) = r else { continue };
                if let Some((sender, placed)) = decode_placed(&buf[..n]) {
                    if sender != id {
                        received.inc();
                        let arms = arms.load();
                        for p in &placed {
                            if let Some(w) = by_id.get(&p.worker) {
                                for arm in arms.iter() {
                                    arm.policy.learn_placement(w, &p.hashes, u64::from(p.uncached));
                                }
                            }
                        }
                    }
                    continue;
                }
                match decode(&buf[..n]) {
                    Some((sender, _, _)) if sender == id => continue,
                    Some((sender, seq, entries)) => {
                        match heard.take(sender, seq, &entries, Instant::now()) {
                            Some(changed) => {
                                received.inc();
                                let now = crate::load::now_us();
                                for c in &changed {
                                    if let Some(w) = by_id.get(&c.worker) {
                                        w.steps.peer_cleared(c.cleared);
                                        if c.sent && w.load.pending_prefill() == 0
                                            && w.load.peer_tokens().0 == 0
                                        {
                                            w.steps.sent(now);
                                        }
                                    }
                                }
                                changed.into_iter().map(|c| c.worker).collect()
                            }
                            None => {
                                rejected.inc();
                                continue;
                            }
                        }
                    }
                    None => {
                        rejected.inc();
                        continue;
                    }
                }
            }
        };
        let now_set = up.pool.snapshot();
        let all = !Arc::ptr_eq(&now_set, &set);
        if all {
            set = now_set;
            by_id = index(&set);
        }
        let write = |worker: u64| {
            if let Some(w) = by_id.get(&worker) {
                let (n, p, c) = heard.sum(worker);
                w.load.set_peers(n, p, c);
            }
        };
        if all {
            by_id.keys().copied().for_each(write);
        } else {
            changed.into_iter().for_each(write);
        }
        up.metrics.peers.set(heard.peers() as i64);
    }
}

fn index(set: &[Arc<Worker>]) -> HashMap<u64, Arc<Worker>> {
    set.iter().map(|w| (w.id_hash, w.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(worker: u64, inflight: u32) -> Entry {
        Entry {
            worker,
            inflight,
            pending: inflight * 100,
            context: inflight * 1000,
        }
    }

    #[test]
    fn entries_cross_the_wire_in_datagrams_of_at_most_an_ethernet_frame() {
        let entries: Vec<Entry> = (0..150).map(|k| entry(k * 7919, k as u32)).collect();
        let datagrams = encode(42, 9, &entries);
        assert_eq!(datagrams.len(), 3);
        assert!(datagrams.iter().all(|d| d.len() <= 1_400));
        let back: Vec<Entry> = datagrams
            .iter()
            .flat_map(|d| {
                let (sender, seq, e) = decode(d).expect("a peer datagram");
                assert_eq!((sender, seq), (42, 9));
                e
            })
            .collect();
        assert_eq!(back, entries);
    }

    #[test]
    fn placements_cross_the_wire_a_long_prompt_in_runs() {
        let long = Placed {
            worker: 7,
            uncached: 9_000,
            hashes: (0..400).collect(),
        };
        let short = Placed {
            worker: 8,
            uncached: 12,
            hashes: vec![11, 12],
        };
        let datagrams = encode_placed(42, &[long.clone(), short.clone()]);
        assert!(datagrams.iter().all(|d| d.len() <= PLACED_MAX));
        assert!(datagrams.iter().all(|d| decode(d).is_none()), "not load");
        let back: Vec<Placed> = datagrams
            .iter()
            .flat_map(|d| {
                let (sender, placed) = decode_placed(d).expect("a placement datagram");
                assert_eq!(sender, 42);
                placed
            })
            .collect();
        // The long prompt's hashes in order, in runs; its uncached tokens counted once.
        let runs: Vec<&Placed> = back.iter().filter(|p| p.worker == 7).collect();
        assert!(runs.len() >= 3);
        let hashes: Vec<u64> = runs.iter().flat_map(|p| p.hashes.clone()).collect();
        assert_eq!(hashes, long.hashes);
        assert_eq!(runs.iter().map(|p| p.uncached).sum::<u32>(), 9_000);
        assert_eq!(back.last(), Some(&short));
        let torn = &datagrams[0][..datagrams[0].len() - 3];
        assert!(decode_placed(torn).is_none());
    }

    #[test]
    fn what_is_not_a_peer_datagram_is_refused() {
        let good = encode(1, 1, &[entry(5, 1)]).remove(0);
        assert!(decode(&good).is_some());
        assert!(decode(b"GET / HTTP/1.1\r\n").is_none());
        assert!(decode(&good[..good.len() - 1]).is_none(), "a torn entry");
        let mut other_version = good.clone();
        other_version[4] = 2;
        assert!(decode(&other_version).is_none());
        assert!(decode_placed(&good).is_none(), "load, not placements");
    }

    #[test]
    fn peers_sum_per_worker_a_stale_datagram_is_dropped_and_silence_expires() {
        let t0 = Instant::now();
        let mut heard = Heard::default();
        let workers =
            |c: Option<Vec<Change>>| c.map(|c| c.iter().map(|c| c.worker).collect::<Vec<_>>());
        assert_eq!(
            workers(heard.take(1, 5, &[entry(10, 2), entry(11, 1)], t0)),
            Some(vec![10, 11])
        );
        assert_eq!(
            workers(heard.take(2, 1, &[entry(10, 3)], t0)),
            Some(vec![10])
        );
        assert_eq!(heard.sum(10), (5, 500, 5_000));
        assert_eq!(heard.sum(11), (1, 100, 1_000));
        assert_eq!(heard.peers(), 2);
        // The same figures again change nothing; an older sequence number is refused.
        assert_eq!(workers(heard.take(1, 5, &[entry(10, 2)], t0)), Some(vec![]));
        assert_eq!(heard.take(1, 4, &[entry(10, 9)], t0), None);
        assert_eq!(heard.sum(10), (5, 500, 5_000));
        // Peer 1 goes on speaking, peer 2 falls silent: only peer 2's figures expire.
        let t1 = t0 + Duration::from_secs(2);
        // Its pending prefill on worker 10 falls from 200 to 100: 100 tokens' first tokens came.
        let changes = heard.take(1, 6, &[entry(10, 1), entry(11, 1)], t1).unwrap();
        assert_eq!(
            changes,
            vec![Change {
                worker: 10,
                cleared: 100,
                sent: false
            }]
        );
        let t2 = t0 + Duration::from_secs(4);
        let mut changed = heard.expire(t2, Duration::from_secs(3));
        changed.sort();
        assert_eq!(changed, vec![10]);
        assert_eq!(heard.sum(10), (1, 100, 1_000));
        assert_eq!(heard.peers(), 1);
        // From none pending to some: a prompt sent.
        let changes = heard.take(1, 7, &[entry(12, 0), entry(12, 3)], t2).unwrap();
        assert_eq!(
            changes[1],
            Change {
                worker: 12,
                cleared: 0,
                sent: true
            }
        );
    }
}
