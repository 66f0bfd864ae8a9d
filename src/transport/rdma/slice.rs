//! Spreading a batch across several NICs ("rails") and resolving its keys (pure).
//!
//! A batch is a list of [`Span`]s (local address, remote address, length). Memory
//! is registered on every rail, with different keys per NIC, so spans are sliced
//! across rails first ([`slice_across`], by bytes, in proportion to each rail's
//! weight, e.g. its link rate), then each rail resolves its spans into
//! [`Transfer`]s with its own lkeys and the peer's rkeys ([`RailKeys::resolve`]),
//! which also checks that every access lies inside a registered region.

use super::handshake::RemoteRegion;
use super::wr::Transfer;
use crate::error::{Error, Result, Status};
use serde::Serialize;

/// One contiguous piece to move, before keys are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Span {
    /// Local address.
    pub local_addr: u64,
    /// Remote address.
    pub remote_addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Splits `spans` across `weights.len()` rails by bytes, rail `i` getting about
/// `weight[i] / sum(weights)` of the total.
///
/// Spans keep their order within a rail. A span that crosses a rail's share
/// boundary is split there when both pieces are at least `min_split` bytes;
/// otherwise it stays whole on the rail that holds most of it. Rails with weight
/// 0 get nothing. Every input byte appears in exactly one output span.
pub fn slice_across(spans: &[Span], weights: &[u64], min_split: u64) -> Result<Vec<Vec<Span>>> {
    let rails = weights.len();
    if rails == 0 || weights.iter().all(|w| *w == 0) {
        return Err(Error::invalid(
            "no rail with a non-zero weight to slice across",
        ));
    }
    let total: u128 = spans.iter().map(|s| s.len as u128).sum();
    let wsum: u128 = weights.iter().map(|w| *w as u128).sum();
    // Cumulative end (in batch bytes) of each rail's share; the last non-empty rail
    // ends at `total` exactly.
    let mut ends = Vec::with_capacity(rails);
    let mut acc: u128 = 0;
    for w in weights {
        acc += *w as u128;
        ends.push(total * acc / wsum);
    }
    let last_rail = weights.iter().rposition(|w| *w > 0).unwrap_or(0);
    let mut out: Vec<Vec<Span>> = vec![Vec::new(); rails];
    let mut r = 0usize;
    let mut pos: u128 = 0; // bytes assigned so far
    let advance = |r: &mut usize, pos: u128| {
        while *r < last_rail && (weights[*r] == 0 || pos >= ends[*r]) {
            *r += 1;
        }
    };
    for s in spans {
        if s.len == 0 {
            continue;
        }
        let mut cur = *s;
        loop {
            advance(&mut r, pos);
            let end = if r == last_rail { total } else { ends[r] };
            let rem = cur.len as u128;
            if pos + rem <= end {
                out[r].push(cur);
                pos += rem;
                break;
            }
            let cut = (end - pos) as u64;
            let rest = cur.len - cut;
            if cut >= min_split.max(1) && rest >= min_split.max(1) {
                out[r].push(Span { len: cut, ..cur });
                pos += cut as u128;
                cur = Span {
                    local_addr: cur.local_addr + cut,
                    remote_addr: cur.remote_addr + cut,
                    len: rest,
                };
                continue;
            }
            if cut >= rest {
                // Most of it belongs here: keep it whole on this rail.
                out[r].push(cur);
                pos += rem;
                break;
            }
            // Most of it belongs to the next rails: give this rail's remainder away.
            let mut next = r + 1;
            while next < last_rail && weights[next] == 0 {
                next += 1;
            }
            out[next.min(last_rail)].push(cur);
            pos += rem;
            r = next.min(last_rail);
            break;
        }
    }
    Ok(out)
}

/// Checks that `new` ranges `(addr, len)` are non-empty, do not wrap, and overlap
/// neither each other nor `existing` ones: memory is registered once
/// ([`Status::RegionOverlap`] names both ranges otherwise).
pub fn check_new_regions(existing: &[(u64, u64)], new: &[(u64, u64)]) -> Result<()> {
    let mut all: Vec<(u64, u64, bool)> = existing.iter().map(|(a, l)| (*a, *l, false)).collect();
    for (a, l) in new {
        if *l == 0 || a.checked_add(*l).is_none() {
            return Err(Error::invalid(format!(
                "cannot register {a:#x}+{l}: empty or wraps the address space"
            )));
        }
        all.push((*a, *l, true));
    }
    all.sort_by_key(|r| r.0);
    for w in all.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.0 + a.1 > b.0 && (a.2 || b.2) {
            return Err(Error::new(
                Status::RegionOverlap,
                format!(
                    "{:#x}+{} overlaps {:#x}+{}{}: register each range once",
                    b.0,
                    b.1,
                    a.0,
                    a.1,
                    if a.2 && b.2 {
                        " (both in this call)"
                    } else {
                        " (already registered)"
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// A registered local region on one rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct LocalRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// lkey on this rail's NIC.
    pub lkey: u32,
}

/// The keys of one rail: local regions (lkeys) and the peer's regions (rkeys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailKeys {
    local: Vec<LocalRegion>,
    remote: Vec<RemoteRegion>,
}

fn find<T: Copy>(
    v: &[T],
    start: impl Fn(&T) -> u64,
    len: impl Fn(&T) -> u64,
    addr: u64,
    n: u64,
) -> Option<T> {
    let inside =
        |x: &T| addr >= start(x) && addr.checked_add(n).is_some_and(|e| e <= start(x) + len(x));
    let i = v.partition_point(|x| start(x) <= addr);
    if i > 0 && inside(&v[i - 1]) {
        return Some(v[i - 1]);
    }
    // Overlapping registrations: fall back to a scan.
    v.iter().copied().find(|x| inside(x))
}

impl RailKeys {
    /// Keys from the local regions of this rail and the peer's regions on its matching rail.
    pub fn new(mut local: Vec<LocalRegion>, mut remote: Vec<RemoteRegion>) -> Self {
        local.sort_by_key(|r| r.addr);
        remote.sort_by_key(|r| r.addr);
        RailKeys { local, remote }
    }

    /// Adds a local region registered after the keys were made (kept sorted; an
    /// exact duplicate is ignored).
    pub fn add_local(&mut self, l: LocalRegion) {
        if self.local.contains(&l) {
            return;
        }
        let i = self.local.partition_point(|r| r.addr <= l.addr);
        self.local.insert(i, l);
    }

    /// Forgets every local region overlapping `[addr, addr+len)` (deregistered:
    /// a work request with its lkey would fail the QP).
    pub fn remove_local(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        self.local
            .retain(|r| !(r.addr < end && addr < r.addr.saturating_add(r.len)));
    }

    /// Resolves one span to a transfer with this rail's keys; the whole span must lie
    /// inside one local and one remote region ([`Status::OutOfBounds`] otherwise).
    pub fn resolve(&self, s: &Span) -> Result<Transfer> {
        let l = find(&self.local, |r| r.addr, |r| r.len, s.local_addr, s.len).ok_or_else(|| {
            Error::new(
                Status::OutOfBounds,
                format!(
                    "local range {:#x}+{} is not inside one registered region ({} region(s) registered on this NIC)",
                    s.local_addr,
                    s.len,
                    self.local.len()
                ),
            )
        })?;
        let r = find(&self.remote, |r| r.addr, |r| r.len, s.remote_addr, s.len).ok_or_else(|| {
            Error::new(
                Status::OutOfBounds,
                format!(
                    "remote range {:#x}+{} is not inside one region the peer advertised ({} region(s))",
                    s.remote_addr,
                    s.len,
                    self.remote.len()
                ),
            )
        })?;
        Ok(Transfer {
            local_addr: s.local_addr,
            lkey: l.lkey,
            remote_addr: s.remote_addr,
            rkey: r.rkey,
            len: s.len,
        })
    }

    /// Resolves a list of spans, failing on the first out-of-bounds one.
    pub fn resolve_all(&self, spans: &[Span]) -> Result<Vec<Transfer>> {
        spans.iter().map(|s| self.resolve(s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(l: u64, r: u64, len: u64) -> Span {
        Span {
            local_addr: l,
            remote_addr: r,
            len,
        }
    }

    /// Every byte (local and remote address pairs) of the input appears exactly once.
    fn check_cover(input: &[Span], out: &[Vec<Span>]) {
        let mut a: Vec<(u64, u64)> = Vec::new();
        for s in input {
            for i in 0..s.len {
                a.push((s.local_addr + i, s.remote_addr + i));
            }
        }
        let mut b: Vec<(u64, u64)> = Vec::new();
        for rail in out {
            for s in rail {
                for i in 0..s.len {
                    b.push((s.local_addr + i, s.remote_addr + i));
                }
            }
        }
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
    }

    fn bytes(rail: &[Span]) -> u64 {
        rail.iter().map(|s| s.len).sum()
    }

    #[test]
    fn one_long_span_splits_evenly() {
        let input = [sp(0, 10_000, 4000)];
        let out = slice_across(&input, &[1, 1, 1, 1], 100).unwrap();
        assert_eq!(
            out.iter().map(|r| bytes(r)).collect::<Vec<_>>(),
            vec![1000; 4]
        );
        assert_eq!(out[1][0], sp(1000, 11_000, 1000));
        check_cover(&input, &out);
    }

    #[test]
    fn small_spans_stay_whole_and_balance() {
        let input: Vec<Span> = (0..40)
            .map(|i| sp(i * 1000, 50_000 + i * 1000, 64))
            .collect();
        let out = slice_across(&input, &[1, 1, 1], 1000).unwrap();
        check_cover(&input, &out);
        for rail in &out {
            assert!(rail.iter().all(|s| s.len == 64), "no span was split");
            let b = bytes(rail) as i64;
            assert!((b - 40 * 64 / 3).abs() <= 64, "{b}");
        }
        // Order is kept within each rail.
        for rail in &out {
            assert!(rail.windows(2).all(|w| w[0].local_addr < w[1].local_addr));
        }
    }

    #[test]
    fn weights_set_the_shares_and_zero_weight_rails_get_nothing() {
        let input = [sp(0, 0, 8000)];
        let out = slice_across(&input, &[1, 0, 3], 1).unwrap();
        assert_eq!(bytes(&out[0]), 2000);
        assert!(out[1].is_empty());
        assert_eq!(bytes(&out[2]), 6000);
        check_cover(&input, &out);
        let out = slice_across(&input, &[0, 0, 5], 1).unwrap();
        assert_eq!(bytes(&out[2]), 8000);
        assert!(slice_across(&input, &[], 1).is_err());
        assert!(slice_across(&input, &[0, 0], 1).is_err());
    }

    #[test]
    fn mixed_spans_cover_exactly_for_many_shapes() {
        // Deterministic pseudo-random shapes (bounded: 200 cases).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let n = (next() % 8) as usize;
            let mut input = Vec::new();
            let mut l = 0;
            for _ in 0..n {
                let len = next() % 300;
                input.push(sp(l, l + 7, len));
                l += len + 1;
            }
            let rails = 1 + (next() % 5) as usize;
            let weights: Vec<u64> = (0..rails).map(|_| next() % 4).collect();
            let min_split = next() % 64;
            match slice_across(&input, &weights, min_split) {
                Ok(out) => {
                    check_cover(&input, &out);
                    for (i, w) in weights.iter().enumerate() {
                        if *w == 0 {
                            assert!(out[i].is_empty());
                        }
                    }
                    for rail in &out {
                        assert!(rail.iter().all(|s| s.len > 0));
                    }
                }
                Err(_) => assert!(weights.iter().all(|w| *w == 0)),
            }
        }
    }

    #[test]
    fn new_regions_must_not_overlap() {
        let have = [(0x1000, 0x1000)];
        assert!(check_new_regions(&have, &[(0x2000, 0x100), (0x3000, 0x10)]).is_ok());
        let e = check_new_regions(&have, &[(0x1fff, 2)]).unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap);
        assert!(e.detail().contains("already registered"), "{e}");
        let e = check_new_regions(&[], &[(0x10, 0x10), (0x1f, 1)]).unwrap_err();
        assert!(e.detail().contains("both in this call"), "{e}");
        assert_eq!(
            check_new_regions(&[], &[(0x10, 0)]).unwrap_err().status(),
            Status::InvalidArgument
        );
        assert!(check_new_regions(&[], &[(u64::MAX, 2)]).is_err());
        // Two existing overlapping ranges are not this call's problem.
        assert!(check_new_regions(&[(0, 10), (5, 10)], &[(100, 1)]).is_ok());
    }

    #[test]
    fn resolve_uses_the_right_keys_and_checks_bounds() {
        let keys = RailKeys::new(
            vec![
                LocalRegion {
                    addr: 0x2000,
                    len: 0x1000,
                    lkey: 2,
                },
                LocalRegion {
                    addr: 0x1000,
                    len: 0x1000,
                    lkey: 1,
                },
            ],
            vec![RemoteRegion {
                addr: 0x10_0000,
                len: 0x10000,
                rkey: 99,
            }],
        );
        let t = keys.resolve(&sp(0x2100, 0x10_0100, 0x100)).unwrap();
        assert_eq!((t.lkey, t.rkey, t.len), (2, 99, 0x100));
        assert_eq!(
            keys.resolve(&sp(0x1000, 0x10_0000, 0x1000)).unwrap().lkey,
            1
        );
        // Crossing two local registrations is refused.
        let e = keys.resolve(&sp(0x1f00, 0x10_0000, 0x200)).unwrap_err();
        assert_eq!(e.status(), Status::OutOfBounds);
        assert!(e.detail().contains("local"), "{e}");
        // One byte past the peer's region.
        let e = keys
            .resolve(&sp(0x1000, 0x10_0000 + 0x10000 - 0x10, 0x11))
            .unwrap_err();
        assert!(e.detail().contains("remote"), "{e}");
        assert!(keys.resolve(&sp(u64::MAX - 1, 0x10_0000, 4)).is_err());
        // A removed (deregistered) local region no longer resolves; its neighbour does.
        let mut k2 = keys.clone();
        k2.remove_local(0x1800, 0x100);
        assert!(k2.resolve(&sp(0x1000, 0x10_0000, 1)).is_err());
        assert_eq!(k2.resolve(&sp(0x2000, 0x10_0000, 1)).unwrap().lkey, 2);
        k2.remove_local(0x1000, 0x1000);
        assert_eq!(
            k2.resolve(&sp(0x2000, 0x10_0000, 1)).unwrap().lkey,
            2,
            "adjacent, not overlapping"
        );
        assert_eq!(
            keys.resolve_all(&[sp(0x1000, 0x10_0000, 1), sp(0x2000, 0x10_0001, 1)])
                .unwrap()
                .len(),
            2
        );
    }
}
