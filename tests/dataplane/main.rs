//! The data plane between processes: `pdxfer target` peers over cma and tcp,
//! peer authentication against an unprivileged attacker, tcp between two
//! network namespaces; the channel's integrity and cma's target after the
//! handshake against another uid and an on-path relay (`security_channel`);
//! floods of pre-auth connections, the bootstrap store's bound and
//! `--insecure` (`security_bounds`); the engine's control channel against
//! an on-path relay (`engine_relay`); encrypted tcp payloads (`tcp_encrypt`).
//! `cargo test --features testing --test dataplane [filter]`.

#[allow(dead_code, unused_imports)] // each binary uses part of it
#[path = "../support/mod.rs"]
mod support;

mod auth;
#[cfg(feature = "testing")]
mod dataplane;
#[cfg(feature = "testing")]
mod engine_relay;
mod netns;
#[cfg(feature = "testing")]
mod security_bounds;
mod security_channel;
mod tcp_encrypt;

/// Without the `testing` feature the modules above marked so are not built;
/// this test says so instead of leaving them out silently.
#[cfg(not(feature = "testing"))]
#[test]
fn the_testing_feature_is_on() {
    panic!(
        "the dataplane tests of this binary need the testing feature: cargo test --features testing --test dataplane"
    );
}
