//! Moves bytes between registered regions.

pub mod nccl;
pub mod rdma;
