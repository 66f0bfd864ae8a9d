//! GPU code without a GPU: the device path, engines with device pools and
//! NCCL on the fake libcuda and libnccl (`fake_driver`, `nccl_fake`,
//! `nccl_engine`), the kernel source on the CPU (`kernel_harness`), nvcc and
//! NVRTC builds of the kernels (`nvcc_kernels`).
//! `cargo test --features testing --test gpu [filter]`.

#[allow(dead_code, unused_imports)] // each binary uses part of it
#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "testing")]
mod fake_driver;
mod kernel_harness;
#[cfg(feature = "testing")]
mod nccl_engine;
mod nccl_fake;
mod nvcc_kernels;

/// Without the `testing` feature the modules above marked so are not built;
/// this test says so instead of leaving them out silently.
#[cfg(not(feature = "testing"))]
#[test]
fn the_testing_feature_is_on() {
    panic!(
        "the fake_driver and nccl_engine tests of this binary need the testing feature: cargo test --features testing --test gpu"
    );
}
