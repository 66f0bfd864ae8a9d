//! Engine metrics: the counters the data path bumps (atomics; none takes a
//! lock of its own on the hot path), the room totals the room table keeps
//! under its own lock, and one [`MetricsSnapshot`] of them all (its
//! Prometheus text: `prometheus`).
//!
//! Where each number comes from:
//! - rooms by state, rooms finished and failures by status kind, and the
//!   transfer latency histograms: the room table ([`RoomTotals`]), counted
//!   when a finished room is cleared and, for live rooms, at the snapshot;
//! - bytes, batches, failed batches and wire time per transport and peer:
//!   each decode link's [`PeerCounters`], bumped by the flight of batches;
//! - host staging in flight: bytes of the staging buffers read by batches
//!   not yet completed (per link, summed);
//! - gather time: the prefill workers' CPU gathers into the staging;
//! - received bytes (decode): the KV bytes each prefill rank reported for
//!   its rooms; received batches: the receiving agent's completion records;
//! - NCCL communicator inits (transport nccl, both roles): each link's
//!   communicator generations opened or failed and the seconds their init
//!   took.

mod prometheus;

use crate::bootstrap::schema::Role;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the transfer latency buckets: 0.5 ms to 60 s,
/// about three per decade (a room's KV moves in well under a millisecond on
/// one host and in seconds over a slow link). A last `+Inf` bucket follows.
/// cbindgen:ignore
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A Prometheus-style histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Observations per bucket, not cumulative; the last is the `+Inf` bucket.
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    /// Sum of the observations, seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    /// Adds one observation of `secs` seconds.
    pub fn observe(&mut self, secs: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    /// Adds every observation of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum += other.sum;
        self.count += other.count;
    }

    /// The `q` quantile (0..=1) estimated from the buckets as Prometheus'
    /// `histogram_quantile` does: linear within the bucket it falls in (the
    /// first bucket starts at 0); in the `+Inf` bucket, the largest finite
    /// bound. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let mut below = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let Some(&hi) = LATENCY_BUCKETS.get(i) else {
                    return Some(LATENCY_BUCKETS[LATENCY_BUCKETS.len() - 1]);
                };
                let lo = if i == 0 { 0.0 } else { LATENCY_BUCKETS[i - 1] };
                let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
                return Some(lo + (hi - lo) * within);
            }
            below += n;
        }
        Some(LATENCY_BUCKETS[LATENCY_BUCKETS.len() - 1])
    }
}

/// The room table's lifecycle totals, kept under its lock: rooms created,
/// and the finished rooms it has cleared (their outcome, failure kind and
/// transfer latency). [`RoomTable::totals`](super::RoomTable::totals) adds
/// the finished live rooms, so a finished room counts once, cleared or not.
#[derive(Debug, Clone, Default)]
pub struct RoomTotals {
    /// Rooms created (every attempt of a reused id counts).
    pub created: u64,
    /// Finished rooms that succeeded.
    pub succeeded: u64,
    /// Finished rooms that failed, by the status kind of their failure.
    pub failed: BTreeMap<&'static str, u64>,
    /// Transfer latency of the rooms that succeeded, by transport: from the
    /// first chunk queued (prefill) or the metadata sent (decode) to Success.
    pub latency: BTreeMap<&'static str, Histogram>,
}

/// The counters of one peer link: a decode rank as the prefill writes to it
/// (or a prefill rank as the decode hears from it). Created once per link
/// and shared with the engine's registry; bumped with relaxed atomics.
#[derive(Debug, Default)]
pub(crate) struct PeerCounters {
    /// Transport label (`cma`, `tcp`, `rdma`, ...).
    pub transport: &'static str,
    /// Peer label: the peer's rank key (`dp0-tp1-cp0-pp0`).
    pub peer: String,
    /// Bytes of batches that completed.
    pub bytes: AtomicU64,
    /// Batches that completed.
    pub batches: AtomicU64,
    /// Batches refused at submit or failed at completion.
    pub failed_batches: AtomicU64,
    /// Nanoseconds workers spent submitting batches and waiting for them.
    pub wire_ns: AtomicU64,
    /// Bytes of host staging read by batches not yet completed.
    pub staged_bytes: AtomicU64,
}

impl PeerCounters {
    /// Adds `d` to the wire time.
    pub(crate) fn add_wire(&self, since: Instant) {
        self.wire_ns
            .fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The engine-wide counters (one per [`Engine`](super::Engine)).
#[derive(Debug, Default)]
pub(crate) struct EngineMetrics {
    /// Every link's counters: taken when a link is made and at a snapshot
    /// only, never per batch, and never while another lock is held (a leaf
    /// in each role's lock order). Counters outlive their link (Prometheus
    /// counters never go down); a link to the same peer over the same
    /// transport reuses them.
    peers: Mutex<Vec<Arc<PeerCounters>>>,
    /// Nanoseconds prefill workers spent gathering rows into host staging.
    gather_ns: AtomicU64,
    /// Gathers into host staging.
    gathers: AtomicU64,
    /// KV bytes gathered straight into same-host decode pools (one copy).
    one_copy_bytes: AtomicU64,
    /// Prefill: rooms resumed on a new tcp connection, and the bytes sent
    /// again there (what had not landed).
    tcp_resumes: AtomicU64,
    tcp_resent_bytes: AtomicU64,
    /// Decode: batches that landed (the agent's completion records).
    received_batches: AtomicU64,
    /// Transport nccl: communicators opened, inits that failed, and the
    /// nanoseconds all inits took.
    nccl_inits: AtomicU64,
    nccl_init_failures: AtomicU64,
    nccl_init_ns: AtomicU64,
}

impl EngineMetrics {
    /// The counters of the link to `peer` over `transport` (made on first use).
    pub(crate) fn peer(&self, transport: &'static str, peer: String) -> Arc<PeerCounters> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = peers
            .iter()
            .find(|c| c.transport == transport && c.peer == peer)
        {
            return c.clone();
        }
        let c = Arc::new(PeerCounters {
            transport,
            peer,
            ..Default::default()
        });
        peers.push(c.clone());
        c
    }

    /// Counts one gather into host staging that started at `since`.
    pub(crate) fn gathered(&self, since: Instant) {
        self.gather_ns
            .fetch_add(nanos(since.elapsed()), Ordering::Relaxed);
        self.gathers.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `bytes` gathered straight into a decode rank's mapped pools.
    pub(crate) fn placed(&self, bytes: u64) {
        self.one_copy_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts one room resumed on a new tcp connection, `bytes` sent again.
    pub(crate) fn room_resumed(&self, bytes: u64) {
        self.tcp_resumes.fetch_add(1, Ordering::Relaxed);
        self.tcp_resent_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Transport nccl: counts one communicator init that took `took`.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn nccl_init(&self, took: Duration, ok: bool) {
        self.nccl_init_ns.fetch_add(nanos(took), Ordering::Relaxed);
        if ok {
            self.nccl_inits.fetch_add(1, Ordering::Relaxed);
        } else {
            self.nccl_init_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Decode: counts `n` batches that landed.
    /// Gathers into host staging so far.
    #[cfg(test)]
    pub(crate) fn gathers_total(&self) -> u64 {
        self.gathers.load(Ordering::Relaxed)
    }

    /// KV bytes moved by one copy so far.
    #[cfg(test)]
    pub(crate) fn one_copy_bytes_total(&self) -> u64 {
        self.one_copy_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn received(&self, n: u64) {
        self.received_batches.fetch_add(n, Ordering::Relaxed);
    }

    fn peers(&self) -> Vec<PeerSnapshot> {
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<PeerSnapshot> = peers
            .iter()
            .map(|c| PeerSnapshot {
                transport: c.transport.to_string(),
                peer: c.peer.clone(),
                bytes: c.bytes.load(Ordering::Relaxed),
                batches: c.batches.load(Ordering::Relaxed),
                failed_batches: c.failed_batches.load(Ordering::Relaxed),
                wire_seconds: c.wire_ns.load(Ordering::Relaxed) as f64 * 1e-9,
                staged_bytes: c.staged_bytes.load(Ordering::Relaxed),
            })
            .collect();
        out.sort_by(|a, b| (&a.transport, &a.peer).cmp(&(&b.transport, &b.peer)));
        out
    }
}

/// One peer link's counters at a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerSnapshot {
    /// Transport label (`cma`, `tcp`, `rdma`, ...).
    pub transport: String,
    /// Peer label: its rank key (`dp0-tp1-cp0-pp0`).
    pub peer: String,
    /// Prefill: bytes of completed batches to the peer (KV, aux, state).
    /// Decode: KV bytes the prefill rank reported for its finished rooms.
    pub bytes: u64,
    /// Prefill: completed batches to the peer (0 on a decode).
    pub batches: u64,
    /// Prefill: batches refused at submit or failed at completion.
    pub failed_batches: u64,
    /// Prefill: seconds workers spent submitting batches and waiting for them.
    pub wire_seconds: f64,
    /// Prefill: bytes of host staging read by batches still in flight.
    pub staged_bytes: u64,
}

/// Every metric of one engine at one moment ([`Engine::metrics_snapshot`](super::Engine::metrics_snapshot)).
#[derive(Debug, Clone)]
pub struct MetricsSnapshot {
    /// The engine's role.
    pub role: Role,
    /// The engine's cluster.
    pub cluster: String,
    /// Live rooms by state, indexed by the `KvPoll` value.
    pub rooms: [u64; 5],
    /// Room totals: created, finished (cleared or live) by outcome and
    /// failure kind, transfer latency of the successful ones by transport.
    pub totals: RoomTotals,
    /// Every peer link's counters, by transport and peer.
    pub peers: Vec<PeerSnapshot>,
    /// Decode: batches that landed (the agent's completion records).
    pub received_batches: u64,
    /// Prefill: seconds workers spent gathering rows into host staging or
    /// straight into mapped decode pools.
    pub gather_seconds: f64,
    /// Prefill: gathers into host staging.
    pub gathers: u64,
    /// Prefill: KV bytes gathered straight into same-host decode ranks'
    /// mapped pools (one copy, no staging; counted once placed).
    pub one_copy_bytes: u64,
    /// Prefill: rooms resumed on a new tcp connection after their data
    /// connection broke in their middle (one per decode rank and redial).
    pub tcp_resumes: u64,
    /// Prefill: bytes those resumed rooms sent again (what had not landed).
    pub tcp_resent_bytes: u64,
    /// Bytes of the prefill workers' host staging buffers.
    pub staging_bytes: u64,
    /// Registered memory by kind (`kv`, `aux`, `state`, `staging`, `other`).
    pub registered_bytes: BTreeMap<&'static str, u64>,
    /// Control messages this process sent and received so far (engine
    /// control channel and data-plane control frames; process-wide).
    pub control: crate::transport::control_counts::ControlCounts,
    /// Decode: room grants this engine's agent holds (rooms granted to
    /// their prefill ranks and not yet ended, revoked or expired).
    pub room_grants_held: u64,
    /// Transport nccl: communicators opened (every link and generation).
    pub nccl_comm_inits: u64,
    /// Transport nccl: communicator inits that failed.
    pub nccl_comm_init_failures: u64,
    /// Transport nccl: seconds spent in communicator inits (opened or failed).
    pub nccl_comm_init_seconds: f64,
}

/// `KvPoll` state names as label values, indexed by the state's value.
/// cbindgen:ignore
pub const STATE_NAMES: [&str; 5] = [
    "failed",
    "bootstrapping",
    "waiting_for_input",
    "transferring",
    "success",
];

impl MetricsSnapshot {
    pub(crate) fn new(
        role: Role,
        cluster: &str,
        rooms: [u64; 5],
        totals: RoomTotals,
        m: &EngineMetrics,
        staging_bytes: u64,
        registered_bytes: BTreeMap<&'static str, u64>,
    ) -> MetricsSnapshot {
        MetricsSnapshot {
            role,
            cluster: cluster.to_string(),
            rooms,
            totals,
            peers: m.peers(),
            received_batches: m.received_batches.load(Ordering::Relaxed),
            gather_seconds: m.gather_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            gathers: m.gathers.load(Ordering::Relaxed),
            one_copy_bytes: m.one_copy_bytes.load(Ordering::Relaxed),
            tcp_resumes: m.tcp_resumes.load(Ordering::Relaxed),
            tcp_resent_bytes: m.tcp_resent_bytes.load(Ordering::Relaxed),
            staging_bytes,
            registered_bytes,
            control: crate::transport::control_counts::control_counts(),
            room_grants_held: 0,
            nccl_comm_inits: m.nccl_inits.load(Ordering::Relaxed),
            nccl_comm_init_failures: m.nccl_init_failures.load(Ordering::Relaxed),
            nccl_comm_init_seconds: m.nccl_init_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// Bytes of host staging read by batches still in flight (every link).
    pub fn staging_in_flight_bytes(&self) -> u64 {
        self.peers.iter().map(|p| p.staged_bytes).sum()
    }

    /// Seconds workers spent submitting batches and waiting for them, by transport.
    pub fn wire_seconds(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for p in &self.peers {
            *out.entry(p.transport.clone()).or_insert(0.0) += p.wire_seconds;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket_and_inf_catches_the_rest() {
        let mut h = Histogram::default();
        h.observe(0.0);
        h.observe(0.0005);
        h.observe(0.0006);
        h.observe(61.0);
        assert_eq!(h.buckets[0], 2, "le is inclusive");
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.buckets[LATENCY_BUCKETS.len()], 1);
        assert_eq!(h.count, 4);
        assert!((h.sum - 61.0011).abs() < 1e-9);
        let mut g = Histogram::default();
        g.observe(0.003);
        g.merge(&h);
        assert_eq!(g.count, 5);
        assert_eq!(g.buckets[3], 1);
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        // 10 observations in (0.01, 0.025]: the median is half way through it
        for _ in 0..10 {
            h.observe(0.02);
        }
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 0.0175).abs() < 1e-12, "{p50}");
        assert!((h.quantile(1.0).unwrap() - 0.025).abs() < 1e-12);
        // one slow room in +Inf: p99 of 11 falls there, p50 does not move bucket
        h.observe(100.0);
        assert_eq!(h.quantile(0.99).unwrap(), 60.0);
        assert!(h.quantile(0.5).unwrap() <= 0.025);
        // in the first bucket the lower bound is 0
        let mut f = Histogram::default();
        f.observe(0.0001);
        f.observe(0.0001);
        assert!((f.quantile(0.5).unwrap() - 0.00025).abs() < 1e-12);
    }

    #[test]
    fn nccl_inits_are_counted_with_their_time() {
        let m = EngineMetrics::default();
        m.nccl_init(Duration::from_millis(300), true);
        m.nccl_init(Duration::from_millis(200), false);
        let s = MetricsSnapshot::new(
            Role::Decode,
            "c",
            [0; 5],
            RoomTotals::default(),
            &m,
            0,
            BTreeMap::new(),
        );
        assert_eq!((s.nccl_comm_inits, s.nccl_comm_init_failures), (1, 1));
        assert!((s.nccl_comm_init_seconds - 0.5).abs() < 1e-9);
    }

    #[test]
    fn counters_are_shared_per_transport_and_peer() {
        let m = EngineMetrics::default();
        let a = m.peer("tcp", "dp0-tp0-cp0-pp0".into());
        let b = m.peer("tcp", "dp0-tp0-cp0-pp0".into());
        let c = m.peer("cma", "dp0-tp0-cp0-pp0".into());
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        a.bytes.fetch_add(10, Ordering::Relaxed);
        b.bytes.fetch_add(5, Ordering::Relaxed);
        let p = m.peers();
        assert_eq!(p.len(), 2);
        assert_eq!((p[1].transport.as_str(), p[1].bytes), ("tcp", 15));
    }
}
