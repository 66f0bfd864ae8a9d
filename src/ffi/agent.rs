//! `PdxAgent`: one process's data-plane endpoint (registry, listener,
//! received completion records) over the C ABI.

use super::ptr::{self, Versioned};
use super::{boundary, PdxStatus};
use crate::error::{Error, Status};
use crate::transport::{Agent, AgentOptions, Completion, Incoming};
use std::ffi::c_char;
use std::time::Duration;

/// Opaque agent handle (`pdxfer_agent_create` / `pdxfer_agent_destroy`).
pub struct PdxAgent {
    pub(crate) agent: Agent,
}

/// Options of `pdxfer_agent_create`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxAgentOptions {
    /// `sizeof(PdxAgentOptions)`, set by the caller.
    pub struct_size: u64,
    /// Address to accept peers on (`"127.0.0.1:0"` picks a port); NULL: send-only agent.
    pub listen: *const c_char,
    /// The cluster secret peers must prove (at least 16 bytes; copied); NULL
    /// reads `PDXFER_CLUSTER_SECRET`, and without either only a
    /// loopback-bound listener is allowed (`PDX_STATUS_AUTH_REQUIRED`).
    /// ABI 1.4; callers of 1.3 and older (a 16-byte struct) get NULL.
    pub secret: *const c_char,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxAgentOptions {
    // the 1.2 struct ended before `secret`
    const MIN_SIZE: usize = std::mem::size_of::<PdxAgentOptions>() - 8;
    const NAME: &'static str = "PdxAgentOptions";
}

/// A completion record (sender: the batch finished; receiver: a batch landed).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PdxCompletion {
    /// `sizeof(PdxCompletion)`, set by the caller before the call.
    pub struct_size: u64,
    /// Batch id (unique per sending connection).
    pub batch_id: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Checksum, valid when `has_checksum` is 1.
    pub checksum: u64,
    /// 1 when the batch carried a checksum (verified by the receiver).
    pub has_checksum: u32,
    /// Receiver side: pid of the sending process; 0 on the sender side.
    pub peer_pid: u32,
    /// Caller tag (room id).
    pub room: u64,
    /// Caller epoch.
    pub epoch: u64,
    /// Receiver side: session (sending connection) id; 0 on the sender side.
    pub session: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers only.
unsafe impl Versioned for PdxCompletion {
    const MIN_SIZE: usize = std::mem::size_of::<PdxCompletion>();
    const NAME: &'static str = "PdxCompletion";
}

impl PdxCompletion {
    pub(crate) fn from_rust(c: &Completion, incoming: Option<&Incoming>) -> Self {
        PdxCompletion {
            struct_size: 0,
            batch_id: c.batch_id.0,
            bytes: c.bytes,
            checksum: c.checksum.unwrap_or(0),
            has_checksum: u32::from(c.checksum.is_some()),
            peer_pid: incoming.map_or(0, |i| i.peer.pid),
            room: c.room,
            epoch: c.epoch,
            session: incoming.map_or(0, |i| i.session),
        }
    }
}

/// Creates an agent. `options` may be NULL (send-only agent).
/// Destroy it with `pdxfer_agent_destroy` after closing its peers.
#[no_mangle]
pub extern "C" fn pdxfer_agent_create(
    options: *const PdxAgentOptions,
    out: *mut *mut PdxAgent,
) -> PdxStatus {
    boundary(|| {
        let (listen, secret) = if options.is_null() {
            (None, None)
        } else {
            let o = ptr::read_versioned(options)?;
            (
                ptr::opt_c_str(o.listen, "listen")?.map(str::to_string),
                ptr::opt_c_str(o.secret, "secret")?.map(str::to_string),
            )
        };
        ptr::check_out(out, "agent output pointer")?;
        let agent = Agent::new(&AgentOptions {
            listen,
            secret,
            ..Default::default()
        })?;
        ptr::new_handle(PdxAgent { agent }, out, "agent")?;
        super::ok()
    })
}

/// Destroys an agent: stops listening and closes its receiver sessions.
/// NULL is a no-op. The handle must not be used afterwards.
///
/// Threads: every other call on the same `PdxAgent` may run concurrently with the others,
/// from any thread. This one may not race any of them: it frees the handle,
/// so no call on the same `PdxAgent` may be in flight when it starts, and none may start
/// after it. (The Python package enforces this: its `Agent.close()` waits for the
/// calls in flight and refuses later ones with a typed error.)
/// `PdxPeer` handles opened from the agent are separate handles, closed with
/// `pdxfer_peer_close` (close them first).
#[no_mangle]
pub extern "C" fn pdxfer_agent_destroy(agent: *mut PdxAgent) {
    let _ = boundary(|| {
        ptr::drop_handle(agent);
        super::ok()
    });
}

/// Writes the `host:port` the agent listens on (NUL-terminated) into `buf`
/// of `capacity` bytes; the needed size goes to `out_len`. Fails with
/// `PDX_STATUS_INVALID_ARGUMENT` for a send-only agent.
#[no_mangle]
pub extern "C" fn pdxfer_agent_listen_addr(
    agent: *const PdxAgent,
    buf: *mut c_char,
    capacity: usize,
    out_len: *mut usize,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        let addr = a
            .agent
            .local_addr()
            .ok_or_else(|| Error::invalid("the agent was created without a listen address"))?;
        ptr::write_c_str(&addr.to_string(), buf, capacity, out_len)
    })
}

/// Takes the next completion record received by this agent, waiting up to
/// `timeout_ms`. `PDX_STATUS_TIMEOUT` when none arrived.
#[no_mangle]
pub extern "C" fn pdxfer_agent_next_completion(
    agent: *const PdxAgent,
    timeout_ms: u64,
    out: *mut PdxCompletion,
) -> PdxStatus {
    boundary(|| {
        let a = ptr::handle(agent, "agent")?;
        ptr::check_versioned_out(out)?;
        match a.agent.next_completion(Duration::from_millis(timeout_ms)) {
            Some(inc) => {
                ptr::write_versioned(out, &PdxCompletion::from_rust(&inc.completion, Some(&inc)))?;
                super::ok()
            }
            None => Err(Error::new(
                Status::Timeout,
                format!("no completion record within {timeout_ms} ms"),
            )),
        }
    })
}
