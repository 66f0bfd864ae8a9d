//! The links between the ranks of a pair: a [`DecodeLink`] is a decode
//! rank as the prefill engine sees it (control writer, data connection,
//! counters), a [`PrefillLink`] a prefill rank as the decode engine sees it.

use super::control::{CtlWriter, RegionMap};
use super::handle::lock;
use super::metrics::PeerCounters;
use crate::bootstrap::schema::{PeerHello, Registration};
use crate::transport::Transport;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// A decode rank as the prefill engine sees it.
pub(super) struct DecodeLink {
    pub(super) hello: PeerHello,
    pub(super) regions: RegionMap,
    pub(super) writer: CtlWriter,
    /// The data connection; remade when it breaks while the control
    /// connection lives (`Inner::redial_if_broken`).
    pub(super) data: Mutex<Arc<dyn Transport>>,
    /// Where the decode rank's agent accepts data connections.
    pub(super) data_addr: String,
    pub(super) alive: AtomicBool,
    /// Device pools: slices are written straight from the device staging
    /// buffer (rdma with GPUDirect RDMA), not copied to the host first;
    /// cleared for good when the NIC refuses device memory.
    pub(super) zero_copy: AtomicBool,
    /// Bytes, batches and wire time of the writes to this decode rank.
    pub(super) counters: Arc<PeerCounters>,
}

impl DecodeLink {
    /// The current data connection.
    pub(super) fn data(&self) -> Arc<dyn Transport> {
        lock(&self.data).clone()
    }
}

/// A prefill rank as the decode engine sees it.
pub(super) struct PrefillLink {
    pub(super) registration: Registration,
    pub(super) writer: CtlWriter,
    pub(super) alive: AtomicBool,
    /// The KV bytes this prefill rank reported for its rooms.
    pub(super) counters: Arc<PeerCounters>,
}
