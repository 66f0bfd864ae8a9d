//! The layer-wise benchmark on a GPU (`examples/gpu_check.rs --layerwise`):
//! the transfer time a prefill's KV adds to time-to-first-token when the
//! rows come from kernels, layer-wise against whole-request.
//!
//! One process: a bootstrap server, a prefill engine (DCP 1) whose KV pools
//! are device memory, and `dcp` decode engines with host pools (cma). A
//! synthetic prefill runs on a "model" stream (its own [`GpuRelayout`]): for
//! each layer a gather kernel writes the layer's rows (the synthetic
//! pattern, from a device copy uploaded once) into the zeroed pool, then
//! `pdx_spin` keeps the stream busy for the layer's compute time, then an
//! event is recorded. Layer-wise: each layer is sent as soon as it is
//! enqueued, `send_with(layers = l..l+1, cuda_event = that layer's event)`,
//! without synchronising. Whole-request: the host synchronises on the last
//! layer's event, then sends the request once. Both report the *exposed*
//! transfer time: from the end of the last layer's compute (its event's
//! timestamp, placed on the host clock through a reference event the host
//! waited for before the prefill) to the last decode rank's completion.
//! Every decode byte is verified after each request.

use crate::bootstrap::schema::Role;
use crate::bootstrap::server::{BootstrapServer, ServerConfig};
use crate::cuda::{DeviceBuffer, GpuEvent};
use crate::engine::synthetic::SyntheticPools;
use crate::engine::{Engine, EngineConfig, KvPoll, KvPool, SendOptions};
use crate::error::{Error, Result};
use crate::layout::{DcpLayout, Run, Side};
use crate::relayout::gpu::{GpuRelayout, PreparedCopy};
use crate::relayout::CopyEntry;
use crate::transport::TransportKind;
use serde::Serialize;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct GpuLayerwiseParams {
    /// CUDA device ordinal of the prefill pools.
    pub device: u32,
    /// Layers (topology entries).
    pub layers: u32,
    /// Bytes of one KV row.
    pub row_bytes: u64,
    /// Request lengths (tokens).
    pub tokens: Vec<u64>,
    /// Decode DCP size.
    pub dcp: u32,
    /// Tokens per page.
    pub page_size: u64,
    /// Compute time of one layer in microseconds (0: 1.5x the measured
    /// transfer time of one layer).
    pub layer_us: u64,
    /// Repetitions per mode (the median is reported).
    pub reps: usize,
    /// Staging bytes per worker.
    pub staging_bytes: u64,
}

/// The result for one request length.
#[derive(Debug, Clone, Serialize)]
pub struct GpuLayerwisePoint {
    /// Request tokens.
    pub tokens: u64,
    /// KV bytes of the request.
    pub bytes: u64,
    /// Compute time of one layer (ms).
    pub layer_ms: f64,
    /// Whole-request exposed time: the transfer after the last layer (ms).
    pub whole_exposed_ms: f64,
    /// Transfer time of one layer: `whole_exposed_ms / layers` (ms).
    pub layer_transfer_ms: f64,
    /// Layer-wise exposed time (ms).
    pub layerwise_exposed_ms: f64,
    /// `layerwise_exposed_ms / layer_transfer_ms` (target: at most 2).
    pub exposed_in_layers: f64,
    /// Decode bytes verified (KV and aux rows, every request).
    pub verified_bytes: u64,
}

struct Setup<'a> {
    model: &'a GpuRelayout,
    _server: BootstrapServer,
    prefill: Engine,
    decode: Vec<(Engine, SyntheticPools)>,
    /// The prefill pools (device), one per layer.
    pools: Vec<DeviceBuffer>,
    /// Each layer's rows as the synthetic pattern (device), the gathers' source.
    _pattern: Vec<DeviceBuffer>,
    /// One prepared gather per layer: pattern -> pool.
    writes: Vec<PreparedCopy>,
    _host: SyntheticPools,
    src: Vec<u64>,
    dst: Vec<u64>,
}

fn setup<'a>(model: &'a GpuRelayout, p: &GpuLayerwiseParams, tokens: u64) -> Result<Setup<'a>> {
    let (ps, dcp) = (p.page_size, p.dcp);
    let src_n = tokens.div_ceil(ps);
    let dst_n = tokens.div_ceil(ps * u64::from(dcp));
    let server = BootstrapServer::start(ServerConfig::default())?;
    let url = server.url();
    let cluster = format!("gpu-layerwise-{tokens}");
    let src: Vec<u64> = (0..src_n).map(|i| (i * 7) % src_n).collect();
    let dst: Vec<u64> = (0..dst_n).map(|i| (i * 5) % dst_n).collect();
    let mut host = SyntheticPools::new(p.layers, p.row_bytes, ps, src_n, 4, 64)?;
    let side = Side {
        layout: DcpLayout::sglang(ps, 1)?,
        rank: 0,
        pages: &src,
        origin: 0,
    };
    host.fill(1, &side, tokens);
    host.fill_aux(1, 3);
    let (mut pools, mut pattern, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    for l in 0..p.layers as usize {
        let bytes = host.layer_bytes(l);
        let pool = model.stream().alloc(bytes.len())?;
        let pat = model.stream().alloc(bytes.len())?;
        model.stream().upload(&pat, 0, bytes)?;
        let rows = bytes.len() as u64 / p.row_bytes;
        let entry = CopyEntry {
            src: pat.ptr(),
            dst: pool.ptr(),
            row_bytes: p.row_bytes,
            reserved: 0,
        };
        let span = Run {
            src: 0,
            dst: 0,
            len: rows,
        };
        writes.push(model.prepare(&[entry], &[span])?);
        pools.push(pool);
        pattern.push(pat);
    }
    model.stream().record(false)?.wait()?;
    let kv: Vec<KvPool> = host
        .kv_pools()
        .into_iter()
        .zip(&pools)
        .map(|(k, d)| KvPool { base: d.ptr(), ..k })
        .collect();
    let mut cfg = EngineConfig::new(Role::Prefill, &cluster, &url, host.topology(1, 0), kv);
    cfg.pool_device = Some(p.device);
    cfg.aux = host.aux_buffers();
    cfg.transport = TransportKind::Cma;
    cfg.staging_bytes = p.staging_bytes;
    // SAFETY: the device pools and the host aux rows live in the Setup beside
    // the engine, which is closed before they are dropped (`close`).
    let prefill = unsafe { Engine::new(cfg) }?;
    let mut decode = Vec::new();
    for r in 0..dcp {
        let pools = SyntheticPools::new(p.layers, p.row_bytes, ps, dst_n, 4, 64)?;
        let mut cfg = EngineConfig::new(
            Role::Decode,
            &cluster,
            &url,
            pools.topology(dcp, r),
            pools.kv_pools(),
        );
        cfg.aux = pools.aux_buffers();
        cfg.transport = TransportKind::Cma;
        // SAFETY: the pools live in `decode` beside the engine, closed first.
        decode.push((unsafe { Engine::new(cfg) }?, pools));
    }
    Ok(Setup {
        model,
        _server: server,
        prefill,
        decode,
        pools,
        _pattern: pattern,
        writes,
        _host: host,
        src,
        dst,
    })
}

impl Setup<'_> {
    fn close(&self) {
        self.prefill.close();
        for (d, _) in &self.decode {
            d.close();
        }
    }

    /// Zeroes the prefill pools (waited for: a send that does not wait for its
    /// layer's event reads zeros, not an earlier request's rows) and the
    /// decode pools, opens `room` and waits until the prefill may send.
    fn open(&mut self, room: u64) -> Result<()> {
        for b in &self.pools {
            self.model.stream().memset(b, 0)?;
        }
        self.model.stream().record(false)?.wait()?;
        for (_, pools) in &mut self.decode {
            for l in 0..self.pools.len() {
                pools.layer_bytes_mut(l).fill(0);
            }
        }
        for (e, _) in &self.decode {
            e.receiver(room, 0, None)?;
            e.send_metadata(room, &self.dst, 0, 2)?;
        }
        self.prefill.sender(room)?;
        let end = Instant::now() + Duration::from_secs(60);
        while self.prefill.poll(room) == KvPoll::Bootstrapping {
            if Instant::now() > end {
                return Err(Error::invalid("the prefill never saw the decode metadata"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Enqueues layer `l` on the model stream: its rows' write, then its
    /// compute; returns the event after both.
    fn layer(&self, l: usize, spin_ns: u64, timing: bool) -> Result<GpuEvent> {
        // SAFETY: the prepared tables address the layer's pattern and pool
        // buffers, both alive in the Setup and sized for every row.
        unsafe { self.model.launch_prepared(&self.writes[l], false) }?;
        if spin_ns > 0 {
            self.model.spin(spin_ns)?;
        }
        self.model.stream().record(timing)
    }

    /// Waits for every decode rank; returns when the last one completed.
    fn acked(&self, room: u64) -> Result<Instant> {
        let mut last = Instant::now();
        for (r, (e, _)) in self.decode.iter().enumerate() {
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

    /// Verifies every decode rank's rows and aux row; returns the bytes checked.
    fn verify(&self, p: &GpuLayerwiseParams, tokens: u64) -> Result<u64> {
        let mut n = 0;
        for (r, (_, pools)) in self.decode.iter().enumerate() {
            let side = Side {
                layout: DcpLayout::sglang(p.page_size, u64::from(p.dcp))?,
                rank: r as u64,
                pages: &self.dst,
                origin: 0,
            };
            n += pools.verify(1, &side, tokens, Some(2))?;
        }
        Ok(n)
    }

    fn clear(&self, room: u64) -> Result<()> {
        self.prefill.clear(room)?;
        for (e, _) in &self.decode {
            e.clear(room)?;
        }
        Ok(())
    }

    /// One request; `layerwise` or whole-request. Returns the exposed time (ms).
    fn request(&mut self, room: u64, tokens: u64, spin_ns: u64, layerwise: bool) -> Result<f64> {
        self.open(room)?;
        // the host clock of the model stream: a reference event waited for
        let reference = self.model.stream().record(true)?;
        reference.wait()?;
        let host0 = Instant::now();
        let n = self.pools.len();
        let mut events = Vec::with_capacity(n);
        for l in 0..n {
            let ev = self.layer(l, spin_ns, l + 1 == n)?;
            if layerwise {
                let o = SendOptions {
                    layers: Some(l as u32..l as u32 + 1),
                    cuda_event: Some(ev.raw()),
                    ..Default::default()
                };
                self.prefill
                    .send_with(room, &self.src, tokens, true, 3, &o)?;
            }
            events.push(ev);
        }
        let last = events.last().expect("at least one layer");
        if !layerwise {
            last.wait()?;
            self.prefill.send(room, &self.src, tokens, true, 3)?;
        }
        let acked = self.acked(room)?;
        // the events outlive the room's sends (terminal now)
        last.wait()?;
        let end_ms = f64::from(reference.elapsed_ms(last)?);
        let acked_ms = (acked - host0).as_secs_f64() * 1e3;
        drop(events);
        Ok(acked_ms - end_ms)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark on `model` (the synthetic prefill's stream); one point
/// per request length. Fails when a decode byte differs.
pub fn run(model: &GpuRelayout, p: &GpuLayerwiseParams) -> Result<Vec<GpuLayerwisePoint>> {
    if p.layers == 0 || p.reps == 0 || p.dcp == 0 {
        return Err(Error::invalid("layers, reps and dcp must be positive"));
    }
    let mut out = Vec::new();
    for &tokens in &p.tokens {
        let mut s = setup(model, p, tokens)?;
        let r = points(&mut s, p, tokens);
        s.close();
        out.push(r?);
    }
    Ok(out)
}

fn points(s: &mut Setup<'_>, p: &GpuLayerwiseParams, tokens: u64) -> Result<GpuLayerwisePoint> {
    let expect = tokens * u64::from(p.layers) * p.row_bytes + u64::from(p.dcp) * 64;
    let mut verified = 0;
    let mut room = 100;
    let mut one = |s: &mut Setup<'_>, spin: u64, lw: bool| -> Result<f64> {
        room += 1;
        let t = s.request(room, tokens, spin, lw)?;
        let n = s.verify(p, tokens)?;
        if n != expect {
            return Err(Error::invalid(format!(
                "room {room}: verified {n} B, expected {expect} B of KV + aux"
            )));
        }
        verified += n;
        s.clear(room)?;
        Ok(t)
    };
    // warm-up (connections, first touch), then the transfer time without compute
    one(s, 0, false)?;
    let bare: Vec<f64> = (0..p.reps)
        .map(|_| one(s, 0, false))
        .collect::<Result<_>>()?;
    let per_layer = median(bare) / f64::from(p.layers);
    let spin_ns = if p.layer_us > 0 {
        p.layer_us * 1000
    } else {
        ((per_layer * 1.5).max(0.01) * 1e6) as u64
    };
    let whole: Vec<f64> = (0..p.reps)
        .map(|_| one(s, spin_ns, false))
        .collect::<Result<_>>()?;
    let layerwise: Vec<f64> = (0..p.reps)
        .map(|_| one(s, spin_ns, true))
        .collect::<Result<_>>()?;
    let whole_exposed_ms = median(whole);
    let layer_transfer_ms = whole_exposed_ms / f64::from(p.layers);
    let layerwise_exposed_ms = median(layerwise);
    Ok(GpuLayerwisePoint {
        tokens,
        bytes: tokens * u64::from(p.layers) * p.row_bytes,
        layer_ms: spin_ns as f64 / 1e6,
        whole_exposed_ms,
        layer_transfer_ms,
        layerwise_exposed_ms,
        exposed_in_layers: layerwise_exposed_ms / layer_transfer_ms,
        verified_bytes: verified,
    })
}
