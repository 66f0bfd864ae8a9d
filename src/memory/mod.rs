//! Registration of host and device memory regions, the descriptors peers
//! receive, and bounds checks on every remote access.
//!
//! A [`Registry`] owns the regions of one process. Every access (a local
//! source range or a remote destination range) is checked against it
//! ([`Registry::check_access`]) and pinned while the bytes move
//! ([`Registry::acquire`] returns an [`AccessGuard`]); unregistering waits
//! for pinned accesses to finish, so nothing writes into freed memory, and
//! then runs the unregister hooks transports installed
//! ([`Registry::add_unregister_hook`]: e.g. the RDMA NIC drops the region's
//! memory registration, so its rkey stops working) before it returns.

mod device_writer;
pub mod prefault;
mod region;
mod registry;
pub mod shared;
mod view_hull;

pub use device_writer::{BounceBuffer, DeviceWriter, Fence};
pub use region::{RegionDesc, RegionKind};
pub use registry::{
    AccessGuard, Registry, RevokeHook, UnregisterHook, MEMFD_KEY, MEMFD_OFFSET_KEY,
};
pub use view_hull::view_hull;
