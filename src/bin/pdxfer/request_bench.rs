//! `pdxfer bench-request`: one PD request (by default 8,192 tokens x 61
//! layers x 1152 B rows = 575.7 MB, 1 prefill -> 4 decode DCP ranks) through
//! the engine, as `pdxfer demo` runs it (a bootstrap server here, every rank
//! its own process: `pdxfer bench-request-rank`), timed per request, next to
//! one memcpy of the same bytes in the prefill rank's process, measured in
//! the same run. Over tcp, an iperf3 loopback single stream in the same run
//! gives the wire baseline. Requests run one at a time; the first one
//! (right after the ranks connect) is reported next to the median of the
//! warm ones. Every request is verified byte by byte on every decode rank
//! (after its timing).

use crate::rank_proc::{pages_of, spawn, EngineRankArgs, Event, Proc};
use crate::request_shape::RequestShape;
use clap::Args;
use crossbeam::channel::{unbounded, Receiver};
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, KvPoll};
use pdxfer::error::{Error, Result, Status};
use pdxfer::layout::{CpMode, DcpLayout, Side};
use pdxfer::transport::TransportKind;
use serde::Serialize;
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `pdxfer bench-request`.
#[derive(Args, Debug)]
pub struct RequestBenchArgs {
    /// Modes to run, each with fresh rank processes: cma-heap (KV pools in
    /// heap memory: process_vm_writev), cma-shared (KV pools in shareable
    /// memory, `SyntheticPools::new_shared`: the prefill copies rows straight
    /// into the decode's rows), tcp.
    #[arg(long, value_delimiter = ',', default_value = "cma-heap,cma-shared,tcp")]
    modes: Vec<String>,
    #[command(flatten)]
    shape: RequestShape,
    /// Decode DCP ranks (processes).
    #[arg(long, default_value_t = 4)]
    dcp_size: u32,
    /// Seconds of the iperf3 loopback stream (tcp mode); 0 skips it.
    #[arg(long, default_value_t = 3)]
    iperf3_secs: u32,
    /// Decode ranks leave their pools to first touch (`EngineConfig::prefault = false`).
    #[arg(long)]
    no_prefault: bool,
    /// Print one JSON object as the last line (and no table).
    #[arg(long)]
    json: bool,
}

/// Arguments of `pdxfer bench-request-rank` (one engine process of the bench).
#[derive(Args, Debug)]
pub struct RequestRankArgs {
    #[command(flatten)]
    pub rank: EngineRankArgs,
    /// Pool memory: heap or shared.
    #[arg(long, default_value = "heap")]
    pools: String,
    /// Leave the pools to first touch.
    #[arg(long)]
    no_prefault: bool,
    /// Prefill: attention CP size (every CP rank holds the request's rows).
    #[arg(long, default_value_t = 1)]
    cp_size: u32,
    /// Prefill: attention CP rank.
    #[arg(long, default_value_t = 0)]
    cp_rank: u32,
    /// Prefill: which CP ranks send, rank0 or all-cp.
    #[arg(long, default_value = "rank0")]
    cp_mode: String,
}

const AUX_ROWS: u64 = 4;
const AUX_ITEM: u64 = 64;

/// One mode of the bench: transport and where the KV pools live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mode {
    transport: TransportKind,
    shared_pools: bool,
}

impl Mode {
    fn parse(s: &str) -> Result<Mode> {
        let (transport, shared_pools) = match s.trim() {
            "cma-heap" | "cma" => (TransportKind::Cma, false),
            "cma-shared" => (TransportKind::Cma, true),
            "tcp" => (TransportKind::Tcp, false),
            "tcp-shared" => (TransportKind::Tcp, true),
            other => {
                return Err(Error::invalid(format!(
                    "mode {other:?}: one of cma-heap, cma-shared, tcp, tcp-shared"
                )))
            }
        };
        Ok(Mode {
            transport,
            shared_pools,
        })
    }

    fn name(&self) -> String {
        format!(
            "{}-{}",
            self.transport.name(),
            if self.shared_pools { "shared" } else { "heap" }
        )
    }
}

/// Seconds of one copy of `src` into `dst` (same length).
fn copy_seconds(src: &[u8], dst: &mut [u8]) -> f64 {
    let t0 = Instant::now();
    dst.copy_from_slice(src);
    std::hint::black_box(&mut *dst);
    t0.elapsed().as_secs_f64()
}

/// A memcpy of `bytes` bytes in this process.
#[derive(Debug, Clone, Copy, Serialize)]
struct MemcpyTiming {
    /// The first copy, into freshly allocated (not yet faulted) memory.
    first_s: f64,
    /// Best of `reps` copies into the same, now faulted, memory.
    best_s: f64,
}

fn time_memcpy(bytes: usize, reps: usize) -> MemcpyTiming {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 131 + 7) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let first_s = copy_seconds(&src, &mut dst);
    let best_s = (0..reps.max(1))
        .map(|_| copy_seconds(&src, &mut dst))
        .fold(f64::INFINITY, f64::min);
    MemcpyTiming { first_s, best_s }
}

/// The median of `v` (mean of the middle two for an even count); `None` if empty.
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(s[n / 2]),
        _ => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
    }
}

/// The sum of every sample of the metrics whose name contains
/// `control_messages` in Prometheus text, but those labelled
/// `direction="received"` (each message is counted once, by its sender);
/// `None` when there is none.
fn control_messages(prometheus: &str) -> Option<u64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in prometheus.lines() {
        if line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(name), Some(value)) = (parts.next(), parts.next()) else {
            continue;
        };
        let bare = name.split('{').next().unwrap_or(name);
        if bare.contains("control_messages") && !name.contains("direction=\"received\"") {
            if let Ok(v) = value.parse::<f64>() {
                found = true;
                sum += v;
            }
        }
    }
    found.then_some(sum as u64)
}

fn say(v: &Value) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{v}");
    let _ = o.flush();
}

/// Runs one engine rank of the bench, driven by JSON lines on stdin.
pub fn run_rank(args: &RequestRankArgs) -> Result<()> {
    let a = &args.rank;
    let alloc = match args.pools.as_str() {
        "heap" => SyntheticPools::new,
        "shared" => SyntheticPools::new_shared,
        other => return Err(Error::invalid(format!("pools {other:?}: heap or shared"))),
    };
    let mut pools = alloc(
        a.layers,
        a.row_bytes,
        a.page_size,
        a.pages,
        AUX_ROWS,
        AUX_ITEM,
    )?;
    let mut cfg = a.engine_config(&pools)?;
    cfg.topology.attn_cp_size = args.cp_size;
    cfg.topology.attn_cp_rank = args.cp_rank;
    cfg.topology.cp.mode = CpMode::parse(&args.cp_mode)?;
    cfg.room_timeout = Duration::from_secs(120);
    cfg.prefault = !args.no_prefault;
    // SAFETY: `pools` lives until this function returns, after `engine.close()`.
    let engine = unsafe { Engine::new(cfg)? };
    say(&json!({"event": "ready", "pid": std::process::id()}));
    let page = a.page_size;
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(cmd) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let room = cmd["room"].as_u64().unwrap_or(0);
        match cmd["cmd"].as_str() {
            Some("fill") => {
                let r = fill_room(&mut pools, &cmd, page);
                say(&json!({"event": "filled", "room": room, "ok": r.is_ok()}));
            }
            Some("send") => {
                let r = prefill_room(&engine, &mut pools, &cmd, page);
                let _ = engine.clear(room);
                match r {
                    Ok((ms, sent_at, done_at)) => {
                        say(&json!({"event": "done", "room": room, "ok": true,
                        "transfer_ms": ms, "sent_at_ns": sent_at, "done_at_ns": done_at}))
                    }
                    Err(e) => say(
                        &json!({"event": "done", "room": room, "ok": false, "error": e.to_string()}),
                    ),
                }
            }
            Some("recv") => {
                let r = decode_room(&engine, &pools, &cmd, page, a);
                let _ = engine.clear(room);
                match r {
                    Ok(b) => say(
                        &json!({"event": "done", "room": room, "ok": true, "verified_bytes": b}),
                    ),
                    Err(e) => say(
                        &json!({"event": "done", "room": room, "ok": false, "error": e.to_string()}),
                    ),
                }
            }
            Some("metrics") => {
                say(
                    &json!({"event": "metrics", "control_messages": control_messages(&engine.metrics()),
                        "one_copy_bytes": engine.metrics_snapshot().one_copy_bytes}),
                );
            }
            Some("memcpy") => {
                let bytes = cmd["bytes"].as_u64().unwrap_or(0) as usize;
                let t = time_memcpy(bytes, 3);
                say(&json!({"event": "memcpy", "first_s": t.first_s, "best_s": t.best_s}));
            }
            Some("quit") => break,
            _ => {}
        }
    }
    engine.close();
    Ok(())
}

/// Writes the request's rows and its aux row into the prefill pools.
fn fill_room(pools: &mut SyntheticPools, cmd: &Value, page: u64) -> Result<()> {
    let room = cmd["room"].as_u64().unwrap_or(0);
    let pages = pages_of(cmd, "pages");
    let total = cmd["total"].as_u64().unwrap_or(0);
    let side = Side {
        layout: DcpLayout::sglang(page, 1)?,
        rank: 0,
        pages: &pages,
        origin: 0,
    };
    pools.fill(room, &side, total);
    pools.fill_aux(room, 0);
    Ok(())
}

/// Nanoseconds since the Unix epoch (the ranks of one host share the clock).
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Fills the request's rows (unless a `fill` command did: `"prefilled"`),
/// opens the room, sends every page in one call; returns the milliseconds
/// from that send to Success (every decode rank acknowledged), and the send
/// and Success times (Unix ns).
fn prefill_room(
    engine: &Engine,
    pools: &mut SyntheticPools,
    cmd: &Value,
    page: u64,
) -> Result<(f64, u64, u64)> {
    let room = cmd["room"].as_u64().unwrap_or(0);
    let pages = pages_of(cmd, "pages");
    let total = cmd["total"].as_u64().unwrap_or(0);
    if cmd["prefilled"] != true {
        fill_room(pools, cmd, page)?;
    }
    engine.sender(room)?;
    engine.set_request_pages(room, pages.len() as u64)?;
    let t0 = Instant::now();
    while engine.poll(room) == KvPoll::Bootstrapping {
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(Error::new(
                Status::Timeout,
                format!("room {room}: decode metadata never arrived"),
            ));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    let (t_send, sent_at) = (Instant::now(), unix_ns());
    engine.send(room, &pages, total, true, 0)?;
    match engine.wait(room, Duration::from_secs(120)) {
        KvPoll::Success => Ok((t_send.elapsed().as_secs_f64() * 1e3, sent_at, unix_ns())),
        p => Err(engine
            .failure(room)
            .unwrap_or_else(|| Error::new(Status::Timeout, format!("room {room} still {p:?}")))),
    }
}

fn decode_room(
    engine: &Engine,
    pools: &SyntheticPools,
    cmd: &Value,
    page: u64,
    a: &EngineRankArgs,
) -> Result<u64> {
    let room = cmd["room"].as_u64().unwrap_or(0);
    let pages = pages_of(cmd, "dst_pages");
    let total = cmd["total"].as_u64().unwrap_or(0);
    engine.receiver(room, 0, Some(Duration::from_secs(120)))?;
    engine.send_metadata(room, &pages, 0, 0)?;
    match engine.wait(room, Duration::from_secs(120)) {
        KvPoll::Success => {}
        p => {
            return Err(engine.failure(room).unwrap_or_else(|| {
                Error::new(Status::Timeout, format!("room {room} still {p:?}"))
            }));
        }
    }
    let side = Side {
        layout: DcpLayout::sglang(page, u64::from(a.dcp_size))?,
        rank: u64::from(a.rank),
        pages: &pages,
        origin: 0,
    };
    pools.verify(room, &side, total, Some(0))
}

/// The figures of one mode.
#[derive(Debug, Clone, Serialize)]
struct ModeResult {
    mode: String,
    /// KV bytes of one request.
    request_bytes: u64,
    requests: u32,
    /// Each request's transfer, first send to every decode rank's acknowledgement.
    transfer_ms: Vec<f64>,
    first_ms: f64,
    /// Median of the requests after the first.
    warm_median_ms: f64,
    /// `first_ms / warm_median_ms` (target <= 1.2).
    first_over_warm: f64,
    gb_per_s: f64,
    /// One memcpy of `request_bytes` in the prefill rank's process, best of 3.
    memcpy_ms: f64,
    /// The first memcpy, into freshly allocated memory.
    memcpy_first_ms: f64,
    /// Warm request speed over memcpy speed (`memcpy_ms / warm_median_ms`).
    ratio_vs_memcpy: f64,
    /// Control messages per request, all ranks together (`None`: the engine does not count them).
    control_messages_per_request: Option<f64>,
    /// KV bytes per request the prefill copied straight into the decode's rows (one copy, no staging).
    one_copy_bytes_per_request: f64,
    /// iperf3 loopback single stream, decimal GB/s (tcp modes).
    iperf3_gb_per_s: Option<f64>,
    /// Warm request speed over iperf3's.
    ratio_vs_iperf3: Option<f64>,
    /// Why iperf3 gave no figure.
    iperf3_note: Option<String>,
}

/// Waits for `event` from every rank in `from` (any order); their events by rank.
pub(crate) fn collect(
    rx: &Receiver<Event>,
    from: &[usize],
    event: &str,
    timeout: Duration,
) -> Result<Vec<Value>> {
    let end = Instant::now() + timeout;
    let mut got: Vec<Option<Value>> = vec![None; from.iter().max().map_or(0, |m| m + 1)];
    while from.iter().any(|&i| got[i].is_none()) {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((i, e)) if e["event"] == "exit" => {
                return Err(Error::new(
                    Status::PeerUnreachable,
                    format!("bench rank {i} exited"),
                ))
            }
            Ok((i, e)) if e["event"] == event && from.contains(&i) => got[i] = Some(e),
            Ok(_) => {}
            Err(_) => {
                let missing: Vec<usize> =
                    from.iter().copied().filter(|&i| got[i].is_none()).collect();
                return Err(Error::new(
                    Status::Timeout,
                    format!("no {event:?} from bench ranks {missing:?} within {timeout:?}"),
                ));
            }
        }
    }
    Ok(from
        .iter()
        .map(|&i| got[i].take().unwrap_or_default())
        .collect())
}

/// Counters of every rank so far.
struct Counters {
    /// Control messages of all ranks (`None` if any rank does not count them).
    control: Option<u64>,
    /// KV bytes the prefill (rank 0) copied straight into decode rows.
    one_copy_bytes: u64,
}

fn counters(procs: &mut [Proc], rx: &Receiver<Event>) -> Result<Counters> {
    for p in procs.iter_mut() {
        p.send(&json!({"cmd": "metrics"}))?;
    }
    let all: Vec<usize> = (0..procs.len()).collect();
    let counts = collect(rx, &all, "metrics", Duration::from_secs(10))?;
    Ok(Counters {
        control: counts
            .iter()
            .map(|e| e["control_messages"].as_u64())
            .sum::<Option<u64>>(),
        one_copy_bytes: counts[0]["one_copy_bytes"].as_u64().unwrap_or(0),
    })
}

/// Runs `iperf3` on loopback, one stream, `secs` seconds; decimal GB/s received.
fn iperf3_gbps(secs: u32) -> std::result::Result<f64, String> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        l.local_addr().map_err(|e| e.to_string())?.port()
    };
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("iperf3 not runnable ({e}): apt-get install -y iperf3"))?;
    let mut out = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let o = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &port.to_string()])
            .args(["-t", &secs.to_string(), "-J"])
            .output()
            .map_err(|e| e.to_string())?;
        if o.status.success() {
            out = Some(o.stdout);
            break;
        }
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok_or("the iperf3 client never connected")?;
    let v: Value = serde_json::from_slice(&out).map_err(|e| format!("iperf3 -J: {e}"))?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| b / 8e9)
        .ok_or_else(|| "iperf3 -J has no end.sum_received.bits_per_second".to_string())
}

fn run_mode(a: &RequestBenchArgs, mode: Mode, bar: &indicatif::ProgressBar) -> Result<ModeResult> {
    let (p, d) = (a.shape.page_size, u64::from(a.dcp_size));
    let src_pages = a.shape.tokens.div_ceil(p);
    let dst_pages = a.shape.tokens.div_ceil(p * d);
    let request_bytes = a.shape.tokens * a.shape.row_bytes * u64::from(a.shape.layers);
    let server = BootstrapServer::start(ServerConfig::default())?;
    let cluster = format!("bench-request-{}", std::process::id());
    let url = server.url();
    let common = |role: &str, dcp: u32, rank: u32, pages: u64| -> Vec<String> {
        let v = [
            ("--role", role.to_string()),
            ("--bootstrap", url.clone()),
            ("--cluster", cluster.clone()),
            ("--dcp-size", dcp.to_string()),
            ("--rank", rank.to_string()),
            ("--layers", a.shape.layers.to_string()),
            ("--row-bytes", a.shape.row_bytes.to_string()),
            ("--page-size", p.to_string()),
            ("--pages", pages.to_string()),
            ("--transport", mode.transport.name().to_string()),
            (
                "--pools",
                if mode.shared_pools { "shared" } else { "heap" }.to_string(),
            ),
            ("--staging-mib", a.shape.staging_mib.to_string()),
        ];
        let mut v: Vec<String> = v
            .into_iter()
            .flat_map(|(k, v)| [k.to_string(), v])
            .collect();
        if a.no_prefault {
            v.push("--no-prefault".into());
        }
        v
    };
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| Error::new(Status::Io, format!("getrandom for the bench's secret: {e}")))?;
    let secret: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let (tx, rx) = unbounded();
    let mut procs = Vec::new();
    let mut spawned = || -> Result<()> {
        procs.push(spawn(
            "bench-request-rank",
            &common("prefill", 1, 0, src_pages),
            0,
            &secret,
            tx.clone(),
        )?);
        for r in 0..a.dcp_size {
            procs.push(spawn(
                "bench-request-rank",
                &common("decode", a.dcp_size, r, dst_pages),
                r as usize + 1,
                &secret,
                tx.clone(),
            )?);
        }
        Ok(())
    };
    let r = spawned().and_then(|()| drive(a, mode, &mut procs, &rx, request_bytes, bar));
    for pr in procs.iter_mut() {
        let _ = pr.send(&json!({"cmd": "quit"}));
    }
    for pr in procs.iter_mut() {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match pr.child.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    let _ = pr.child.kill();
                    let _ = pr.child.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    server.stop();
    let mut r = r?;
    if mode.transport == TransportKind::Tcp && a.iperf3_secs > 0 {
        bar.set_message(format!("{}: iperf3 loopback", mode.name()));
        match iperf3_gbps(a.iperf3_secs) {
            Ok(g) => {
                r.iperf3_gb_per_s = Some(g);
                r.ratio_vs_iperf3 = Some(r.gb_per_s / g);
            }
            Err(e) => r.iperf3_note = Some(e),
        }
    }
    Ok(r)
}

fn drive(
    a: &RequestBenchArgs,
    mode: Mode,
    procs: &mut [Proc],
    rx: &Receiver<Event>,
    request_bytes: u64,
    bar: &indicatif::ProgressBar,
) -> Result<ModeResult> {
    let all: Vec<usize> = (0..procs.len()).collect();
    collect(rx, &all, "ready", Duration::from_secs(60))?;
    let (p, d) = (a.shape.page_size, u64::from(a.dcp_size));
    let src: Vec<u64> = (0..a.shape.tokens.div_ceil(p)).collect();
    let dst: Vec<u64> = (0..a.shape.tokens.div_ceil(p * d)).collect();
    let before = counters(procs, rx)?;
    let mut transfer_ms = Vec::new();
    for room in 1..=u64::from(a.shape.requests) {
        bar.set_message(format!("{}: request {room}", mode.name()));
        for pr in procs.iter_mut().skip(1) {
            pr.send(
                &json!({"cmd": "recv", "room": room, "dst_pages": dst, "total": a.shape.tokens}),
            )?;
        }
        procs[0]
            .send(&json!({"cmd": "send", "room": room, "pages": src, "total": a.shape.tokens}))?;
        let done = collect(rx, &all, "done", Duration::from_secs(300))?;
        for (i, e) in done.iter().enumerate() {
            if e["ok"] != true {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!(
                        "{}: room {room}, rank {i}: {}",
                        mode.name(),
                        e["error"].as_str().unwrap_or("?")
                    ),
                ));
            }
        }
        transfer_ms.push(done[0]["transfer_ms"].as_f64().unwrap_or(0.0));
        bar.inc(1);
    }
    let after = counters(procs, rx)?;
    bar.set_message(format!("{}: memcpy", mode.name()));
    procs[0].send(&json!({"cmd": "memcpy", "bytes": request_bytes}))?;
    let m = collect(rx, &[0], "memcpy", Duration::from_secs(120))?.remove(0);
    let memcpy_ms = m["best_s"].as_f64().unwrap_or(0.0) * 1e3;
    let memcpy_first_ms = m["first_s"].as_f64().unwrap_or(0.0) * 1e3;
    let first_ms = transfer_ms[0];
    let warm_median_ms = median(&transfer_ms[1..]).unwrap_or(first_ms);
    let n = f64::from(a.shape.requests);
    let control = match (before.control, after.control) {
        (Some(b), Some(e)) => Some(e.saturating_sub(b) as f64 / n),
        _ => None,
    };
    Ok(ModeResult {
        mode: mode.name(),
        request_bytes,
        requests: a.shape.requests,
        first_ms,
        warm_median_ms,
        first_over_warm: first_ms / warm_median_ms,
        gb_per_s: request_bytes as f64 / (warm_median_ms / 1e3) / 1e9,
        memcpy_ms,
        memcpy_first_ms,
        ratio_vs_memcpy: memcpy_ms / warm_median_ms,
        control_messages_per_request: control,
        one_copy_bytes_per_request: after.one_copy_bytes.saturating_sub(before.one_copy_bytes)
            as f64
            / n,
        iperf3_gb_per_s: None,
        ratio_vs_iperf3: None,
        iperf3_note: None,
        transfer_ms,
    })
}

fn opt(v: Option<f64>, prec: usize, suffix: &str) -> String {
    v.map_or("n/a".to_string(), |x| format!("{x:.prec$}{suffix}"))
}

/// Runs `pdxfer bench-request`.
pub fn run(a: &RequestBenchArgs) -> Result<()> {
    if a.shape.requests < 2 || a.shape.tokens == 0 || a.shape.page_size == 0 || a.dcp_size == 0 {
        return Err(Error::invalid(
            "requests must be >= 2 (the first is reported apart); tokens, page-size and dcp-size >= 1",
        ));
    }
    let modes: Vec<Mode> = a
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<Result<_>>()?;
    let bar = indicatif::ProgressBar::new(u64::from(a.shape.requests) * modes.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut results = Vec::new();
    let mut errors = Vec::new();
    let mut first_error: Option<Error> = None;
    for &m in &modes {
        match run_mode(a, m, &bar) {
            Ok(r) => results.push(r),
            Err(e) => {
                bar.suspend(|| eprintln!("pdxfer bench-request: {}: {e}", m.name()));
                errors.push(json!({"mode": m.name(), "kind": e.kind(), "error": e.to_string()}));
                first_error.get_or_insert(e);
            }
        }
    }
    bar.finish_and_clear();
    let bytes = a.shape.tokens * a.shape.row_bytes * u64::from(a.shape.layers);
    if a.json {
        println!(
            "{}",
            json!({
                "tokens": a.shape.tokens, "layers": a.shape.layers, "row_bytes": a.shape.row_bytes, "dcp_size": a.dcp_size,
                "request_bytes": bytes, "requests": a.shape.requests, "results": results, "errors": errors,
            })
        );
    } else {
        println!(
            "pdxfer bench-request: {} tokens x {} layers x {} B = {:.1} MB, 1 prefill -> {} decode DCP ranks, {} requests per mode (warm = median of requests 2..{})",
            a.shape.tokens, a.shape.layers, a.shape.row_bytes, bytes as f64 / 1e6, a.dcp_size, a.shape.requests, a.shape.requests
        );
        println!();
        println!("| mode | first ms | warm ms | GB/s (warm) | memcpy ms (same run) | x memcpy | first / warm | control msgs / request | one-copy share | iperf3 GB/s | x iperf3 |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &results {
            println!(
                "| {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2}x | {:.2}x | {} | {:.0}% | {} | {} |",
                r.mode,
                r.first_ms,
                r.warm_median_ms,
                r.gb_per_s,
                r.memcpy_ms,
                r.ratio_vs_memcpy,
                r.first_over_warm,
                opt(r.control_messages_per_request, 1, ""),
                r.one_copy_bytes_per_request / r.request_bytes as f64 * 1e2,
                opt(r.iperf3_gb_per_s, 2, ""),
                opt(r.ratio_vs_iperf3, 2, "x"),
            );
        }
        for e in &errors {
            println!(
                "| {} | {} | | | | | | | | | |",
                e["mode"].as_str().unwrap_or(""),
                e["error"].as_str().unwrap_or("")
            );
        }
        for r in &results {
            if let Some(n) = &r.iperf3_note {
                println!("{}: iperf3: {n}", r.mode);
            }
        }
    }
    match first_error {
        None => Ok(()),
        Some(e) => Err(Error::new(
            e.status(),
            format!(
                "{} of {} modes did not run: {}",
                errors.len(),
                modes.len(),
                errors
                    .iter()
                    .map(|e| e["error"].as_str().unwrap_or("").to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_seconds_copies_and_times() {
        let src: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let s = copy_seconds(&src, &mut dst);
        assert_eq!(dst, src);
        assert!(s > 0.0 && s < 10.0, "{s}");
        let t = time_memcpy(1 << 20, 2);
        assert!(t.best_s > 0.0 && t.first_s > 0.0);
        assert!(t.best_s.is_finite());
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn control_messages_sums_matching_metrics_only() {
        let text = "# HELP x\npdxfer_engine_sent_batches_total 9\n\
                    pdxfer_engine_control_messages_total{channel=\"engine\",direction=\"sent\"} 3\n\
                    pdxfer_engine_control_messages_total{channel=\"engine\",direction=\"received\"} 3\n\
                    pdxfer_engine_control_messages_total{channel=\"data_plane\",direction=\"sent\"} 4\n";
        assert_eq!(control_messages(text), Some(7));
        assert_eq!(
            control_messages("pdxfer_engine_sent_batches_total 9\n"),
            None
        );
    }

    #[test]
    fn modes_parse() {
        let m = Mode::parse("cma-shared").unwrap();
        assert_eq!(m.transport, TransportKind::Cma);
        assert!(m.shared_pools);
        assert_eq!(m.name(), "cma-shared");
        assert_eq!(Mode::parse("tcp").unwrap().name(), "tcp-heap");
        assert!(Mode::parse("rdma").is_err());
    }
}
