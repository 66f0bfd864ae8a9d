//! [`Landed`]: the destination bytes of a granted tcp room that landed, as
//! coalesced ranges per region. The receiver keeps one per room grant,
//! across the sender's connections, so a sender that redialled in the
//! middle of a room asks what landed and sends only the rest; a byte that
//! lands twice counts once.

use crate::error::{Error, Result, Status};
use crate::transport::wire::Cursor;
use std::collections::{BTreeMap, HashMap};

/// Ranges at most in one RoomLanded answer (24 bytes each): a room's pieces
/// coalesce into far fewer (its decode pages' runs, per layer).
pub(crate) const LANDED_MAX_RANGES: usize = 1 << 20;

/// See the module documentation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Landed {
    /// Per region: range start -> range end, disjoint and not touching.
    by_region: HashMap<u64, BTreeMap<u64, u64>>,
    bytes: u64,
}

impl Landed {
    /// Bytes landed (each byte once).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Records `[offset, offset + len)` of `region` as landed; returns the
    /// bytes not recorded before.
    pub(crate) fn insert(&mut self, region: u64, offset: u64, len: u64) -> u64 {
        let Some(mut end) = offset.checked_add(len).filter(|_| len > 0) else {
            return 0;
        };
        let m = self.by_region.entry(region).or_default();
        let mut start = offset;
        let mut covered = 0u64;
        // the range that starts at or before `offset` and reaches it
        if let Some((&s, &e)) = m.range(..=offset).next_back() {
            if e >= offset {
                if e >= end {
                    return 0;
                }
                covered += e - offset;
                start = s;
                m.remove(&s);
            }
        }
        // ranges that start inside (or touch the end of) the new one
        let inside: Vec<(u64, u64)> = m.range(offset..=end).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in inside {
            covered += e.min(end) - s;
            end = end.max(e);
            m.remove(&s);
        }
        m.insert(start, end);
        let new = len - covered.min(len);
        self.bytes += new;
        new
    }

    /// The parts of `[offset, offset + len)` of `region` not landed, in
    /// order, as (offset, len).
    pub fn missing(&self, region: u64, offset: u64, len: u64) -> Vec<(u64, u64)> {
        let end = offset.saturating_add(len);
        let Some(m) = self.by_region.get(&region) else {
            return vec![(offset, len)];
        };
        let mut out = Vec::new();
        let mut at = offset;
        let first = m.range(..=offset).next_back().map(|(&s, &e)| (s, e));
        let rest = m
            .range(offset.saturating_add(1)..end)
            .map(|(&s, &e)| (s, e));
        for (s, e) in first.into_iter().chain(rest) {
            if e <= at {
                continue;
            }
            if s > at {
                out.push((at, s.min(end) - at));
            }
            at = at.max(e);
            if at >= end {
                break;
            }
        }
        if at < end {
            out.push((at, end - at));
        }
        out
    }

    /// The RoomLanded payload: `token | bytes | count | (region, offset, len) * count`.
    pub fn encode(&self, token: u64) -> Vec<u8> {
        let n: usize = self.by_region.values().map(|m| m.len()).sum();
        let mut b = Vec::with_capacity(24 + 24 * n);
        for v in [token, self.bytes, n as u64] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for (&region, m) in &self.by_region {
            for (&s, &e) in m {
                for v in [region, s, e - s] {
                    b.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        b
    }

    /// A RoomLanded payload: the token and what landed (the byte count
    /// must match the ranges).
    pub fn decode(p: &[u8]) -> Result<(u64, Landed)> {
        let mut c = Cursor::new(p, "room landed");
        let token = c.u64()?;
        let bytes = c.u64()?;
        let n = c.u64()?;
        if n > LANDED_MAX_RANGES as u64 {
            return Err(Error::new(
                Status::Protocol,
                format!("room landed: {n} ranges, at most {LANDED_MAX_RANGES}"),
            ));
        }
        let mut l = Landed::default();
        for _ in 0..n {
            let (region, offset, len) = (c.u64()?, c.u64()?, c.u64()?);
            l.insert(region, offset, len);
        }
        c.finish()?;
        if l.bytes != bytes {
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "room landed: the ranges hold {} bytes, the answer says {bytes}",
                    l.bytes
                ),
            ));
        }
        Ok((token, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_landed_twice_counts_once() {
        let mut l = Landed::default();
        assert_eq!(l.insert(1, 100, 50), 50);
        assert_eq!(l.insert(1, 100, 50), 0, "the same piece again");
        assert_eq!(l.insert(1, 120, 10), 0, "inside");
        assert_eq!(l.insert(1, 140, 20), 10, "overlapping the end");
        assert_eq!(l.insert(1, 80, 30), 20, "overlapping the start");
        assert_eq!(l.insert(1, 200, 10), 10);
        assert_eq!(
            l.insert(1, 60, 200),
            200 - 80 - 10,
            "over both, and the gap"
        );
        assert_eq!(l.insert(2, 60, 5), 5, "another region");
        assert_eq!(l.insert(1, 0, 0), 0);
        assert_eq!(l.bytes(), 200 + 5);
        assert_eq!(l.missing(1, 0, 300), [(0, 60), (260, 40)]);
        assert_eq!(l.missing(2, 0, 100), [(0, 60), (65, 35)]);
        assert_eq!(l.missing(2, 61, 2), []);
        assert_eq!(l.missing(3, 7, 9), [(7, 9)]);
    }

    #[test]
    fn missing_parts_and_landed_bytes_tile_every_range() {
        let mut l = Landed::default();
        // every third 16-byte piece of two regions, some twice
        for i in (0..300u64).step_by(3) {
            l.insert(i % 2, i * 16, 16);
            l.insert(i % 2, i * 16, 16);
        }
        for region in 0..2u64 {
            for (off, len) in [(0u64, 4800u64), (5, 77), (47, 1), (4000, 2000)] {
                let miss: u64 = l.missing(region, off, len).iter().map(|m| m.1).sum();
                let landed = (off..off + len)
                    .filter(|&b| {
                        let i = b / 16;
                        i < 300 && i % 3 == 0 && i % 2 == region
                    })
                    .count() as u64;
                assert_eq!(miss + landed, len, "region {region} {off}+{len}");
            }
        }
    }

    #[test]
    fn the_answer_round_trips_and_a_wrong_count_is_refused() {
        let mut l = Landed::default();
        l.insert(4, 0, 64);
        l.insert(4, 128, 64);
        l.insert(9, 8, 8);
        let (t, back) = Landed::decode(&l.encode(77)).unwrap();
        assert_eq!((t, &back), (77, &l));
        let mut bad = l.encode(77);
        bad[8] ^= 1;
        assert_eq!(Landed::decode(&bad).unwrap_err().status(), Status::Protocol);
        assert!(Landed::decode(&l.encode(77)[..30]).is_err());
    }
}
