//! The receiver's state for one sender connection: its control socket, the
//! per-batch grants it holds (cma, rdma), its tcp batches in progress and its RDMA
//! queue pairs. Created by the handshake, closed when the control
//! connection ends or the agent shuts down.

use super::grant::Granted;
use super::lock;
use crate::auth::{PeerInstance, SessionMac};
use crate::error::{Error, Result, Status};
use crate::transport::identity::ProcIdentity;
use crate::transport::rdma::nic::DataPath;
use crate::transport::tcp::TcpRecv;
use crate::transport::wire::{self, FrameType};
use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// One sender connection as the receiver sees it (the sender's side of it is
/// its [`Transport`](crate::transport::Transport)).
pub(crate) struct ReceiverSession {
    pub(crate) id: u64,
    /// 128 random bits (hex) a data stream presents to attach to this session.
    pub(crate) token: String,
    /// The instance the control connection authenticated: data streams of
    /// this session must authenticate as the same one.
    pub(crate) instance: PeerInstance,
    pub(crate) peer: Mutex<Option<ProcIdentity>>,
    /// The control connection's write half and the MAC sealing its frames.
    pub(crate) writer: Mutex<Option<(TcpStream, SessionMac)>>,
    pub(crate) granted: Mutex<HashMap<u64, Granted>>,
    /// Batches whose grant expired, newest last (their commits are refused).
    pub(crate) expired: Mutex<VecDeque<u64>>,
    pub(crate) tcp: Mutex<TcpRecv>,
    pub(crate) sockets: Mutex<Vec<TcpStream>>,
    /// rdma: this side's connected QPs (the peer writes through them).
    pub(crate) rdma: Mutex<Option<Box<dyn DataPath>>>,
    /// tcp was selected: this side lands the bytes (its data streams).
    pub(crate) lands_tcp: AtomicBool,
    pub(crate) closed: AtomicBool,
}

impl ReceiverSession {
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        lock(&self.granted).clear();
        lock(&self.tcp).batches.clear();
        let path = lock(&self.rdma).take();
        drop(path);
    }

    /// Sends a sealed control frame; a failure shuts the connection.
    pub(crate) fn send(&self, ty: FrameType, p: &[u8]) {
        if let Some((w, mac)) = lock(&self.writer).as_mut() {
            if wire::write_frame_sealed(w, ty, p, mac).is_err() {
                let _ = w.shutdown(Shutdown::Both);
            }
        }
    }

    /// Sends a sealed control frame, returning the failure.
    pub(crate) fn write(&self, ty: FrameType, p: &[u8]) -> Result<()> {
        match lock(&self.writer).as_mut() {
            Some((w, mac)) => wire::write_frame_sealed(w, ty, p, mac),
            None => Err(Error::new(
                Status::PeerUnreachable,
                format!("session {}: its control connection is gone", self.id),
            )),
        }
    }
}
