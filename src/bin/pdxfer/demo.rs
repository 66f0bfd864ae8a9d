//! `pdxfer demo`: the main job. Starts a bootstrap server, one prefill rank
//! and N decode DCP ranks as separate processes on this host (each a
//! `pdxfer demo-rank`), with a synthetic DeepSeek-like MLA pool (61 layers,
//! 576 bf16 values per token row, page 64); sends requests of varied lengths
//! (some with a cached decode prefix, some chunked); every decode rank verifies
//! every byte it owns against the plan; prints a summary (and `--json`).

use crate::rank_proc::{pages_of, spawn, EngineRankArgs, Event, Proc};
use clap::Args;
use crossbeam::channel::{unbounded, Receiver};
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, KvPoll};
use pdxfer::error::{Error, Result, Status};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::rng::SplitMix64;
use pdxfer::transport::TransportKind;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Arguments of `pdxfer demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Transport for the KV data: auto (cma on one host), cma or tcp.
    #[arg(long, default_value = "auto")]
    transport: String,
    /// Decode DCP ranks (processes).
    #[arg(long, default_value_t = 4)]
    dcp_size: u32,
    /// Requests to send.
    #[arg(long, default_value_t = 24)]
    requests: u32,
    /// Longest request, in tokens.
    #[arg(long, default_value_t = 2048)]
    max_tokens: u64,
    /// KV entries (layers).
    #[arg(long, default_value_t = 61)]
    layers: u32,
    /// Values per token row (bf16: 2 bytes each).
    #[arg(long, default_value_t = 576)]
    row_values: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    page_size: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Seed of the request generator.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Prefill staging (pack) buffer per worker, MiB; 0 writes unpacked rows.
    #[arg(long, default_value_t = 64)]
    staging_mib: u64,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Grant every batch separately (no room-level grants).
    #[arg(long)]
    no_room_grants: bool,
}

/// Arguments of `pdxfer demo-rank` (one engine process of the demo).
#[derive(Args, Debug)]
pub struct DemoRankArgs {
    #[command(flatten)]
    pub rank: EngineRankArgs,
    /// Grant every batch separately (no room-level grants).
    #[arg(long)]
    no_room_grants: bool,
}

const AUX_ROWS: u64 = 64;
const AUX_ITEM: u64 = 64;

fn say(out: &Mutex<std::io::Stdout>, v: &Value) {
    let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
    let _ = writeln!(o, "{v}");
    let _ = o.flush();
}

/// Runs one engine rank of the demo, driven by JSON lines on stdin.
pub fn run_rank(args: &DemoRankArgs) -> Result<()> {
    let a = &args.rank;
    let pools = SyntheticPools::new(
        a.layers,
        a.row_bytes,
        a.page_size,
        a.pages,
        AUX_ROWS,
        AUX_ITEM,
    )?;
    let mut cfg = a.engine_config(&pools)?;
    cfg.room_timeout = Duration::from_secs(60);
    cfg.room_grants = !args.no_room_grants;
    // SAFETY: `pools` lives until this function returns, after `engine.close()`.
    let engine = unsafe { Engine::new(cfg)? };
    let pools = Arc::new(Mutex::new(pools));
    let out = Arc::new(Mutex::new(std::io::stdout()));
    say(&out, &json!({"event": "ready", "pid": std::process::id()}));
    let dcp = u64::from(a.dcp_size);
    let mut threads = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(cmd) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let (engine, pools, out) = (engine.clone(), pools.clone(), out.clone());
        let (page, rank) = (a.page_size, u64::from(a.rank));
        match cmd["cmd"].as_str() {
            Some("send") => threads.push(std::thread::spawn(move || {
                let room = cmd["room"].as_u64().unwrap_or(0);
                let r = prefill_room(&engine, &pools, &cmd, page);
                let _ = engine.clear(room);
                let (ok, ms, err) = match r {
                    Ok(ms) => (true, ms, None),
                    Err(e) => (false, 0.0, Some(e.to_string())),
                };
                say(&out, &json!({"event": "done", "room": room, "ok": ok, "transfer_ms": ms, "error": err}));
            })),
            Some("recv") => threads.push(std::thread::spawn(move || {
                let room = cmd["room"].as_u64().unwrap_or(0);
                let r = decode_room(&engine, &pools, &cmd, page, dcp, rank, &out);
                let _ = engine.clear(room);
                let (ok, bytes, err) = match r {
                    Ok(b) => (true, b, None),
                    Err(e) => (false, 0, Some(e.to_string())),
                };
                say(&out, &json!({"event": "done", "room": room, "ok": ok, "verified_bytes": bytes, "error": err}));
            })),
            Some("metrics") => {
                let control = engine.metrics_snapshot().control;
                say(&out, &json!({"event": "metrics", "latency": latency_summary(&engine), "control": control}));
            }
            Some("quit") => break,
            _ => {}
        }
        threads.retain(|t| !t.is_finished());
    }
    for t in threads {
        let _ = t.join();
    }
    engine.close();
    Ok(())
}

/// The engine's transfer latency histogram per transport, summarised:
/// count and p50 / p90 / p99 in milliseconds (estimated from the buckets).
fn latency_summary(engine: &Engine) -> Value {
    let s = engine.metrics_snapshot();
    let mut out = serde_json::Map::new();
    for (transport, h) in &s.totals.latency {
        let ms = |q: f64| h.quantile(q).map(|v| v * 1e3);
        out.insert(
            transport.to_string(),
            json!({
                "count": h.count, "p50_ms": ms(0.5), "p90_ms": ms(0.9), "p99_ms": ms(0.99),
                "mean_ms": (h.count > 0).then(|| h.sum / h.count as f64 * 1e3),
            }),
        );
    }
    Value::Object(out)
}

/// Asks every rank for its metrics (waits up to 10 s): the prefill rank's
/// latency histogram summary, and the control messages all ranks sent and
/// received (summed over the processes).
fn rank_metrics(procs: &mut [Proc], rx: &Receiver<Event>) -> Result<(Value, u64, u64)> {
    for p in procs.iter_mut() {
        p.send(&json!({"cmd": "metrics"}))?;
    }
    let end = Instant::now() + Duration::from_secs(10);
    let (mut latency, mut sent, mut received, mut left) = (Value::Null, 0, 0, procs.len());
    while left > 0 {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok((i, e)) if e["event"] == "metrics" => {
                if i == 0 {
                    latency = e["latency"].clone();
                }
                let c = &e["control"];
                let n = |k: &str| c[k].as_u64().unwrap_or(0);
                sent += n("engine_sent") + n("data_plane_sent");
                received += n("engine_received") + n("data_plane_received");
                left -= 1;
            }
            Ok(_) => {}
            Err(_) => {
                return Err(Error::new(
                    Status::Timeout,
                    "the demo ranks did not report their metrics within 10 s",
                ))
            }
        }
    }
    Ok((latency, sent, received))
}

/// Fills the request's rows, opens the room, sends the chunks; returns the
/// milliseconds from the first send to Success (every decode rank acknowledged).
fn prefill_room(
    engine: &Engine,
    pools: &Mutex<SyntheticPools>,
    cmd: &Value,
    page: u64,
) -> Result<f64> {
    let room = cmd["room"].as_u64().unwrap_or(0);
    let pages = pages_of(cmd, "pages");
    let prefix = cmd["prefix"].as_u64().unwrap_or(0);
    let total = cmd["total"].as_u64().unwrap_or(0);
    let chunk = cmd["chunk_pages"].as_u64().unwrap_or(u64::MAX).max(1) as usize;
    let aux = cmd["aux_index"].as_u64().unwrap_or(0);
    {
        let mut p = pools.lock().unwrap_or_else(|e| e.into_inner());
        let side = Side {
            layout: DcpLayout::sglang(page, 1)?,
            rank: 0,
            pages: &pages,
            origin: prefix,
        };
        p.fill(room, &side, total);
        p.fill_aux(room, aux);
    }
    engine.sender(room)?;
    let t0 = Instant::now();
    while engine.poll(room) == KvPoll::Bootstrapping {
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(Error::new(
                Status::Timeout,
                format!("room {room}: decode metadata never arrived"),
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let n = total - prefix;
    let mut sent = 0u64;
    let t_send = Instant::now();
    for (i, c) in pages.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= pages.len();
        let tokens = if last {
            n - sent
        } else {
            c.len() as u64 * page
        };
        engine.send(room, c, tokens, last, aux)?;
        sent += tokens;
    }
    match engine.wait(room, Duration::from_secs(120)) {
        KvPoll::Success => Ok(t_send.elapsed().as_secs_f64() * 1e3),
        p => Err(engine
            .failure(room)
            .unwrap_or_else(|| Error::new(Status::Timeout, format!("room {room} still {p:?}")))),
    }
}

fn decode_room(
    engine: &Engine,
    pools: &Mutex<SyntheticPools>,
    cmd: &Value,
    page: u64,
    dcp: u64,
    rank: u64,
    out: &Mutex<std::io::Stdout>,
) -> Result<u64> {
    let room = cmd["room"].as_u64().unwrap_or(0);
    let pages = pages_of(cmd, "dst_pages");
    let prefix = cmd["prefix"].as_u64().unwrap_or(0);
    let total = cmd["total"].as_u64().unwrap_or(0);
    let aux = cmd["aux_index"].as_u64().unwrap_or(0);
    engine.receiver(room, 0, Some(Duration::from_secs(120)))?;
    engine.send_metadata(room, &pages, prefix, aux)?;
    say(out, &json!({"event": "meta", "room": room}));
    match engine.wait(room, Duration::from_secs(120)) {
        KvPoll::Success => {}
        p => {
            return Err(engine.failure(room).unwrap_or_else(|| {
                Error::new(Status::Timeout, format!("room {room} still {p:?}"))
            }));
        }
    }
    let side = Side {
        layout: DcpLayout::sglang(page, dcp)?,
        rank,
        pages: &pages,
        origin: prefix,
    };
    let p = pools.lock().unwrap_or_else(|e| e.into_inner());
    p.verify(room, &side, total, Some(aux))
}

/// An event from demo rank `.0`.
struct Req {
    room: u64,
    total: u64,
    prefix: u64,
    src: Vec<u64>,
    dst: Vec<u64>,
    transfer_ms: f64,
    pending: usize,
    ok: bool,
    error: Option<String>,
}

/// Runs `pdxfer demo`.
pub fn run(a: &DemoArgs) -> Result<()> {
    let transport = TransportKind::parse(&a.transport)?;
    if a.dcp_size == 0 || a.requests == 0 || a.page_size == 0 || a.max_tokens == 0 {
        return Err(Error::invalid(
            "dcp-size, requests, page-size and max-tokens must be >= 1",
        ));
    }
    let row_bytes = a.row_values * 2;
    let (p, d) = (a.page_size, u64::from(a.dcp_size));
    let v = p * d;
    let conc = a.concurrency.max(1);
    let src_pages_total = conc as u64 * a.max_tokens.div_ceil(p) + 4;
    let dst_pages_total = conc as u64 * a.max_tokens.div_ceil(v) + 4;
    let server = BootstrapServer::start(ServerConfig::default())?;
    let cluster = format!("demo-{}", std::process::id());
    let common = |role: &str, dcp: u32, rank: u32, pages: u64| -> Vec<String> {
        [
            "--role",
            role,
            "--bootstrap",
            &server.url(),
            "--cluster",
            &cluster,
            "--dcp-size",
            &dcp.to_string(),
            "--rank",
            &rank.to_string(),
            "--layers",
            &a.layers.to_string(),
            "--row-bytes",
            &row_bytes.to_string(),
            "--page-size",
            &p.to_string(),
            "--pages",
            &pages.to_string(),
            "--transport",
            &a.transport,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(a.no_room_grants.then(|| "--no-room-grants".to_string()))
        .collect()
    };
    // one cluster secret per run: the ranks authenticate every connection
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| Error::new(Status::Io, format!("getrandom for the demo's secret: {e}")))?;
    let secret: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let (tx, rx) = unbounded::<Event>();
    let mut procs = vec![spawn(
        "demo-rank",
        &common("prefill", 1, 0, src_pages_total),
        0,
        &secret,
        tx.clone(),
    )?];
    for r in 0..a.dcp_size {
        procs.push(spawn(
            "demo-rank",
            &common("decode", a.dcp_size, r, dst_pages_total),
            r as usize + 1,
            &secret,
            tx.clone(),
        )?);
    }
    let result = drive(
        a,
        &mut procs,
        &rx,
        src_pages_total,
        dst_pages_total,
        row_bytes,
        transport,
    );
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
    result
}

#[allow(clippy::too_many_arguments)]
fn drive(
    a: &DemoArgs,
    procs: &mut [Proc],
    rx: &Receiver<Event>,
    src_total: u64,
    dst_total: u64,
    row_bytes: u64,
    transport: TransportKind,
) -> Result<()> {
    let (p, d) = (a.page_size, u64::from(a.dcp_size));
    let v = p * d;
    // wait for every rank
    let mut ready = 0;
    let t0 = Instant::now();
    while ready < procs.len() {
        match rx.recv_timeout(Duration::from_secs(60).saturating_sub(t0.elapsed())) {
            Ok((_, e)) if e["event"] == "ready" => ready += 1,
            Ok((i, e)) if e["event"] == "exit" => {
                return Err(Error::new(
                    Status::PeerUnreachable,
                    format!("demo rank {i} exited during start-up"),
                ));
            }
            Ok(_) => {}
            Err(_) => {
                return Err(Error::new(
                    Status::Timeout,
                    "demo ranks did not start within 60 s",
                ))
            }
        }
    }
    let mut rng = SplitMix64::new(a.seed);
    let mut free_src: VecDeque<u64> = (0..src_total).rev().collect();
    let mut free_dst: VecDeque<u64> = (0..dst_total).collect();
    let mut inflight: HashMap<u64, Req> = HashMap::new();
    let mut latencies = Vec::new();
    let (mut tokens, mut bytes, mut failures) = (0u64, 0u64, Vec::new());
    let bar = indicatif::ProgressBar::new(u64::from(a.requests));
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let start = Instant::now();
    let mut next_room = 1u64;
    let mut done = 0u32;
    while done < a.requests {
        // start requests while there is room
        while inflight.len() < a.concurrency.max(1) && next_room <= u64::from(a.requests) {
            let room = next_room;
            let total = 1 + (a.max_tokens / 8) + rng.below(a.max_tokens - a.max_tokens / 8);
            let prefix = if room.is_multiple_of(3) && total > v {
                (1 + rng.below((total - 1) / v)) * v
            } else {
                0
            };
            let prefix = prefix.min((total - 1) / v * v);
            let n = total - prefix;
            let chunk = if room.is_multiple_of(2) {
                2 + rng.below(6)
            } else {
                u64::MAX
            };
            let src: Vec<u64> = (0..n.div_ceil(p))
                .filter_map(|_| free_src.pop_front())
                .collect();
            let dst: Vec<u64> = (0..n.div_ceil(v))
                .filter_map(|_| free_dst.pop_front())
                .collect();
            let aux = room % AUX_ROWS;
            for pr in procs.iter_mut().skip(1) {
                pr.send(
                    &json!({"cmd": "recv", "room": room, "dst_pages": dst, "prefix": prefix, "total": total, "aux_index": aux}),
                )?;
            }
            procs[0].send(
                &json!({"cmd": "send", "room": room, "pages": src, "prefix": prefix, "total": total, "chunk_pages": chunk, "aux_index": aux}),
            )?;
            inflight.insert(
                room,
                Req {
                    room,
                    total,
                    prefix,
                    src,
                    dst,
                    transfer_ms: 0.0,
                    pending: procs.len(),
                    ok: true,
                    error: None,
                },
            );
            next_room += 1;
        }
        let (i, ev) = rx.recv_timeout(Duration::from_secs(180)).map_err(|_| {
            Error::new(Status::Timeout, "no progress from the demo ranks for 180 s")
        })?;
        match ev["event"].as_str() {
            Some("exit") => {
                return Err(Error::new(
                    Status::PeerUnreachable,
                    format!("demo rank {i} exited"),
                ))
            }
            Some("done") => {
                let room = ev["room"].as_u64().unwrap_or(0);
                let Some(req) = inflight.get_mut(&room) else {
                    continue;
                };
                req.pending -= 1;
                if i == 0 {
                    req.transfer_ms = ev["transfer_ms"].as_f64().unwrap_or(0.0);
                }
                if ev["ok"] != true {
                    req.ok = false;
                    req.error.get_or_insert_with(|| {
                        format!("rank {i}: {}", ev["error"].as_str().unwrap_or("?"))
                    });
                }
                if req.pending == 0 {
                    let req = inflight.remove(&room).expect("present");
                    latencies.push(req.transfer_ms);
                    let n = req.total - req.prefix;
                    tokens += n;
                    bytes += n * row_bytes * u64::from(a.layers) + d * AUX_ITEM;
                    if !req.ok {
                        failures.push(format!(
                            "room {}: {}",
                            req.room,
                            req.error.unwrap_or_default()
                        ));
                    }
                    free_src.extend(req.src);
                    free_dst.extend(req.dst);
                    done += 1;
                    bar.inc(1);
                    bar.set_message(format!(
                        "{:.2} GB/s",
                        bytes as f64 / start.elapsed().as_secs_f64() / 1e9
                    ));
                }
            }
            _ => {}
        }
    }
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let (histogram, ctl_sent, ctl_received) = rank_metrics(procs, rx)?;
    // every message is sent by one rank and received by another: per request,
    // the messages sent (connection set-up included, spread over the requests)
    let ctl_per_request = ctl_sent as f64 / f64::from(a.requests.max(1));
    latencies.sort_by(|x, y| x.total_cmp(y));
    let pct = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
    let verified = failures.is_empty();
    let tname = match transport {
        TransportKind::Auto => "auto (cma on this host)",
        other => other.name(),
    };
    if !a.json {
        println!(
            "pdxfer demo: 1 prefill rank -> {} decode DCP ranks, {} layers x {} B rows, page {}",
            a.dcp_size, a.layers, row_bytes, p
        );
        println!("(GB/s: KV + aux bytes over the whole run, pattern fill and verification included; p50/p99: one request's transfer, first send to every decode rank's acknowledgement)");
        println!(
            "{:<12} {:>10} {:>14} {:>9} {:>8} {:>9} {:>9}  transport",
            "requests", "tokens", "bytes", "seconds", "GB/s", "p50 ms", "p99 ms"
        );
        println!(
            "{:<12} {:>10} {:>14} {:>9.3} {:>8.3} {:>9.2} {:>9.2}  {}",
            a.requests,
            tokens,
            bytes,
            secs,
            bytes as f64 / secs / 1e9,
            pct(0.5),
            pct(0.99),
            tname
        );
        println!(
            "verified: {} ({} of {} requests byte-exact on every decode rank)",
            verified,
            a.requests as usize - failures.len(),
            a.requests
        );
        println!("prefill engine transfer latency histogram (first chunk queued to Success; quantiles from the buckets):");
        if let Some(m) = histogram.as_object() {
            for (t, h) in m {
                let ms = |k: &str| h[k].as_f64().map_or("-".to_string(), |v| format!("{v:.2}"));
                println!(
                    "  {t:<6} rooms {:>6}  p50 {:>9} ms  p90 {:>9} ms  p99 {:>9} ms",
                    h["count"],
                    ms("p50_ms"),
                    ms("p90_ms"),
                    ms("p99_ms")
                );
            }
        }
        println!(
            "control messages: {ctl_sent} sent, {ctl_received} received by all ranks; {ctl_per_request:.1} per request (connection set-up included)"
        );
        for f in &failures {
            println!("  FAILED {f}");
        }
    }
    println!(
        "{}",
        json!({
            "verified": verified, "requests": a.requests, "tokens": tokens, "bytes": bytes, "seconds": secs,
            "gb_per_s": bytes as f64 / secs / 1e9, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "transport": tname, "dcp_size": a.dcp_size, "failures": failures,
            "latency_histogram": histogram,
            "control_messages": ctl_sent, "control_messages_received": ctl_received,
            "control_messages_per_request": ctl_per_request,
        })
    );
    if verified {
        Ok(())
    } else {
        Err(Error::new(
            Status::RoomFailed,
            format!(
                "{} of {} requests failed verification",
                failures.len(),
                a.requests
            ),
        ))
    }
}
