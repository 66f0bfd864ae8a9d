//! A prefill engine's state without a peer process, for the engine's unit
//! tests: a real agent over registered synthetic pools, and a decode link
//! whose data connection ([`MemConn`]) applies every write (and every placed
//! batch) at once in this process into a second set of synthetic pools. No
//! bootstrap, no control plane: what it does not model is the decode side
//! (its grants, its completion records, its control messages).

use crate::bootstrap::schema::{InstanceId, PeerHello, Registration, Role};
use crate::bootstrap::store::MemStore;
use crate::engine::config::EngineConfig;
use crate::engine::control::{CtlWriter, RegionMap};
use crate::engine::decode::Decode;
use crate::engine::link::DecodeLink;
use crate::engine::path::{Conn, WritePath};
use crate::engine::prefill::Prefill;
use crate::engine::room::RoomTable;
use crate::engine::state::Shared;
use crate::engine::synthetic::SyntheticPools;
use crate::error::{Error, Result, Status};
use crate::layout::{DcpLayout, Side};
use crate::memory::RegionDesc;
use crate::transport::{
    Agent, AgentOptions, BatchId, BatchOptions, BatchStatus, Completion, MappedRegion, PlacedRange,
    Transport, TransportKind, WriteOp,
};
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub(super) const LAYERS: u32 = 3;
pub(super) const ROW: u64 = 64;
pub(super) const P: u64 = 4;
pub(super) const ROOM: u64 = 9;
/// First region id of the decode's pools (one per layer) on [`MemConn`].
pub(super) const DST_REGION: u64 = 1000;

/// A data connection inside this process: a write is copied at submit from
/// the prefill's registered region to the decode pool it names; the decode
/// pools are also mapped here (the one-copy path's `mapped_dst`).
pub(super) struct MemConn {
    local: HashMap<u64, (u64, u64)>,
    remote: HashMap<u64, (u64, u64)>,
    next: AtomicU64,
    /// Bytes written by `submit` and placed by `submit_placed`.
    pub(super) written: AtomicU64,
    pub(super) placed: AtomicU64,
}

fn range(m: &HashMap<u64, (u64, u64)>, region: u64, off: u64, len: u64) -> Result<u64> {
    match m.get(&region) {
        Some(&(addr, rlen)) if off + len <= rlen => Ok(addr + off),
        _ => Err(Error::new(
            Status::OutOfBounds,
            format!("region {region} bytes {off}+{len}"),
        )),
    }
}

impl Transport for MemConn {
    fn kind(&self) -> TransportKind {
        TransportKind::Cma
    }

    fn remote_regions(&self) -> Vec<RegionDesc> {
        Vec::new()
    }

    fn submit(&self, ops: &[WriteOp], _opts: &BatchOptions) -> Result<BatchId> {
        for op in ops {
            let src = range(&self.local, op.local_region, op.local_offset, op.len)?;
            let dst = range(&self.remote, op.remote_region, op.remote_offset, op.len)?;
            // SAFETY: both ranges were checked inside live buffers the test
            // holds (the prefill's registered regions, the decode's pools),
            // which are distinct allocations.
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, op.len as usize)
            };
            self.written.fetch_add(op.len, Ordering::Relaxed);
        }
        Ok(BatchId(self.next.fetch_add(1, Ordering::Relaxed)))
    }

    fn mapped_dst(&self, region: u64) -> Option<MappedRegion> {
        self.remote
            .get(&region)
            .map(|&(addr, len)| MappedRegion { addr, len })
    }

    fn submit_placed(
        &self,
        ranges: &[PlacedRange],
        _opts: &BatchOptions,
        place: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchId> {
        for r in ranges {
            range(&self.remote, r.remote_region, r.remote_offset, r.len)?;
        }
        place()?;
        let bytes: u64 = ranges.iter().map(|r| r.len).sum();
        self.placed.fetch_add(bytes, Ordering::Relaxed);
        Ok(BatchId(self.next.fetch_add(1, Ordering::Relaxed)))
    }

    fn poll(&self, id: BatchId) -> Result<BatchStatus> {
        Ok(BatchStatus::Done(completion(id)))
    }

    fn wait(&self, id: BatchId, _timeout: Duration) -> Result<Completion> {
        Ok(completion(id))
    }

    fn close(&self) {}

    fn is_alive(&self) -> bool {
        true
    }
}

fn completion(id: BatchId) -> Completion {
    Completion {
        batch_id: id,
        bytes: 0,
        checksum: None,
        room: ROOM,
        epoch: 1,
    }
}

/// A prefill engine's state over registered synthetic pools (and a host
/// staging of `staging` bytes), a decode's pools and the link between them.
/// Fields drop in order: the engine's state before the pools it registered.
pub(super) struct Rig {
    pub(super) prefill: Prefill,
    pub(super) conn: Arc<MemConn>,
    pub(super) link: Arc<DecodeLink>,
    pub(super) src: SyntheticPools,
    pub(super) dst: SyntheticPools,
}

/// The next decode instance id of a rig.
static INSTANCES: AtomicU64 = AtomicU64::new(1);

pub(super) fn rig(staging: u64) -> Rig {
    let src = SyntheticPools::new(LAYERS, ROW, P, 16, 2, 8).unwrap();
    let dst = SyntheticPools::new(LAYERS, ROW, P, 16, 2, 8).unwrap();
    rig_over(staging, src, dst)
}

/// A rig over the given prefill (`src`) and decode (`dst`) pools (strided
/// ones among them: their strides travel in the decode's region map).
pub(super) fn rig_over(staging: u64, src: SyntheticPools, dst: SyntheticPools) -> Rig {
    let cfg = EngineConfig::new(
        Role::Prefill,
        "path-tests",
        "http://127.0.0.1:1",
        src.topology(1, 0),
        src.kv_pools(),
    );
    let agent = Agent::new(&AgentOptions::default()).unwrap();
    let len = |p: &crate::engine::config::KvPool| p.geometry().unwrap().span();
    let pool_regions: Vec<RegionDesc> = cfg
        .pools
        .iter()
        .map(|p| {
            let (base, n) = (p.base as *mut u8, len(p) as usize);
            let reg = agent.registry();
            if p.page_stride == p.page_bytes {
                // SAFETY: the pools live in the rig, next to (and dropped after) the agent.
                unsafe { reg.register_host(base, n) }.unwrap()
            } else {
                // SAFETY: as above.
                unsafe { reg.register_host_view(base, n) }.unwrap()
            }
        })
        .collect();
    let mut staged = Vec::new();
    if staging > 0 {
        let mut buf = crate::engine::path::staged::faulted_in(staging as usize);
        // SAFETY: the buffer is kept in the engine's state with its registration.
        let desc = unsafe { agent.register_host(buf.as_mut_ptr(), buf.len()) }.unwrap();
        staged.push((buf, desc));
    }
    let mut local: HashMap<u64, (u64, u64)> = pool_regions
        .iter()
        .map(|r| (r.id, (r.addr, r.len)))
        .collect();
    local.extend(staged.iter().map(|(_, d)| (d.id, (d.addr, d.len))));
    let remote = dst
        .kv_pools()
        .iter()
        .enumerate()
        .map(|(e, p)| (DST_REGION + e as u64, (p.base, len(p))))
        .collect();
    let conn = Arc::new(MemConn {
        local,
        remote,
        next: AtomicU64::new(1),
        written: AtomicU64::new(0),
        placed: AtomicU64::new(0),
    });
    let shared = rig_shared(cfg, agent, pool_regions, staged);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ctl = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let reg = Registration::new(
        "path-tests",
        Role::Decode,
        // each rig's decode rank is another instance
        InstanceId(u128::from(INSTANCES.fetch_add(1, Ordering::Relaxed))),
        dst.topology(1, 0),
    );
    let regions = RegionMap {
        kv: (0..LAYERS)
            .map(|e| (e, DST_REGION + u64::from(e)))
            .collect(),
        kv_stride: dst
            .kv_pools()
            .iter()
            .filter(|p| p.page_stride != p.page_bytes)
            .map(|p| (p.layer_id, p.page_stride))
            .collect(),
        ..Default::default()
    };
    let link = Arc::new(DecodeLink {
        hello: PeerHello::from(&reg),
        regions,
        writer: CtlWriter::new(ctl),
        conn: Mutex::new(Conn {
            data: conn.clone(),
            path: Arc::new(WritePath::Staged {
                sender_gathers: false,
            }),
        }),
        data_addr: String::new(),
        alive: AtomicBool::new(true),
        counters: Default::default(),
    });
    Rig {
        prefill: Prefill::new(shared),
        conn,
        link,
        src,
        dst,
    }
}

pub(super) fn side(pages: &[u64]) -> Side<'_> {
    Side {
        layout: DcpLayout::sglang(P, 1).unwrap(),
        rank: 0,
        pages,
        origin: 0,
    }
}

/// A decode engine's state over registered synthetic pools (returned with
/// it; drop the state first), with no room and no prefill link.
pub(super) fn decode_state() -> (Decode, SyntheticPools) {
    let pools = SyntheticPools::new(LAYERS, ROW, P, 16, 2, 8).unwrap();
    let cfg = EngineConfig::new(
        Role::Decode,
        "decode-tests",
        "http://127.0.0.1:1",
        pools.topology(1, 0),
        pools.kv_pools(),
    );
    let agent = Agent::new(&AgentOptions::default()).unwrap();
    let pool_regions: Vec<RegionDesc> = cfg
        .pools
        .iter()
        .map(|p| {
            let len = (p.page_bytes * p.num_pages) as usize;
            // SAFETY: the pools are returned with the state, which the caller drops first.
            unsafe { agent.register_host(p.base as *mut u8, len) }.unwrap()
        })
        .collect();
    let shared = rig_shared(cfg, agent, pool_regions, Vec::new());
    (Decode::new(shared), pools)
}

/// An engine's shared state over the rig's pools: an in-memory bootstrap store,
/// no aux or state rows, no metrics responder.
fn rig_shared(
    cfg: EngineConfig,
    agent: Agent,
    pool_regions: Vec<RegionDesc>,
    staging: Vec<(Vec<u8>, RegionDesc)>,
) -> Shared {
    Shared {
        cfg,
        agent,
        store: Arc::new(MemStore::new()),
        registrar: Mutex::new(None),
        rooms: Mutex::new(RoomTable::new()),
        cv: Condvar::new(),
        pool_regions,
        aux_regions: Vec::new(),
        state_regions: Vec::new(),
        staging,
        closed: AtomicBool::new(false),
        metrics: Default::default(),
        metrics_addr: None,
        gpu_direct_logged: AtomicBool::new(false),
    }
}
