//! The device-copy hook of device regions: how a transport that receives
//! bytes on the host (tcp) lands them in CUDA device memory, without the
//! memory and transport layers depending on a CUDA library.

use crate::error::Result;

/// Copies host bytes into the device memory of registered device regions.
///
/// Registered with a region through
/// [`Registry::register_device_with`](super::Registry::register_device_with)
/// and implemented above this layer (the engine's CUDA host-to-device copier,
/// or a host-memory stand-in in tests).
pub trait DeviceWriter: Send + Sync {
    /// Copies `src` to device address `dst` (already bounds-checked against a
    /// registered region by the caller) and returns only once every byte is
    /// in device memory (a synchronous copy, or an asynchronous one followed
    /// by a wait): the caller reuses `src` and may report the bytes as
    /// delivered as soon as this returns.
    fn write(&self, dst: u64, src: &[u8]) -> Result<()>;
}
