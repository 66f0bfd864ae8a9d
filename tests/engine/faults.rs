//! Fault injection with real processes: engine ranks run as
//! `pdxfer-fault-peer` processes (pools fenced by guard pages and canaries),
//! the bootstrap server runs in this process. Processes are killed with
//! SIGKILL at seeded random points of a transfer, the bootstrap server and etcd
//! are restarted. Every affected room must end `Failed` with a reason within
//! its deadline, every unaffected room must succeed byte-exact, no canary may
//! change, and every process must exit when told (every wait is bounded).
//!
//! The seed is printed; `PDXFER_FAULT_SEED=N cargo test --features testing --test engine faults` replays it.

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::bootstrap::store::Store;
use pdxfer::rng::SplitMix64;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PAGE: u64 = 16;
const ROW_TOTAL: u64 = 4 * 64;
const AUX_ITEM: u64 = 32;
use crate::support as common;
use crate::support;
use common::{skip, Etcd};
use support::{DEADLINE, SLACK};

/// The seeded generator of the fault points, from `PDXFER_FAULT_SEED` or the clock.
fn seeded_rng() -> SplitMix64 {
    let s = std::env::var("PDXFER_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("fault seed: PDXFER_FAULT_SEED={s}");
    SplitMix64::new(s)
}

fn send(room: u64, pages: u64, src0: u64, delay_ms: u64) -> Value {
    json!({"cmd": "send", "room": room, "total": pages * PAGE,
           "src_pages": (0..pages).map(|i| src0 + i).collect::<Vec<_>>(),
           "chunk_pages": 1, "aux": room % 8, "delay_ms": delay_ms,
           "timeout_ms": DEADLINE.as_millis() as u64})
}

fn recv(room: u64, dst_pages: &[u64]) -> Value {
    json!({"cmd": "recv", "room": room, "total": 0, "dst_pages": dst_pages,
           "aux": room % 8, "timeout_ms": DEADLINE.as_millis() as u64})
}

fn recv_total(room: u64, total: u64, dst_pages: &[u64]) -> Value {
    let mut v = recv(room, dst_pages);
    v["total"] = json!(total);
    v
}

fn assert_success(d: &Value, want_bytes: u64, who: &str) {
    assert_eq!(d["poll"], "Success", "{who}: {d}");
    if want_bytes > 0 {
        assert_eq!(d["verified"], want_bytes, "{who}: {d}");
    }
}

fn assert_failed(d: &Value, who: &str) {
    assert_eq!(d["poll"], "Failed", "{who}: {d}");
    let reason = d["reason"].as_str().unwrap_or("");
    assert!(!reason.is_empty(), "{who}: failed without a reason: {d}");
    let ms = d["elapsed_ms"].as_u64().unwrap();
    assert!(
        ms <= (DEADLINE + SLACK).as_millis() as u64,
        "{who}: failed after {ms} ms, past the deadline"
    );
}

fn wait_registered(server: &BootstrapServer, cluster: &str, role: Role, n: usize) {
    wait_in(server.store().as_ref(), cluster, role, n);
}

fn wait_in(store: &dyn Store, cluster: &str, role: Role, n: usize) {
    let end = Instant::now() + DEADLINE;
    while store.entries(cluster, role).map_or(0, |e| e.len()) < n {
        assert!(
            Instant::now() < end,
            "{cluster}: {n} {role:?} entries never registered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Three decode instances (dp 0..3, DCP 1) on one prefill; one decode is
/// killed mid-transfer at a random chunk: its room fails on the prefill with
/// a reason, the two other rooms in flight succeed byte-exact, the prefill
/// keeps serving (a new room, and a restarted decode), canaries stay intact.
#[test]
fn kill_decode_mid_transfer() {
    let mut rng = seeded_rng();
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let cl = "faults-kd";
    let transport = if rng.below(2) == 0 { "tcp" } else { "cma" };
    eprintln!("transport {transport}");
    let t = ("transport", transport.to_string());
    let mut p = support::fault_peer(
        "prefill",
        &url,
        cl,
        &[("role", "prefill".into()), t.clone()],
    );
    let decode = |i: u32| {
        support::fault_peer(
            &format!("decode{i}"),
            &url,
            cl,
            &[
                ("role", "decode".into()),
                ("dp-size", "3".into()),
                ("dp-rank", i.to_string()),
                t.clone(),
            ],
        )
    };
    let mut d: Vec<support::Peer> = (0..3).map(decode).collect();
    wait_registered(&server, cl, Role::Prefill, 1);
    let pages = 12u64;
    let victim = rng.below(3) as usize;
    let kill_after = rng.below(pages - 2);
    eprintln!("killing decode{victim} after chunk {kill_after}");
    for (i, dp) in d.iter_mut().enumerate() {
        let room = 1 + i as u64;
        let dst: Vec<u64> = (0..pages).map(|k| (k * 5 + i as u64) % 32).collect();
        dp.cmd(recv_total(room, pages * PAGE, &dst));
        dp.expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
        p.cmd(send(room, pages, i as u64 * 16, 25));
    }
    let vroom = 1 + victim as u64;
    p.expect_match(
        |v| v["event"] == "chunk" && v["room"] == vroom && v["i"] == kill_after,
        DEADLINE,
    );
    let killed_at = Instant::now();
    d[victim].kill9();
    for (i, dp) in d.iter_mut().enumerate() {
        let room = 1 + i as u64;
        let pd = p.done(room, DEADLINE + SLACK);
        if i == victim {
            assert_failed(&pd, "prefill, room of the killed decode");
            assert!(killed_at.elapsed() < DEADLINE + SLACK);
        } else {
            assert_eq!(pd["poll"], "Success", "prefill room {room}: {pd}");
            let dd = dp.done(room, SLACK);
            assert_success(&dd, pages * PAGE * ROW_TOTAL + AUX_ITEM, "decode");
        }
    }
    // the prefill keeps serving: a restarted decode at the same dp rank and a survivor
    d[victim] = decode(victim as u32);
    for (i, dp) in d.iter_mut().enumerate() {
        let room = 10 + i as u64;
        let dst: Vec<u64> = (0..4).map(|k| 20 + k).collect();
        dp.cmd(recv_total(room, 4 * PAGE, &dst));
        dp.expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
        p.cmd(send(room, 4, 48 + 4 * i as u64, 0));
        assert_eq!(p.done(room, DEADLINE + SLACK)["poll"], "Success");
        assert_success(
            &dp.done(room, SLACK),
            4 * PAGE * ROW_TOTAL + AUX_ITEM,
            "decode after the kill",
        );
    }
    p.check_canaries();
    for dp in d {
        dp.exit();
    }
    p.exit();
}

/// One decode instance of two DCP ranks; the prefill is killed mid-transfer:
/// both decode ranks fail the room with a reason (lost control connection)
/// well before the deadline; a restarted prefill serves the next room.
#[test]
fn kill_prefill_mid_transfer() {
    let mut rng = seeded_rng();
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let cl = "faults-kp";
    let transport = if rng.below(2) == 0 { "tcp" } else { "cma" };
    eprintln!("transport {transport}");
    let t = ("transport", transport.to_string());
    let prefill = || {
        support::fault_peer(
            "prefill",
            &url,
            cl,
            &[("role", "prefill".into()), t.clone()],
        )
    };
    let mut p = prefill();
    let mut d: Vec<support::Peer> = (0..2)
        .map(|r| {
            support::fault_peer(
                &format!("decode{r}"),
                &url,
                cl,
                &[
                    ("role", "decode".into()),
                    ("dcp", "2".into()),
                    ("rank", r.to_string()),
                    t.clone(),
                ],
            )
        })
        .collect();
    wait_registered(&server, cl, Role::Prefill, 1);
    // 16 prefill pages = 8 virtual pages of the DCP-2 decode
    let dst: Vec<u64> = (0..8).map(|k| (k * 3 + 1) % 32).collect();
    for dp in d.iter_mut() {
        dp.cmd(recv_total(1, 16 * PAGE, &dst));
        dp.expect_match(|v| v["event"] == "meta" && v["room"] == 1, SLACK);
    }
    p.cmd(send(1, 16, 0, 25));
    let kill_after = rng.below(14);
    eprintln!("killing the prefill after chunk {kill_after}");
    p.expect_match(
        |v| v["event"] == "chunk" && v["room"] == 1 && v["i"] == kill_after,
        DEADLINE,
    );
    p.kill9();
    for (r, dp) in d.iter_mut().enumerate() {
        let dd = dp.done(1, DEADLINE + SLACK);
        assert_failed(&dd, &format!("decode{r}"));
        // the lost connection is noticed at once, not at the deadline
        assert!(
            dd["elapsed_ms"].as_u64().unwrap() < DEADLINE.as_millis() as u64,
            "decode{r} only failed at the deadline: {dd}"
        );
    }
    // restart: the new prefill replaces the dead one's bootstrap entry
    let mut p = prefill();
    std::thread::sleep(Duration::from_millis(50));
    for dp in d.iter_mut() {
        dp.cmd(recv_total(2, 16 * PAGE, &dst));
        dp.expect_match(|v| v["event"] == "meta" && v["room"] == 2, SLACK);
    }
    p.cmd(send(2, 16, 16, 0));
    assert_eq!(p.done(2, DEADLINE + SLACK)["poll"], "Success");
    for dp in d.iter_mut() {
        // each DCP rank holds half of the 256 tokens, and the aux row
        assert_success(
            &dp.done(2, SLACK),
            128 * ROW_TOTAL + AUX_ITEM,
            "decode after restart",
        );
    }
    for dp in d {
        dp.exit();
    }
    p.exit();
}

fn restart_server(addr: std::net::SocketAddr) -> BootstrapServer {
    let end = Instant::now() + DEADLINE;
    loop {
        match BootstrapServer::start(ServerConfig {
            listen: addr.to_string(),
            ..Default::default()
        }) {
            Ok(s) => return s,
            Err(e) => {
                assert!(Instant::now() < end, "cannot listen on {addr} again: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The bootstrap server stops in the middle of a transfer and comes back
/// empty on the same address: the room in flight still succeeds (the data
/// plane does not need it), a room opened while it is down fails with a
/// reason, the ranks re-register through their keep-alive, new rooms succeed.
#[test]
fn bootstrap_restart_mid_transfer() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let (url, addr) = (server.url(), server.addr());
    let cl = "faults-bs";
    let store = server.store();
    wait_prefill_then_outage(
        &url,
        cl,
        600,
        || wait_in(store.as_ref(), cl, Role::Prefill, 1),
        || server.stop(),
        || {
            let server = restart_server(addr);
            wait_registered(&server, cl, Role::Prefill, 1);
            wait_registered(&server, cl, Role::Decode, 1);
            server
        },
    );
}

/// The outage script shared by the bootstrap and etcd restarts. Room 1 is in
/// flight when `stop` takes the store down; room 2, opened during the outage,
/// fails with a reason, promptly; room 1 still succeeds (the data plane does
/// not need the store); after `restart` (which returns once the ranks are
/// registered again, and whose value is kept alive to the end) room 3 succeeds.
fn wait_prefill_then_outage<T>(
    url: &str,
    cl: &str,
    lease_ms: u64,
    registered: impl FnOnce(),
    stop: impl FnOnce(),
    restart: impl FnOnce() -> T,
) {
    let lease = ("lease-ms", lease_ms.to_string());
    let mut p = support::fault_peer(
        "prefill",
        url,
        cl,
        &[("role", "prefill".into()), lease.clone()],
    );
    let mut d = support::fault_peer("decode", url, cl, &[("role", "decode".into()), lease]);
    registered();
    let dst: Vec<u64> = (0..12).collect();
    d.cmd(recv_total(1, 12 * PAGE, &dst));
    d.expect_match(|v| v["event"] == "meta" && v["room"] == 1, SLACK);
    p.cmd(send(1, 12, 0, 40));
    p.expect_match(
        |v| v["event"] == "chunk" && v["room"] == 1 && v["i"] == 2,
        DEADLINE,
    );
    stop();
    d.cmd(recv_total(2, 4 * PAGE, &[20, 21, 22, 23]));
    assert_failed(
        &d.done(2, DEADLINE + SLACK),
        &format!("{cl}: decode room opened during the outage"),
    );
    assert_eq!(p.done(1, DEADLINE + SLACK)["poll"], "Success");
    assert_success(
        &d.done(1, SLACK),
        12 * PAGE * ROW_TOTAL + AUX_ITEM,
        &format!("{cl}: room in flight"),
    );
    let _back = restart();
    d.cmd(recv_total(3, 4 * PAGE, &[24, 25, 26, 27]));
    d.expect_match(|v| v["event"] == "meta" && v["room"] == 3, SLACK);
    p.cmd(send(3, 4, 20, 0));
    assert_eq!(p.done(3, DEADLINE + SLACK)["poll"], "Success");
    assert_success(
        &d.done(3, SLACK),
        4 * PAGE * ROW_TOTAL + AUX_ITEM,
        &format!("{cl}: room after the restart"),
    );
    d.exit();
    p.exit();
}

/// The detector itself: one stray byte just past a pool is reported.
#[test]
fn canaries_catch_a_stray_write() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let mut d = support::fault_peer(
        "decode",
        &server.url(),
        "faults-canary",
        &[("role", "decode".into())],
    );
    d.check_canaries();
    d.cmd(json!({"cmd": "poke"}));
    d.expect_match(|v| v["event"] == "poked", SLACK);
    d.cmd(json!({"cmd": "check"}));
    assert_eq!(
        d.expect_match(|v| v["event"] == "canaries", SLACK)["damaged"],
        1
    );
}

/// etcd (the bootstrap backend) is killed with SIGKILL mid-transfer and
/// restarted on its data directory: the room in flight succeeds, a room opened
/// during the outage fails with a reason, the ranks' keep-alives resume and
/// new rooms succeed. Without an etcd binary the skip is recorded
/// ([`common::skip`]).
#[test]
fn etcd_restart_mid_transfer() {
    let Some(mut etcd) = Etcd::start() else {
        return; // the skip is recorded
    };
    let url = etcd.store_url("faults");
    let store = pdxfer::bootstrap::open_store(&url, None).unwrap();
    let (bin, dir, client, peer) = (
        Etcd::binary().expect("etcd started"),
        etcd.dir.clone(),
        etcd.client,
        etcd.peer,
    );
    let cl = "faults-etcd";
    wait_prefill_then_outage(
        &url,
        cl,
        2000,
        || wait_in(store.as_ref(), cl, Role::Prefill, 1),
        || etcd.kill9(),
        || {
            let etcd = Etcd::start_at(&bin, &dir, client, peer);
            wait_in(store.as_ref(), cl, Role::Prefill, 1);
            etcd
        },
    );
}

/// Deletes the network namespaces it names (and with them their veth ends).
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Prefill and decode in two network namespaces of their own joined by a veth
/// pair (10.231.x addresses exist only inside them), tcp transport, the
/// bootstrap server in the prefill's namespace. The decode's link goes down in
/// the middle of a transfer: both sides fail the room with a reason within its
/// deadline, and both processes still exit when told. Where namespaces cannot
/// be created (not root, no `ip`) the skip is recorded ([`common::skip`]).
#[test]
fn netns_link_down_mid_transfer() {
    let tag = format!("pdx{}", std::process::id() % 1_000_000);
    let (np, nd) = (format!("{tag}p"), format!("{tag}d"));
    if !ip(&["netns", "add", &np]) {
        skip("netns", "`ip netns add` failed (needs root and iproute2)");
        return;
    }
    let _ns = Netns(vec![np.clone(), nd.clone()]);
    let (vp, vd) = (format!("{tag}a"), format!("{tag}b"));
    let setup = ip(&["netns", "add", &nd])
        && ip(&[
            "link", "add", &vp, "netns", &np, "type", "veth", "peer", "name", &vd, "netns", &nd,
        ])
        && ip(&["-n", &np, "addr", "add", "10.231.0.1/24", "dev", &vp])
        && ip(&["-n", &nd, "addr", "add", "10.231.0.2/24", "dev", &vd])
        && ip(&["-n", &np, "link", "set", "lo", "up"])
        && ip(&["-n", &nd, "link", "set", "lo", "up"])
        && ip(&["-n", &np, "link", "set", &vp, "up"])
        && ip(&["-n", &nd, "link", "set", &vd, "up"]);
    if !setup {
        skip(
            "netns",
            "cannot set up the veth pair between the namespaces",
        );
        return;
    }
    // the bootstrap server inside the prefill's namespace
    let mut boot = Command::new("ip")
        .args([
            "netns",
            "exec",
            &np,
            env!("CARGO_BIN_EXE_pdxfer"),
            "bootstrap",
            "--listen",
            "10.231.0.1:0",
            // the test's own veth pair: no token on a non-loopback address
            "--insecure",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn pdxfer bootstrap");
    struct KillOnDrop(Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(
        &mut std::io::BufReader::new(boot.stdout.take().unwrap()),
        &mut line,
    );
    let _boot = KillOnDrop(boot);
    let url = serde_json::from_str::<Value>(&line).expect("bootstrap url line")["url"]
        .as_str()
        .unwrap()
        .to_string();
    let cl = "faults-netns";
    let bin = env!("CARGO_BIN_EXE_pdxfer-fault-peer");
    // listeners on the veth addresses need the cluster secret
    let secret_env = format!(
        "{}=faults-netns-cluster-secret-0123456789",
        pdxfer::transport::CLUSTER_SECRET_ENV
    );
    let common = |role: &str, host: &str| {
        vec![
            ("role", role.to_string()),
            ("transport", "tcp".to_string()),
            ("host", host.to_string()),
        ]
    };
    let mut p = support::Peer::spawn_wrapped(
        &["ip", "netns", "exec", &np, "env", &secret_env],
        bin,
        "prefill",
        &url,
        cl,
        &common("prefill", "10.231.0.1"),
    );
    let mut d = support::Peer::spawn_wrapped(
        &["ip", "netns", "exec", &nd, "env", &secret_env],
        bin,
        "decode",
        &url,
        cl,
        &common("decode", "10.231.0.2"),
    );
    // a room over the veth first: the path works
    let dst: Vec<u64> = (0..12).collect();
    d.cmd(recv_total(1, 4 * PAGE, &dst[..4]));
    d.expect_match(|v| v["event"] == "meta" && v["room"] == 1, SLACK);
    p.cmd(send(1, 4, 0, 0));
    assert_eq!(p.done(1, DEADLINE + SLACK)["poll"], "Success");
    assert_success(
        &d.done(1, SLACK),
        4 * PAGE * ROW_TOTAL + AUX_ITEM,
        "room over the veth",
    );
    // then the link goes down mid-transfer
    d.cmd(recv_total(2, 12 * PAGE, &dst));
    d.expect_match(|v| v["event"] == "meta" && v["room"] == 2, SLACK);
    p.cmd(send(2, 12, 16, 40));
    p.expect_match(
        |v| v["event"] == "chunk" && v["room"] == 2 && v["i"] == 2,
        DEADLINE,
    );
    assert!(ip(&["-n", &nd, "link", "set", &vd, "down"]), "link down");
    assert_failed(&p.done(2, DEADLINE + SLACK), "prefill, link down");
    assert_failed(&d.done(2, DEADLINE + SLACK), "decode, link down");
    // neither process hangs on the dead link at exit
    let t = Instant::now();
    d.exit();
    p.exit();
    eprintln!(
        "both ranks exited {:?} after the link went down",
        t.elapsed()
    );
}
