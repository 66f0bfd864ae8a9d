//! Test knobs of an agent: behaviour that only tests and fixtures change. The
//! type exists only with `cfg(test)` or the `testing` feature, so a product
//! build (and the C ABI and Python on top of it) cannot set any of them.

use crate::transport::rdma::nic::NicProvider;
use std::sync::Arc;
use std::time::Duration;

/// Test knobs of an [`Agent`](super::Agent), set through
/// [`AgentOptions::testing`](super::AgentOptions::testing) or
/// [`EngineConfig::testing`](crate::engine::EngineConfig::testing). The
/// default is production behaviour.
#[derive(Debug, Clone, Default)]
pub struct TestKnobs {
    /// The receiver sleeps this long before validating each new batch
    /// (simulates a stalled peer). Zero: no sleep.
    pub stall: Duration,
    /// The receiver sleeps this long before answering each RoomEnd (a
    /// decode slow to close its rooms). Zero: no sleep.
    pub room_end_stall: Duration,
    /// The RDMA NIC provider to use (e.g. the software fabric
    /// [`FakeNic`](crate::transport::rdma::fake::FakeNic)). `None` opens the
    /// real NICs through verbs when first needed.
    pub nic: Option<Arc<dyn NicProvider>>,
    /// Never treat a peer as on this host when choosing a transport
    /// automatically (so two agents of one process can test the cross-host
    /// choice).
    pub deny_same_host: bool,
    /// Engine transport nccl: the NCCL plan options this engine plans with
    /// instead of the defaults (a peer planning with others sees
    /// `nccl_plan_mismatch`).
    pub nccl_plan: Option<crate::transport::nccl::NcclPlanOptions>,
    /// Engine transport nccl, decode: the chunks of these rooms are accepted
    /// but their recvs are never posted (a decode that never posts).
    pub nccl_never_post_rooms: Vec<u64>,
    /// Engine transport nccl, prefill: the chunks of these rooms are
    /// accepted by the decode but their sends are never posted (the decode's
    /// recvs stay in flight).
    pub nccl_never_send_rooms: Vec<u64>,
    /// Engine transport nccl, prefill: the chunks of these rooms plan,
    /// gather and name these decode pages instead of those the decode's
    /// metadata gave (a prefill that names another room's pages).
    pub nccl_forge_dst_pages: Vec<(u64, Vec<u64>)>,
    /// Engine, decode: dial this address for every prefill's control
    /// endpoint instead of the one its bootstrap entry advertises (an
    /// on-path relay in front of the prefill).
    pub ctl_via: Option<String>,
    /// Engine, prefill: once the KV bytes its workers submitted over tcp
    /// reach this count (counted down, shared by every engine holding a
    /// clone), the data connection that took the last of them is closed
    /// right after its submit, once (a tcp link broken in the middle of a
    /// room). `None`: never.
    pub sever_tcp_data_after: Option<Arc<std::sync::atomic::AtomicU64>>,
}
