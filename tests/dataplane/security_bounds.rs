//! No lock-out before authentication, and the bootstrap's own bounds, as
//! real processes on loopback: a flooding process (as uid 65534 when the
//! tests run as root, else as this uid; it says which) holds more idle
//! connections than a listener's slots, each having sent a valid first
//! message (or nothing), from one source address and from several
//! (127.0.0.x); meanwhile a real peer still completes its handshake
//! promptly against an agent's data port, a prefill's control port and
//! `pdxfer bootstrap` (`/health` answers 200). The store's byte bound
//! answers 507 and frees its bytes on expiry and replacement; `pdxfer
//! bootstrap` on a non-loopback address without a token refuses to start
//! unless `--insecure`. Every test stops by itself within seconds.

use pdxfer::auth::{Channel, ClientAuth, Mode};
use pdxfer::bootstrap::{InstanceId, RegisterRequest, Registration, Role};
use pdxfer::layout::Topology;
use pdxfer::transport::wire::{self, FrameType};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long the flooder holds its connections (it exits then by itself).
const HOLD: Duration = Duration::from_secs(20);
/// A real peer's handshake under a flood must end within this.
const PROMPT: Duration = Duration::from_secs(5);

/// The flooder's entry point: run only when re-executed by [`Flooder`].
#[test]
#[ignore = "the flooding process of the tests below, run by them"]
fn flooder_process() {
    let Ok(addr) = std::env::var("SB_FLOOD_ADDR") else {
        return;
    };
    let addr: SocketAddr = addr.parse().unwrap();
    let n: usize = std::env::var("SB_FLOOD_N").unwrap().parse().unwrap();
    let sources: u8 = std::env::var("SB_FLOOD_SOURCES").unwrap().parse().unwrap();
    let first = unhex(&std::env::var("SB_FLOOD_FIRST").unwrap_or_default());
    let hold: u64 = std::env::var("SB_FLOOD_HOLD_MS").unwrap().parse().unwrap();
    let redial = std::env::var("SB_FLOOD_REDIAL").is_ok_and(|v| v == "1");
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let mut held = Vec::new();
    let mut failed = 0;
    for i in 0..n {
        let src = Ipv4Addr::new(127, 0, 0, 2 + (i % sources as usize) as u8);
        match connect_from(src, addr) {
            Ok(mut s) => {
                let _ = s.write_all(&first);
                held.push(s);
            }
            Err(_) => failed += 1,
        }
    }
    println!("FLOODER uid={uid} held={} failed={failed}", held.len());
    std::io::stdout().flush().unwrap();
    let end = Instant::now() + Duration::from_millis(hold);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        if !redial {
            continue;
        }
        // re-dial what the listener closed, keeping the pressure on
        for (i, s) in held.iter_mut().enumerate() {
            let mut b = [0u8; 256];
            let _ = s.set_nonblocking(true);
            let closed = match s.read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            if closed {
                let src = Ipv4Addr::new(127, 0, 0, 2 + (i % sources as usize) as u8);
                if let Ok(mut n) = connect_from(src, addr) {
                    let _ = n.write_all(&first);
                    *s = n;
                }
            }
        }
    }
}

/// A client socket bound to `src` (any 127.0.0.x is this host) dialling `to`.
fn connect_from(src: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(to) = to else {
        return Err(std::io::ErrorKind::Unsupported.into());
    };
    let sin = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket creation; the fd is owned by the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nothing else owns.
    let s = unsafe { TcpStream::from_raw_fd(fd) };
    let (from, to) = (sin(SocketAddrV4::new(src, 0)), sin(to));
    // SAFETY: `from` is a valid sockaddr_in of `len` bytes for the call.
    if unsafe { libc::bind(fd, &from as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `to` is a valid sockaddr_in of `len` bytes for the call.
    if unsafe { libc::connect(fd, &to as *const _ as *const libc::sockaddr, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The flooding process; killed on drop.
struct Flooder {
    child: Child,
}

impl Flooder {
    /// `n` connections to `addr` from `sources` loopback addresses, each
    /// sending `first` and then nothing; as uid 65534 when root.
    fn start(addr: SocketAddr, n: usize, sources: u8, first: &[u8]) -> Flooder {
        let exe = std::env::current_exe().unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let mut cmd = if root {
            let mut c = Command::new("setpriv");
            c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
                .arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let name = crate::support::test_name(module_path!(), "flooder_process");
        cmd.args(["--ignored", "--exact", name.as_str(), "--nocapture"])
            .env("SB_FLOOD_ADDR", addr.to_string())
            .env("SB_FLOOD_N", n.to_string())
            .env("SB_FLOOD_SOURCES", sources.to_string())
            .env("SB_FLOOD_FIRST", hex(first))
            .env("SB_FLOOD_HOLD_MS", HOLD.as_millis().to_string())
            // Re-dialling each closed connection at once keeps the tables
            // churning; a flooder of the real peers' own uid shares their
            // per-source share, so there it only holds its first wave.
            .env("SB_FLOOD_REDIAL", if root { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().expect("spawn the flooder");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { return };
                if l.starts_with("FLOODER") {
                    let _ = tx.send(l);
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the flooder's report");
        let who = if root {
            "uid 65534 (another uid than the listener), re-dialling what is closed"
        } else {
            "this uid (not root: no other uid to run as), holding its first wave"
        };
        eprintln!("flooder as {who}: {line}");
        assert!(line.contains("held="), "{line}");
        if root {
            assert!(line.contains("uid=65534"), "{line}");
        }
        Flooder { child }
    }
}

impl Drop for Flooder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The first frame a data-port client sends: a valid open-mode AuthHello.
fn data_auth_hello() -> Vec<u8> {
    let (_, hello) = ClientAuth::start(&Mode::Open, Channel::Data, [0x71; 16]).unwrap();
    let mut b = Vec::new();
    wire::write_json(&mut b, FrameType::AuthHello, &hello).unwrap();
    b
}

/// The first line a control-port client sends: a valid open-mode auth_hello.
fn control_auth_hello() -> Vec<u8> {
    let (_, hello) = ClientAuth::start(&Mode::Open, Channel::Control, [0x72; 16]).unwrap();
    let mut b =
        serde_json::to_vec(&serde_json::json!({"type": "auth_hello", "auth": hello})).unwrap();
    b.push(b'\n');
    b
}

/// A `pdxfer` child printing one JSON line when ready; killed on drop.
struct Proc {
    child: Child,
    first: Value,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pdxfer");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let first: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        Proc { child, first }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real data-plane client's authentication against `addr`, timed.
fn data_handshake(addr: &str) -> Duration {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PROMPT)).unwrap();
    let (_, mut keys) = pdxfer::transport::peer_auth::authenticate_client(
        &mut s,
        &Mode::Open,
        [0x33; 16],
        None,
        "t",
    )
    .unwrap_or_else(|e| panic!("a real peer's handshake failed under the flood: {e}"));
    // and the session opens: Hello answered by a HelloAck (sealed frames)
    let me = pdxfer::transport::ProcIdentity::current().unwrap();
    wire::write_json_sealed(
        &mut s,
        FrameType::Hello,
        &serde_json::json!({"version": wire::VERSION, "identity": me}),
        &mut keys.send,
    )
    .unwrap();
    let (ty, _) = wire::read_frame_sealed(&mut s, wire::MAX_CONTROL_PAYLOAD, &mut keys.recv)
        .unwrap_or_else(|e| panic!("no HelloAck for a real peer under the flood: {e}"));
    assert_eq!(ty, FrameType::HelloAck);
    t.elapsed()
}

/// Threads of process `pid`.
fn threads(pid: u32) -> usize {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

fn agent_flood(sources: u8) {
    let t = Proc::start(&[
        "target",
        "--listen",
        "127.0.0.1:0",
        "--size",
        "4096",
        "--max-handshakes",
        "32",
    ]);
    assert_eq!(t.first["ready"], true, "{}", t.first);
    let addr = t.first["addr"].as_str().unwrap().to_string();
    let pid = t.first["pid"].as_u64().unwrap() as u32;
    let base = threads(pid);
    let _f = Flooder::start(addr.parse().unwrap(), 64, sources, &data_auth_hello());
    std::thread::sleep(Duration::from_millis(300));
    // each flooding connection got its challenge and stalls: in the poll
    // loop, without a thread
    let n = threads(pid);
    assert!(
        n <= base + 2,
        "64 connections stalled in their authentication grew the agent from {base} to {n} threads"
    );
    // the flood holds more connections than the 32 handshake slots, each past
    // its AuthHello; real peers still get through, again and again
    for _ in 0..5 {
        let took = data_handshake(&addr);
        assert!(took < PROMPT, "a real handshake took {took:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn an_agent_data_port_flooded_from_one_source_still_serves_real_peers() {
    agent_flood(1);
}

#[test]
fn an_agent_data_port_flooded_from_several_sources_still_serves_real_peers() {
    agent_flood(8);
}

/// A prefill's control port flooded with idle `auth_hello` lines: a real
/// decode rank still authenticates promptly.
#[test]
fn a_prefill_control_port_flooded_past_its_handshake_slots_still_serves_decodes() {
    use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
    use pdxfer::bootstrap::store::Store;
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let cl = "sb-ctl";
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdxfer-fault-peer"));
    cmd.args([
        "--name",
        "prefill",
        "--bootstrap",
        &server.url(),
        "--cluster",
        cl,
        "--role",
        "prefill",
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut p = cmd.spawn().unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    let ctl = loop {
        let e = server
            .store()
            .entries(cl, Role::Prefill)
            .unwrap_or_default();
        if let Some(r) = e.first() {
            let v = serde_json::to_value(r).unwrap();
            break v["endpoints"]["ctl"].as_str().unwrap().to_string();
        }
        assert!(Instant::now() < end, "the prefill never registered");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _f = Flooder::start(ctl.parse().unwrap(), 64, 4, &control_auth_hello());
    for i in 0..5 {
        let t = Instant::now();
        let mut s = TcpStream::connect(&ctl).unwrap();
        s.set_read_timeout(Some(PROMPT)).unwrap();
        s.write_all(&control_auth_hello()).unwrap();
        let mut line = String::new();
        BufReader::new(&s)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("real decode {i}: no auth_challenge under the flood: {e}"));
        assert!(line.contains("auth_challenge"), "{line}");
        assert!(t.elapsed() < PROMPT, "took {:?}", t.elapsed());
        std::thread::sleep(Duration::from_millis(300));
    }
    let _ = p.kill();
    let _ = p.wait();
}

fn http(addr: SocketAddr, req: &str) -> (Option<u16>, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PROMPT)).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut a = Vec::new();
    let _ = s.read_to_end(&mut a);
    let a = String::from_utf8_lossy(&a).to_string();
    let code = a.split_whitespace().nth(1).and_then(|c| c.parse().ok());
    (code, a)
}

fn bootstrap(extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["bootstrap", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let p = Proc::start(&args);
    assert_eq!(p.first["event"], "listening", "{}", p.first);
    let addr = p.first["url"]
        .as_str()
        .unwrap()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    (p, addr)
}

/// More idle connections than `--max-connections`, from one source and
/// from several: `/health` still answers 200, promptly, every time.
#[test]
fn bootstrap_health_answers_during_an_idle_flood() {
    for sources in [1u8, 8] {
        let (_p, addr) = bootstrap(&["--max-connections", "32", "--header-timeout-ms", "60000"]);
        let _f = Flooder::start(addr, 96, sources, b"GET /hea");
        for _ in 0..5 {
            let t = Instant::now();
            let (code, a) = http(addr, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
            assert_eq!(code, Some(200), "{sources} source(s): {a:?}");
            assert!(t.elapsed() < PROMPT, "took {:?}", t.elapsed());
            std::thread::sleep(Duration::from_millis(200));
        }
        let (_, m) = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let evicted = m
            .lines()
            .find_map(|l| l.strip_prefix("pdxfer_bootstrap_evicted_connections_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        assert!(evicted > 0, "{m}");
    }
}

fn registration(tp: u32, regions: usize, ttl_ms: u64) -> String {
    let mut t = Topology::single_mla(64, 2, 1152);
    t.attn_tp_size = 8;
    t.attn_tp_rank = tp;
    let mut r = Registration::new("sb-bytes", Role::Prefill, InstanceId::random().unwrap(), t);
    // padding in an endpoint the store keeps as given
    r.endpoints.insert("pad".into(), "x".repeat(regions));
    serde_json::to_string(&RegisterRequest {
        registration: r,
        ttl_ms,
    })
    .unwrap()
}

fn register(addr: SocketAddr, body: &str) -> (Option<u16>, String) {
    http(
        addr,
        &format!(
            "POST /v1/register HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// The byte bound: a registration past it gets 507 naming the bound and
/// the flag; a replacement does not count twice; expiry frees the bytes.
#[test]
fn the_bootstrap_store_byte_bound_answers_507_and_frees_on_expiry() {
    let (_p, addr) = bootstrap(&["--max-store-bytes", "50000"]);
    // two entries of about 20 kB fit, a third does not
    let (c, a) = register(addr, &registration(0, 20_000, 60_000));
    assert_eq!(c, Some(200), "{a}");
    let (c, a) = register(addr, &registration(1, 20_000, 500));
    assert_eq!(c, Some(200), "{a}");
    let (c, a) = register(addr, &registration(2, 20_000, 60_000));
    assert_eq!(c, Some(507), "{a}");
    assert!(
        a.contains("store_full") && a.contains("--max-store-bytes") && a.contains("50000"),
        "{a}"
    );
    // replacing rank 0 again and again: its bytes are counted once
    for _ in 0..5 {
        let (c, a) = register(addr, &registration(0, 20_000, 60_000));
        assert_eq!(c, Some(200), "{a}");
    }
    // rank 1's lease expires: its bytes are freed and rank 2 fits
    std::thread::sleep(Duration::from_millis(800));
    let (c, a) = register(addr, &registration(2, 20_000, 60_000));
    assert_eq!(c, Some(200), "{a}");
}

/// `pdxfer bootstrap --listen 0.0.0.0:0` without a token: refused, naming
/// the address and the fix; with `--insecure` it starts (and warns).
#[test]
fn an_open_bootstrap_on_a_public_address_needs_insecure() {
    let out = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
        .args(["bootstrap", "--listen", "0.0.0.0:0"])
        .env_remove("PDXFER_BOOTSTRAP_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("0.0.0.0") && err.contains("--insecure") && err.contains("token"),
        "{err}"
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
        .args(["bootstrap", "--listen", "0.0.0.0:0", "--insecure"])
        .env_remove("PDXFER_BOOTSTRAP_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let mut warn = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut warn);
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    assert_eq!(v["event"], "listening", "{v}");
    assert!(warn.contains("NO TOKEN"), "{warn}");
}
