//! The links between the ranks of a pair: a [`DecodeLink`] is a decode
//! rank as the prefill engine sees it (control writer, data connection with
//! its write path, counters), a [`PrefillLink`] a prefill rank as the decode
//! engine sees it.

use super::control::{CtlWriter, RegionMap};
use super::metrics::PeerCounters;
use super::path::Conn;
use super::state::lock;
use crate::bootstrap::schema::{PeerHello, Registration};
use crate::transport::Transport;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// A decode rank as the prefill engine sees it.
pub(super) struct DecodeLink {
    pub(super) hello: PeerHello,
    pub(super) regions: RegionMap,
    pub(super) writer: CtlWriter,
    /// The data connection and the path the rows take over it; remade
    /// when it breaks while the control connection lives
    /// (`Prefill::redial_if_broken`).
    pub(super) conn: Mutex<Conn>,
    /// Where the decode rank's agent accepts data connections.
    pub(super) data_addr: String,
    pub(super) alive: AtomicBool,
    /// Bytes, batches and wire time of the writes to this decode rank.
    pub(super) counters: Arc<PeerCounters>,
}

impl DecodeLink {
    /// The current data connection.
    pub(super) fn data(&self) -> Arc<dyn Transport> {
        lock(&self.conn).data.clone()
    }

    /// The current data connection with its write path.
    pub(super) fn conn(&self) -> Conn {
        lock(&self.conn).clone()
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
