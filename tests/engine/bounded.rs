//! Bounded resources and contained stalls, with real processes: `pdxfer
//! target` (an agent) and `pdxfer-fault-peer` engine ranks are flooded with
//! idle connections, left half-open sessions and half-sent pieces, starved of
//! descriptors, or have one of their decode peers SIGSTOPped; each must stay
//! bounded (threads read from `/proc/<pid>/status`), release what a silent
//! peer holds after its timeout, and keep serving real peers.

use crate::support::target::Target;
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::bootstrap::store::Store;
use pdxfer::transport::{
    wire, Agent, AgentOptions, BatchOptions, ConnectOptions, TransportKind, WriteOp,
};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support;
use support::{DEADLINE, SLACK};

const FLOOD: usize = 2000;
const PAGE: u64 = 16;
const ROW_TOTAL: u64 = 4 * 64;
const AUX_ITEM: u64 = 32;

/// Threads of process `pid`.
fn threads(pid: u32) -> usize {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads line")
}

/// CPU time (user + system) of process `pid`.
fn cpu_time(pid: u32) -> Duration {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // fields after the command name: state is field 3; utime 14, stime 15
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// Lets this test process hold the flood's descriptors.
fn raise_nofile(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: r is a valid rlimit to fill in.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    assert!(
        r.rlim_max >= want,
        "the flood needs {want} descriptors; the hard limit is {}",
        r.rlim_max
    );
    if r.rlim_cur < want {
        r.rlim_cur = want;
        // SAFETY: r is a valid rlimit within the hard limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    }
}

/// `n` connections to `addr` that never send a byte.
fn flood(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            TcpStream::connect(addr)
                .unwrap_or_else(|e| panic!("idle connection {i} to {addr}: {e}"))
        })
        .collect()
}

/// Waits up to 10 s for the other side to have closed at least `want` of
/// `conns`; returns how many it closed.
fn closed_at_least(conns: &[TcpStream], want: usize) -> usize {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let c = closed(conns);
        if c >= want || Instant::now() >= end {
            return c;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How many of `conns` the other side closed.
fn closed(conns: &[TcpStream]) -> usize {
    conns
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            let r = (&**s).read(&mut b);
            s.set_nonblocking(false).unwrap();
            match r {
                Ok(0) => true,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                Ok(_) => false,
            }
        })
        .count()
}

/// A real sender: writes 4 KiB into the target's region over tcp and checks
/// the batch completed and the target delivered its completion record.
fn real_write(t: &Target, a: &Agent, src: &mut [u8], room: u64) {
    // SAFETY: `src` outlives its registration (unregistered below).
    let d = unsafe { a.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let tr = a
        .connect(
            &t.addr,
            &ConnectOptions {
                transport: TransportKind::Tcp,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("a real peer could not connect: {e}"));
    let ops = [WriteOp {
        local_region: d.id,
        local_offset: 0,
        remote_region: t.region,
        remote_offset: 0,
        len: 4096,
    }];
    let opts = BatchOptions {
        room,
        ..Default::default()
    };
    let id = tr.submit(&ops, &opts).unwrap();
    let c = tr.wait(id, Duration::from_secs(20)).unwrap();
    assert_eq!(c.bytes, 4096);
    let line = t.line("completion");
    assert_eq!(line["completion"]["room"], room, "{line}");
    tr.close();
    a.registry()
        .unregister(d.id, Duration::from_secs(5))
        .unwrap();
}

/// 2,000 idle connections to an agent: its threads stay bounded (no thread
/// per connection), the excess is closed, and a real peer is still served.
#[test]
fn agent_idle_flood_is_bounded_and_real_peers_are_served() {
    raise_nofile(FLOOD as u64 + 512);
    let t = Target::spawn(1 << 20, &["--max-pending", "256"], None);
    let base = threads(t.pid);
    let conns = flood(&t.addr, FLOOD);
    std::thread::sleep(Duration::from_millis(500));
    let n = threads(t.pid);
    assert!(
        n <= base + 2,
        "{FLOOD} idle connections grew the agent from {base} to {n} threads"
    );
    let c = closed_at_least(&conns, FLOOD - 256);
    assert!(
        c >= FLOOD - 256,
        "{c} of {FLOOD} idle connections closed; at most 256 may wait"
    );
    let a = Agent::new(&AgentOptions::default()).unwrap();
    let mut src = vec![7u8; 4096];
    real_write(&t, &a, &mut src, 1);
    assert!(threads(t.pid) <= base + 8, "threads after a real peer");
    drop(conns);
}

/// A raw-wire client: dials `addr` and performs the authentication exchange
/// (the target runs without a secret, on loopback), as one fixed instance, so
/// its data streams attach to its sessions; its frames after the exchange are
/// sealed with the session keys.
fn dial(addr: &str) -> Raw {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (_, keys) = pdxfer::transport::peer_auth::authenticate_client(
        &mut s,
        &pdxfer::auth::Mode::Open,
        [0x5b; 16],
        None,
        "target",
    )
    .unwrap();
    Raw::new(s, keys)
}

type Raw = pdxfer::transport::peer_auth::Sealed<TcpStream>;

/// Opens a raw tcp session (hello, select tcp) to `addr`; returns the
/// control connection and the HelloAck.
fn raw_session(addr: &str) -> (Raw, Value) {
    let mut s = dial(addr);
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &json!({"version": wire::VERSION, "identity": me}),
    )
    .unwrap();
    let (ty, p) = wire::read_frame(&mut s).unwrap();
    assert_eq!(ty, wire::FrameType::HelloAck);
    let ack: Value = serde_json::from_slice(&p).unwrap();
    wire::write_json(
        &mut s,
        wire::FrameType::Select,
        &json!({"transport": "tcp", "streams": 1, "proof": 0}),
    )
    .unwrap();
    assert_eq!(
        wire::read_frame(&mut s).unwrap().0,
        wire::FrameType::SelectOk
    );
    (s, ack)
}

/// Waits up to `within` for the other side to close `s`; the time it took.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return None
            }
            Err(_) => return Some(t0.elapsed()),
        }
        if t0.elapsed() >= within {
            return None;
        }
    }
}

/// A session whose sender went silent is closed after the idle timeout; a
/// real sender's idle session stays open (its keepalives) and still works.
#[test]
fn an_idle_half_open_session_is_closed_after_its_timeout() {
    let mut t = Target::spawn(
        1 << 20,
        &[
            "--idle-timeout-ms",
            "1000",
            "--handshake-timeout-ms",
            "1000",
        ],
        None,
    );
    let (mut silent, _) = raw_session(&t.addr);
    let opened = Instant::now();
    let a = Agent::new(&AgentOptions::default()).unwrap();
    let mut src = vec![3u8; 4096];
    // SAFETY: `src` lives until the end of the test, after the agent.
    let d = unsafe { a.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let real = a
        .connect(
            &t.addr,
            &ConnectOptions {
                transport: TransportKind::Tcp,
                keepalive: Duration::from_millis(200),
                ..Default::default()
            },
        )
        .unwrap();
    closed_within(&mut silent, Duration::from_secs(5))
        .expect("the silent session was not closed within 5 s");
    let took = opened.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before its idle timeout"
    );
    // three idle timeouts later the real session still carries a batch
    std::thread::sleep(Duration::from_millis(2000));
    t.cmd("stats");
    assert_eq!(
        t.line("sessions")["sessions"],
        1,
        "only the real session is left"
    );
    let ops = [WriteOp {
        local_region: d.id,
        local_offset: 0,
        remote_region: t.region,
        remote_offset: 0,
        len: 4096,
    }];
    let id = real.submit(&ops, &BatchOptions::default()).unwrap();
    real.wait(id, Duration::from_secs(10)).unwrap();
    // a connection stuck in its handshake (authenticated, hello answered, no
    // select) is closed too
    let mut s = dial(&t.addr);
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    wire::write_json(
        &mut s,
        wire::FrameType::Hello,
        &json!({"version": wire::VERSION, "identity": me}),
    )
    .unwrap();
    assert_eq!(
        wire::read_frame(&mut s).unwrap().0,
        wire::FrameType::HelloAck
    );
    let took = closed_within(&mut s, Duration::from_secs(5))
        .expect("a connection stuck in its handshake was not closed within 5 s");
    assert!(took >= Duration::from_millis(700), "closed after {took:?}");
    drop(real);
    drop(a);
}

/// A data piece that announces 64 KiB and stops after 100 bytes pins the
/// region only until the pin timeout: unregister then succeeds.
#[test]
fn a_half_sent_piece_releases_its_pin_after_the_timeout() {
    let mut t = Target::spawn(1 << 20, &["--pin-timeout-ms", "1500"], None);
    let (_ctl, ack) = raw_session(&t.addr);
    let mut data = dial(&t.addr);
    wire::write_json(
        &mut data,
        wire::FrameType::Attach,
        &json!({"session": ack["session"], "token": ack["token"], "index": 0}),
    )
    .unwrap();
    assert_eq!(
        wire::read_frame(&mut data).unwrap().0,
        wire::FrameType::AttachOk
    );
    let h = wire::DataHeader {
        flags: 0,
        batch: 1,
        region: t.region,
        offset: 0,
        len: 64 << 10,
    };
    data.write_all(&h.encode()).unwrap();
    data.write_all(&[9u8; 100]).unwrap();
    std::thread::sleep(Duration::from_millis(300)); // the target reads the header and pins
    let busy = t.unregister(100);
    assert_eq!(
        busy["ok"], false,
        "the piece in progress pins the region: {busy}"
    );
    let t0 = Instant::now();
    let r = t.unregister(5000);
    assert_eq!(r["ok"], true, "the pin never expired: {r}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(
        closed_within(&mut data, Duration::from_secs(2)).is_some(),
        "the stalled stream is closed"
    );
}

/// A cma-style grant whose commit never comes pins the region only until
/// the pin timeout: unregister then succeeds, and the late commit is refused.
#[test]
fn an_uncommitted_grant_expires_after_the_pin_timeout() {
    let mut t = Target::spawn(1 << 20, &["--pin-timeout-ms", "1000"], None);
    let (mut ctl, _) = raw_session(&t.addr);
    let range = wire::Range {
        region: t.region,
        offset: 0,
        len: 4096,
    };
    wire::write_frame(
        &mut ctl,
        wire::FrameType::Intent,
        &wire::encode_intent(1, &[range]),
    )
    .unwrap();
    assert_eq!(
        wire::read_frame(&mut ctl).unwrap().0,
        wire::FrameType::Grant
    );
    let busy = t.unregister(100);
    assert_eq!(busy["ok"], false, "the grant pins the region: {busy}");
    let t0 = Instant::now();
    let r = t.unregister(5000);
    assert_eq!(r["ok"], true, "the grant never expired: {r}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    let c = wire::Commit {
        batch: 1,
        bytes: 4096,
        checksum: None,
        room: 0,
        epoch: 0,
    };
    wire::write_frame(&mut ctl, wire::FrameType::Commit, &wire::encode_commit(&c)).unwrap();
    let (ty, p) = wire::read_frame(&mut ctl).unwrap();
    assert_eq!(ty, wire::FrameType::Nack);
    let (batch, e) = wire::decode_reason(&p).unwrap();
    assert_eq!(batch, 1);
    assert!(e.detail().contains("expired"), "{e}");
}

/// Out of descriptors (RLIMIT_NOFILE 64, 150 connections kept open: each one
/// the agent closes is opened again), the agent backs off instead of
/// spinning on accept, and serves again once they close.
#[test]
fn emfile_backs_off_and_keeps_serving() {
    let t = Target::spawn(1 << 20, &[], Some(64));
    // more than its descriptors, fewer than the listen backlog (so every connect completes)
    let mut conns = flood(&t.addr, 150);
    std::thread::sleep(Duration::from_millis(300));
    let c0 = cpu_time(t.pid);
    let end = Instant::now() + Duration::from_secs(2);
    let mut reopened = 0;
    while Instant::now() < end {
        for c in conns.iter_mut() {
            if closed(std::slice::from_ref(c)) == 1 {
                let addr: std::net::SocketAddr = t.addr.parse().unwrap();
                if let Ok(n) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    *c = n;
                    reopened += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let used = cpu_time(t.pid) - c0;
    eprintln!("CPU while out of descriptors: {used:?} in 2 s ({reopened} connections reopened)");
    assert!(
        used < Duration::from_millis(300),
        "the agent used {used:?} of CPU in 2 s while out of descriptors (spinning)"
    );
    drop(conns);
    std::thread::sleep(Duration::from_millis(1500));
    let a = Agent::new(&AgentOptions::default()).unwrap();
    let mut src = vec![5u8; 4096];
    real_write(&t, &a, &mut src, 2);
}

/// The fault tests' engine ranks.
use support::fault_peer as rank;

fn wait_in(server: &BootstrapServer, cluster: &str, role: Role, n: usize) -> Vec<Value> {
    let end = Instant::now() + DEADLINE;
    loop {
        let e = server.store().entries(cluster, role).unwrap_or_default();
        if e.len() >= n {
            return e.iter().map(|r| serde_json::to_value(r).unwrap()).collect();
        }
        assert!(
            Instant::now() < end,
            "{cluster}: {n} {role:?} never registered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(room: u64, pages: u64, src0: u64) -> Value {
    json!({"cmd": "send", "room": room, "total": pages * PAGE,
           "src_pages": (0..pages).map(|i| src0 + i).collect::<Vec<_>>(),
           "chunk_pages": 1, "aux": room % 8, "delay_ms": 0,
           "timeout_ms": DEADLINE.as_millis() as u64})
}

fn recv(room: u64, total: u64, dst_pages: &[u64]) -> Value {
    json!({"cmd": "recv", "room": room, "total": total, "dst_pages": dst_pages,
           "aux": room % 8, "timeout_ms": DEADLINE.as_millis() as u64})
}

/// One room from the prefill to decode `d`, which must succeed byte-exact.
fn room_ok(p: &mut support::Peer, d: &mut support::Peer, room: u64, src0: u64) {
    let dst: Vec<u64> = (0..4).map(|k| 20 + k).collect();
    d.cmd(recv(room, 4 * PAGE, &dst));
    d.expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
    p.cmd(send(room, 4, src0));
    let pd = p.done(room, DEADLINE + SLACK);
    assert_eq!(pd["poll"], "Success", "prefill room {room}: {pd}");
    let dd = d.done(room, SLACK);
    assert_eq!(dd["poll"], "Success", "decode room {room}: {dd}");
    assert_eq!(dd["verified"], 4 * PAGE * ROW_TOTAL + AUX_ITEM, "{dd}");
}

/// 2,000 idle connections to a prefill's control port: its threads stay
/// bounded, the excess is closed, and a decode rank still connects and
/// receives a room.
#[test]
fn prefill_ctl_idle_flood_is_bounded_and_decodes_are_served() {
    raise_nofile(FLOOD as u64 + 512);
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let cl = "bounded-ctl";
    let mut p = rank("prefill", &url, cl, &[("role", "prefill".into())]);
    let reg = wait_in(&server, cl, Role::Prefill, 1);
    let ctl = reg[0]["endpoints"]["ctl"].as_str().unwrap().to_string();
    let pid = p.child.id();
    let base = threads(pid);
    let conns = flood(&ctl, FLOOD);
    std::thread::sleep(Duration::from_millis(500));
    let n = threads(pid);
    assert!(
        n <= base + 2,
        "{FLOOD} idle connections grew the prefill from {base} to {n} threads"
    );
    let c = closed_at_least(&conns, FLOOD - 256);
    assert!(c >= FLOOD - 256, "{c} of {FLOOD} idle connections closed");
    let mut d = rank("decode", &url, cl, &[("role", "decode".into())]);
    room_ok(&mut p, &mut d, 1, 0);
    drop(conns);
    d.exit();
    p.exit();
}

/// Three decode ranks on one prefill (two workers); one is SIGSTOPped:
/// rooms to the two healthy ones all succeed within their deadline, the
/// stopped one's rooms fail with a reason naming it, and after SIGCONT
/// rooms to it succeed again.
#[test]
fn a_stopped_decode_delays_only_its_own_rooms() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let cl = "bounded-stall";
    let t = ("transport", "tcp".to_string());
    let mut p = rank(
        "prefill",
        &url,
        cl,
        &[
            ("role", "prefill".into()),
            ("workers", "2".into()),
            t.clone(),
        ],
    );
    let mut d: Vec<support::Peer> = (0..3)
        .map(|i| {
            rank(
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
        })
        .collect();
    wait_in(&server, cl, Role::Prefill, 1);
    let decodes = wait_in(&server, cl, Role::Decode, 3);
    let stopped = 2usize;
    let stopped_id = decodes
        .iter()
        .find(|r| r["dp_rank"] == stopped as u64)
        .map(|r| r["instance_id"].as_str().unwrap().to_string())
        .unwrap();
    // warm every link, then stop one decode
    for (i, dp) in d.iter_mut().enumerate() {
        room_ok(&mut p, dp, 100 + i as u64, 8 * i as u64);
    }
    let spid = d[stopped].child.id() as i32;
    // the stopped decode's rooms: metadata sent, then it stops answering
    // two rooms per decode: six rooms with distinct aux rows (room % 8)
    let per = 2u64;
    let dst: Vec<u64> = (0..4).collect();
    let room_of = |i: usize, k: u64| 1 + i as u64 * 10 + k;
    for k in 0..per {
        let room = room_of(stopped, k);
        d[stopped].cmd(recv(room, 4 * PAGE, &dst));
        d[stopped].expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGSTOP) }, 0);
    for (i, dp) in d.iter_mut().enumerate() {
        if i == stopped {
            continue;
        }
        for k in 0..per {
            let room = room_of(i, k);
            let dst: Vec<u64> = (0..4).map(|x| 4 * k + x).collect();
            dp.cmd(recv(room, 4 * PAGE, &dst));
            dp.expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
        }
    }
    // interleave the rooms so that every worker sees the stopped decode's
    let t0 = Instant::now();
    for k in 0..per {
        for i in 0..3 {
            p.cmd(send(room_of(i, k), 4, 4 * (3 * k + i as u64)));
        }
    }
    for k in 0..per {
        for i in 0..3 {
            let room = room_of(i, k);
            let pd = p.done(room, DEADLINE + SLACK);
            if i == stopped {
                assert_eq!(
                    pd["poll"], "Failed",
                    "room {room} of the stopped decode: {pd}"
                );
                let reason = pd["reason"].as_str().unwrap_or("");
                assert!(
                    reason.contains(&stopped_id),
                    "room {room}: the reason does not name the stopped decode {stopped_id}: {pd}"
                );
            } else {
                assert_eq!(
                    pd["poll"], "Success",
                    "room {room} to a healthy decode: {pd}"
                );
                let ms = pd["elapsed_ms"].as_u64().unwrap();
                assert!(ms < DEADLINE.as_millis() as u64, "room {room} took {ms} ms");
            }
        }
    }
    for (i, dp) in d.iter_mut().enumerate() {
        if i == stopped {
            continue;
        }
        for k in 0..per {
            let dd = dp.done(room_of(i, k), SLACK);
            assert_eq!(dd["poll"], "Success", "{dd}");
            assert_eq!(dd["verified"], 4 * PAGE * ROW_TOTAL + AUX_ITEM, "{dd}");
        }
    }
    eprintln!("healthy rooms done after {:?}", t0.elapsed());
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(spid, libc::SIGCONT) }, 0);
    for k in 0..per {
        let dd = d[stopped].done(room_of(stopped, k), DEADLINE + SLACK);
        assert_eq!(dd["poll"], "Failed", "{dd}");
    }
    // once the prefill's batches to it finished (the batch timeout at most),
    // rooms to it succeed again
    let end = Instant::now() + Duration::from_secs(45);
    let mut room = 200;
    loop {
        let dst: Vec<u64> = (0..4).map(|x| 20 + x).collect();
        d[stopped].cmd(recv(room, 4 * PAGE, &dst));
        d[stopped].expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
        p.cmd(send(room, 4, 56));
        let pd = p.done(room, DEADLINE + SLACK);
        let dd = d[stopped].done(room, DEADLINE + SLACK);
        if pd["poll"] == "Success" {
            assert_eq!(dd["verified"], 4 * PAGE * ROW_TOTAL + AUX_ITEM, "{dd}");
            break;
        }
        assert!(
            Instant::now() < end,
            "rooms to the resumed decode keep failing: {pd}"
        );
        room += 1;
    }
    p.check_canaries();
    for dp in d {
        dp.exit();
    }
    p.exit();
}
