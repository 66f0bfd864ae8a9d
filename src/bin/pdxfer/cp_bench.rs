//! `pdxfer bench-cp`: one PD request from C prefill attention CP processes
//! (each holding the request's rows, as SGLang's CP ranks do) to D decode DCP
//! processes on this host, in SGLang's rank-0 mode (CP rank 0 sends all) and
//! in all-CP-ranks mode (each CP rank its page range: on a GPU node, C NICs).
//! Every rank is a `pdxfer bench-request-rank` process; a request's rows are
//! written into every CP rank's pools before the clock starts, and its time
//! runs from the first sender's send to the last sender's Success. Every
//! request is verified byte by byte on every decode rank.

use crate::rank_proc::{spawn, Event, Proc};
use crate::request_bench::{collect, median};
use crate::request_shape::RequestShape;
use clap::Args;
use crossbeam::channel::{unbounded, Receiver};
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::error::{Error, Result, Status};
use pdxfer::layout::{cp_page_bounds, CpMode};
use pdxfer::transport::TransportKind;
use serde::Serialize;
use serde_json::json;
use std::time::{Duration, Instant};

/// Arguments of `pdxfer bench-cp`.
#[derive(Args, Debug)]
pub struct CpBenchArgs {
    /// Prefill attention CP ranks (processes).
    #[arg(long, default_value_t = 2)]
    src_cp_size: u32,
    /// Decode DCP ranks (processes).
    #[arg(long, default_value_t = 4)]
    dcp_size: u32,
    /// CP send modes to run, each with fresh rank processes: rank0, all-cp.
    #[arg(long, value_delimiter = ',', default_value = "rank0,all-cp")]
    cp_modes: Vec<String>,
    #[command(flatten)]
    shape: RequestShape,
    /// Transport: cma, tcp or auto.
    #[arg(long, default_value = "cma")]
    transport: String,
    /// Pool memory: heap or shared.
    #[arg(long, default_value = "heap")]
    pools: String,
    /// Print one JSON object as the last line (and no table).
    #[arg(long)]
    json: bool,
}

/// The figures of one CP send mode.
#[derive(Debug, Clone, Serialize)]
struct CpModeResult {
    cp_mode: &'static str,
    /// Prefill CP ranks that send KV.
    senders: u32,
    /// KV bytes each sending CP rank moves per request.
    bytes_per_sender: Vec<u64>,
    request_bytes: u64,
    /// Each request: the first sender's send to the last sender's Success.
    transfer_ms: Vec<f64>,
    first_ms: f64,
    /// Median of the requests after the first.
    warm_median_ms: f64,
    gb_per_s: f64,
}

fn run_mode(a: &CpBenchArgs, mode: CpMode) -> Result<CpModeResult> {
    let transport = TransportKind::parse(&a.transport)?;
    let (c, d, p) = (a.src_cp_size, a.dcp_size, a.shape.page_size);
    let src: Vec<u64> = (0..a.shape.tokens.div_ceil(p)).collect();
    let dst: Vec<u64> = (0..a.shape.tokens.div_ceil(p * u64::from(d))).collect();
    let token_bytes = a.shape.row_bytes * u64::from(a.shape.layers);
    let request_bytes = a.shape.tokens * token_bytes;
    let server = BootstrapServer::start(ServerConfig::default())?;
    let cluster = format!("bench-cp-{}", std::process::id());
    let url = server.url();
    let args = |role: &str, dcp: u32, rank: u32, pages: u64| -> Vec<String> {
        [
            ("--role", role.to_string()),
            ("--bootstrap", url.clone()),
            ("--cluster", cluster.clone()),
            ("--dcp-size", dcp.to_string()),
            ("--rank", rank.to_string()),
            ("--layers", a.shape.layers.to_string()),
            ("--row-bytes", a.shape.row_bytes.to_string()),
            ("--page-size", p.to_string()),
            ("--pages", pages.to_string()),
            ("--transport", transport.name().to_string()),
            ("--pools", a.pools.clone()),
            ("--staging-mib", a.shape.staging_mib.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    };
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| Error::new(Status::Io, format!("getrandom for the bench's secret: {e}")))?;
    let secret: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let (tx, rx) = unbounded();
    let mut procs: Vec<Proc> = Vec::new();
    let mut spawned = || -> Result<()> {
        for k in 0..c {
            let mut v = args("prefill", 1, 0, src.len() as u64);
            v.extend([
                "--cp-size".into(),
                c.to_string(),
                "--cp-rank".into(),
                k.to_string(),
                "--cp-mode".into(),
                mode.as_str().into(),
            ]);
            procs.push(spawn(
                "bench-request-rank",
                &v,
                k as usize,
                &secret,
                tx.clone(),
            )?);
        }
        for r in 0..d {
            procs.push(spawn(
                "bench-request-rank",
                &args("decode", d, r, dst.len() as u64),
                (c + r) as usize,
                &secret,
                tx.clone(),
            )?);
        }
        Ok(())
    };
    let r = spawned().and_then(|()| drive(a, mode, &mut procs, &rx, &src, &dst));
    for pr in procs.iter_mut() {
        let _ = pr.send(&json!({"cmd": "quit"}));
    }
    for pr in procs.iter_mut() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !matches!(pr.child.try_wait(), Ok(Some(_))) {
            if Instant::now() > deadline {
                let _ = pr.child.kill();
                let _ = pr.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    server.stop();
    let (transfer_ms, senders) = r?;
    let first_ms = transfer_ms[0];
    let warm_median_ms = median(&transfer_ms[1..]).unwrap_or(first_ms);
    let n_pages = src.len() as u64;
    let bytes_per_sender = senders
        .iter()
        .map(|&k| {
            let b = if mode == CpMode::AllCp {
                cp_page_bounds(n_pages, u64::from(k), u64::from(c))
            } else {
                0..n_pages
            };
            (b.end * p).min(a.shape.tokens).saturating_sub(b.start * p) * token_bytes
        })
        .collect();
    Ok(CpModeResult {
        cp_mode: mode.as_str(),
        senders: senders.len() as u32,
        bytes_per_sender,
        request_bytes,
        transfer_ms,
        first_ms,
        warm_median_ms,
        gb_per_s: request_bytes as f64 / (warm_median_ms / 1e3) / 1e9,
    })
}

/// Runs the requests of one mode; returns each request's milliseconds and
/// the sending CP ranks.
fn drive(
    a: &CpBenchArgs,
    mode: CpMode,
    procs: &mut [Proc],
    rx: &Receiver<Event>,
    src: &[u64],
    dst: &[u64],
) -> Result<(Vec<f64>, Vec<u32>)> {
    let c = a.src_cp_size as usize;
    let all: Vec<usize> = (0..procs.len()).collect();
    let prefills: Vec<usize> = (0..c).collect();
    let senders: Vec<usize> = if mode == CpMode::AllCp {
        prefills.clone()
    } else {
        vec![0]
    };
    collect(rx, &all, "ready", Duration::from_secs(60))?;
    let mut transfer_ms = Vec::new();
    for room in 1..=u64::from(a.shape.requests) {
        for pr in procs.iter_mut().take(c) {
            pr.send(&json!({"cmd": "fill", "room": room, "pages": src, "total": a.shape.tokens}))?;
        }
        collect(rx, &prefills, "filled", Duration::from_secs(300))?;
        for pr in procs.iter_mut().skip(c) {
            pr.send(
                &json!({"cmd": "recv", "room": room, "dst_pages": dst, "total": a.shape.tokens}),
            )?;
        }
        for pr in procs.iter_mut().take(c) {
            pr.send(
                &json!({"cmd": "send", "room": room, "pages": src, "total": a.shape.tokens,
                            "prefilled": true}),
            )?;
        }
        let done = collect(rx, &all, "done", Duration::from_secs(300))?;
        for (i, e) in done.iter().enumerate() {
            if e["ok"] != true {
                return Err(Error::new(
                    Status::RoomFailed,
                    format!(
                        "{}: room {room}, rank {i}: {}",
                        mode.as_str(),
                        e["error"].as_str().unwrap_or("?")
                    ),
                ));
            }
        }
        let at = |k: &str| -> Vec<u64> {
            senders
                .iter()
                .filter_map(|&i| done[i][k].as_u64())
                .collect()
        };
        let start = at("sent_at_ns").into_iter().min().unwrap_or(0);
        let end = at("done_at_ns").into_iter().max().unwrap_or(start);
        transfer_ms.push(end.saturating_sub(start) as f64 / 1e6);
    }
    Ok((transfer_ms, senders.iter().map(|&i| i as u32).collect()))
}

/// Runs `pdxfer bench-cp`.
pub fn run(a: &CpBenchArgs) -> Result<()> {
    if a.shape.requests < 2
        || a.shape.tokens == 0
        || a.shape.page_size == 0
        || a.dcp_size == 0
        || a.src_cp_size < 2
    {
        return Err(Error::invalid(
            "requests must be >= 2 (the first is reported apart), src-cp-size >= 2; tokens, page-size and dcp-size >= 1",
        ));
    }
    let modes: Vec<CpMode> = a
        .cp_modes
        .iter()
        .map(|m| CpMode::parse(m.trim()))
        .collect::<Result<_>>()?;
    let results: Vec<CpModeResult> = modes
        .iter()
        .map(|&m| run_mode(a, m))
        .collect::<Result<_>>()?;
    let bytes = a.shape.tokens * a.shape.row_bytes * u64::from(a.shape.layers);
    if a.json {
        println!(
            "{}",
            json!({
                "tokens": a.shape.tokens, "layers": a.shape.layers, "row_bytes": a.shape.row_bytes, "page_size": a.shape.page_size,
                "src_cp_size": a.src_cp_size, "dcp_size": a.dcp_size, "transport": a.transport,
                "pools": a.pools, "request_bytes": bytes, "requests": a.shape.requests, "results": results,
            })
        );
        return Ok(());
    }
    println!(
        "pdxfer bench-cp: {} tokens x {} layers x {} B = {:.1} MB, {} prefill CP -> {} decode DCP processes over {} ({} pools), {} requests per mode (warm = median of requests 2..{})",
        a.shape.tokens, a.shape.layers, a.shape.row_bytes, bytes as f64 / 1e6, a.src_cp_size, a.dcp_size, a.transport,
        a.pools, a.shape.requests, a.shape.requests
    );
    println!();
    println!("| CP mode | senders | MB per sender | first ms | warm ms | GB/s (warm) |");
    println!("|---|---:|---|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.2} |",
            r.cp_mode,
            r.senders,
            r.bytes_per_sender
                .iter()
                .map(|b| format!("{:.1}", *b as f64 / 1e6))
                .collect::<Vec<_>>()
                .join(" / "),
            r.first_ms,
            r.warm_median_ms,
            r.gb_per_s
        );
    }
    Ok(())
}
