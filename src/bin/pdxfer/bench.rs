//! `pdxfer bench`: nixlbench-like sweeps between two processes.
//!
//! The initiator (this process) writes batches of `batch` blocks of
//! `block` bytes into a target (`pdxfer target`, spawned here unless
//! `--connect` names one) over the chosen transport (through the
//! `Transport` trait: cma, tcp, rdma, local), for every point of the
//! sweep (block sizes x batch sizes x threads/streams). Per point it
//! reports GB/s (decimal), operations/s, batch latency p50/p99, and a plain
//! `memcpy` of the same bytes measured in the same run (for the ratio).

use crate::bench_args::{parse_size, BenchArgs};
use pdxfer::auth::PeerInstance;
use pdxfer::error::{Error, Result};
use pdxfer::transport::control_counts::control_counts;
use pdxfer::transport::room::{GrantRange, RoomGrant};
use pdxfer::transport::{
    tcp_encrypt, Agent, AgentOptions, BatchId, BatchOptions, ConnectOptions, Transport,
    TransportKind, WriteOp, TCP_ENCRYPT_ENV,
};
use serde::Serialize;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One measured point.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Transport actually used.
    pub transport: String,
    /// How the bytes moved (e.g. memcpy into mapped memfd regions, process_vm_writev).
    pub data_path: String,
    /// Bytes per block (one write op).
    pub block_size: u64,
    /// Blocks per batch.
    pub batch_size: usize,
    /// cma writer threads or tcp streams.
    pub threads: u32,
    /// Batches measured.
    pub batches: usize,
    /// Decimal GB/s of the transport.
    pub gb_per_s: f64,
    /// Decimal GB/s of a plain memcpy of the same bytes in the same run (best of 3).
    pub memcpy_gb_per_s: f64,
    /// `gb_per_s / memcpy_gb_per_s`.
    pub ratio_vs_memcpy: f64,
    /// Write operations (blocks) per second.
    pub ops_per_s: f64,
    /// Median batch latency (submit to completion), microseconds.
    pub p50_us: f64,
    /// 99th percentile batch latency, microseconds.
    pub p99_us: f64,
    /// Median time spent inside `submit` per batch, microseconds (a cma
    /// batch moved by the submitting thread is written inside it).
    pub submit_p50_us: f64,
    /// The batches were written under a room grant.
    pub room_grant: bool,
    /// tcp: the payload was encrypted (`--encrypt`).
    pub encrypted: bool,
    /// Control messages this process sent and received per batch (the
    /// room's close included).
    pub control_messages_per_batch: f64,
}

struct Target {
    child: Option<Child>,
    /// The spawned target's answers to commands.
    out: Option<BufReader<std::process::ChildStdout>>,
    addr: String,
    local: Option<Agent>,
    _local_buf: Vec<u8>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            drop(c.stdin.take());
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(2) {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_target(size: u64, heap: bool, encrypt: bool) -> Result<Target> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .env(TCP_ENCRYPT_ENV, if encrypt { "1" } else { "0" })
        .args([
            "target",
            "--listen",
            "127.0.0.1:0",
            "--quiet",
            "--size",
            &size.to_string(),
        ])
        .args(heap.then_some("--heap"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| Error::invalid("no target stdout"))?;
    let mut out = BufReader::new(out);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let v: serde_json::Value = serde_json::from_str(line.trim())
        .map_err(|e| Error::invalid(format!("target did not start: {e}: {line:?}")))?;
    let addr = v["addr"].as_str().unwrap_or_default().to_string();
    Ok(Target {
        child: Some(child),
        out: Some(out),
        addr,
        local: None,
        _local_buf: Vec::new(),
    })
}

impl Target {
    /// A room grant of the target's regions to `me` for `room` (epoch 1).
    fn grant(&mut self, me: PeerInstance, room: u64) -> Result<RoomGrant> {
        let live = Duration::from_secs(600);
        if let Some(ag) = &self.local {
            let ranges: Vec<GrantRange> = ag
                .registry()
                .descriptors()
                .iter()
                .map(|d| GrantRange {
                    region: d.id,
                    offset: 0,
                    len: d.len,
                })
                .collect();
            return ag.grant_room(me, room, 1, &ranges, live);
        }
        let (Some(child), Some(out)) = (&mut self.child, &mut self.out) else {
            return Err(Error::invalid(
                "--room-grant needs a target this bench spawns (not --connect)",
            ));
        };
        let stdin = child
            .stdin
            .as_mut()
            .ok_or_else(|| Error::invalid("no target stdin"))?;
        writeln!(stdin, "grant {me} {room} 1 {}", live.as_millis())?;
        stdin.flush()?;
        loop {
            let mut line = String::new();
            if out.read_line(&mut line)? == 0 {
                return Err(Error::invalid("the target exited before granting"));
            }
            let v: serde_json::Value = match serde_json::from_str(line.trim()) {
                Ok(v) => v,
                Err(_) => continue,
            };
            if v.get("grant").is_none() {
                continue;
            }
            return serde_json::from_value(v["grant"].clone()).map_err(|e| {
                Error::invalid(format!(
                    "the target refused the grant: {} ({e})",
                    v["error"].as_str().unwrap_or("?")
                ))
            });
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A plain memcpy of `batch` blocks of `block` bytes, `iters` times; GB/s.
fn memcpy_gbps(src: &[u8], dst: &mut [u8], block: usize, batch: usize, iters: usize) -> f64 {
    let t0 = Instant::now();
    for _ in 0..iters {
        for i in 0..batch {
            dst[i * block..(i + 1) * block].copy_from_slice(&src[i * block..(i + 1) * block]);
        }
        std::hint::black_box(&mut *dst);
    }
    let s = t0.elapsed().as_secs_f64();
    (block * batch * iters) as f64 / s / 1e9
}

#[allow(clippy::too_many_arguments)]
fn measure(
    t: &dyn Transport,
    src_region: u64,
    dst_region: u64,
    block: u64,
    batch: usize,
    a: &BenchArgs,
    room: u64,
) -> Result<(usize, f64, Vec<f64>, Vec<f64>)> {
    let ops: Vec<WriteOp> = (0..batch as u64)
        .map(|i| WriteOp {
            local_region: src_region,
            local_offset: i * block,
            remote_region: dst_region,
            remote_offset: i * block,
            len: block,
        })
        .collect();
    let opts = BatchOptions {
        timeout: Duration::from_secs(30),
        checksum: a.checksum,
        room,
        epoch: 1,
    };
    let run = |n: usize,
               budget: Duration,
               lat: &mut Vec<f64>,
               in_submit: &mut Vec<f64>|
     -> Result<usize> {
        let t0 = Instant::now();
        let mut inflight: VecDeque<(BatchId, Instant)> = VecDeque::new();
        let mut done = 0usize;
        let mut submitted = 0usize;
        while done < n {
            while inflight.len() < a.depth.max(1) && submitted < n && t0.elapsed() < budget {
                // timed from before the submit: a transport may move the bytes inside it
                let s = Instant::now();
                inflight.push_back((t.submit(&ops, &opts)?, s));
                in_submit.push(s.elapsed().as_secs_f64() * 1e6);
                submitted += 1;
            }
            let Some((id, s)) = inflight.pop_front() else {
                break;
            };
            t.wait(id, Duration::from_secs(30))?;
            lat.push(s.elapsed().as_secs_f64() * 1e6);
            done += 1;
        }
        Ok(done)
    };
    let (mut warm, mut warm_submit) = (Vec::new(), Vec::new());
    run(3, Duration::from_secs(10), &mut warm, &mut warm_submit)?;
    let mut lat = Vec::with_capacity(a.iters);
    let mut in_submit = Vec::with_capacity(a.iters);
    let t0 = Instant::now();
    let n = run(
        a.iters.max(1),
        Duration::from_millis(a.max_ms),
        &mut lat,
        &mut in_submit,
    )?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((n, secs, lat, in_submit))
}

/// Runs the benchmark.
pub fn run(a: &BenchArgs) -> Result<()> {
    if a.layerwise.layerwise {
        return crate::layerwise_bench::run(&a.layerwise, &a.transport, a.json);
    }
    let kind = TransportKind::parse(&a.transport)?;
    if kind == TransportKind::Nccl {
        return nccl(a);
    }
    let blocks: Vec<u64> = a
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    let max_bytes = blocks.iter().max().copied().unwrap_or(0)
        * a.batch_sizes.iter().max().copied().unwrap_or(1) as u64;
    if max_bytes == 0 || max_bytes > (8u64 << 30) {
        return Err(Error::invalid(format!(
            "block x batch = {max_bytes} bytes: need 1..=8 GiB"
        )));
    }
    let encrypt = tcp_encrypt(a.encrypt.then_some(true));
    let me = Agent::new(&AgentOptions {
        tcp_encrypt: Some(encrypt),
        ..AgentOptions::default()
    })?;
    let mut src: Vec<u8> = (0..max_bytes).map(|i| (i * 31 + 7) as u8).collect();
    // SAFETY: src outlives every transport below (dropped at the end of this function, after them).
    let s_desc = unsafe { me.register_host(src.as_mut_ptr(), src.len()) }?;
    let mut target = if kind == TransportKind::Local {
        let ag = Agent::new(&AgentOptions::default())?;
        let mut buf = vec![0u8; max_bytes as usize];
        super::target::prefault(&mut buf);
        // SAFETY: buf is kept in the Target next to the agent and outlives it.
        unsafe { ag.register_host(buf.as_mut_ptr(), buf.len()) }?;
        Target {
            child: None,
            out: None,
            addr: String::new(),
            local: Some(ag),
            _local_buf: buf,
        }
    } else if let Some(addr) = &a.connect {
        Target {
            child: None,
            out: None,
            addr: addr.clone(),
            local: None,
            _local_buf: Vec::new(),
        }
    } else {
        spawn_target(max_bytes, a.heap_target, encrypt)?
    };
    let mut memsrc = vec![1u8; max_bytes as usize];
    let mut memdst = vec![0u8; max_bytes as usize];
    memsrc[0] = 2;
    super::target::prefault(&mut memdst);
    let total = blocks.len() * a.batch_sizes.len() * a.threads.len();
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} points {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    if total < 4 {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut points = Vec::new();
    let mut room = 0u64;
    for &threads in &a.threads {
        let t: Box<dyn Transport> = match &target.local {
            Some(ag) => me.connect_local(ag),
            None => me.connect(
                &target.addr,
                &ConnectOptions {
                    transport: kind,
                    streams: threads,
                    threads,
                    ..Default::default()
                },
            )?,
        };
        let d_region = t
            .remote_regions()
            .iter()
            .find(|d| d.len >= max_bytes)
            .map(|d| d.id)
            .ok_or_else(|| {
                Error::invalid(format!("the target has no region of {max_bytes} bytes"))
            })?;
        for &batch in &a.batch_sizes {
            for &block in &blocks {
                bar.set_message(format!(
                    "{} block={block} batch={batch} threads={threads}",
                    t.kind().name()
                ));
                room += 1;
                let c0 = control_counts();
                if a.room_grant {
                    let g = target.grant(me.instance(), room)?;
                    t.open_room(&g, 1)?;
                }
                let (n, secs, mut lat, mut in_submit) =
                    measure(&*t, s_desc.id, d_region, block, batch, a, room)?;
                if a.room_grant {
                    t.close_room(room, 1, Duration::from_secs(30))?;
                }
                let c1 = control_counts();
                // the warm-up's 3 batches are counted too
                let per_batch =
                    (c1.sent() + c1.received() - c0.sent() - c0.received()) as f64 / (n + 3) as f64;
                lat.sort_by(|x, y| x.total_cmp(y));
                in_submit.sort_by(|x, y| x.total_cmp(y));
                let bytes = block as f64 * batch as f64 * n as f64;
                let gbps = bytes / secs / 1e9;
                memcpy_gbps(&memsrc, &mut memdst, block as usize, batch, 1);
                // Best of 3 runs of the same bytes: a conservative baseline on a noisy machine.
                let mc = (0..3)
                    .map(|_| memcpy_gbps(&memsrc, &mut memdst, block as usize, batch, n.max(1)))
                    .fold(0.0, f64::max);
                let p = Point {
                    transport: t.kind().name().to_string(),
                    data_path: t.data_path().to_string(),
                    block_size: block,
                    batch_size: batch,
                    threads,
                    batches: n,
                    gb_per_s: gbps,
                    memcpy_gb_per_s: mc,
                    ratio_vs_memcpy: if mc > 0.0 { gbps / mc } else { 0.0 },
                    ops_per_s: (batch * n) as f64 / secs,
                    p50_us: percentile(&lat, 0.50),
                    p99_us: percentile(&lat, 0.99),
                    submit_p50_us: percentile(&in_submit, 0.50),
                    room_grant: a.room_grant,
                    encrypted: encrypt && kind == TransportKind::Tcp,
                    control_messages_per_batch: per_batch,
                };
                bar.suspend(|| {
                    if !a.json {
                        println!(
                            "{:<5} block={:>9} batch={:>4} thr={:>2}  {:>7.3} GB/s  memcpy {:>7.3} GB/s  ratio {:>5.2}  {:>10.0} ops/s  p50 {:>9.1} us  p99 {:>9.1} us  ctl/batch {:>5.2}{}{}",
                            p.transport, p.block_size, p.batch_size, p.threads, p.gb_per_s,
                            p.memcpy_gb_per_s, p.ratio_vs_memcpy, p.ops_per_s, p.p50_us, p.p99_us,
                            p.control_messages_per_batch,
                            if p.room_grant { "  (room grant)" } else { "" },
                            if p.encrypted { "  (encrypted)" } else { "" }
                        );
                    }
                });
                points.push(p);
                bar.inc(1);
            }
        }
        t.close();
    }
    bar.finish_and_clear();
    if let Some(path) = &a.plot {
        plot(path, &points)?;
    }
    if a.json {
        let last = points.last().cloned();
        let mut v = serde_json::to_value(&last).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "points".into(),
                serde_json::to_value(&points).unwrap_or_default(),
            );
        }
        println!("{v}");
    }
    std::io::stdout().flush()?;
    drop(target.local.take());
    drop(target);
    drop(me);
    drop(src);
    Ok(())
}

/// Draws GB/s (and memcpy GB/s) against block size, log2 x axis.
fn plot(path: &str, points: &[Point]) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::new(pdxfer::Status::Io, format!("plot {path}: {e}"));
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let xs: Vec<f64> = points
        .iter()
        .map(|p| (p.block_size as f64).log2())
        .collect();
    let (x0, x1) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let ymax = points
        .iter()
        .map(|p| p.gb_per_s.max(p.memcpy_gb_per_s))
        .fold(0.0, f64::max)
        * 1.1;
    // No font is compiled in (plotters' text needs system fonts), so the
    // chart has no text: grid lines mark each block size (x, log2) and each
    // 1 GB/s (y); the scale is printed on stdout.
    let mut chart = ChartBuilder::on(&root)
        .margin(30)
        .build_cartesian_2d((x0 - 0.5)..(x1 + 0.5), 0.0..ymax.max(0.1))
        .map_err(|e| err(e.to_string()))?;
    let grey = RGBColor(220, 220, 220);
    let mut xs_sorted = xs.clone();
    xs_sorted.sort_by(|a, b| a.total_cmp(b));
    xs_sorted.dedup();
    for &x in &xs_sorted {
        chart
            .draw_series(LineSeries::new(vec![(x, 0.0), (x, ymax)], grey))
            .map_err(|e| err(e.to_string()))?;
    }
    let ystep = if ymax > 20.0 { 5.0 } else { 1.0 };
    let mut y = 0.0;
    while y <= ymax {
        chart
            .draw_series(LineSeries::new(vec![(x0 - 0.5, y), (x1 + 0.5, y)], grey))
            .map_err(|e| err(e.to_string()))?;
        y += ystep;
    }
    println!(
        "plot {path}: x = block size, log2 from {} to {} (a grey line per block size); y = 0..{ymax:.1} GB/s (a grey line every {ystep} GB/s); lines = transport GB/s per (batch, threads), dots = memcpy",
        1u64 << x0.round() as u32,
        1u64 << x1.round() as u32
    );
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for p in points {
        let key = format!("{} batch={} thr={}", p.transport, p.batch_size, p.threads);
        let x = (p.block_size as f64).log2();
        match series.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((x, p.gb_per_s)),
            None => series.push((key, vec![(x, p.gb_per_s)])),
        }
    }
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (_, v)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(v.clone(), c.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
    }
    let mem: Vec<(f64, f64)> = points
        .iter()
        .map(|p| ((p.block_size as f64).log2(), p.memcpy_gb_per_s))
        .collect();
    chart
        .draw_series(
            mem.iter()
                .map(|&(x, y)| Circle::new((x, y), 4, BLACK.filled())),
        )
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// `--transport nccl`: engines over NCCL (`nccl_bench`).
fn nccl(a: &BenchArgs) -> Result<()> {
    #[cfg(feature = "nccl")]
    {
        crate::nccl_bench::run(a)
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = a;
        Err(Error::new(
            pdxfer::Status::Unsupported,
            "pdxfer bench --transport nccl needs pdxfer built with the `nccl` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_rank() {
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.5), 2.0);
    }

    #[test]
    fn plot_writes_a_png() {
        let p = |b: u64, g: f64| Point {
            transport: "cma".into(),
            data_path: "cma".into(),
            block_size: b,
            batch_size: 1,
            threads: 1,
            batches: 1,
            gb_per_s: g,
            memcpy_gb_per_s: g * 1.2,
            ratio_vs_memcpy: 0.8,
            ops_per_s: 1.0,
            p50_us: 1.0,
            p99_us: 2.0,
            submit_p50_us: 0.5,
            room_grant: false,
            encrypted: false,
            control_messages_per_batch: 2.0,
        };
        let dir = std::env::temp_dir().join(format!("pdxfer-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.png");
        plot(f.to_str().unwrap(), &[p(4096, 1.0), p(1 << 20, 5.0)]).unwrap();
        let b = std::fs::read(&f).unwrap();
        assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
