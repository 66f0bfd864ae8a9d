//! Moves bytes between registered regions.
//!
//! One [`Transport`] trait for every byte mover: submit a batch of
//! [`WriteOp`]s, poll or wait for it with a deadline, and get a
//! [`Completion`] (batch id, bytes, optional checksum, room, epoch). The
//! receiving [`Agent`] sees the same completion record only after every byte
//! of the batch has landed, and validates every incoming write against its
//! [`Registry`](crate::memory::Registry) before touching memory.
//!
//! Implementations: [`local`] (same process), [`cma`] (same host, one-sided
//! `process_vm_writev`), [`tcp`] (several streams, no intermediate copy),
//! [`rdma`] (one-sided RDMA WRITE/READ on RC queue pairs, sliced across the
//! NICs; [`rdma::RdmaTransport`]; the only one that moves device regions,
//! through the NIC's GPUDirect RDMA path). [`Agent::connect`] chooses one
//! automatically with [`choose_auto`]: cma when the peer is on this host and
//! proves it, else rdma when both sides have a usable NIC, else tcp; a peer
//! with device-memory regions never gets cma ([`choose_auto_for`]); or it
//! takes an explicit [`TransportKind`] (an explicit cma write into a device
//! region is refused with `unsupported`).
//!
//! [`nccl`] is not a `Transport`: NCCL point-to-point plans and communicator
//! pairs, which the engine uses for [`TransportKind::Nccl`] (device pools on
//! both sides; the communicators are set up over the engine's control channel).
//!
//! [`listen`] serves every port peers can reach (the agent's data port, the
//! engine's control port) within bounds: no thread before a connection's
//! first message, bounded handshakes and connections, back-off on `EMFILE`.

mod agent;
pub mod auth_exchange;
mod batch;
pub mod checksum;
pub mod cma;
mod conn;
pub mod control_counts;
mod frame_type;
pub mod handshake;
pub mod http_serve;
pub mod identity;
pub mod landed;
pub mod listen;
pub mod local;
pub mod nccl;
pub mod peer_auth;
mod piece;
pub mod room;
mod standing;
// Nothing in the RDMA transport crosses the C ABI: keep its items out of pdxfer.h.
/// cbindgen:ignore
pub mod rdma;
pub mod tcp;
#[cfg(test)]
pub(crate) mod testing;
pub mod wire;

#[cfg(any(test, feature = "testing"))]
pub use agent::TestKnobs;
pub use agent::{
    auth_mode, check_listener, tcp_encrypt, Agent, AgentOptions, ConnectOptions, Incoming,
    CLUSTER_SECRET_ENV, TCP_ENCRYPT_ENV,
};
pub use identity::ProcIdentity;

use crate::error::Result;
use crate::memory::RegionDesc;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One write: `len` bytes from `local_offset` of local region `local_region`
/// to `remote_offset` of the peer's region `remote_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WriteOp {
    /// Source region id in this process's registry.
    pub local_region: u64,
    /// Offset inside the source region.
    pub local_offset: u64,
    /// Destination region id in the peer's registry.
    pub remote_region: u64,
    /// Offset inside the destination region.
    pub remote_offset: u64,
    /// Bytes to write.
    pub len: u64,
}

/// One read: `len` bytes from `remote_offset` of the peer's region
/// `remote_region` into `local_offset` of local region `local_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadOp {
    /// Destination region id in this process's registry.
    pub local_region: u64,
    /// Offset inside the destination region.
    pub local_offset: u64,
    /// Source region id in the peer's registry.
    pub remote_region: u64,
    /// Offset inside the source region.
    pub remote_offset: u64,
    /// Bytes to read.
    pub len: u64,
}

impl WriteOp {
    pub(crate) fn as_read(&self) -> ReadOp {
        ReadOp {
            local_region: self.local_region,
            local_offset: self.local_offset,
            remote_region: self.remote_region,
            remote_offset: self.remote_offset,
            len: self.len,
        }
    }
}

impl ReadOp {
    pub(crate) fn as_write(&self) -> WriteOp {
        WriteOp {
            local_region: self.local_region,
            local_offset: self.local_offset,
            remote_region: self.remote_region,
            remote_offset: self.remote_offset,
            len: self.len,
        }
    }
}

/// A peer's region mapped into this process (see [`Transport::mapped_dst`]):
/// byte `k` of the region is at `addr + k` here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappedRegion {
    /// Address of the region's first byte in this process.
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
}

/// One destination range of a batch whose bytes the caller places itself
/// (see [`Transport::submit_placed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlacedRange {
    /// Destination region id in the peer's registry.
    pub remote_region: u64,
    /// Offset inside the destination region.
    pub remote_offset: u64,
    /// Bytes the caller places there.
    pub len: u64,
}

/// Identifies a submitted batch on the peer connection that accepted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BatchId(pub u64);

/// Per-batch options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// The batch fails with `Timeout` when it has not completed this long after submission.
    pub timeout: Duration,
    /// Compute a checksum over the written bytes; the receiver recomputes it
    /// over the landed bytes and fails the batch on a mismatch.
    pub checksum: bool,
    /// Caller tag carried to the receiver's completion (the engine's room id).
    pub room: u64,
    /// Caller epoch carried to the receiver's completion.
    pub epoch: u64,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            timeout: Duration::from_secs(30),
            checksum: false,
            room: 0,
            epoch: 0,
        }
    }
}

/// The completion record of a batch, identical on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Completion {
    /// The batch.
    pub batch_id: BatchId,
    /// Bytes written.
    pub bytes: u64,
    /// Checksum over the written pieces, when requested.
    pub checksum: Option<u64>,
    /// Caller tag (room id).
    pub room: u64,
    /// Caller epoch.
    pub epoch: u64,
}

impl Completion {
    /// The record of a batch not yet numbered (the batch table assigns its id).
    pub(crate) fn pending(bytes: u64, checksum: Option<u64>, opts: &BatchOptions) -> Completion {
        Completion {
            batch_id: BatchId(0),
            bytes,
            checksum,
            room: opts.room,
            epoch: opts.epoch,
        }
    }
}

/// Where a batch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchStatus {
    /// Still moving.
    Pending,
    /// Every byte landed and the receiver accepted the completion.
    Done(Completion),
    /// The batch failed; the error names the reason (peer died, refused,
    /// deadline passed, checksum mismatch).
    Failed(crate::Error),
}

/// Which byte mover to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Choose ([`choose_auto`]): cma when the kernel names the peer as a
    /// process of this host and this uid (the listener of its cma binding
    /// socket, by `SO_PEERCRED`; pidfd, start time), else rdma when
    /// both sides have a usable RDMA NIC, else tcp; never cma when the peer
    /// registered device memory ([`choose_auto_for`]). When rdma is chosen but
    /// its handshake fails (NICs that cannot negotiate), tcp is used and the
    /// reason logged.
    Auto,
    /// Same process.
    Local,
    /// Same host, `process_vm_writev`.
    Cma,
    /// TCP streams.
    Tcp,
    /// RDMA: one-sided WRITE/READ on RC queue pairs. Explicitly chosen
    /// without a usable NIC here: `NoRdmaDevice` with the reason; when the
    /// peer has none: `TransportUnavailable` naming the peer's reason.
    /// Moves host and device regions (device ones where the NIC has
    /// GPUDirect RDMA, `NoGpuDirect` with the reason otherwise).
    Rdma,
    /// NCCL point-to-point, for engines with KV pools in device memory on
    /// both sides: a two-rank communicator per (prefill rank, decode rank)
    /// link, the decode posting the recvs (see [`nccl`]). An engine choice,
    /// not a [`Transport`]: the aux and state rows of such an engine move
    /// over the automatic choice, and [`choose_auto`] never picks nccl.
    /// Without NCCL or a CUDA driver: `NoNccl` / `NoCudaDriver`.
    Nccl,
}

impl TransportKind {
    /// The lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Local => "local",
            TransportKind::Cma => "cma",
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
            TransportKind::Nccl => "nccl",
        }
    }

    /// Parses a name (`auto`, `local`, `cma`, `tcp`, `rdma`, `nccl`).
    pub fn parse(s: &str) -> Result<TransportKind> {
        Ok(match s {
            "auto" => TransportKind::Auto,
            "local" => TransportKind::Local,
            "cma" => TransportKind::Cma,
            "tcp" => TransportKind::Tcp,
            "rdma" => TransportKind::Rdma,
            "nccl" => TransportKind::Nccl,
            _ => {
                return Err(crate::Error::invalid(format!(
                    "unknown transport {s:?} (auto, local, cma, tcp, rdma, nccl)"
                )))
            }
        })
    }
}

/// The automatic transport choice: cma when the peer is on this host and
/// proved it (`same_host`), else rdma when both this side (`local_nic`) and
/// the peer (`peer_nic`) have a usable RDMA NIC, else tcp.
pub fn choose_auto(same_host: bool, local_nic: bool, peer_nic: bool) -> TransportKind {
    if same_host {
        TransportKind::Cma
    } else if local_nic && peer_nic {
        TransportKind::Rdma
    } else {
        TransportKind::Tcp
    }
}

/// [`choose_auto`] for a peer whose registered regions include device
/// memory (`peer_device`): cma writes with `process_vm_writev`, which cannot
/// reach CUDA device memory, so such a peer gets rdma when both sides have a
/// usable NIC and the peer's NICs take GPU memory (GPUDirect; the agent passes
/// `peer_nic = false` otherwise), and tcp otherwise (its receiver copies into
/// device memory), even on the same host.
pub fn choose_auto_for(
    same_host: bool,
    local_nic: bool,
    peer_nic: bool,
    peer_device: bool,
) -> TransportKind {
    if peer_device {
        choose_auto(false, local_nic, peer_nic)
    } else {
        choose_auto(same_host, local_nic, peer_nic)
    }
}

/// A connection to one peer over one byte mover.
///
/// Every method is thread-safe. Batches are independent: a failed batch
/// never blocks later ones, and a dead peer fails its batches (with the
/// reason) within their deadlines.
pub trait Transport: Send + Sync {
    /// The byte mover in use.
    fn kind(&self) -> TransportKind;

    /// How bytes move on this connection, in words (for reports and benches).
    fn data_path(&self) -> &'static str {
        self.kind().name()
    }

    /// The peer's region descriptors (as of the handshake).
    fn remote_regions(&self) -> Vec<RegionDesc>;

    /// Submits a batch of writes. Every op is checked against the local
    /// registry and the peer's descriptors first; an out-of-bounds op fails
    /// the call with `OutOfBounds` and nothing is sent.
    fn submit(&self, ops: &[WriteOp], opts: &BatchOptions) -> Result<BatchId>;

    /// Submits a batch of one-sided reads from the peer's registered memory,
    /// where the transport can (`local`, `cma`, `rdma`); the peer validates and pins
    /// the source ranges first, exactly as for writes. The completion
    /// (checksum over the bytes read, when asked) stays on this side: the
    /// peer delivers no completion record for reads. Others return `Unsupported`.
    fn submit_reads(&self, ops: &[ReadOp], opts: &BatchOptions) -> Result<BatchId> {
        let _ = (ops, opts);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!(
                "the {} transport cannot read from the peer; ask the peer to write instead",
                self.kind().name()
            ),
        ))
    }

    /// The peer's region `region` when it is mapped into this process (cma:
    /// a memfd-backed region of a same-host peer), so a caller can place a
    /// batch's bytes itself ([`submit_placed`](Self::submit_placed)); `None`
    /// for every other region and transport. The address stays valid while
    /// this transport lives.
    fn mapped_dst(&self, region: u64) -> Option<MappedRegion> {
        let _ = region;
        None
    }

    /// Submits a batch whose bytes the caller places itself into the peer's
    /// mapped regions ([`mapped_dst`](Self::mapped_dst)): the same
    /// validation, grant, commit and completion as [`submit`](Self::submit),
    /// with `place` in place of the transport's copy. `place` is called once,
    /// on this thread, only after the peer validated and pinned every range
    /// (its grant), and must write exactly `ranges` (and only them) through
    /// the mapped addresses. Returns once the batch is committed (wait for its
    /// completion as for any batch); an error names the refusal, the grant
    /// that never came or `place`'s failure, and the batch is then gone (the
    /// peer gets no completion). A range outside a mapped region, or on a
    /// transport that maps none: `Unsupported`, nothing sent.
    fn submit_placed(
        &self,
        ranges: &[PlacedRange],
        opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        let _ = (ranges, opts, place);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!(
                "the {} transport maps no peer memory; use submit",
                self.kind().name()
            ),
        ))
    }

    /// Opens a room grant (issued by the receiver's
    /// [`Agent::grant_room`] for this side's instance) on this connection:
    /// from now on the batches whose options carry `grant.room` and `epoch`
    /// (and no checksum) are checked against the grant's ranges on this side
    /// (`OutOfBounds` naming the room for one outside it: nothing is written)
    /// and skip the per-batch exchange with the receiver. A grant for another
    /// instance is refused with `PeerIdentity`. Transports that keep the
    /// per-batch protocol (local) answer `Unsupported`; their batches are unchanged.
    fn open_room(&self, grant: &room::RoomGrant, epoch: u64) -> Result<()> {
        let _ = (grant, epoch);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!(
                "the {} transport has no room grants; its batches use the per-batch protocol",
                self.kind().name()
            ),
        ))
    }

    /// Sends the room's end now and returns without waiting for the
    /// receiver's answer; [`close_room`](Self::close_room) of the same room
    /// then waits for it (so a room closed on several connections has every
    /// end in flight at once). Transports without room grants do nothing
    /// here; their `close_room` answers.
    fn end_room(&self, room: u64, epoch: u64, timeout: Duration) -> Result<()> {
        let _ = (room, epoch, timeout);
        Ok(())
    }

    /// Closes an open room: waits (within `timeout`) for its batches, then one
    /// round trip: the receiver checks the totals, releases the grant and
    /// acknowledges once every byte landed. Fails when a batch of the room
    /// failed, or the receiver refused (revoked, expired or foreign grant).
    fn close_room(&self, room: u64, epoch: u64, timeout: Duration) -> Result<room::RoomSummary> {
        let _ = (room, epoch, timeout);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!("the {} transport has no room grants", self.kind().name()),
        ))
    }

    /// Forgets an open room without closing it (after a failure: the
    /// receiver revokes its grant itself).
    fn forget_room(&self, room: u64, epoch: u64) {
        let _ = (room, epoch);
    }

    /// Opens `grant` on this connection after an earlier connection of the
    /// room broke in its middle, and returns what the receiver says landed
    /// under it so far (over every connection): the caller sends only the
    /// rest, then counts the bytes it does not send again with
    /// [`carry_room`](Self::carry_room), so the room end names the room's
    /// whole total. tcp only (its receiver records what landed); the other
    /// transports answer `Unsupported`.
    fn resume_room(
        &self,
        grant: &room::RoomGrant,
        epoch: u64,
        timeout: Duration,
    ) -> Result<landed::Landed> {
        let _ = (grant, epoch, timeout);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!(
                "the {} transport cannot resume a room on a new connection",
                self.kind().name()
            ),
        ))
    }

    /// Counts `bytes` of the open room `(room, epoch)` as landed over an
    /// earlier connection ([`resume_room`](Self::resume_room)).
    fn carry_room(&self, room: u64, epoch: u64, bytes: u64) -> Result<()> {
        let _ = (room, epoch, bytes);
        Err(crate::Error::new(
            crate::Status::Unsupported,
            format!("the {} transport has no room grants", self.kind().name()),
        ))
    }

    /// The current status of a batch. A terminal status (`Done`, `Failed`)
    /// is returned once; the batch id is then forgotten.
    fn poll(&self, id: BatchId) -> Result<BatchStatus>;

    /// Waits up to `timeout` (and at most until the batch deadline) for the
    /// batch; `Ok` when every byte landed, else the batch's failure. A wait
    /// that times out before the batch deadline returns `Timeout` and the
    /// batch stays pending.
    fn wait(&self, id: BatchId, timeout: Duration) -> Result<Completion>;

    /// Closes the connection; pending batches fail with `PeerUnreachable`.
    fn close(&self);

    /// Whether the connection still works.
    fn is_alive(&self) -> bool;
}

impl std::fmt::Debug for dyn Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("kind", &self.kind())
            .field("alive", &self.is_alive())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_choice_prefers_cma_then_rdma_then_tcp() {
        use TransportKind::*;
        for local in [false, true] {
            for peer in [false, true] {
                assert_eq!(choose_auto(true, local, peer), Cma);
            }
        }
        assert_eq!(choose_auto(false, true, true), Rdma);
        assert_eq!(choose_auto(false, true, false), Tcp);
        assert_eq!(choose_auto(false, false, true), Tcp);
        assert_eq!(choose_auto(false, false, false), Tcp);
    }

    #[test]
    fn auto_choice_never_picks_cma_for_a_peer_with_device_regions() {
        use TransportKind::*;
        for same in [false, true] {
            assert_eq!(choose_auto_for(same, true, true, true), Rdma);
            assert_eq!(choose_auto_for(same, false, true, true), Tcp);
            assert_eq!(choose_auto_for(same, true, false, true), Tcp);
        }
        assert_eq!(choose_auto_for(true, false, false, false), Cma);
        assert_eq!(choose_auto_for(false, true, true, false), Rdma);
    }

    #[test]
    fn every_kind_parses_from_its_name_and_auto_never_picks_nccl() {
        use TransportKind::*;
        for k in [Auto, Local, Cma, Tcp, Rdma, Nccl] {
            assert_eq!(TransportKind::parse(k.name()).unwrap(), k);
        }
        let e = TransportKind::parse("nvlink").unwrap_err();
        assert!(e.detail().contains("nccl"), "{e}");
        for s in [false, true] {
            for l in [false, true] {
                for p in [false, true] {
                    for d in [false, true] {
                        assert_ne!(choose_auto_for(s, l, p, d), Nccl);
                    }
                }
            }
        }
    }
}
