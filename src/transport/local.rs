//! Same-process transport: validated `memcpy` between two agents' regions.

use super::batch::{BatchTable, Stage};
use super::conn::{checksum_pieces, validate_ops, Reach};
use super::identity::ProcIdentity;
use super::{
    BatchId, BatchOptions, BatchStatus, Completion, ReadOp, Transport, TransportKind, WriteOp,
};
use crate::error::Result;
use crate::memory::{RegionDesc, Registry};
use std::sync::Arc;
use std::time::Duration;

/// What a local transport needs from the agent it writes into.
pub(crate) trait LocalTarget: Send + Sync {
    /// The target's registry (destinations are checked and pinned in it).
    fn registry(&self) -> &Registry;
    /// Hands the target a completion record, as its receiver would.
    fn deliver(&self, peer: ProcIdentity, session: u64, completion: Completion);
}

/// Writes into another agent of this process with `memcpy`; the target's
/// registry is checked and its regions pinned for every op.
pub struct LocalTransport {
    src: Registry,
    me: ProcIdentity,
    target: Arc<dyn LocalTarget>,
    table: BatchTable,
}

impl LocalTransport {
    pub(crate) fn new(src: Registry, me: ProcIdentity, target: Arc<dyn LocalTarget>) -> Self {
        LocalTransport {
            src,
            me,
            target,
            table: BatchTable::default(),
        }
    }
}

impl Transport for LocalTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    fn remote_regions(&self) -> Vec<RegionDesc> {
        self.target.registry().descriptors()
    }

    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId> {
        let dst = self.target.registry();
        let (pieces, guards, bytes) =
            validate_ops(&self.src, |id| dst.get(id).ok(), ops, Reach::Host)?;
        // Pin the destinations for the copy (the descriptors could be stale).
        let mut pins = Vec::with_capacity(pieces.len());
        for p in &pieces {
            pins.push(dst.acquire(p.region, p.offset, p.len)?);
        }
        for (p, g) in pieces.iter().zip(&pins) {
            // SAFETY: the source range is pinned in our registry, the destination by g; regions never overlap within one registry, and ranges of two registries of one process are checked as distinct regions by their owners.
            unsafe { std::ptr::copy(p.src as *const u8, g.addr() as *mut u8, p.len as usize) };
        }
        drop(pins);
        let checksum = opts.checksum.then(|| checksum_pieces(&pieces));
        let c = Completion {
            batch_id: BatchId(0),
            bytes,
            checksum,
            room: opts.room,
            epoch: opts.epoch,
        };
        let id = self.table.insert(opts.timeout, c, guards)?;
        self.table.set(id, Stage::Done);
        let done = Completion {
            batch_id: BatchId(id),
            ..c
        };
        self.target.deliver(self.me.clone(), 0, done);
        Ok(BatchId(id))
    }

    fn submit_reads(&self, ops: &[ReadOp], opts: &BatchOptions) -> Result<BatchId> {
        let dst = self.target.registry();
        let w: Vec<WriteOp> = ops.iter().map(ReadOp::as_write).collect();
        let (pieces, guards, bytes) =
            validate_ops(&self.src, |id| dst.get(id).ok(), &w, Reach::Host)?;
        let mut pins = Vec::with_capacity(pieces.len());
        for p in &pieces {
            pins.push(dst.acquire(p.region, p.offset, p.len)?);
        }
        let mut sum = 0u64;
        for (p, g) in pieces.iter().zip(&pins) {
            // SAFETY: the peer range is pinned by g, the local destination by the batch guards; distinct registered regions.
            unsafe { std::ptr::copy(g.addr() as *const u8, p.src as *mut u8, p.len as usize) };
            if opts.checksum {
                // SAFETY: the local range was just written and stays pinned.
                let d = unsafe { std::slice::from_raw_parts(p.src as *const u8, p.len as usize) };
                sum = super::checksum::combine(sum, super::checksum::piece(p.region, p.offset, d));
            }
        }
        drop(pins);
        let c = Completion {
            batch_id: BatchId(0),
            bytes,
            checksum: opts.checksum.then_some(sum),
            room: opts.room,
            epoch: opts.epoch,
        };
        let id = self.table.insert(opts.timeout, c, guards)?;
        self.table.set(id, Stage::Done);
        Ok(BatchId(id))
    }

    fn poll(&self, id: BatchId) -> Result<BatchStatus> {
        self.table.poll(id)
    }

    fn wait(&self, id: BatchId, timeout: Duration) -> Result<Completion> {
        self.table.wait(id, timeout)
    }

    fn close(&self) {
        self.table.fail_all(crate::Error::new(
            crate::Status::PeerUnreachable,
            "the connection was closed by this side",
        ));
    }

    fn is_alive(&self) -> bool {
        self.table.dead().is_none()
    }
}
