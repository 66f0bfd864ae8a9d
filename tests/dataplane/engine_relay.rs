//! The engine's control channel against an on-path relay: a relay process
//! without the secret (uid 65534 when the test runs as root) sits between a
//! real decode engine and a real prefill engine (in this process), passes the
//! three authentication lines through and flips one byte of a later line
//! (the decode's Hello, the prefill's HelloAck, the decode's Meta). Each is
//! caught by the session MAC: the room fails with `channel_integrity` on the
//! decode and no byte of the decode's pools changes. Through the same relay
//! without a rewrite the room succeeds.

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::Status;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};

const SECRET: &str = "engine-relay-cluster-secret-0123456789";
const LAYERS: u32 = 4;
const ROW: u64 = 64;
const P: u64 = 16;
const TOTAL: u64 = 40;
const CHILD_ENV: &str = "PDXFER_ENGINE_RELAY_CHILD";

/// The relay: re-runs this test binary for [`child_relay`], as uid/gid
/// 65534 when root; its JSON lines come through the shared harness.
fn spawn_relay(upstream: &str, plan: &str) -> crate::support::Proc {
    let mut c = crate::support::child::command(module_path!(), "child_relay", CHILD_ENV, true);
    c.env("RELAY_UPSTREAM", upstream)
        .env("RELAY_PLAN", plan)
        .stderr(Stdio::inherit());
    crate::support::Proc::start("relay", c)
}

/// One JSON line for the parent (on a line of its own: the harness may have
/// printed the test's name without a newline).
fn report(v: Value) {
    println!("\n{v}");
}

/// Adds one to the first digit after `key` in `line` (a JSON line without
/// its tag); true when there was one.
fn bump_digit_after(line: &mut [u8], key: &[u8]) -> bool {
    let Some(at) = line.windows(key.len()).position(|w| w == key) else {
        return false;
    };
    let Some(d) = line[at + key.len()..]
        .iter()
        .position(u8::is_ascii_digit)
        .map(|i| at + key.len() + i)
    else {
        return false;
    };
    line[d] = b'0' + (line[d] - b'0' + 1) % 10;
    true
}

/// A rewrite: the line (from 0) whose digit after the key is bumped.
type Rewrite = (usize, &'static [u8]);

/// Copies lines from `from` to `to`; line `at` (from 0) is rewritten by
/// bumping the digit after `key`, its tag kept (the relay cannot re-tag).
fn pipe(mode: String, from: TcpStream, mut to: TcpStream, rewrite: Option<Rewrite>) {
    let mut r = BufReader::new(from);
    let mut line = Vec::new();
    for n in 0.. {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if let Some((_, key)) = rewrite.filter(|(at, _)| *at == n) {
            if bump_digit_after(&mut line, key) {
                report(json!({"event": "rewrote", "mode": mode, "line": n}));
            }
        }
        if to.write_all(&line).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The relay: listens, reports its address, and relays its n-th connection
/// to `RELAY_UPSTREAM` with the n-th rewrite of `RELAY_PLAN` (`hello`,
/// `hello_ack`, `meta` or `none`; `none` past its end). Ends by itself after
/// 60 s.
#[test]
#[ignore = "child process of the engine_relay tests"]
fn child_relay() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("child_relay") {
        return;
    }
    let upstream = std::env::var("RELAY_UPSTREAM").unwrap();
    let plan: Vec<String> = std::env::var("RELAY_PLAN")
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(0);
    });
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    report(json!({"event": "listening", "addr": l.local_addr().unwrap().to_string()}));
    for (n, c) in l.incoming().enumerate() {
        let Ok(c) = c else { continue };
        let Ok(u) = TcpStream::connect(&upstream) else {
            continue;
        };
        let mode = plan.get(n).cloned().unwrap_or_else(|| "none".into());
        report(json!({"event": "connection", "n": n, "mode": mode}));
        // decode -> prefill: auth_hello, auth_proof, hello, meta ...;
        // prefill -> decode: auth_challenge, hello_ack, status ...
        let (up, down): (Option<Rewrite>, Option<Rewrite>) = match mode.as_str() {
            "hello" => (Some((2, b"\"data_addr\":\"")), None),
            "meta" => (Some((3, b"\"dst_pages\":[")), None),
            "hello_ack" => (None, Some((1, b"\"dp_rank\":"))),
            _ => (None, None),
        };
        let (c2, u2) = (c.try_clone().unwrap(), u.try_clone().unwrap());
        let m2 = mode.clone();
        std::thread::spawn(move || pipe(m2, c, u, up));
        std::thread::spawn(move || pipe(mode, u2, c2, down));
    }
}

fn engine(role: Role, url: &str, pages: u64, ctl_via: Option<String>) -> (Engine, SyntheticPools) {
    let pools = SyntheticPools::new(LAYERS, ROW, P, pages, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(role, "relay", url, pools.topology(1, 0), pools.kv_pools());
    cfg.aux = pools.aux_buffers();
    cfg.token = Some(SECRET.into());
    cfg.room_timeout = Duration::from_secs(20);
    cfg.testing.ctl_via = ctl_via;
    // SAFETY: the pools are returned with the engine and outlive it in the test.
    (unsafe { Engine::new(cfg) }.unwrap(), pools)
}

fn pool_bytes(p: &SyntheticPools) -> Vec<Vec<u8>> {
    (0..LAYERS as usize)
        .map(|l| p.layer_bytes(l).to_vec())
        .collect()
}

fn side(pages: &[u64]) -> Side<'_> {
    Side {
        layout: DcpLayout::sglang(P, 1).unwrap(),
        rank: 0,
        pages,
        origin: 0,
    }
}

/// Waits (10 s at most) for the relay to report the rewrite of `mode`.
fn rewrote(relay: &crate::support::Proc, mode: &str) {
    relay.expect_match(
        |v| v["event"] == "rewrote" && v["mode"] == mode,
        Duration::from_secs(10),
    );
}

#[test]
fn a_relay_that_rewrites_an_engine_control_line_is_caught() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let (prefill, mut p_pools) = engine(Role::Prefill, &url, 64, None);
    let upstream = prefill.registration().unwrap().endpoints["ctl"].clone();
    let relay = spawn_relay(&upstream, "hello,hello_ack,meta,none");
    let via = relay.expect("listening")["addr"]
        .as_str()
        .unwrap()
        .to_string();
    let (decode, d_pools) = engine(Role::Decode, &url, 32, Some(via));
    let src: Vec<u64> = (0..TOTAL.div_ceil(P)).map(|i| i * 7 % 64).collect();
    let dst: Vec<u64> = (0..TOTAL.div_ceil(P)).map(|i| i * 3 % 32 + 1).collect();
    let before = pool_bytes(&d_pools);

    // the decode's Hello (its data address) and the prefill's HelloAck
    // rewritten: the link is refused, the room fails, nothing is written
    for (room, mode) in [(1u64, "hello"), (2, "hello_ack")] {
        let e = decode
            .receiver(room, 0, Some(Duration::from_secs(20)))
            .unwrap_err();
        rewrote(&relay, mode);
        assert_eq!(e.status(), Status::ChannelIntegrity, "{mode}: {e}");
        assert!(e.detail().contains("session MAC"), "{mode}: {e}");
        assert_eq!(decode.poll(room), KvPoll::Failed, "{mode}");
        assert_eq!(
            decode.failure(room).map(|e| e.status()),
            Some(Status::ChannelIntegrity),
            "{mode}"
        );
        decode.clear(room).unwrap();
    }

    // the decode's Meta rewritten (other destination pages): the prefill
    // drops the connection and tells the decode why; the prefill, asked to
    // send the room, has no metadata to write with
    p_pools.fill(3, &side(&src), TOTAL);
    p_pools.fill_aux(3, 3);
    decode
        .receiver(3, 0, Some(Duration::from_secs(20)))
        .unwrap();
    decode.send_metadata(3, &dst, 0, 5).unwrap();
    rewrote(&relay, "meta");
    assert_eq!(
        decode.wait(3, Duration::from_secs(10)),
        KvPoll::Failed,
        "{:?}",
        decode.failure(3)
    );
    let e = decode.failure(3).unwrap();
    assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
    assert!(e.detail().contains("session MAC"), "{e}");
    prefill.sender(3).unwrap();
    let _ = prefill.send(3, &src, TOTAL, true, 3);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        pool_bytes(&d_pools) == before,
        "bytes of the decode's pools changed"
    );
    decode.clear(3).unwrap();

    // the same relay, passing every line: the room succeeds
    p_pools.fill(4, &side(&src), TOTAL);
    p_pools.fill_aux(4, 3);
    let t = Instant::now();
    decode
        .receiver(4, 0, Some(Duration::from_secs(20)))
        .unwrap();
    decode.send_metadata(4, &dst, 0, 5).unwrap();
    prefill.sender(4).unwrap();
    while prefill.poll(4) == KvPoll::Bootstrapping {
        assert!(t.elapsed() < Duration::from_secs(10), "no metadata");
        std::thread::sleep(Duration::from_millis(5));
    }
    prefill.send(4, &src, TOTAL, true, 3).unwrap();
    for (e, who) in [(&prefill, "prefill"), (&decode, "decode")] {
        assert_eq!(
            e.wait(4, Duration::from_secs(20)),
            KvPoll::Success,
            "{who}: {:?}",
            e.failure(4)
        );
    }
    assert!(d_pools.verify(4, &side(&dst), TOTAL, Some(5)).unwrap() > 0);
    // it went through the relay, on its fourth connection
    relay.expect_match(
        |v| v["event"] == "connection" && v["n"] == 3 && v["mode"] == "none",
        Duration::from_secs(1),
    );
    drop(decode);
    drop(prefill);
    drop(d_pools);
    drop(server);
}
