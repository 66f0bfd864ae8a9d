//! Moves bytes between registered regions.

pub mod nccl;
// Nothing in the RDMA transport crosses the C ABI: keep its items out of pdxfer.h.
/// cbindgen:ignore
pub mod rdma;
