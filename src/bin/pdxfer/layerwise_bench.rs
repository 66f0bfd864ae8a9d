//! `pdxfer bench --layerwise`: the transfer time a prefill's KV adds to
//! time-to-first-token, layer-wise against whole-request.
//!
//! One process: a bootstrap server, a prefill engine (DCP 1) and `dcp`
//! decode engines (host pools, the chosen transport). A synthetic prefill
//! "computes" layer after layer at a set rate (`--layer-ms` each; the host
//! pools were filled before, the compute only takes time, as a GPU's would
//! not use the CPU). Whole-request: the request is sent once every layer is
//! computed. Layer-wise: each layer is queued as a send behind a ready flag
//! before the compute starts and the synthetic prefill sets the layer's flag
//! when its compute ends. Both report the *exposed* transfer time: from the
//! end of the last layer's compute to the last decode rank's completion.
//! The whole-request exposed time is the transfer time of the request; the
//! target is a layer-wise exposed time of at most two layers' share of it.

use clap::Args;
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll, ReadyFlag, SendOptions};
use pdxfer::error::{Error, Result};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::transport::TransportKind;
use serde::Serialize;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `pdxfer bench --layerwise`.
#[derive(Args, Debug, Clone)]
pub struct LayerwiseArgs {
    /// Run the layer-wise benchmark instead of the transport sweep.
    #[arg(long)]
    pub layerwise: bool,
    /// Layers (topology entries).
    #[arg(long, default_value_t = 61)]
    pub layers: u32,
    /// Bytes of one KV row of a layer (MLA: 576 bf16 values = 1152 B).
    #[arg(long, default_value_t = 1152)]
    pub row_bytes: u64,
    /// Request lengths (tokens) to run.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    pub tokens: Vec<u64>,
    /// Decode DCP size.
    #[arg(long, default_value_t = 4)]
    pub dcp: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u64,
    /// Compute time of one layer in ms (0: 1.5x the measured transfer time
    /// of one layer, a rate the transfer can keep up with).
    #[arg(long, default_value_t = 0.0)]
    pub layer_ms: f64,
    /// Repetitions per mode (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
}

/// The result for one request length.
#[derive(Debug, Clone, Serialize)]
pub struct LayerwisePoint {
    pub tokens: u64,
    pub layers: u32,
    pub row_bytes: u64,
    pub dcp: u32,
    pub transport: String,
    /// KV bytes of the request (all decode ranks together).
    pub kv_bytes: u64,
    /// Compute time of one layer used (ms).
    pub layer_ms: f64,
    /// Whole-request: last layer computed -> every decode rank done (ms, median).
    pub whole_exposed_ms: f64,
    /// Transfer time of one layer: `whole_exposed_ms / layers` (ms).
    pub layer_transfer_ms: f64,
    /// Layer-wise: last layer computed -> every decode rank done (ms, median).
    pub layerwise_exposed_ms: f64,
    /// `layerwise_exposed_ms / layer_transfer_ms` (target: at most 2).
    pub exposed_in_layers: f64,
    /// Every decode byte was checked after the first repetition of each mode.
    pub verified: bool,
}

struct Setup {
    _server: BootstrapServer,
    prefill: Engine,
    _p_pools: SyntheticPools,
    decode: Vec<(Engine, SyntheticPools)>,
    src: Vec<u64>,
    dst: Vec<u64>,
}

fn setup(a: &LayerwiseArgs, transport: TransportKind, tokens: u64) -> Result<Setup> {
    let p = a.page_size;
    let v = p * u64::from(a.dcp);
    if tokens == 0 || !tokens.is_multiple_of(v) {
        return Err(Error::invalid(format!(
            "tokens={tokens} must be a positive multiple of page_size x dcp = {v}"
        )));
    }
    let server = BootstrapServer::start(ServerConfig::default())?;
    let url = server.url();
    let cluster = format!("lw-bench-{tokens}");
    let pages = tokens / p;
    let mut p_pools = SyntheticPools::new(a.layers, a.row_bytes, p, pages, 8, 32)?;
    let src: Vec<u64> = (0..pages).map(|i| (i * 7) % pages).collect();
    let dst_n = tokens / v;
    let dst: Vec<u64> = (0..dst_n).map(|i| (i * 3) % dst_n).collect();
    let side = Side {
        layout: DcpLayout::sglang(p, 1)?,
        rank: 0,
        pages: &src,
        origin: 0,
    };
    p_pools.fill(1, &side, tokens);
    p_pools.fill_aux(1, 3);
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        &cluster,
        &url,
        p_pools.topology(1, 0),
        p_pools.kv_pools(),
    );
    cfg.aux = p_pools.aux_buffers();
    cfg.transport = transport;
    cfg.room_timeout = Duration::from_secs(600);
    // SAFETY: the pools live in the returned Setup beside the engine.
    let prefill = unsafe { Engine::new(cfg) }?;
    let mut decode = Vec::new();
    for r in 0..a.dcp {
        let pools = SyntheticPools::new(a.layers, a.row_bytes, p, dst_n, 8, 32)?;
        let mut cfg = EngineConfig::new(
            Role::Decode,
            &cluster,
            &url,
            pools.topology(a.dcp, r),
            pools.kv_pools(),
        );
        cfg.aux = pools.aux_buffers();
        cfg.transport = transport;
        cfg.room_timeout = Duration::from_secs(600);
        // SAFETY: as above.
        decode.push((unsafe { Engine::new(cfg) }?, pools));
    }
    Ok(Setup {
        _server: server,
        prefill,
        _p_pools: p_pools,
        decode,
        src,
        dst,
    })
}

/// Opens room `room` on every rank (the KV pattern is room 1's: every
/// repetition sends the same rows) and waits until the prefill may send.
fn open(s: &Setup, room: u64) -> Result<()> {
    for (e, _) in &s.decode {
        e.receiver(room, 0, None)?;
        e.send_metadata(room, &s.dst, 0, 5)?;
    }
    s.prefill.sender(room)?;
    let end = Instant::now() + Duration::from_secs(30);
    while s.prefill.poll(room) == KvPoll::Bootstrapping {
        if Instant::now() > end {
            return Err(Error::invalid("the prefill never saw the decode metadata"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Waits for every decode rank; returns when the last one completed.
fn acked(s: &Setup, room: u64) -> Result<Instant> {
    let mut last = Instant::now();
    for (r, (e, _)) in s.decode.iter().enumerate() {
        if e.wait(room, Duration::from_secs(600)) != KvPoll::Success {
            return Err(Error::invalid(format!(
                "decode rank {r}: room {room} failed: {:?}",
                e.failure(room)
            )));
        }
        last = Instant::now();
    }
    Ok(last)
}

/// Checks every decode rank's rows and aux row (room 1's pattern).
fn verify(s: &Setup, a: &LayerwiseArgs, tokens: u64) -> Result<()> {
    for (r, (_, pools)) in s.decode.iter().enumerate() {
        let side = Side {
            layout: DcpLayout::sglang(a.page_size, u64::from(a.dcp))?,
            rank: r as u64,
            pages: &s.dst,
            origin: 0,
        };
        pools.verify(1, &side, tokens, Some(5))?;
    }
    Ok(())
}

fn clear(s: &Setup, room: u64) -> Result<()> {
    s.prefill.clear(room)?;
    for (e, _) in &s.decode {
        e.clear(room)?;
    }
    Ok(())
}

/// The synthetic compute of `layers` layers of `layer` each, calling `done(l)`
/// as layer `l` ends; returns when the last one ended.
fn compute(layers: u32, layer: Duration, mut done: impl FnMut(u32)) -> Instant {
    let t0 = Instant::now();
    for l in 0..layers {
        let end = t0 + layer * (l + 1);
        let now = Instant::now();
        if end > now {
            std::thread::sleep(end - now);
        }
        done(l);
    }
    Instant::now()
}

fn whole(s: &Setup, a: &LayerwiseArgs, room: u64, layer: Duration, tokens: u64) -> Result<f64> {
    open(s, room)?;
    let end = compute(a.layers, layer, |_| {});
    s.prefill.send(room, &s.src, tokens, true, 3)?;
    let t = acked(s, room)?;
    Ok((t - end).as_secs_f64() * 1e3)
}

fn layerwise(s: &Setup, a: &LayerwiseArgs, room: u64, layer: Duration, tokens: u64) -> Result<f64> {
    open(s, room)?;
    let flags: Vec<ReadyFlag> = (0..a.layers)
        .map(|_| ReadyFlag::new(Arc::<AtomicU64>::default()))
        .collect();
    for (l, f) in flags.iter().enumerate() {
        let o = SendOptions {
            layers: Some(l as u32..l as u32 + 1),
            ready_flag: Some(f.clone()),
            ..Default::default()
        };
        s.prefill.send_with(room, &s.src, tokens, true, 3, &o)?;
    }
    let end = compute(a.layers, layer, |l| flags[l as usize].set());
    let t = acked(s, room)?;
    Ok((t - end).as_secs_f64() * 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark; prints one line per request length (and JSON with `json`).
pub fn run(a: &LayerwiseArgs, transport: &str, json: bool) -> Result<()> {
    let kind = TransportKind::parse(transport)?;
    if a.layers == 0 || a.reps == 0 {
        return Err(Error::invalid("--layers and --reps must be positive"));
    }
    let mut points = Vec::new();
    for &tokens in &a.tokens {
        let mut s = setup(a, kind, tokens)?;
        let mut room = 100;
        // a warm-up request (first-touch of the decode pools, connections)
        whole(&s, a, room, Duration::ZERO, tokens)?;
        verify(&s, a, tokens)?;
        clear(&s, room)?;
        let mut w = Vec::new();
        for _ in 0..a.reps {
            room += 1;
            w.push(whole(&s, a, room, Duration::ZERO, tokens)?);
            clear(&s, room)?;
        }
        let whole_ms = median(w);
        let per_layer = whole_ms / f64::from(a.layers);
        let layer_ms = if a.layer_ms > 0.0 {
            a.layer_ms
        } else {
            (per_layer * 1.5).max(0.1)
        };
        let layer = Duration::from_secs_f64(layer_ms / 1e3);
        // the whole-request exposed time with the compute in front (as measured
        // with none: the transfer starts after it either way)
        let mut we = Vec::new();
        for _ in 0..a.reps {
            room += 1;
            we.push(whole(&s, a, room, layer, tokens)?);
            clear(&s, room)?;
        }
        let mut lw = Vec::new();
        for i in 0..a.reps {
            room += 1;
            // the decode pools hold the same rows from before: zero them so the
            // check after the first layer-wise request proves this request's bytes
            if i == 0 {
                zero_decode(&mut s, a.layers);
            }
            lw.push(layerwise(&s, a, room, layer, tokens)?);
            if i == 0 {
                verify(&s, a, tokens)?;
            }
            clear(&s, room)?;
        }
        let whole_exposed = median(we);
        let lw_exposed = median(lw);
        let layer_transfer = whole_exposed / f64::from(a.layers);
        let kv_bytes = tokens * u64::from(a.layers) * a.row_bytes;
        let p = LayerwisePoint {
            tokens,
            layers: a.layers,
            row_bytes: a.row_bytes,
            dcp: a.dcp,
            transport: s.prefill.transport().name().to_string(),
            kv_bytes,
            layer_ms,
            whole_exposed_ms: whole_exposed,
            layer_transfer_ms: layer_transfer,
            layerwise_exposed_ms: lw_exposed,
            exposed_in_layers: lw_exposed / layer_transfer,
            verified: true,
        };
        println!(
            "tokens {:>6}  {} layers x {} B  DCP 1->{}  {:>7.1} MB  layer {:>6.2} ms | whole-request exposed {:>8.2} ms ({:.2} ms/layer) | layer-wise exposed {:>7.2} ms = {:.2} layers",
            p.tokens,
            p.layers,
            p.row_bytes,
            p.dcp,
            kv_bytes as f64 / 1e6,
            p.layer_ms,
            p.whole_exposed_ms,
            p.layer_transfer_ms,
            p.layerwise_exposed_ms,
            p.exposed_in_layers
        );
        s.prefill.close();
        for (e, _) in &s.decode {
            e.close();
        }
        points.push(p);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(&points).map_err(|e| Error::invalid(e.to_string()))?
        );
    }
    Ok(())
}

/// Zeroes the decode pools (no room is in flight: every room was cleared).
fn zero_decode(s: &mut Setup, layers: u32) {
    for (_, pools) in &mut s.decode {
        for l in 0..layers as usize {
            pools.layer_bytes_mut(l).fill(0);
        }
    }
}
