//! Executes plans: CPU gather/scatter for host pools, CUDA kernels for device pools.

pub mod gpu;
