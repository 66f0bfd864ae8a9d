//! Standing grants, sender side: the receiver's regions a cma connection may
//! write without a per-batch intent, for the connection's life
//! (`StandingGrant`), until the receiver revokes one (`Revoke`, sent when an
//! unregister of it begins). A batch whose every destination region is
//! granted holds a [`Ticket`] while its bytes move; a revoke closes the
//! region to new batches, waits for the tickets on it and answers `Fenced`,
//! after which no byte of this connection reaches the region. The bounds of
//! every op are checked against the peer's descriptors before (as for any
//! batch): a refused batch writes nothing.

use super::piece::Piece;
use crate::error::{Error, Result, Status};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One granted region: whether new batches may use it, and how many hold it.
#[derive(Default)]
struct Slot {
    open: bool,
    inflight: u32,
}

/// The standing grants of one connection (sender side).
#[derive(Default)]
pub(crate) struct StandingRegions {
    m: Mutex<HashMap<u64, Slot>>,
    idle: Condvar,
}

/// A batch's hold on its destination regions' standing grants; dropped once
/// its bytes were written (or failed).
pub(crate) struct Ticket {
    owner: Arc<StandingRegions>,
    regions: Vec<u64>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut m = self.owner.lock();
        for r in &self.regions {
            if let Some(s) = m.get_mut(r) {
                s.inflight = s.inflight.saturating_sub(1);
            }
        }
        drop(m);
        self.owner.idle.notify_all();
    }
}

impl StandingRegions {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Slot>> {
        self.m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The receiver granted these regions for the connection's life.
    pub(crate) fn grant(&self, regions: &[u64]) {
        let mut m = self.lock();
        for &r in regions {
            m.entry(r).or_default().open = true;
        }
    }

    /// A ticket for a batch whose every piece lands in a granted region, or
    /// `None` (the batch then takes the per-batch grant).
    pub(crate) fn admit(self: &Arc<Self>, pieces: &[Piece]) -> Option<Ticket> {
        if pieces.is_empty() {
            return None;
        }
        let mut regions: Vec<u64> = pieces.iter().map(|p| p.region).collect();
        regions.sort_unstable();
        regions.dedup();
        let mut m = self.lock();
        if !regions.iter().all(|r| m.get(r).is_some_and(|s| s.open)) {
            return None;
        }
        for r in &regions {
            if let Some(s) = m.get_mut(r) {
                s.inflight += 1;
            }
        }
        Some(Ticket {
            owner: self.clone(),
            regions,
        })
    }

    /// Revokes the standing grant of `region`: no new batch is admitted into
    /// it, and this returns once the batches holding it finished (`Timeout`
    /// after `timeout`, the region still closed to new batches).
    pub(crate) fn revoke(&self, region: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut m = self.lock();
        if let Some(s) = m.get_mut(&region) {
            s.open = false;
        }
        loop {
            let inflight = m.get(&region).map_or(0, |s| s.inflight);
            if inflight == 0 {
                m.remove(&region);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    Status::Timeout,
                    format!(
                        "{inflight} batch(es) under the standing grant of region {region} \
                         still writing after {timeout:?}"
                    ),
                ));
            }
            m = self
                .idle
                .wait_timeout(m, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether `region` is granted and open to new batches.
    #[cfg(test)]
    pub(crate) fn is_open(&self, region: u64) -> bool {
        self.lock().get(&region).is_some_and(|s| s.open)
    }
}

/// Encodes a list of region ids (StandingGrant).
pub fn encode_regions(regions: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 8 * regions.len());
    b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        b.extend_from_slice(&r.to_le_bytes());
    }
    b
}

/// Decodes a list of region ids (StandingGrant); `Protocol` when malformed.
pub fn decode_regions(p: &[u8]) -> Result<Vec<u64>> {
    let bad = || Error::new(Status::Protocol, "malformed standing grant region list");
    let n = p.get(..4).ok_or_else(bad)?;
    let n = u32::from_le_bytes(n.try_into().map_err(|_| bad())?) as usize;
    let rest = &p[4..];
    if rest.len() != n.checked_mul(8).ok_or_else(bad)? {
        return Err(bad());
    }
    Ok(rest
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(region: u64) -> Piece {
        Piece {
            src: 0,
            region,
            offset: 0,
            dst: 0,
            len: 1,
        }
    }

    #[test]
    fn only_batches_into_granted_regions_are_admitted() {
        let s = Arc::new(StandingRegions::default());
        assert!(s.admit(&[piece(1)]).is_none(), "nothing granted yet");
        s.grant(&[1, 2]);
        assert!(s.admit(&[piece(1), piece(2)]).is_some());
        assert!(
            s.admit(&[piece(1), piece(3)]).is_none(),
            "region 3 not granted"
        );
        assert!(s.admit(&[]).is_none());
    }

    #[test]
    fn revoke_waits_for_the_batches_in_flight_and_admits_no_new_one() {
        let s = Arc::new(StandingRegions::default());
        s.grant(&[1, 2]);
        let t = s.admit(&[piece(1)]).unwrap();
        let e = s.revoke(1, Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.status(), Status::Timeout, "{e}");
        assert!(!s.is_open(1));
        assert!(s.admit(&[piece(1)]).is_none(), "closed to new batches");
        assert!(s.is_open(2), "other regions stay granted");
        let s2 = s.clone();
        let h = std::thread::spawn(move || s2.revoke(1, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!h.is_finished(), "the revoke waits for the batch");
        drop(t);
        h.join().unwrap().unwrap();
        assert!(s.admit(&[piece(1)]).is_none());
    }

    #[test]
    fn region_lists_round_trip_and_malformed_ones_are_refused() {
        let b = encode_regions(&[3, 9, u64::MAX]);
        assert_eq!(decode_regions(&b).unwrap(), vec![3, 9, u64::MAX]);
        assert_eq!(
            decode_regions(&encode_regions(&[])).unwrap(),
            Vec::<u64>::new()
        );
        for bad in [&b[..b.len() - 1], &b[..3], &[9, 0, 0, 0, 1][..]] {
            assert_eq!(decode_regions(bad).unwrap_err().status(), Status::Protocol);
        }
    }
}
