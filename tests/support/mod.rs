//! Test harness shared by the integration-test binaries (each `main.rs`
//! includes it with `#[path = "../support/mod.rs"]`): the child-process harness
//! ([`proc`]), a private etcd ([`etcd`]), the fake libcuda and libnccl
//! ([`fakes`]), the in-process cluster of engines ([`cluster`]) and [`skip`], the one recorder of skipped tests (the
//! library's own unit tests compile the same file).

pub mod child;
pub mod cluster;
pub mod etcd;
pub mod fakes;
pub mod proc;
pub mod target;

#[path = "../../src/test_skip.rs"]
mod test_skip;

pub use etcd::Etcd;
pub use proc::{Proc, DEADLINE, SLACK, WAIT};
pub(crate) use test_skip::{skip, skip_log};

use serde_json::Value;
use std::net::TcpListener;
use std::time::{Duration, Instant};

/// The `pdxfer-fault-peer` handle of the fault and bound tests.
pub type Peer = Proc;

/// The libtest name of test `name` in the module `module_path` (its
/// `module_path!()`, crate name first): what a child process of this test
/// binary is started with (`--exact`).
pub fn test_name(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    }
}

/// Spawns `pdxfer` (the CLI of this package) with `args`.
pub fn pdxfer(name: &str, args: &[&str]) -> Proc {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_pdxfer"));
    cmd.args(args);
    Proc::start(name, cmd)
}

/// Starts a `pdxfer-fault-peer` engine rank (the binary cargo built for
/// this test, with the `testing` feature) and waits for its `ready` line.
pub fn fault_peer(name: &str, url: &str, cluster: &str, args: &[(&str, String)]) -> Proc {
    Proc::spawn_bin(
        env!("CARGO_BIN_EXE_pdxfer-fault-peer"),
        name,
        url,
        cluster,
        args,
    )
}

/// A free loopback port (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Starts `pdxfer bootstrap` on a free port; returns the process and its URL.
pub fn bootstrap_server(extra: &[&str]) -> (Proc, String) {
    let mut args = vec!["bootstrap", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let p = pdxfer("bootstrap", &args);
    let url = p.expect("listening")["url"]
        .as_str()
        .expect("url")
        .to_string();
    (p, url)
}

/// Arguments of a `pdxfer rank`.
pub fn rank_args(store: &str, cluster: &str, role: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "rank",
        "--store",
        store,
        "--cluster",
        cluster,
        "--role",
        role,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Spawns a rank and waits for its registration.
pub fn rank(name: &str, store: &str, cluster: &str, role: &str, extra: &[&str]) -> (Proc, Value) {
    let args = rank_args(store, cluster, role, extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = pdxfer(name, &refs);
    let ev = p.expect("registered");
    (p, ev)
}

/// Polls `f` every 50 ms until it returns Some, for at most `limit`.
pub fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
