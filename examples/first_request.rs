//! The first request after connecting against warm ones, on one host: a
//! bootstrap server, one prefill engine and `--dcp` decode engines in this
//! process over cma, and the same request (`--tokens` x `--layers` x `--row`
//! bytes, scattered pages) sent `--requests` times; prints each request's
//! transfer time (first send to Success) and first / median-of-the-rest.
//!
//! `--shared`: the decode KV pools are shared pool allocations (the prefill
//! maps them at connect and copies rows straight in: one copy); otherwise
//! heap pools (touched before the run, as a serving engine's zeroed KV cache
//! is), written through the prefill's staging with `process_vm_writev`.
//!
//! ```text
//! cargo run --release --no-default-features --example first_request -- --shared
//! ```

use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::transport::TransportKind;
use std::time::{Duration, Instant};

struct Args {
    shared: bool,
    one_copy: bool,
    requests: u64,
    tokens: u64,
    layers: u32,
    row: u64,
    dcp: u32,
    page: u64,
    settle_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        shared: false,
        one_copy: true,
        requests: 6,
        tokens: 8192,
        layers: 61,
        row: 1152,
        dcp: 4,
        page: 64,
        settle_ms: 500,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut num = || -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{k} needs a number"))
        };
        match k.as_str() {
            "--shared" => a.shared = true,
            "--no-one-copy" => a.one_copy = false,
            "--requests" => a.requests = num().max(2),
            "--tokens" => a.tokens = num(),
            "--layers" => a.layers = num() as u32,
            "--row" => a.row = num(),
            "--dcp" => a.dcp = num() as u32,
            "--page" => a.page = num(),
            "--settle-ms" => a.settle_ms = num(),
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

fn main() -> pdxfer::Result<()> {
    let a = args();
    let server = BootstrapServer::start(ServerConfig::default())?;
    let url = server.url();
    let cluster = format!("first-request-{}", std::process::id());
    let (p, d) = (a.page, u64::from(a.dcp));
    let src_pages = a.tokens.div_ceil(p) + 1;
    let dst_pages = a.tokens.div_ceil(p * d) + 1;
    let mut p_pools = SyntheticPools::new(a.layers, a.row, p, src_pages, 8, 32)?;
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        &cluster,
        &url,
        p_pools.topology(1, 0),
        p_pools.kv_pools(),
    );
    cfg.aux = p_pools.aux_buffers();
    cfg.transport = TransportKind::Cma;
    cfg.one_copy = a.one_copy;
    // SAFETY: the pools outlive the engine (closed before they drop).
    let prefill = unsafe { Engine::new(cfg)? };
    let mut decode = Vec::new();
    for r in 0..a.dcp {
        let mut pools = if a.shared {
            SyntheticPools::new_shared(a.layers, a.row, p, dst_pages, 8, 32)?
        } else {
            SyntheticPools::new(a.layers, a.row, p, dst_pages, 8, 32)?
        };
        for l in 0..a.layers as usize {
            pools.layer_bytes_mut(l).fill(0); // a zeroed KV cache: its pages exist
        }
        let mut cfg = EngineConfig::new(
            Role::Decode,
            &cluster,
            &url,
            pools.topology(a.dcp, r),
            pools.kv_pools(),
        );
        cfg.aux = pools.aux_buffers();
        cfg.transport = TransportKind::Cma;
        // SAFETY: as above.
        decode.push((unsafe { Engine::new(cfg)? }, pools));
    }
    // distinct pages, in descending order: no two consecutive pages adjacent
    let src: Vec<u64> = (0..a.tokens.div_ceil(p))
        .map(|i| src_pages - 1 - i)
        .collect();
    let dst: Vec<u64> = (0..a.tokens.div_ceil(p * d))
        .map(|i| dst_pages - 1 - i)
        .collect();
    let bytes = a.tokens * a.row * u64::from(a.layers);
    println!(
        "{} tokens x {} layers x {} B = {:.1} MB, 1 prefill -> {} decode ranks over cma, decode pools {}{}",
        a.tokens,
        a.layers,
        a.row,
        bytes as f64 / 1e6,
        a.dcp,
        if a.shared { "shared" } else { "heap" },
        if a.one_copy { "" } else { ", one copy off" }
    );
    // the engines' start-up threads (bootstrap leases, connections) settle first
    std::thread::sleep(Duration::from_millis(a.settle_ms));
    let mut ms = Vec::new();
    for room in 1..=a.requests {
        let side = Side {
            layout: DcpLayout::sglang(p, 1)?,
            rank: 0,
            pages: &src,
            origin: 0,
        };
        p_pools.fill(room, &side, a.tokens);
        for (e, _) in &decode {
            e.receiver(room, 0, Some(Duration::from_secs(60)))?;
            e.send_metadata(room, &dst, 0, 1)?;
        }
        prefill.sender(room)?;
        while prefill.poll(room) == KvPoll::Bootstrapping {
            std::thread::sleep(Duration::from_micros(200));
        }
        let gather0 = prefill.metrics_snapshot().gather_seconds;
        let faults0 = minor_faults();
        let t0 = Instant::now();
        prefill.send(room, &src, a.tokens, true, 1)?;
        let st = prefill.wait(room, Duration::from_secs(60));
        let took = t0.elapsed().as_secs_f64() * 1e3;
        let faults = minor_faults() - faults0;
        let gather = (prefill.metrics_snapshot().gather_seconds - gather0) * 1e3;
        if st != KvPoll::Success {
            return Err(prefill
                .failure(room)
                .unwrap_or_else(|| pdxfer::Error::invalid(format!("room {room}: {st:?}"))));
        }
        for (r, (e, pools)) in decode.iter().enumerate() {
            e.wait(room, Duration::from_secs(60));
            let side = Side {
                layout: DcpLayout::sglang(p, d)?,
                rank: r as u64,
                pages: &dst,
                origin: 0,
            };
            pools.verify(room, &side, a.tokens, None)?;
            e.clear(room)?;
        }
        prefill.clear(room)?;
        println!(
            "request {room}: {took:8.1} ms  {:6.2} GB/s  {faults:7} page faults  gathers {gather:6.1} ms (all workers)",
            bytes as f64 / took / 1e6
        );
        ms.push(took);
    }
    let mut warm = ms[1..].to_vec();
    warm.sort_by(|x, y| x.total_cmp(y));
    let median = warm[warm.len() / 2];
    let s = prefill.metrics_snapshot();
    println!(
        "first {:.1} ms, warm median {median:.1} ms: first/warm = {:.2}x; one-copy bytes {}, gathers {}",
        ms[0],
        ms[0] / median,
        s.one_copy_bytes,
        s.gathers
    );
    // one memcpy of the same bytes in this process, between faulted-in buffers
    let src_buf = vec![1u8; bytes as usize];
    let mut dst_buf = vec![2u8; bytes as usize];
    let t0 = Instant::now();
    dst_buf.copy_from_slice(&src_buf);
    let memcpy = t0.elapsed().as_secs_f64() * 1e3;
    std::hint::black_box(&dst_buf);
    println!(
        "one memcpy of {:.1} MB: {memcpy:.1} ms; warm median / memcpy = {:.2}x the time",
        bytes as f64 / 1e6,
        median / memcpy
    );
    prefill.close();
    for (e, _) in &decode {
        e.close();
    }
    server.stop();
    Ok(())
}

/// Minor page faults of this process so far (every engine runs in it).
fn minor_faults() -> i64 {
    // SAFETY: ru is a valid out-struct for getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_minflt
}
