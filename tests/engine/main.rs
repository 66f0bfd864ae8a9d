//! The engine: in one process (a bootstrap server, prefill and decode ranks
//! over cma, tcp and rdma on the fake NIC; layer-wise sends; metrics and
//! telemetry; room-setup races) and with real processes (bounded resources,
//! fault injection with `pdxfer-fault-peer`; a dummy TP prefill rank). Room grants between agents are
//! the `room_grants` binary: they count process-wide frames.
//! `cargo test --features testing --test engine [filter]`.

#[allow(dead_code, unused_imports)] // each binary uses part of it
#[path = "../support/mod.rs"]
mod support;

mod bounded;
#[cfg(feature = "testing")]
mod cp;
mod dummy_tp;
#[cfg(feature = "testing")]
mod engine;
mod engine_metrics;
mod engine_races;
#[cfg(feature = "testing")]
mod faults;
#[cfg(feature = "testing")]
mod layerwise;
#[cfg(feature = "testing")]
mod room_close;
#[cfg(feature = "testing")]
mod strided;
#[cfg(feature = "testing")]
mod tcp_resume;

/// Without the `testing` feature the modules above marked so are not built;
/// this test says so instead of leaving them out silently.
#[cfg(not(feature = "testing"))]
#[test]
fn the_testing_feature_is_on() {
    panic!(
        "the engine, faults and layerwise tests of this binary need the testing feature: cargo test --features testing --test engine"
    );
}
