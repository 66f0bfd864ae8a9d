//! What the agent needs from "a NIC", independent of verbs: a [`NicProvider`]
//! registers memory and creates endpoints, a [`NicEndpoint`] carries the local
//! [`Handshake`] and connects to the peer's, and the connected result is a
//! [`DataPath`] (a [`Session`] over any [`RailIo`]) that posts batches and
//! reports their completions.
//!
//! Providers: [`VerbsProvider`] (feature `rdma`: real NICs through
//! `RdmaTransport`) and [`super::fake::FakeNic`] (an in-process software
//! fabric that moves real bytes after key and bounds checks; tests only,
//! never chosen unless passed explicitly in `AgentOptions::nic`).

use super::handshake::{Handshake, Negotiated};
use super::session::{RailIo, Session};
use super::slice::{LocalRegion, Span};
use super::tracker::BatchState;
use super::wr::Direction;
use crate::error::Result;
use std::time::Duration;

/// A connected RDMA data path (one QP per rail).
pub trait DataPath: Send + Sync {
    /// Posts one batch: sliced across the rails, keys resolved and bounds-checked
    /// before anything is posted.
    fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()>;
    /// Waits up to `timeout` for the batch (`Timeout` then; it keeps running).
    fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState>;
    /// Adds a local region registered after connecting (`per_rail[i]` on rail `i`).
    fn add_local(&self, per_rail: &[LocalRegion]);
    /// Connected rails.
    fn rails(&self) -> usize;
}

impl<R: RailIo> DataPath for Session<R> {
    fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
        Session::post_batch(self, batch, dir, spans)
    }
    fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
        Session::wait(self, batch, timeout)
    }
    fn add_local(&self, per_rail: &[LocalRegion]) {
        Session::add_local(self, per_rail)
    }
    fn rails(&self) -> usize {
        self.connected_rails()
    }
}

/// One side of a connection before it is connected: QPs exist, the local
/// handshake is known.
pub trait NicEndpoint: Send {
    /// What to send the peer.
    fn local(&self) -> &Handshake;
    /// Negotiates every rail with the peer's handshake (errors name the
    /// failing field), brings the QPs up and returns the running data path.
    fn connect(self: Box<Self>, remote: &Handshake)
        -> Result<(Box<dyn DataPath>, Vec<Negotiated>)>;
}

/// The NICs of this process.
pub trait NicProvider: Send + Sync {
    /// What the NICs are, in words (for the handshake offer and reports).
    fn describe(&self) -> String;
    /// Registers `[addr, addr+len)` on every rail (an exact range registered
    /// before returns its keys again); returns the lkey per rail.
    ///
    /// # Safety
    /// The memory must stay valid while the registration can be used (the
    /// agent passes registry regions, valid until unregistered).
    unsafe fn register(&self, addr: u64, len: u64) -> Result<Vec<LocalRegion>>;
    /// A new endpoint (one QP per rail) advertising every region registered so far.
    fn endpoint(&self) -> Result<Box<dyn NicEndpoint>>;
}

impl std::fmt::Debug for dyn NicProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NicProvider({})", self.describe())
    }
}

#[cfg(feature = "rdma")]
pub use verbs_provider::VerbsProvider;

#[cfg(feature = "rdma")]
mod verbs_provider {
    use super::*;
    use crate::error::{Error, Status};
    use crate::transport::rdma::config::{RdmaConfig, RecordMode};
    use crate::transport::rdma::endpoint::{RdmaEndpoint, RdmaTransport};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Real NICs through [`RdmaTransport`].
    pub struct VerbsProvider {
        t: RdmaTransport,
        registered: Mutex<HashMap<(u64, u64), Vec<LocalRegion>>>,
    }

    impl VerbsProvider {
        /// Opens the NICs `cfg` selects ([`Status::NoRdmaDevice`] with the
        /// reason when none is usable). The agent's control channel carries the
        /// completion record, so no WRITE_WITH_IMM record is posted.
        pub fn open(mut cfg: RdmaConfig) -> Result<VerbsProvider> {
            cfg.record = RecordMode::None;
            Ok(VerbsProvider {
                t: RdmaTransport::new(cfg)?,
                registered: Mutex::new(HashMap::new()),
            })
        }
    }

    impl NicProvider for VerbsProvider {
        fn describe(&self) -> String {
            let names: Vec<String> = self
                .t
                .rails()
                .iter()
                .map(|r| format!("{}:{}", r.device, r.port))
                .collect();
            format!("verbs {}", names.join(","))
        }

        unsafe fn register(&self, addr: u64, len: u64) -> Result<Vec<LocalRegion>> {
            let mut m = crate::transport::rdma::session::lock(&self.registered);
            if let Some(k) = m.get(&(addr, len)) {
                return Ok(k.clone());
            }
            // SAFETY: forwarded from this function's contract.
            unsafe { self.t.register_host(&[(addr, len)]) }?;
            let keys = self.t.local_keys(addr).ok_or_else(|| {
                Error::new(
                    Status::Rdma,
                    format!("region {addr:#x} vanished after registration"),
                )
            })?;
            m.insert((addr, len), keys.clone());
            Ok(keys)
        }

        fn endpoint(&self) -> Result<Box<dyn NicEndpoint>> {
            Ok(Box::new(self.t.endpoint()?))
        }
    }

    impl NicEndpoint for RdmaEndpoint {
        fn local(&self) -> &Handshake {
            self.local_handshake()
        }
        fn connect(
            mut self: Box<Self>,
            remote: &Handshake,
        ) -> Result<(Box<dyn DataPath>, Vec<Negotiated>)> {
            let n = RdmaEndpoint::connect(&mut self, remote)?;
            Ok((self, n))
        }
    }

    impl DataPath for RdmaEndpoint {
        fn post_batch(&self, batch: u32, dir: Direction, spans: &[Span]) -> Result<()> {
            RdmaEndpoint::post_batch(self, batch, dir, spans)
        }
        fn wait(&self, batch: u32, timeout: Duration) -> Result<BatchState> {
            RdmaEndpoint::wait(self, batch, timeout)
        }
        fn add_local(&self, per_rail: &[LocalRegion]) {
            self.session_add_local(per_rail)
        }
        fn rails(&self) -> usize {
            self.negotiated().len()
        }
    }
}
