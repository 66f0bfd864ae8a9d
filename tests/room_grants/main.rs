//! Room grants and standing grants between two agents of this process on real connections (cma,
//! tcp, rdma on the software fabric). A binary of its own: its tests assert
//! the control frames this process received, which are counted process-wide,
//! so no other test may run in the process (its tests take one lock).
//! `cargo test --features testing --test room_grants [filter]`.

#[cfg(feature = "testing")]
mod room_grants;
#[cfg(feature = "testing")]
mod standing_grants;

/// Without the `testing` feature the module above is not built; this test
/// says so instead of leaving it out silently.
#[cfg(not(feature = "testing"))]
#[test]
fn the_testing_feature_is_on() {
    panic!(
        "the room_grants tests need the testing feature: cargo test --features testing --test room_grants"
    );
}
