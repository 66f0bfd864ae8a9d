//! Work-request construction (pure): turns a batch of resolved transfers into the
//! list of send work requests one QP posts, with
//! - writes longer than the port's maximum message size split into several WRs,
//! - one signalled completion every `k` WRs (and always on the last), each
//!   signalled WR recording how many send-queue slots its completion frees,
//! - a completion record last: the final WRITE carries an immediate (the batch id)
//!   as RDMA WRITE_WITH_IMM, or an extra small ordered WRITE is appended.
//!
//! The verbs layer converts [`WorkRequest`]s into linked `ibv_send_wr` lists
//! ([`post_groups`] says which runs can be posted together under a queue depth).

use crate::error::{Error, Result};
use serde::Serialize;

/// The direction of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Direction {
    /// RDMA WRITE: local memory -> remote memory.
    Write,
    /// RDMA READ: remote memory -> local memory.
    Read,
}

/// The verbs opcode of one work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Opcode {
    /// `IBV_WR_RDMA_WRITE`.
    Write,
    /// `IBV_WR_RDMA_WRITE_WITH_IMM` (consumes a receive WR on the peer).
    WriteWithImm,
    /// `IBV_WR_RDMA_READ`.
    Read,
}

/// One transfer with its keys resolved for a given NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Transfer {
    /// Local address (host VA or GPU VA inside a registered region).
    pub local_addr: u64,
    /// lkey of the local region on this NIC.
    pub lkey: u32,
    /// Remote address inside one of the peer's advertised regions.
    pub remote_addr: u64,
    /// rkey of the remote region on the peer's NIC.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u64,
}

/// How the peer learns that a write batch has fully landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CompletionRecord {
    /// Nothing (the initiator's completion is enough, e.g. for reads).
    None,
    /// The last WRITE becomes WRITE_WITH_IMM carrying this 32-bit value
    /// (the batch id); the peer sees it as a receive completion.
    Immediate(u32),
    /// A final ordered WRITE of a small record (e.g. a sequence number the
    /// receiver polls), posted after every data write of the batch on the same QP.
    FinalWrite(Transfer),
}

/// Limits a batch is built under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BatchParams {
    /// Largest message one WR may carry (the port's `max_msg_sz`; at most `u32::MAX`).
    pub max_msg: u64,
    /// Signal one completion every this many WRs (`>= 1`).
    pub signal_every: u32,
    /// The QP's send-queue depth (`max_send_wr`); `signal_every` must not exceed it.
    pub sq_depth: u32,
}

impl Default for BatchParams {
    fn default() -> Self {
        BatchParams {
            max_msg: 1 << 30,
            signal_every: 64,
            sq_depth: 1024,
        }
    }
}

/// One send work request, ready to be converted to `ibv_send_wr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct WorkRequest {
    /// `(batch << 32) | seq`: the batch id and the WR's index in the batch.
    pub wr_id: u64,
    /// The opcode.
    pub opcode: Opcode,
    /// Local address (the single SGE).
    pub local_addr: u64,
    /// Local key.
    pub lkey: u32,
    /// Length of this WR in bytes.
    pub len: u32,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Whether this WR generates a completion (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
    /// The immediate value for [`Opcode::WriteWithImm`].
    pub imm: Option<u32>,
    /// For a signalled WR: the send-queue slots its completion frees (itself and the
    /// unsignalled WRs before it since the previous signalled one); 0 otherwise.
    pub retires: u32,
}

/// Packs a batch id and sequence number into a `wr_id`.
pub fn wr_id(batch: u32, seq: u32) -> u64 {
    ((batch as u64) << 32) | seq as u64
}

/// Splits a `wr_id` into (batch id, sequence number).
pub fn split_wr_id(id: u64) -> (u32, u32) {
    ((id >> 32) as u32, id as u32)
}

/// Largest batch id an immediate completion record can carry (24 bits).
pub fn max_imm_batch() -> u32 {
    0x00ff_ffff
}

/// The immediate of a WRITE_WITH_IMM record: `batch` (24 bits) and the number of
/// rails (QPs) the batch was spread over (8 bits), so the receiver knows how many
/// records complete the batch.
pub fn imm_encode(batch: u32, rails: usize) -> Result<u32> {
    if batch > max_imm_batch() {
        return Err(Error::invalid(format!(
            "batch id {batch} does not fit the 24 bits of an immediate completion record"
        )));
    }
    if rails == 0 || rails > 255 {
        return Err(Error::invalid(format!(
            "{rails} rails; an immediate record counts 1..=255"
        )));
    }
    Ok((batch << 8) | rails as u32)
}

/// Splits an immediate into (batch id, rails).
pub fn imm_decode(imm: u32) -> (u32, usize) {
    (imm >> 8, (imm & 0xff) as usize)
}

/// Builds the work requests of one batch on one QP.
///
/// Every transfer must be non-empty and must not wrap the address space; a
/// [`CompletionRecord`] is only allowed for writes. Transfers longer than
/// `max_msg` become several WRs of at most `max_msg` bytes each.
pub fn build_batch(
    batch: u32,
    dir: Direction,
    transfers: &[Transfer],
    record: CompletionRecord,
    p: &BatchParams,
) -> Result<Vec<WorkRequest>> {
    if p.signal_every == 0 || p.signal_every > p.sq_depth {
        return Err(Error::invalid(format!(
            "signal_every {} must be in 1..=sq_depth ({}): unsignalled WRs hold send-queue slots until a signalled one completes",
            p.signal_every, p.sq_depth
        )));
    }
    let max_msg = p.max_msg.min(u32::MAX as u64);
    if max_msg == 0 {
        return Err(Error::invalid("max_msg must be > 0"));
    }
    if dir == Direction::Read && record != CompletionRecord::None {
        return Err(Error::invalid(
            "a completion record (immediate or final write) applies to write batches only",
        ));
    }
    if transfers.is_empty() && matches!(record, CompletionRecord::None) {
        return Err(Error::invalid("empty batch"));
    }
    let base_op = match dir {
        Direction::Write => Opcode::Write,
        Direction::Read => Opcode::Read,
    };
    let mut out: Vec<WorkRequest> = Vec::new();
    let push = |t: &Transfer, len: u64, off: u64, op: Opcode, out: &mut Vec<WorkRequest>| {
        out.push(WorkRequest {
            wr_id: 0,
            opcode: op,
            local_addr: t.local_addr + off,
            lkey: t.lkey,
            len: len as u32,
            remote_addr: t.remote_addr + off,
            rkey: t.rkey,
            signaled: false,
            imm: None,
            retires: 0,
        });
    };
    for (i, t) in transfers.iter().enumerate() {
        if t.len == 0 {
            return Err(Error::invalid(format!("transfer {i} has length 0")));
        }
        if t.local_addr.checked_add(t.len).is_none() || t.remote_addr.checked_add(t.len).is_none() {
            return Err(Error::invalid(format!(
                "transfer {i} ({:#x} -> {:#x}, {} bytes) wraps the address space",
                t.local_addr, t.remote_addr, t.len
            )));
        }
        let mut off = 0;
        while off < t.len {
            let n = (t.len - off).min(max_msg);
            push(t, n, off, base_op, &mut out);
            off += n;
        }
    }
    match record {
        CompletionRecord::None => {}
        CompletionRecord::Immediate(imm) => match out.last_mut() {
            Some(last) => {
                last.opcode = Opcode::WriteWithImm;
                last.imm = Some(imm);
            }
            None => {
                // No data: a zero-length WRITE_WITH_IMM still notifies the peer.
                out.push(WorkRequest {
                    wr_id: 0,
                    opcode: Opcode::WriteWithImm,
                    local_addr: 0,
                    lkey: 0,
                    len: 0,
                    remote_addr: 0,
                    rkey: 0,
                    signaled: false,
                    imm: Some(imm),
                    retires: 0,
                });
            }
        },
        CompletionRecord::FinalWrite(t) => {
            if t.len == 0 || t.len > max_msg {
                return Err(Error::invalid(format!(
                    "completion record length {} must be in 1..={max_msg}",
                    t.len
                )));
            }
            push(&t, t.len, 0, Opcode::Write, &mut out);
        }
    }
    if out.len() > u32::MAX as usize {
        return Err(Error::invalid("batch has more than 2^32 work requests"));
    }
    let k = p.signal_every as usize;
    let n = out.len();
    let mut since = 0u32;
    for (seq, w) in out.iter_mut().enumerate() {
        w.wr_id = wr_id(batch, seq as u32);
        since += 1;
        if (seq + 1) % k == 0 || seq + 1 == n {
            w.signaled = true;
            w.retires = since;
            since = 0;
        }
    }
    Ok(out)
}

/// Splits a built batch into consecutive groups that each end with a signalled WR
/// (so each group's slots come back with one completion). Each group holds at most
/// `signal_every` WRs, which [`build_batch`] checked is within the queue depth; the
/// poster posts a group as one linked list once that many slots are free.
pub fn post_groups(wrs: &[WorkRequest]) -> Vec<&[WorkRequest]> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, w) in wrs.iter().enumerate() {
        if w.signaled {
            out.push(&wrs[start..=i]);
            start = i + 1;
        }
    }
    if start < wrs.len() {
        out.push(&wrs[start..]);
    }
    out
}

/// The number of signalled completions a built batch produces.
pub fn signaled_count(wrs: &[WorkRequest]) -> usize {
    wrs.iter().filter(|w| w.signaled).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(local: u64, remote: u64, len: u64) -> Transfer {
        Transfer {
            local_addr: local,
            lkey: 11,
            remote_addr: remote,
            rkey: 22,
            len,
        }
    }

    fn params(max_msg: u64, k: u32) -> BatchParams {
        BatchParams {
            max_msg,
            signal_every: k,
            sq_depth: 128,
        }
    }

    #[test]
    fn imm_roundtrip_and_limits() {
        assert_eq!(
            imm_decode(imm_encode(0x12_3456, 3).unwrap()),
            (0x12_3456, 3)
        );
        assert!(imm_encode(1 << 24, 1).is_err());
        assert!(imm_encode(1, 0).is_err());
        assert!(imm_encode(1, 256).is_err());
    }

    #[test]
    fn wr_id_roundtrip() {
        assert_eq!(split_wr_id(wr_id(7, 9)), (7, 9));
        assert_eq!(split_wr_id(wr_id(u32::MAX, u32::MAX)), (u32::MAX, u32::MAX));
    }

    #[test]
    fn splits_long_writes_and_preserves_bytes() {
        let ts = [t(0x1000, 0x9000, 2500), t(0x10_0000, 0x20_0000, 10)];
        let w = build_batch(
            3,
            Direction::Write,
            &ts,
            CompletionRecord::None,
            &params(1000, 4),
        )
        .unwrap();
        let lens: Vec<u32> = w.iter().map(|x| x.len).collect();
        assert_eq!(lens, vec![1000, 1000, 500, 10]);
        assert_eq!(w[1].local_addr, 0x1000 + 1000);
        assert_eq!(w[2].remote_addr, 0x9000 + 2000);
        assert_eq!(w[3].local_addr, 0x10_0000);
        assert!(w
            .iter()
            .all(|x| x.opcode == Opcode::Write && x.imm.is_none()));
        assert_eq!(w.iter().map(|x| x.len as u64).sum::<u64>(), 2510);
        for (i, x) in w.iter().enumerate() {
            assert_eq!(split_wr_id(x.wr_id), (3, i as u32));
            assert_eq!((x.lkey, x.rkey), (11, 22));
        }
    }

    #[test]
    fn signals_every_k_and_the_last_with_retire_counts() {
        let ts: Vec<Transfer> = (0..10).map(|i| t(i * 100, i * 100, 100)).collect();
        let w = build_batch(
            1,
            Direction::Write,
            &ts,
            CompletionRecord::None,
            &params(1 << 20, 4),
        )
        .unwrap();
        let sig: Vec<usize> = (0..w.len()).filter(|i| w[*i].signaled).collect();
        assert_eq!(sig, vec![3, 7, 9]);
        let retires: Vec<u32> = w.iter().filter(|x| x.signaled).map(|x| x.retires).collect();
        assert_eq!(retires, vec![4, 4, 2]);
        assert_eq!(retires.iter().sum::<u32>() as usize, w.len());
        assert!(w.iter().filter(|x| !x.signaled).all(|x| x.retires == 0));
        assert_eq!(signaled_count(&w), 3);
        let groups = post_groups(&w);
        assert_eq!(
            groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        assert!(groups.iter().all(|g| g.last().unwrap().signaled));
    }

    #[test]
    fn immediate_rides_on_the_last_write() {
        let ts = [t(0, 0, 3000)];
        let w = build_batch(
            5,
            Direction::Write,
            &ts,
            CompletionRecord::Immediate(5),
            &params(1024, 64),
        )
        .unwrap();
        assert_eq!(w.len(), 3);
        assert_eq!(w[2].opcode, Opcode::WriteWithImm);
        assert_eq!(w[2].imm, Some(5));
        assert!(w[2].signaled);
        assert!(w[..2].iter().all(|x| x.opcode == Opcode::Write));
        // Empty write batch with an immediate: a zero-length notification.
        let w = build_batch(
            6,
            Direction::Write,
            &[],
            CompletionRecord::Immediate(6),
            &params(1024, 64),
        )
        .unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(
            (w[0].opcode, w[0].len, w[0].imm),
            (Opcode::WriteWithImm, 0, Some(6))
        );
    }

    #[test]
    fn final_write_is_last_and_ordered_after_data() {
        let rec = t(0xaaaa, 0xbbbb, 8);
        let ts = [t(0, 0, 100), t(100, 100, 100)];
        let w = build_batch(
            2,
            Direction::Write,
            &ts,
            CompletionRecord::FinalWrite(rec),
            &params(1024, 64),
        )
        .unwrap();
        assert_eq!(w.len(), 3);
        let last = w.last().unwrap();
        assert_eq!(
            (last.local_addr, last.remote_addr, last.len),
            (0xaaaa, 0xbbbb, 8)
        );
        assert!(last.signaled && last.opcode == Opcode::Write);
        assert!(build_batch(
            2,
            Direction::Write,
            &ts,
            CompletionRecord::FinalWrite(t(0, 0, 0)),
            &params(1024, 64)
        )
        .is_err());
    }

    #[test]
    fn reads_and_invalid_batches() {
        let ts = [t(0, 0, 10)];
        let w = build_batch(
            1,
            Direction::Read,
            &ts,
            CompletionRecord::None,
            &params(1024, 1),
        )
        .unwrap();
        assert_eq!(w[0].opcode, Opcode::Read);
        assert!(build_batch(
            1,
            Direction::Read,
            &ts,
            CompletionRecord::Immediate(1),
            &params(1024, 1)
        )
        .is_err());
        assert!(build_batch(
            1,
            Direction::Write,
            &[t(0, 0, 0)],
            CompletionRecord::None,
            &params(1024, 1)
        )
        .is_err());
        assert!(build_batch(
            1,
            Direction::Write,
            &[t(u64::MAX - 1, 0, 10)],
            CompletionRecord::None,
            &params(1024, 1)
        )
        .is_err());
        assert!(build_batch(
            1,
            Direction::Write,
            &[],
            CompletionRecord::None,
            &params(1024, 1)
        )
        .is_err());
        let mut p = params(1024, 0);
        assert!(build_batch(1, Direction::Write, &ts, CompletionRecord::None, &p).is_err());
        p.signal_every = 129;
        let e = build_batch(1, Direction::Write, &ts, CompletionRecord::None, &p).unwrap_err();
        assert!(e.detail().contains("sq_depth"), "{e}");
        assert!(build_batch(
            1,
            Direction::Write,
            &ts,
            CompletionRecord::None,
            &params(0, 1)
        )
        .is_err());
    }

    #[test]
    fn max_msg_is_capped_at_u32() {
        let ts = [t(0, 0, (u32::MAX as u64) + 10)];
        let w = build_batch(
            1,
            Direction::Write,
            &ts,
            CompletionRecord::None,
            &params(u64::MAX, 1),
        )
        .unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].len, u32::MAX);
        assert_eq!(w[1].len, 10);
    }
}
