//! The copy crew of the one-copy path: a pair's rows split by destination
//! over the worker's thread and helper threads started once per engine (at
//! its first one-copy pair), so a pair of a few hundred KiB (a layer-wise
//! send's layer group) is copied by every core too, for two channel
//! hand-offs per helper and no thread spawn. The rows are sorted by
//! destination and merged into runs before they are split into four groups
//! a thread, each a contiguous stretch of the decode's rows; the threads
//! take the groups one at a time (the caller takes back what no helper took).

use crate::error::{Error, Result, Status};
use crate::layout::runs::RunMerger;
use crate::layout::Run;
use crate::relayout::CopyEntry;
use crossbeam::channel::{bounded, unbounded, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// Bytes of a pair below which the worker's thread copies it alone (a
/// hand-off to a helper costs a few microseconds: about a copy of this).
pub(super) const SPREAD_MIN_BYTES: u64 = 256 << 10;

/// Most threads one pair's copy is spread over.
const SPREAD_MAX_THREADS: usize = 8;

/// Groups a pair is cut into per thread of the crew: the threads take them
/// one at a time, so a helper the scheduler leaves off its core for a while
/// holds back one small group, not a whole share the caller must then copy
/// after its own (on a 2-core machine beside the decode ranks, the slowest
/// request's extra time).
const GROUPS_PER_THREAD: usize = 4;

/// One group of a pair's runs for a helper, and where it says it is done.
struct Task {
    entries: Arc<[CopyEntry]>,
    runs: Arc<[Run]>,
    /// Set by whoever copies the group: the helper, or the caller that
    /// takes it back once its own groups are done (a helper busy with
    /// another pair, or not scheduled on a loaded machine, then costs no
    /// wait). A helper answers only for the groups it took.
    taken: Arc<AtomicBool>,
    done: Sender<bool>,
}

/// See the module documentation.
pub(in crate::engine) struct CopyCrew {
    /// Threads a pair is split over, the worker's included.
    threads: usize,
    /// The helpers' queue, started at the first spread copy (`None`: they
    /// could not be started; the worker's thread copies alone).
    helpers: OnceLock<Option<Sender<Task>>>,
}

impl Default for CopyCrew {
    /// As many threads as the machine has cores, at most eight.
    fn default() -> CopyCrew {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        CopyCrew::new(cores.min(SPREAD_MAX_THREADS))
    }
}

impl CopyCrew {
    /// A crew of `threads` (the caller's and `threads - 1` helpers, which
    /// end when the crew drops).
    pub(in crate::engine) fn new(threads: usize) -> CopyCrew {
        CopyCrew {
            threads: threads.max(1),
            helpers: OnceLock::new(),
        }
    }

    fn helpers(&self) -> Option<&Sender<Task>> {
        self.helpers
            .get_or_init(|| {
                let (tx, rx) = unbounded::<Task>();
                for i in 1..self.threads {
                    let rx = rx.clone();
                    let started = crate::threads::spawn(format!("pdxfer-copy{i}"), move || {
                            for t in rx {
                                if t.taken.swap(true, Ordering::AcqRel) {
                                    continue;
                                }
                                let ok = std::panic::catch_unwind(|| {
                                    // SAFETY: the contract of `copy`, whose caller
                                    // waits for this answer before it returns.
                                    unsafe {
                                        crate::relayout::cpu::copy_spans_streaming(
                                            &t.entries, &t.runs,
                                        )
                                    }
                                })
                                .is_ok();
                                let _ = t.done.send(ok);
                            }
                        });
                    if let Err(e) = started {
                        log::warn!("engine: a one-copy helper thread did not start ({e}); copying on fewer threads");
                        if i == 1 {
                            return None;
                        }
                        break;
                    }
                }
                Some(tx)
            })
            .as_ref()
    }

    /// Copies every run of every entry (`bytes` in all), split by
    /// destination over the crew when the pair is at least
    /// [`SPREAD_MIN_BYTES`]; returns once every byte is copied.
    ///
    /// # Safety
    /// As [`copy_spans_streaming`](crate::relayout::cpu::copy_spans_streaming):
    /// every run of every entry readable at its source and writable at its
    /// destination, no destination byte overlapping a source byte or another
    /// destination byte.
    pub(in crate::engine) unsafe fn copy(
        &self,
        entries: &[CopyEntry],
        runs: &[Run],
        bytes: u64,
    ) -> Result<()> {
        let helpers = match self.helpers() {
            Some(h) if self.threads > 1 && bytes >= SPREAD_MIN_BYTES => h,
            _ => {
                let runs = merge_by_destination(runs);
                // SAFETY: the caller's contract (the same rows, merged).
                unsafe { crate::relayout::cpu::copy_spans_streaming(entries, &runs) };
                return Ok(());
            }
        };
        let groups = split_by_destination(runs, self.threads * GROUPS_PER_THREAD);
        // one answer per group at most: a helper never waits to answer
        let (done_tx, done_rx) = bounded::<bool>(groups.len().max(1));
        let mut groups = groups.into_iter();
        let Some(first) = groups.next() else {
            return Ok(());
        };
        let shared: Arc<[CopyEntry]> = Arc::from(entries);
        let mut handed: Vec<(Arc<AtomicBool>, Arc<[Run]>)> = Vec::new();
        let mut here: Vec<Arc<[Run]>> = vec![Arc::from(first)];
        for g in groups {
            let (runs, taken): (Arc<[Run]>, _) = (Arc::from(g), Arc::new(AtomicBool::new(false)));
            let task = Task {
                entries: shared.clone(),
                runs: runs.clone(),
                taken: taken.clone(),
                done: done_tx.clone(),
            };
            match helpers.send(task) {
                Ok(()) => handed.push((taken, runs)),
                Err(_) => here.push(runs),
            }
        }
        let copy_here = |g: &[Run]| {
            // SAFETY: a subset of the caller's rows (the groups are disjoint
            // in destination, so no two threads write the same byte).
            unsafe { crate::relayout::cpu::copy_spans_streaming(entries, g) }
        };
        for g in &here {
            copy_here(g);
        }
        // the groups no helper took yet are copied here
        let mut helped = 0usize;
        for (taken, g) in &handed {
            if taken.swap(true, Ordering::AcqRel) {
                helped += 1;
            } else {
                copy_here(g);
            }
        }
        // every helper that took a group answers before the caller's memory may go
        let mut lost = 0usize;
        for _ in 0..helped {
            if !matches!(done_rx.recv(), Ok(true)) {
                lost += 1;
            }
        }
        if lost > 0 {
            return Err(Error::new(
                Status::BatchFailed,
                format!("{lost} one-copy helper copies did not finish (a helper thread panicked); the pair's rows are incomplete"),
            ));
        }
        Ok(())
    }
}

/// `runs` sorted by destination row, merged where both sides continue.
fn merge_by_destination(runs: &[Run]) -> Vec<Run> {
    let mut sorted = runs.to_vec();
    if !sorted.is_sorted_by_key(|r| r.dst) {
        sorted.sort_unstable_by_key(|r| r.dst);
    }
    let mut out = Vec::with_capacity(sorted.len());
    let mut m = RunMerger::default();
    let mut f = |r: Run| out.push(r);
    for r in sorted.iter().filter(|r| r.len > 0) {
        m.push(r.src, r.dst, r.len, &mut f);
    }
    m.finish(&mut f);
    out
}

/// `runs` sorted by destination, merged, and cut into at most `parts`
/// groups of about equal rows (a run cut at a row where a share ends):
/// each group a stretch of destination rows, the groups in destination
/// order, every row of `runs` in exactly one.
fn split_by_destination(runs: &[Run], parts: usize) -> Vec<Vec<Run>> {
    let merged = merge_by_destination(runs);
    let rows: u64 = merged.iter().map(|r| r.len).sum();
    if rows == 0 {
        return Vec::new();
    }
    let parts = (parts.max(1) as u64).min(rows);
    let share = rows.div_ceil(parts);
    let mut out: Vec<Vec<Run>> = vec![Vec::new()];
    let mut taken = 0u64;
    for r in merged {
        let mut r = r;
        while r.len > 0 {
            if taken == share {
                out.push(Vec::new());
                taken = 0;
            }
            let n = r.len.min(share - taken);
            if let Some(g) = out.last_mut() {
                g.push(Run {
                    src: r.src,
                    dst: r.dst,
                    len: n,
                });
            }
            taken += n;
            r.src += n;
            r.dst += n;
            r.len -= n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic xorshift stream for the tables below.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Every (source row, destination row) of `runs`.
    fn rows(runs: &[Run]) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = runs
            .iter()
            .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Runs of a shuffled page table: `pages` pages of `page` rows, each
    /// source page to a distinct destination page, some pages continuing.
    fn shuffled(rng: &mut Rng, pages: u64, page: u64) -> Vec<Run> {
        let mut dst: Vec<u64> = (0..pages).collect();
        for i in (1..dst.len()).rev() {
            if rng.below(3) != 0 {
                dst.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        dst.iter()
            .enumerate()
            .map(|(i, &d)| Run {
                src: 3 * page + i as u64 * page,
                dst: d * page,
                len: page,
            })
            .collect()
    }

    #[test]
    fn the_split_covers_every_row_once_in_destination_stretches() {
        let mut rng = Rng(0x5eed);
        for (pages, page, parts) in [
            (1u64, 1u64, 4usize),
            (3, 1, 8),
            (64, 1, 3),
            (37, 16, 2),
            (200, 4, 8),
            (5, 1000, 7),
        ] {
            let runs = shuffled(&mut rng, pages, page);
            let groups = split_by_destination(&runs, parts);
            assert!(!groups.is_empty() && groups.len() <= parts);
            let all: Vec<Run> = groups.iter().flatten().copied().collect();
            assert_eq!(
                rows(&all),
                rows(&runs),
                "{pages} pages of {page}, {parts} parts"
            );
            // each group a stretch of destinations, after the previous group's
            let mut last_end = 0u64;
            for g in &groups {
                for w in g.windows(2) {
                    assert!(w[0].dst + w[0].len <= w[1].dst);
                    // merged: no two runs continue on both sides
                    assert!(!(w[0].dst + w[0].len == w[1].dst && w[0].src + w[0].len == w[1].src));
                }
                assert!(g[0].dst >= last_end);
                last_end = g.last().map_or(last_end, |r| r.dst + r.len);
            }
            // shares of about equal rows
            let total = pages * page;
            let share = total.div_ceil((parts as u64).min(total));
            for g in &groups {
                assert!(g.iter().map(|r| r.len).sum::<u64>() <= share);
            }
        }
        // a sorted, continuing table is merged into one run before it is cut
        let one: Vec<Run> = (0..10)
            .map(|i| Run {
                src: i,
                dst: 100 + i,
                len: 1,
            })
            .collect();
        assert_eq!(
            merge_by_destination(&one),
            [Run {
                src: 0,
                dst: 100,
                len: 10
            }]
        );
        assert_eq!(
            split_by_destination(&one, 2)
                .iter()
                .map(|g| g.len())
                .sum::<usize>(),
            2
        );
        assert!(split_by_destination(&[], 4).is_empty());
    }

    #[test]
    fn a_small_pair_is_copied_by_the_crew_every_byte_once() {
        let (rb, entries_n, pages) = (128u64, 3usize, 1024u64);
        let mut rng = Rng(7);
        let runs = shuffled(&mut rng, pages, 1);
        let rows_n = pages + 3;
        let src: Vec<Vec<u8>> = (0..entries_n)
            .map(|e| {
                (0..rows_n * rb)
                    .map(|i| (i as u8).wrapping_mul(13) ^ (e as u8 + 1))
                    .collect()
            })
            .collect();
        let mut dst: Vec<Vec<u8>> = (0..entries_n)
            .map(|_| vec![0u8; (pages * rb) as usize])
            .collect();
        let entries: Vec<CopyEntry> = src
            .iter()
            .zip(&mut dst)
            .map(|(s, d)| CopyEntry {
                src: s.as_ptr() as u64,
                dst: d.as_mut_ptr() as u64,
                row_bytes: rb,
                reserved: 0,
            })
            .collect();
        let bytes = pages * rb * entries_n as u64;
        // a pair far under the old 8 MiB threshold, above the crew's
        assert!((SPREAD_MIN_BYTES..8 << 20).contains(&bytes));
        let crew = CopyCrew::new(4);
        // SAFETY: every run lies inside both vectors; the destinations are distinct rows.
        unsafe { crew.copy(&entries, &runs, bytes) }.unwrap();
        assert!(crew.helpers().is_some(), "the crew's helpers started");
        for (e, (s, d)) in src.iter().zip(&dst).enumerate() {
            for r in &runs {
                let (so, dof) = ((r.src * rb) as usize, (r.dst * rb) as usize);
                assert_eq!(
                    &d[dof..dof + rb as usize],
                    &s[so..so + rb as usize],
                    "entry {e} row {}",
                    r.dst
                );
            }
        }
    }

    #[test]
    fn pairs_copied_at_once_through_one_crew_land_byte_exact() {
        // four workers share a crew of three: groups are taken by the
        // helpers or back by their caller, each row copied once
        let crew = CopyCrew::new(3);
        let (rb, rows) = (256u64, 2048u64);
        std::thread::scope(|s| {
            for w in 0..4u8 {
                let crew = &crew;
                s.spawn(move || {
                    let mut rng = Rng(u64::from(w) + 11);
                    for round in 0..10u8 {
                        let runs = shuffled(&mut rng, rows, 1);
                        let src: Vec<u8> = (0..(rows + 3) * rb)
                            .map(|i| (i as u8) ^ w.wrapping_mul(31) ^ round)
                            .collect();
                        let mut dst = vec![0u8; (rows * rb) as usize];
                        let e = [CopyEntry {
                            src: src.as_ptr() as u64,
                            dst: dst.as_mut_ptr() as u64,
                            row_bytes: rb,
                            reserved: 0,
                        }];
                        // SAFETY: every run lies inside both vectors; distinct destination rows.
                        unsafe { crew.copy(&e, &runs, rows * rb) }.unwrap();
                        for r in &runs {
                            let (so, d) = ((r.src * rb) as usize, (r.dst * rb) as usize);
                            assert_eq!(
                                &dst[d..d + rb as usize],
                                &src[so..so + rb as usize],
                                "worker {w} round {round} row {}",
                                r.dst
                            );
                        }
                    }
                });
            }
        });
    }
}
