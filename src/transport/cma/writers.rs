//! The writer threads a large cma batch is split over: the connection's
//! writer thread and `threads - 1` helpers started with the connection, so
//! a batch costs two channel hand-offs per helper, not a thread spawn.

use super::peer::PeerProcess;
use crate::error::{Error, Result, Status};
use crate::transport::piece::Piece;
use crossbeam::channel::{bounded, unbounded, Sender};
use std::sync::Arc;

/// One group of a batch's pieces for a helper, and where its outcome goes.
struct Task {
    pieces: Vec<Piece>,
    read: bool,
    done: Sender<Result<u64>>,
}

/// See the module documentation.
pub(super) struct Writers {
    helpers: Option<Sender<Task>>,
    threads: usize,
}

impl Writers {
    /// One thread: the caller's.
    pub(super) fn single() -> Writers {
        Writers {
            helpers: None,
            threads: 1,
        }
    }

    /// The caller's thread and `threads - 1` helpers writing into `peer`;
    /// they end when this value drops.
    pub(super) fn start(peer: &Arc<PeerProcess>, threads: usize) -> Result<Writers> {
        if threads <= 1 {
            return Ok(Writers::single());
        }
        let (tx, rx) = unbounded::<Task>();
        for i in 1..threads {
            let (rx, p) = (rx.clone(), peer.clone());
            crate::threads::spawn(format!("pdxfer-cma-w{i}"), move || {
                for t in rx {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        p.xfer(&t.pieces, t.read)
                    }))
                    .unwrap_or_else(|_| {
                        Err(Error::new(
                            Status::BatchFailed,
                            "a cma writer thread panicked",
                        ))
                    });
                    let _ = t.done.send(r);
                }
            })?;
        }
        Ok(Writers {
            helpers: Some(tx),
            threads,
        })
    }

    /// Threads a batch may be split over.
    pub(super) fn threads(&self) -> usize {
        self.threads
    }

    /// Moves `groups` (disjoint pieces of one batch): the first on this
    /// thread, the others on the helpers (on this thread too where a helper
    /// is gone); the bytes moved, or the last error.
    pub(super) fn xfer(
        &self,
        peer: &PeerProcess,
        groups: Vec<Vec<Piece>>,
        read: bool,
    ) -> Result<u64> {
        let mut groups = groups.into_iter();
        let Some(first) = groups.next() else {
            return Ok(0);
        };
        let (done_tx, done_rx) = bounded::<Result<u64>>(self.threads);
        let mut handed = 0usize;
        let mut here: Vec<Vec<Piece>> = Vec::new();
        for g in groups {
            let task = Task {
                pieces: g,
                read,
                done: done_tx.clone(),
            };
            match &self.helpers {
                Some(h) => match h.send(task) {
                    Ok(()) => handed += 1,
                    Err(e) => here.push(e.into_inner().pieces),
                },
                None => here.push(task.pieces),
            }
        }
        let mut sum = 0u64;
        let mut err = None;
        for g in std::iter::once(first).chain(here) {
            match peer.xfer(&g, read) {
                Ok(n) => sum += n,
                Err(e) => err = Some(e),
            }
        }
        // every helper answers (its pieces point into memory this batch pins)
        for _ in 0..handed {
            match done_rx.recv() {
                Ok(Ok(n)) => sum += n,
                Ok(Err(e)) => err = Some(e),
                Err(_) => {
                    err = Some(Error::new(
                        Status::BatchFailed,
                        "a cma writer thread is gone",
                    ))
                }
            }
        }
        err.map_or(Ok(sum), Err)
    }
}
