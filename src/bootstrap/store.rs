//! The [`Store`] trait every bootstrap backend implements, and [`MemStore`],
//! the in-memory store behind the embedded HTTP server.
//!
//! Every entry is bound to a lease with a time-to-live; an entry whose lease
//! is not kept alive disappears by itself. Writing an entry at a key that
//! already has one replaces it in one step (the old entry is never visible
//! beside the new one), and the new entry's epoch is larger.

use super::schema::{now_ms, random_bytes, RankKey, RegisterAck, Registration, Role, Summary};
use super::view::View;
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest lease the in-memory store grants.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// Longest lease the in-memory store grants.
pub const MAX_TTL: Duration = Duration::from_secs(3600);
/// Default cap on live entries of an in-memory store (bounds its memory).
/// cbindgen:ignore
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;
/// Default bound on the stored registrations' serialized size, in bytes
/// (1 GiB: thousands of the largest registrations a rank sends).
/// cbindgen:ignore
pub const DEFAULT_MAX_STORE_BYTES: usize = 1 << 30;

/// A bootstrap backend: the embedded server's memory, a remote server, or etcd.
pub trait Store: Send + Sync {
    /// Writes (or atomically replaces) the entry at `reg.key()`, bound to a
    /// new lease of `ttl`. The store assigns the epoch and registration time.
    fn register(&self, reg: &Registration, ttl: Duration) -> Result<RegisterAck>;

    /// Renews a lease. `not_registered` if it expired (register again);
    /// `stale_metadata` if its entry was replaced by another registration.
    fn keepalive(&self, lease_id: u64) -> Result<()>;

    /// Removes the entries bound to `lease_id` (only those: an entry that was
    /// replaced by another process is left alone).
    fn deregister(&self, lease_id: u64) -> Result<()>;

    /// All live entries of `cluster`/`role`, current and stale.
    fn entries(&self, cluster: &str, role: Role) -> Result<Vec<Registration>>;

    /// A short description of the backend for error messages.
    fn describe(&self) -> String;

    /// The live entries of `cluster`/`role`, classified.
    fn view(&self, cluster: &str, role: Role) -> Result<View> {
        Ok(View::new(cluster, role, self.entries(cluster, role)?))
    }

    /// Topology and readiness of `cluster`/`role`.
    fn summary(&self, cluster: &str, role: Role) -> Result<Summary> {
        Ok(self.view(cluster, role)?.summary())
    }

    /// The current entry of one rank.
    fn lookup(&self, cluster: &str, role: Role, key: &RankKey) -> Result<Registration> {
        self.view(cluster, role)?.lookup(key)
    }
}

/// Counters of a [`MemStore`] (exported by `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Successful registrations.
    pub registrations: u64,
    /// Registrations that replaced an entry at the same key.
    pub replacements: u64,
    /// Entries removed because their lease expired.
    pub expirations: u64,
    /// Entries removed by deregistration.
    pub deregistrations: u64,
    /// Successful keep-alives.
    pub keepalives: u64,
    /// Live entries now.
    pub entries: u64,
    /// Live leases now.
    pub leases: u64,
    /// Serialized size of the live entries now, in bytes.
    pub bytes: u64,
}

type EntryKey = (String, Role, RankKey);

struct Lease {
    ttl: Duration,
    expires: Instant,
}

#[derive(Default)]
struct Inner {
    /// Entry -> (registration, its lease, its serialized size in bytes).
    entries: HashMap<EntryKey, (Registration, u64, usize)>,
    /// Sum of the live entries' serialized sizes.
    bytes: usize,
    leases: HashMap<u64, Lease>,
    /// Last epoch handed out; epochs are global to the store, so they also
    /// increase per (cluster, role).
    epoch: u64,
    stats: MemStats,
    /// Lease -> who replaced its entry, for a precise keep-alive answer.
    replaced_by: HashMap<u64, String>,
}

impl Inner {
    fn purge(&mut self, now: Instant) {
        let before = self.leases.len();
        self.leases.retain(|_, l| l.expires > now);
        if self.leases.len() == before {
            return;
        }
        let leases = &self.leases;
        let n = self.entries.len();
        let mut freed = 0;
        self.entries.retain(|_, (_, lease, size)| {
            let keep = leases.contains_key(lease);
            if !keep {
                freed += *size;
            }
            keep
        });
        self.bytes -= freed;
        self.stats.expirations += (n - self.entries.len()) as u64;
        self.replaced_by.retain(|l, _| leases.contains_key(l));
    }
}

/// The in-memory store: leases with TTL expiry, atomic replacement, and
/// caps on live entries and on their serialized size.
pub struct MemStore {
    inner: Mutex<Inner>,
    max_entries: usize,
    max_bytes: usize,
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new()
    }
}

impl MemStore {
    /// An empty store holding at most [`DEFAULT_MAX_ENTRIES`] entries.
    pub fn new() -> MemStore {
        MemStore::with_max_entries(DEFAULT_MAX_ENTRIES)
    }

    /// An empty store holding at most `max_entries` live entries; a
    /// registration of a new key beyond that fails (replacements still work).
    pub fn with_max_entries(max_entries: usize) -> MemStore {
        MemStore::with_limits(max_entries, DEFAULT_MAX_STORE_BYTES)
    }

    /// An empty store holding at most `max_entries` live entries whose
    /// serialized registrations total at most `max_bytes`; a registration
    /// past the byte bound fails with `StoreFull` (a replacement counts its
    /// new size in place of the old one, an expired or deregistered entry
    /// frees its bytes).
    pub fn with_limits(max_entries: usize, max_bytes: usize) -> MemStore {
        MemStore {
            inner: Mutex::new(Inner::default()),
            max_entries,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent maps (every update
        // is a single insert/remove), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counters and gauges, after removing expired entries.
    pub fn stats(&self) -> MemStats {
        let mut g = self.lock();
        g.purge(Instant::now());
        let mut s = g.stats;
        s.entries = g.entries.len() as u64;
        s.leases = g.leases.len() as u64;
        s.bytes = g.bytes as u64;
        s
    }
}

fn new_lease_id() -> Result<u64> {
    loop {
        let id = u64::from_le_bytes(random_bytes::<8>()?) >> 1; // fits i64 (etcd-compatible)
        if id != 0 {
            return Ok(id);
        }
    }
}

/// Checks a requested TTL against the store's bounds.
pub fn check_ttl(ttl: Duration, min: Duration, max: Duration) -> Result<()> {
    if ttl < min || ttl > max {
        return Err(Error::invalid(format!(
            "ttl_ms: {} is outside the accepted range {}..={} ms",
            ttl.as_millis(),
            min.as_millis(),
            max.as_millis()
        )));
    }
    Ok(())
}

impl Store for MemStore {
    fn register(&self, reg: &Registration, ttl: Duration) -> Result<RegisterAck> {
        reg.validate()?;
        check_ttl(ttl, MIN_TTL, MAX_TTL)?;
        let lease_id = new_lease_id()?;
        let now = Instant::now();
        let mut g = self.lock();
        g.purge(now);
        let key = (reg.cluster.clone(), reg.role, reg.key());
        if g.entries.len() >= self.max_entries && !g.entries.contains_key(&key) {
            return Err(Error::new(
                Status::Bootstrap,
                format!(
                    "bootstrap store is full ({} live entries); entries expire with their leases, or raise the server's --max-entries",
                    g.entries.len()
                ),
            ));
        }
        let mut r = reg.clone();
        r.epoch = g.epoch + 1;
        r.registered_at_ms = now_ms();
        let size = serde_json::to_vec(&r).map(|v| v.len()).map_err(|e| {
            Error::new(
                Status::Bootstrap,
                format!("cannot encode the registration: {e}"),
            )
        })?;
        let old_size = g.entries.get(&key).map_or(0, |(_, _, n)| *n);
        let after = g.bytes - old_size + size;
        if after > self.max_bytes {
            return Err(Error::new(
                Status::StoreFull,
                format!(
                    "bootstrap store is at its byte bound: this {size}-byte registration would make the live entries {after} bytes, over the server's --max-store-bytes {}; entries free their bytes when their leases expire, or raise --max-store-bytes",
                    self.max_bytes
                ),
            ));
        }
        g.epoch += 1;
        g.bytes = after;
        g.leases.insert(
            lease_id,
            Lease {
                ttl,
                expires: now + ttl,
            },
        );
        let desc = r.describe();
        let ack = RegisterAck {
            epoch: r.epoch,
            registered_at_ms: r.registered_at_ms,
            lease_id,
            ttl_ms: ttl.as_millis() as u64,
            replaced: false,
        };
        let old = g.entries.insert(key, (r, lease_id, size));
        g.stats.registrations += 1;
        let replaced = if let Some((_, old_lease, _)) = old {
            g.stats.replacements += 1;
            g.replaced_by.insert(old_lease, desc);
            true
        } else {
            false
        };
        Ok(RegisterAck { replaced, ..ack })
    }

    fn keepalive(&self, lease_id: u64) -> Result<()> {
        let now = Instant::now();
        let mut g = self.lock();
        g.purge(now);
        let Some(l) = g.leases.get_mut(&lease_id) else {
            return Err(Error::new(
                Status::NotRegistered,
                format!("lease {lease_id} is unknown or expired; register again"),
            ));
        };
        l.expires = now + l.ttl;
        if let Some(by) = g.replaced_by.get(&lease_id) {
            return Err(Error::new(
                Status::StaleMetadata,
                format!("the entry of lease {lease_id} was replaced by {by}; another process registered the same rank"),
            ));
        }
        g.stats.keepalives += 1;
        Ok(())
    }

    fn deregister(&self, lease_id: u64) -> Result<()> {
        let mut g = self.lock();
        g.purge(Instant::now());
        if g.leases.remove(&lease_id).is_none() {
            return Err(Error::new(
                Status::NotRegistered,
                format!("lease {lease_id} is unknown or expired"),
            ));
        }
        g.replaced_by.remove(&lease_id);
        let n = g.entries.len();
        let mut freed = 0;
        g.entries.retain(|_, (_, l, size)| {
            let keep = *l != lease_id;
            if !keep {
                freed += *size;
            }
            keep
        });
        g.bytes -= freed;
        g.stats.deregistrations += (n - g.entries.len()) as u64;
        Ok(())
    }

    fn entries(&self, cluster: &str, role: Role) -> Result<Vec<Registration>> {
        let mut g = self.lock();
        g.purge(Instant::now());
        Ok(g.entries
            .iter()
            .filter(|((c, r, _), _)| c == cluster && *r == role)
            .map(|(_, (reg, _, _))| reg.clone())
            .collect())
    }

    fn describe(&self) -> String {
        "in-memory bootstrap store".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::schema::InstanceId;
    use crate::layout::Topology;

    fn reg(cluster: &str, tp: u32, tp_size: u32) -> Registration {
        let mut t = Topology::single_mla(64, 2, 1152);
        t.attn_tp_size = tp_size;
        t.attn_tp_rank = tp;
        Registration::new(cluster, Role::Prefill, InstanceId::random().unwrap(), t)
    }

    #[test]
    fn reregistration_replaces_and_bumps_epoch() {
        let s = MemStore::new();
        let ttl = Duration::from_secs(10);
        let a = s.register(&reg("c", 0, 2), ttl).unwrap();
        let r2 = reg("c", 0, 2);
        let b = s.register(&r2, ttl).unwrap();
        assert!(b.epoch > a.epoch && b.replaced && !a.replaced);
        let sum = s.summary("c", Role::Prefill).unwrap();
        assert_eq!((sum.registered_ranks, sum.expected_ranks), (1, 2));
        assert_eq!(sum.ranks[0].instance_id, r2.instance_id);
        // The replaced owner learns it on its next keep-alive.
        let e = s.keepalive(a.lease_id).unwrap_err();
        assert_eq!(e.status(), Status::StaleMetadata);
        assert!(e.detail().contains(&r2.instance_id.to_string()));
        s.keepalive(b.lease_id).unwrap();
        // Deregistering the replaced lease leaves the new entry alone.
        s.deregister(a.lease_id).unwrap();
        assert_eq!(s.entries("c", Role::Prefill).unwrap().len(), 1);
        s.deregister(b.lease_id).unwrap();
        assert!(s.entries("c", Role::Prefill).unwrap().is_empty());
        assert_eq!(s.stats().deregistrations, 1);
    }

    #[test]
    fn entries_expire_without_keepalive() {
        let s = MemStore::new();
        let ttl = Duration::from_millis(150);
        let a = s.register(&reg("c", 0, 2), ttl).unwrap();
        let b = s.register(&reg("c", 1, 2), ttl).unwrap();
        let start = Instant::now();
        // Keep only b alive, for 3 TTLs.
        while start.elapsed() < Duration::from_millis(450) {
            std::thread::sleep(Duration::from_millis(40));
            s.keepalive(b.lease_id).unwrap();
        }
        let e = s.entries("c", Role::Prefill).unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].epoch, b.epoch);
        assert_eq!(
            s.keepalive(a.lease_id).unwrap_err().status(),
            Status::NotRegistered
        );
        assert_eq!(s.stats().expirations, 1);
    }

    #[test]
    fn the_entry_cap_refuses_new_keys_but_not_replacements() {
        let s = MemStore::with_max_entries(2);
        let ttl = Duration::from_secs(10);
        s.register(&reg("c", 0, 4), ttl).unwrap();
        s.register(&reg("c", 1, 4), ttl).unwrap();
        let e = s.register(&reg("c", 2, 4), ttl).unwrap_err();
        assert_eq!(e.status(), Status::Bootstrap);
        assert!(e.detail().contains("full"), "{}", e.detail());
        assert!(s.register(&reg("c", 1, 4), ttl).unwrap().replaced);
        assert_eq!(s.stats().entries, 2);
    }

    #[test]
    fn the_byte_bound_counts_replacements_once_and_expiry_frees() {
        let one = serde_json::to_vec(&reg("c", 0, 4)).unwrap().len();
        // room for two entries (the store adds an epoch and a timestamp: a few
        // dozen bytes more than this)
        let s = MemStore::with_limits(100, 2 * one + one / 2);
        let ttl = Duration::from_secs(10);
        s.register(&reg("c", 0, 4), ttl).unwrap();
        let b = s
            .register(&reg("c", 1, 4), Duration::from_millis(200))
            .unwrap();
        let e = s.register(&reg("c", 2, 4), ttl).unwrap_err();
        assert_eq!(e.status(), Status::StoreFull);
        assert!(e.detail().contains("--max-store-bytes"), "{}", e.detail());
        // a replacement's bytes take the place of the old entry's
        for _ in 0..5 {
            assert!(s.register(&reg("c", 0, 4), ttl).unwrap().replaced);
        }
        let st = s.stats();
        assert_eq!(st.entries, 2);
        assert!(st.bytes as usize <= 2 * one + 64, "{st:?}");
        // expiry frees the bytes
        std::thread::sleep(Duration::from_millis(300));
        assert!(s.stats().bytes as usize <= one + 32);
        assert_eq!(
            s.keepalive(b.lease_id).unwrap_err().status(),
            Status::NotRegistered
        );
        let c = s.register(&reg("c", 2, 4), ttl).unwrap();
        assert_eq!(s.entries("c", Role::Prefill).unwrap().len(), 2);
        // and so does deregistration
        s.deregister(c.lease_id).unwrap();
        assert!(s.stats().bytes as usize <= one + 32);
    }

    #[test]
    fn clusters_are_isolated_and_bad_input_changes_nothing() {
        let s = MemStore::new();
        let ttl = Duration::from_secs(10);
        s.register(&reg("blue", 0, 1), ttl).unwrap();
        s.register(&reg("green", 0, 1), ttl).unwrap();
        assert_eq!(s.entries("blue", Role::Prefill).unwrap().len(), 1);
        assert!(s.entries("blue", Role::Decode).unwrap().is_empty());
        let mut bad = reg("blue", 0, 1);
        bad.topology.dcp_rank = 5;
        assert!(s.register(&bad, ttl).is_err());
        assert!(s
            .register(&reg("blue", 0, 1), Duration::from_millis(1))
            .is_err());
        assert_eq!(s.stats().registrations, 2);
        assert!(s.summary("blue", Role::Prefill).unwrap().ready);
    }
}
