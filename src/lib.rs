//! pdxfer: KV-cache transfer for prefill/decode disaggregated LLM serving.
//!
//! Layers as folders, data flowing one way (see `DESIGN.md` in the shared docs):
//! [`ffi`] (C ABI) -> `engine` -> `bootstrap` -> `relayout` -> `transport` ->
//! `memory` -> [`layout`] (pure). A layer uses the ones below it, never above.
#![warn(missing_docs)]

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
pub mod transport;
pub mod version;

pub use error::{Error, Result, Status};

pub use version::{
    PDXFER_ABI_VERSION_MAJOR as ABI_VERSION_MAJOR, PDXFER_ABI_VERSION_MINOR as ABI_VERSION_MINOR,
};
