//! pdxfer: KV-cache transfer for prefill/decode disaggregated LLM serving.
//!
//! Layers as folders, data flowing one way (see `DESIGN.md` in the shared docs):
//! [`ffi`] -> `engine` -> `transport` -> `relayout` -> `cuda` -> `bootstrap` ->
//! `memory` -> `layout`. [`ffi`] is the C ABI, `cuda` the driver beneath the
//! kernels of `relayout` and the GPU paths of `transport`, [`layout`] pure
//! planning. Beside them, usable from every layer and using none: `admission`, `auth`,
//! `error`, `version`, `rng`. A layer uses only the ones below it; the
//! architecture test in `src/architecture.rs` checks it.
#![warn(missing_docs)]

pub mod admission;
#[cfg(test)]
mod architecture;
pub mod auth;
pub mod bootstrap;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod layout;
pub mod memory;
pub mod relayout;
pub mod rng;
#[cfg(test)]
mod test_skip;
pub mod threads;
pub mod transport;
pub mod version;

pub use error::{Error, Result, Status};

pub use version::{
    PDXFER_ABI_VERSION_MAJOR as ABI_VERSION_MAJOR, PDXFER_ABI_VERSION_MINOR as ABI_VERSION_MINOR,
};
