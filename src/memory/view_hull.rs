//! The hull of interleaved pool views: the smallest range covering a view and
//! every view it overlaps, transitively (for a block-outermost KV cache, the
//! allocation its layers' pages interleave in). A NIC registers that range
//! once for all of them.

/// The hull of the views in `views` (`(addr, len)`, same address space)
/// connected by overlap to `[addr, addr + len)`; `None` when no view overlaps
/// that range. Views that only touch (one ends where the next begins) are
/// separate allocations, not one hull.
pub fn view_hull(views: &[(u64, u64)], addr: u64, len: u64) -> Option<(u64, u64)> {
    let overlaps = |a: u64, l: u64, s: u64, e: u64| a < e && s < a.saturating_add(l);
    let (mut start, mut end) = (addr, addr.saturating_add(len));
    if !views.iter().any(|&(a, l)| overlaps(a, l, start, end)) {
        return None;
    }
    // grow until no view outside overlaps the hull (views are few: one per layer)
    loop {
        let mut grew = false;
        for &(a, l) in views {
            if overlaps(a, l, start, end) && (a < start || a.saturating_add(l) > end) {
                start = start.min(a);
                end = end.max(a.saturating_add(l));
                grew = true;
            }
        }
        if !grew {
            return Some((start, end - start));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_views_share_one_hull_and_touching_ones_do_not() {
        // three layers interleaved in [0, 3000): page 100 B, stride 300 B, 10 pages
        let views = [
            (0, 2800),
            (100, 2800),
            (200, 2800),
            (5000, 400),
            (5400, 400),
        ];
        assert_eq!(view_hull(&views, 100, 2800), Some((0, 3000)));
        assert_eq!(view_hull(&views, 0, 2800), Some((0, 3000)));
        // a range inside the hull maps to it
        assert_eq!(view_hull(&views, 1000, 8), Some((0, 3000)));
        // 5000+400 and 5400+400 touch but do not overlap: two hulls
        assert_eq!(view_hull(&views, 5000, 400), Some((5000, 400)));
        assert_eq!(view_hull(&views, 5400, 400), Some((5400, 400)));
        // no view there
        assert_eq!(view_hull(&views, 3000, 2000), None);
        assert_eq!(view_hull(&[], 0, 10), None);
    }

    #[test]
    fn a_chain_of_overlaps_is_followed_transitively() {
        // a overlaps b, b overlaps c, a does not overlap c
        let views = [(0, 150), (100, 150), (200, 150)];
        assert_eq!(view_hull(&views, 0, 150), Some((0, 350)));
        assert_eq!(view_hull(&views, 300, 50), Some((0, 350)));
    }
}
