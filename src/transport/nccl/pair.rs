//! [`NcclPair`]: the two-rank communicator of one (prefill rank, decode rank)
//! pair and its lifecycle (see the module docs of `transport::nccl`).

use super::sys::{self, Comm, Nccl, NcclResult};
use super::{NcclBuffer, NcclId, NcclPlan, NcclRole};
use crate::error::{Error, Result, Status};
use cudarc::driver::sys as cu;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the clean path waits for `ncclCommFinalize` before aborting.
const FINALIZE_WAIT: Duration = Duration::from_secs(5);

/// A request to abort a pair's communicator from another thread: the
/// pair's next poll (inside [`NcclPair::connect`] or [`NcclPair::wait`])
/// calls `ncclCommAbort` and fails with [`Status::Aborted`].
#[derive(Debug, Clone, Default)]
pub struct NcclAbort(Arc<AtomicBool>);

impl NcclAbort {
    /// A fresh, unset flag.
    pub fn new() -> NcclAbort {
        NcclAbort::default()
    }

    /// Asks the pair to abort.
    pub fn abort(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once [`abort`](Self::abort) was called.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

fn no_driver() -> Error {
    Error::new(
        Status::NoCudaDriver,
        "no CUDA driver: libcuda.so / libcuda.so.1 could not be loaded, so no NCCL communicator can be created",
    )
}

/// One CUDA driver call through cudarc's loader, a panic (missing symbol)
/// becoming [`Status::NoCudaDriver`].
fn cu_call(what: &str, f: impl FnOnce() -> cu::CUresult) -> Result<cu::CUresult> {
    catch_unwind(AssertUnwindSafe(f))
        .map_err(|_| Error::new(Status::NoCudaDriver, format!("{what}: libcuda lacks it")))
}

fn cu_check(what: &str, f: impl FnOnce() -> cu::CUresult) -> Result<()> {
    match cu_call(what, f)? {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        rc => Err(Error::new(Status::Cuda, format!("{what} failed: {rc:?}"))),
    }
}

/// What ended a poll loop early.
enum Stop {
    Deadline,
    PeerDead,
    Aborted,
    Async(NcclResult),
    Cuda(Error),
}

/// A two-rank communicator for one (prefill rank, decode rank) pair.
pub struct NcclPair {
    nccl: &'static Nccl,
    comm: Comm,
    role: NcclRole,
    peer: String,
    stream: cu::CUstream,
    /// Recorded after the last posted plan; Some while that work may run.
    in_flight: Option<cu::CUevent>,
    abort: NcclAbort,
    ctx: Arc<cudarc::driver::CudaContext>,
}

// SAFETY: an NCCL communicator and a CUDA stream may be used from any thread,
// one at a time; every method that uses them takes &mut self (or self).
unsafe impl Send for NcclPair {}

impl NcclPair {
    /// Joins the pair's communicator without blocking inside NCCL: the
    /// init is non-blocking and polled until it succeeds, `deadline` passes
    /// ([`Status::Timeout`]), `alive` says the peer is gone
    /// ([`Status::PeerUnreachable`]) or `abort` is set ([`Status::Aborted`]);
    /// each failure aborts the half-made communicator and names `peer`.
    /// `stream` is the raw `CUstream` the ops are enqueued on (e.g. the
    /// relayout stream, so sends follow the gather without a host wait).
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        id: &NcclId,
        role: NcclRole,
        ordinal: usize,
        stream: u64,
        peer: &str,
        deadline: Instant,
        alive: &mut dyn FnMut() -> bool,
        abort: NcclAbort,
    ) -> Result<NcclPair> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cu::is_culib_present() } {
            return Err(no_driver());
        }
        let nccl = sys::nccl()?;
        let ctx = match catch_unwind(|| cudarc::driver::CudaContext::new(ordinal)) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(Error::new(
                    Status::Cuda,
                    format!("CUDA context for device {ordinal}: {e}"),
                ))
            }
            Err(_) => return Err(no_driver()),
        };
        let mut me = NcclPair {
            nccl,
            comm: std::ptr::null_mut(),
            role,
            peer: peer.to_string(),
            stream: stream as usize as cu::CUstream,
            in_flight: None,
            abort,
            ctx,
        };
        me.bind()?;
        let uid = sys::UniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        let mut cfg = sys::Config::new(false);
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: comm and cfg are valid for the call; world size 2, rank 0 or 1.
        let rc = unsafe { (nccl.comm_init_rank_config)(&mut comm, 2, uid, role.rank(), &mut cfg) };
        me.comm = comm;
        if rc != sys::SUCCESS && rc != sys::IN_PROGRESS {
            let e = me.nccl_error("ncclCommInitRankConfig", rc);
            me.abort_comm();
            return Err(e);
        }
        match me.poll_async(deadline, alive) {
            Ok(()) => Ok(me),
            Err(stop) => Err(me.fail(stop, "communicator init")),
        }
    }

    /// The peer's name, as given to [`connect`](Self::connect).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// True while posted work may still run on the stream.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The flag that aborts this pair from another thread.
    pub fn abort_handle(&self) -> NcclAbort {
        self.abort.clone()
    }

    fn bind(&self) -> Result<()> {
        match catch_unwind(AssertUnwindSafe(|| self.ctx.bind_to_thread())) {
            Ok(Ok(())) => Ok(()),
            _ => Err(Error::new(
                Status::Cuda,
                "cannot make the pair's CUDA context current on this thread",
            )),
        }
    }

    fn usable(&self) -> Result<()> {
        if self.comm.is_null() {
            return Err(Error::new(
                Status::Nccl,
                format!(
                    "the NCCL communicator with {} was aborted; create a new pair",
                    self.peer
                ),
            ));
        }
        Ok(())
    }

    fn nccl_error(&self, what: &str, rc: NcclResult) -> Error {
        Error::new(
            Status::Nccl,
            format!("{what} with {} failed: {}", self.peer, self.described(rc)),
        )
    }

    /// NCCL's text for `rc`, with its last warning where it has one (a
    /// failed init says why there: "Duplicate GPU detected ...").
    fn described(&self, rc: NcclResult) -> String {
        let text = self.nccl.error(rc);
        match self.nccl.last_error(self.comm) {
            Some(last) => format!("{text} (NCCL's last warning: \"{last}\")"),
            None => text,
        }
    }

    /// One `ncclCommGetAsyncError`.
    fn async_state(&self) -> NcclResult {
        let mut st: NcclResult = sys::SUCCESS;
        // SAFETY: comm is a live communicator; st is a local out-pointer.
        let rc = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut st) };
        if rc != sys::SUCCESS {
            rc
        } else {
            st
        }
    }

    /// Checks the abort flag, the deadline and the peer; `None` to go on.
    fn watch(&self, deadline: Instant, alive: &mut dyn FnMut() -> bool) -> Option<Stop> {
        if self.abort.is_set() {
            Some(Stop::Aborted)
        } else if !alive() {
            Some(Stop::PeerDead)
        } else if Instant::now() >= deadline {
            Some(Stop::Deadline)
        } else {
            None
        }
    }

    /// Polls `ncclCommGetAsyncError` until it is `ncclSuccess`.
    fn poll_async(
        &self,
        deadline: Instant,
        alive: &mut dyn FnMut() -> bool,
    ) -> std::result::Result<(), Stop> {
        let mut nap = Duration::from_micros(50);
        loop {
            match self.async_state() {
                sys::SUCCESS => return Ok(()),
                sys::IN_PROGRESS => {}
                rc => return Err(Stop::Async(rc)),
            }
            if let Some(stop) = self.watch(deadline, alive) {
                return Err(stop);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    /// Aborts the communicator (once), then waits for the stream so no NCCL
    /// kernel still touches the buffers. Errors cannot be reported here.
    fn abort_comm(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: comm came from ncclCommInitRankConfig and is released once.
            let _ = unsafe { (self.nccl.comm_abort)(self.comm) };
            self.comm = std::ptr::null_mut();
        }
        if let Some(ev) = self.in_flight.take() {
            let stream = self.stream;
            // After the abort the enqueued NCCL kernels return: the stream drains.
            // SAFETY: stream is the caller's live stream; ev was created by us.
            let _ = cu_call("cuStreamSynchronize", || unsafe {
                cu::cuStreamSynchronize(stream)
            });
            // SAFETY: ev was created in `post` and is destroyed once.
            let _ = cu_call("cuEventDestroy", || unsafe { cu::cuEventDestroy_v2(ev) });
        }
    }

    /// Aborts and turns `stop` into the typed error naming the peer.
    fn fail(&mut self, stop: Stop, doing: &str) -> Error {
        let peer = self.peer.clone();
        let e = match stop {
            Stop::Deadline => Error::new(
                Status::Timeout,
                format!("NCCL {doing} with {peer} did not finish by its deadline; the communicator was aborted"),
            ),
            Stop::PeerDead => Error::new(
                Status::PeerUnreachable,
                format!("NCCL {doing} with {peer}: the peer is gone; the communicator was aborted"),
            ),
            Stop::Aborted => Error::new(
                Status::Aborted,
                format!("NCCL {doing} with {peer} was aborted"),
            ),
            Stop::Async(rc) => Error::new(
                Status::Nccl,
                format!(
                    "NCCL {doing} with {peer} failed: {}; the communicator was aborted",
                    self.described(rc)
                ),
            ),
            Stop::Cuda(e) => Error::new(
                e.status(),
                format!("NCCL {doing} with {peer}: {}; the communicator was aborted", e.detail()),
            ),
        };
        self.abort_comm();
        e
    }

    /// Enqueues the plan's ops on the stream, grouped as planned, and
    /// records the completion event after them; returns once they are
    /// enqueued (a non-blocking `ncclGroupEnd` is polled as `connect` is).
    /// Sender ops read `staging`; receiver ops write `staging` (Staged mode)
    /// or the pool entries at `entry_bases` (Direct mode). Any failure
    /// aborts the communicator. Finish with [`wait`](Self::wait).
    ///
    /// # Safety
    /// Every op's range must be valid device memory of the pair's device
    /// until [`wait`](Self::wait) returned or the pair was dropped, and the
    /// peer must post the mirrored plan (check digests with
    /// [`super::check_mirror`] first).
    pub unsafe fn post(
        &mut self,
        plan: &NcclPlan,
        staging: u64,
        entry_bases: &[u64],
        deadline: Instant,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<()> {
        self.usable()?;
        if self.in_flight.is_some() {
            return Err(Error::invalid(format!(
                "a plan to {} is still in flight: wait for it first",
                self.peer
            )));
        }
        if plan.role != self.role {
            return Err(Error::invalid(format!(
                "plan is for the {:?} but this pair end is the {:?}",
                plan.role, self.role
            )));
        }
        // every op's base before anything is enqueued
        let mut ptrs = Vec::with_capacity(plan.ops.len());
        for op in &plan.ops {
            let base = match op.buffer {
                NcclBuffer::Staging => staging,
                NcclBuffer::Entry(e) => *entry_bases.get(e as usize).ok_or_else(|| {
                    Error::invalid(format!(
                        "NCCL op names entry {e} but {} entry bases were given",
                        entry_bases.len()
                    ))
                })?,
            };
            ptrs.push((base + op.offset) as usize);
        }
        self.bind()?;
        let n = self.nccl;
        let peer = 1 - self.role.rank();
        let stream = self.stream as *mut std::ffi::c_void;
        for g in &plan.groups {
            // SAFETY: plain NCCL group bracket.
            let rc = unsafe { (n.group_start)() };
            if rc != sys::SUCCESS {
                let e = self.nccl_error("ncclGroupStart", rc);
                self.abort_comm();
                return Err(e);
            }
            let mut first = None;
            for (op, &ptr) in plan.ops[g.clone()].iter().zip(&ptrs[g.clone()]) {
                let len = op.len as usize;
                let rc = match self.role {
                    // SAFETY: the caller guarantees the ranges (see above).
                    NcclRole::Sender => unsafe {
                        (n.send)(ptr as *const _, len, sys::UINT8, peer, self.comm, stream)
                    },
                    // SAFETY: as above.
                    NcclRole::Receiver => unsafe {
                        (n.recv)(ptr as *mut _, len, sys::UINT8, peer, self.comm, stream)
                    },
                };
                if rc != sys::SUCCESS && rc != sys::IN_PROGRESS {
                    first = Some(self.nccl_error("ncclSend/ncclRecv", rc));
                    break;
                }
            }
            // SAFETY: closes the bracket opened above, also after a failed op.
            let rc = unsafe { (n.group_end)() };
            if let Some(e) = first {
                self.abort_comm();
                return Err(e);
            }
            match rc {
                sys::SUCCESS => {}
                sys::IN_PROGRESS => {
                    if let Err(stop) = self.poll_async(deadline, alive) {
                        return Err(self.fail(stop, "group launch"));
                    }
                }
                rc => {
                    let e = self.nccl_error("ncclGroupEnd", rc);
                    self.abort_comm();
                    return Err(e);
                }
            }
        }
        let mut ev: cu::CUevent = std::ptr::null_mut();
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: an out-pointer to a local; the pair's context is current.
        if let Err(e) = cu_check("cuEventCreate", || unsafe {
            cu::cuEventCreate(&mut ev, flags)
        }) {
            return Err(self.fail(Stop::Cuda(e), "completion event"));
        }
        self.in_flight = Some(ev);
        let s = self.stream;
        // SAFETY: ev is live; the stream is the one the ops went on.
        if let Err(e) = cu_check("cuEventRecord", || unsafe { cu::cuEventRecord(ev, s) }) {
            return Err(self.fail(Stop::Cuda(e), "completion event"));
        }
        Ok(())
    }

    /// One look at the posted work: `Ok(true)` once its event completed (the
    /// bytes are in place on the receiver, the sender's buffers are free),
    /// `Ok(false)` while it runs; an NCCL async error aborts.
    pub fn poll(&mut self) -> Result<bool> {
        let Some(ev) = self.in_flight else {
            return Ok(true);
        };
        self.usable()?;
        self.bind()?;
        match self.async_state() {
            sys::SUCCESS | sys::IN_PROGRESS => {}
            rc => return Err(self.fail(Stop::Async(rc), "transfer")),
        }
        // SAFETY: ev is the live completion event.
        match cu_call("cuEventQuery", || unsafe { cu::cuEventQuery(ev) }) {
            Ok(cu::CUresult::CUDA_SUCCESS) => {
                self.in_flight = None;
                // SAFETY: created in `post`, destroyed once (it completed).
                let _ = cu_call("cuEventDestroy", || unsafe { cu::cuEventDestroy_v2(ev) });
                Ok(true)
            }
            Ok(cu::CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Ok(rc) => {
                let e = Error::new(Status::Cuda, format!("cuEventQuery failed: {rc:?}"));
                Err(self.fail(Stop::Cuda(e), "transfer"))
            }
            Err(e) => Err(self.fail(Stop::Cuda(e), "transfer")),
        }
    }

    /// Waits for the posted work: polls its event with
    /// `ncclCommGetAsyncError`, `alive`, the abort flag and `deadline`; any
    /// of them failing aborts the communicator (its kernels return, the
    /// stream is waited) and is a typed error naming the peer.
    pub fn wait(&mut self, deadline: Instant, alive: &mut dyn FnMut() -> bool) -> Result<()> {
        let mut nap = Duration::from_micros(50);
        loop {
            if self.poll()? {
                return Ok(());
            }
            if let Some(stop) = self.watch(deadline, alive) {
                return Err(self.fail(stop, "transfer"));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(5));
        }
    }

    /// Aborts now (e.g. on engine shutdown); the stream is waited after.
    pub fn abort(&mut self) {
        self.abort_comm();
    }

    /// The clean end: `ncclCommFinalize`, polled until done (bounded), then
    /// `ncclCommDestroy`. Work still in flight is refused: wait first.
    pub fn close(mut self) -> Result<()> {
        if self.in_flight.is_some() {
            let e = Error::invalid(format!(
                "a plan to {} is still in flight: wait for it before closing",
                self.peer
            ));
            return Err(e);
        }
        self.finalize()
    }

    fn finalize(&mut self) -> Result<()> {
        if self.comm.is_null() {
            return Ok(());
        }
        self.bind()?;
        let n = self.nccl;
        // SAFETY: comm is live and has no work in flight.
        let rc = unsafe { (n.comm_finalize)(self.comm) };
        if rc != sys::SUCCESS && rc != sys::IN_PROGRESS {
            let e = self.nccl_error("ncclCommFinalize", rc);
            self.abort_comm();
            return Err(e);
        }
        let deadline = Instant::now() + FINALIZE_WAIT;
        if let Err(stop) = self.poll_async(deadline, &mut || true) {
            return Err(self.fail(stop, "finalize"));
        }
        // SAFETY: finalized; destroyed once.
        let rc = unsafe { (n.comm_destroy)(self.comm) };
        self.comm = std::ptr::null_mut();
        n.check("ncclCommDestroy", rc)
    }
}

impl std::fmt::Debug for NcclPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclPair")
            .field("role", &self.role)
            .field("peer", &self.peer)
            .field("in_flight", &self.in_flight.is_some())
            .finish()
    }
}

impl Drop for NcclPair {
    fn drop(&mut self) {
        let _ = self.bind();
        if self.in_flight.is_some() {
            // work may run: abort (the kernels return) and wait for the stream
            self.abort_comm();
        } else {
            let _ = self.finalize();
        }
    }
}
