//! `pdxfer bootstrap` as a real process against hostile clients on
//! loopback: a huge `Content-Length`, connections that stall, a flood of
//! connections, file-descriptor exhaustion and out-of-range topologies. The
//! server must answer with a clear code, never die, never spin, and serve
//! normal clients again as soon as the hostile ones are gone.

use pdxfer::bootstrap::{InstanceId, RegisterRequest, Registration, Role};
use pdxfer::layout::Topology;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "hostile-test-token";
/// Longest wait for anything the server must do promptly.
const WAIT: Duration = Duration::from_secs(10);

/// A `pdxfer bootstrap` child process; killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    /// Starts `pdxfer bootstrap` with `extra` flags; `nofile` lowers its RLIMIT_NOFILE.
    fn start(extra: &[&str], nofile: Option<u64>) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdxfer"));
        cmd.args(["bootstrap", "--listen", "127.0.0.1:0", "--token", TOKEN])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(n) = nofile {
            // SAFETY: the closure runs in the forked child before exec and only
            // calls setrlimit, which is async-signal-safe; it allocates nothing.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn pdxfer bootstrap");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(v["event"], "listening", "{v}");
        let addr = v["url"]
            .as_str()
            .unwrap()
            .trim_start_matches("http://")
            .parse()
            .unwrap();
        Server { child, addr }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// utime + stime of the server process, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `raw` on a fresh connection and returns what the server answers
/// until it closes (or `WAIT` passes).
fn exchange(addr: SocketAddr, raw: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, WAIT)?;
    s.set_read_timeout(Some(WAIT))?;
    s.write_all(raw)?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn status_of(answer: &str) -> Option<u16> {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
}

fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: pdxfer\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

fn health_ok(addr: SocketAddr) -> bool {
    get(addr, "/health").is_ok_and(|a| status_of(&a) == Some(200) && a.contains("\"ok\""))
}

/// Polls `f` every 50 ms for up to `WAIT`.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + WAIT;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

fn metric(addr: SocketAddr, name: &str) -> u64 {
    let m = get(addr, "/metrics").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

#[test]
fn a_huge_content_length_is_refused_from_the_header_and_the_server_stays_up() {
    let mut srv = Server::start(&[], None);
    let addr = srv.addr;
    let auth = format!("Authorization: Bearer {TOKEN}\r\n");
    for (method, path, token) in [
        ("GET", "/health", ""),
        ("GET", "/health", auth.as_str()),
        ("POST", "/v1/register", ""),
        ("POST", "/v1/register", auth.as_str()),
        ("POST", "/v1/leases/1/keepalive", auth.as_str()),
        ("GET", "/metrics", ""),
    ] {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: pdxfer\r\n{token}Content-Length: 1000000000000\r\n\r\n"
        );
        let a = exchange(addr, req.as_bytes()).unwrap();
        assert_eq!(status_of(&a), Some(413), "{method} {path} {token:?}: {a:?}");
        assert!(a.contains("payload_too_large"), "{a}");
        assert!(srv.alive(), "the server died on {method} {path}");
        assert!(health_ok(addr), "no /health after {method} {path}");
    }
    // The client that keeps sending after the 413 gets the answer, not a reset.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(
        b"POST /v1/register HTTP/1.1\r\nHost: pdxfer\r\nContent-Length: 1000000000000\r\n\r\n",
    )
    .unwrap();
    let _ = s.write_all(&vec![b'x'; 256 * 1024]);
    let mut a = Vec::new();
    let _ = s.read_to_end(&mut a);
    assert_eq!(status_of(&String::from_utf8_lossy(&a)), Some(413));
    assert!(srv.alive());
    assert!(
        metric(
            addr,
            "pdxfer_bootstrap_rejected_requests_total{reason=\"too_large\"}"
        ) >= 7
    );
}

#[test]
fn stalled_clients_do_not_block_others_and_time_out() {
    let srv = Server::start(
        &["--header-timeout-ms", "1500", "--body-timeout-ms", "1500"],
        None,
    );
    let addr = srv.addr;
    // Eight connections announce a body and never send it; two more stop
    // in the middle of their headers.
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(
            format!(
                "POST /v1/register HTTP/1.1\r\nHost: pdxfer\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .unwrap();
        stalled.push(s);
    }
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /heal").unwrap();
        stalled.push(s);
    }
    // A normal client is served while they stall: its answer comes before
    // any stalled connection reached its deadline (they are all still open).
    assert!(
        health_ok(addr),
        "a normal client was blocked by stalled ones"
    );
    for s in &stalled {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        let r = (&*s).read(&mut b);
        assert!(
            r.as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
            "a stalled connection was already answered or closed: {r:?}"
        );
        s.set_nonblocking(false).unwrap();
    }
    // Each stalled connection is answered 408 and closed at its deadline.
    for mut s in stalled {
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut a = Vec::new();
        let _ = s.read_to_end(&mut a);
        let a = String::from_utf8_lossy(&a);
        assert_eq!(status_of(&a), Some(408), "{a:?}");
    }
    assert_eq!(
        metric(
            addr,
            "pdxfer_bootstrap_rejected_requests_total{reason=\"timeout\"}"
        ),
        10
    );
    assert_eq!(metric(addr, "pdxfer_bootstrap_registrations_total"), 0);
}

#[test]
fn connections_beyond_the_bound_evict_the_oldest_idle_one_and_the_server_recovers() {
    let srv = Server::start(
        &["--max-connections", "8", "--header-timeout-ms", "60000"],
        None,
    );
    let addr = srv.addr;
    let held: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // A ninth connection that asks something is answered: the oldest of the
    // eight idle ones (still in its header phase) is evicted for it, not the
    // newcomer refused behind them.
    assert!(health_ok(addr), "/health refused behind 8 idle connections");
    assert!(metric(addr, "pdxfer_bootstrap_evicted_connections_total") >= 1);
    // A flood of further idle connections evicts its own: /health is still answered.
    let flood: Vec<TcpStream> = (0..50).map(|_| TcpStream::connect(addr).unwrap()).collect();
    assert!(
        eventually(|| health_ok(addr)),
        "/health refused during a flood of idle connections"
    );
    assert!(metric(addr, "pdxfer_bootstrap_evicted_connections_total") >= 50);
    drop(flood);
    drop(held);
    assert!(
        eventually(|| health_ok(addr)),
        "no recovery after the flood"
    );
}

#[test]
fn fd_exhaustion_backs_off_without_spinning_and_the_server_recovers() {
    let mut srv = Server::start(
        &["--max-connections", "4096", "--header-timeout-ms", "60000"],
        Some(48),
    );
    let addr = srv.addr;
    assert!(health_ok(addr));
    // Far more idle connections than the server has descriptors: it accepts
    // until EMFILE, the rest wait in the kernel's backlog.
    let mut held = Vec::new();
    for _ in 0..120 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => held.push(s),
            Err(_) => break,
        }
    }
    assert!(held.len() > 60, "only {} connections opened", held.len());
    std::thread::sleep(Duration::from_millis(300));
    assert!(srv.alive());
    // While descriptors are exhausted the accept loop backs off: over two
    // seconds it uses well under half a core (a spinning loop uses all of one).
    let hz = 100; // USER_HZ on Linux
    let before = srv.cpu_ticks();
    std::thread::sleep(Duration::from_secs(2));
    let used = srv.cpu_ticks() - before;
    assert!(
        used < hz,
        "the server used {used} ticks of CPU in 2 s while out of fds"
    );
    // Once the clients go away it serves again, and it did meet EMFILE.
    drop(held);
    assert!(
        eventually(|| health_ok(addr)),
        "no recovery after fd exhaustion"
    );
    assert!(srv.alive());
    assert!(metric(addr, "pdxfer_bootstrap_accept_errors_total") > 0);
}

#[test]
fn out_of_range_topology_values_get_a_400_naming_the_field() {
    let srv = Server::start(&[], None);
    let mut t = Topology::single_mla(64, 2, 1152);
    t.pp_size = 1 << 31;
    let req = RegisterRequest {
        registration: Registration::new("caps", Role::Prefill, InstanceId::random().unwrap(), t),
        ttl_ms: 10_000,
    };
    let body = serde_json::to_string(&req).unwrap();
    let a = exchange(
        srv.addr,
        format!(
            "POST /v1/register HTTP/1.1\r\nHost: pdxfer\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(status_of(&a), Some(400), "{a}");
    let json = &a[a.find("\r\n\r\n").unwrap() + 4..];
    let v: Value = serde_json::from_str(json).unwrap();
    let detail = v["detail"].as_str().unwrap();
    assert!(detail.contains("pp_size"), "{detail}");
    assert!(detail.contains("2147483648"), "{detail}");
    assert_eq!(metric(srv.addr, "pdxfer_bootstrap_registrations_total"), 0);
}
