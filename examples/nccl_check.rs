//! NCCL check for `scripts/nccl-check.sh` (two GPUs, one rank per GPU) and
//! the NCCL step of `scripts/gpu-check.sh` (one GPU). Built here, run on a GPU
//! host without Rust:
//!
//! ```sh
//! cargo build --release --example nccl_check --no-default-features --features nccl
//! strip -o target/nccl-check target/release/examples/nccl_check
//! ```
//!
//! `--solo`: loads NCCL (`libnccl.so.2`, a pip wheel in site-packages, or
//! `$PDXFER_NCCL`), makes a unique id, and joins a two-rank communicator
//! whose peer never joins: the non-blocking init must fail at its deadline
//! (`timeout`, naming the peer) and the abort must return promptly.
//!
//! `--role send|recv --dir DIR`: one end of a pair transfer of one DCP pair
//! request (`--tokens` tokens of `--layers` x `--row-bytes`): the sender
//! gathers its KV pools into staging with the relayout kernel and sends; the
//! receiver posts the mirrored recvs (Direct into its pool rows, or Staged
//! and scattered by the kernel) on its own stream. The two processes meet
//! through files in DIR (unique id, both plans' digests, pids). Each of
//! `--iters` rounds is timed from post to completion; the receiver reads its
//! pools back and compares every byte with the CPU relayout.
//!
//! Exit codes: 0 passed, 1 a failure, 2 usage, 3 no NCCL or no device.

use clap::Parser;
use pdxfer::cuda::DeviceBuffer;
use pdxfer::layout::{PackLayout, PairRequest, SglangChunk};
use pdxfer::relayout::gpu::GpuRelayout;
use pdxfer::relayout::{self, cpu};
use pdxfer::transport::nccl::{
    check_mirror, probe, NcclAbort, NcclId, NcclPair, NcclPlan, NcclPlanOptions, NcclRole,
};
use pdxfer::Status;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "pdxfer NCCL pair check")]
struct Args {
    /// Init with a peer that never joins: must fail at the deadline.
    #[arg(long)]
    solo: bool,
    /// `send` or `recv` (pair mode).
    #[arg(long)]
    role: Option<String>,
    /// Rendezvous directory shared by the two ranks.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Deadline of the solo init, milliseconds.
    #[arg(long, default_value_t = 3000)]
    deadline_ms: u64,
    /// Tokens of the pair request.
    #[arg(long, default_value_t = 8192)]
    tokens: u64,
    /// KV entries (layers).
    #[arg(long, default_value_t = 61)]
    layers: usize,
    /// Bytes per token row of each entry.
    #[arg(long, default_value_t = 1152)]
    row_bytes: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    page: u64,
    /// Timed rounds.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Force Staged mode (one big chunk stream, scattered on the receiver).
    #[arg(long)]
    staged: bool,
}

fn fail(code: i32, msg: String) -> ! {
    eprintln!("nccl-check: {msg}");
    std::process::exit(code)
}

fn main() {
    let a = Args::parse();
    match probe() {
        Ok((v, path)) => println!(
            "nccl-check: NCCL {}.{}.{} from {path}",
            v / 10000,
            v / 100 % 100,
            v % 100
        ),
        Err(e) => fail(3, format!("{}: {}", e.kind(), e.detail())),
    }
    if a.solo {
        solo(&a);
        return;
    }
    let (Some(role), Some(dir)) = (a.role.as_deref(), a.dir.as_deref()) else {
        fail(2, "give --solo, or --role send|recv and --dir".into())
    };
    match role {
        "send" => send(&a, dir),
        "recv" => recv(&a, dir),
        r => fail(2, format!("unknown role {r}")),
    }
}

fn solo(a: &Args) {
    let id = NcclId::new().unwrap_or_else(|e| fail(3, e.to_string()));
    println!("nccl-check: unique id {id:?}");
    let g = GpuRelayout::new(a.device).unwrap_or_else(|e| fail(3, e.to_string()));
    let deadline = Duration::from_millis(a.deadline_ms);
    let t0 = Instant::now();
    let r = NcclPair::connect(
        &id,
        NcclRole::Sender,
        a.device,
        g.stream().raw(),
        "a decode rank that never joins",
        t0 + deadline,
        &mut || true,
        NcclAbort::new(),
    );
    let took = t0.elapsed();
    match r {
        Err(e) if e.status() == Status::Timeout && e.detail().contains("never joins") => {
            if took > deadline + Duration::from_secs(2) {
                fail(
                    1,
                    format!("init failed {took:?} after start, deadline {deadline:?}"),
                );
            }
            println!(
                "nccl-check: init with a peer that never joins failed at its deadline ({} ms of {} ms, abort included): {e}",
                took.as_millis(),
                deadline.as_millis()
            );
        }
        Err(e) => fail(1, format!("init failed with the wrong error: {e}")),
        Ok(_) => fail(1, "init succeeded without a peer".into()),
    }
}

fn pages(a: &Args) -> (Vec<u64>, Vec<u64>) {
    let n = a.tokens.div_ceil(a.page);
    let src: Vec<u64> = (0..n).collect();
    let dst: Vec<u64> = (0..n).rev().collect();
    (src, dst)
}

fn request<'a>(a: &Args, src: &'a [u64], dst: &'a [u64]) -> PairRequest<'a> {
    SglangChunk {
        src_pages: src,
        dst_pages: dst,
        page_size: a.page,
        dcp_size: 1,
        dcp_rank: 0,
        src_page_offset: 0,
        decode_prefix_len: 0,
        num_tokens: Some(a.tokens),
    }
    .to_pair()
    .unwrap_or_else(|e| fail(2, e.to_string()))
}

fn options(a: &Args) -> NcclPlanOptions {
    let mut o = NcclPlanOptions::default();
    if a.staged {
        o.max_direct_ops = 0;
    }
    o
}

fn pattern(layer: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + layer as u64 * 7 + i as u64 / 4093) as u8)
        .collect()
}

fn put(dir: &Path, name: &str, v: &str) {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, format!("{v}\n")).unwrap_or_else(|e| fail(1, e.to_string()));
    std::fs::rename(tmp, dir.join(name)).unwrap_or_else(|e| fail(1, e.to_string()));
}

fn get(dir: &Path, name: &str) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            if s.ends_with('\n') {
                return s.trim().to_string();
            }
        }
        if t0.elapsed() > Duration::from_secs(120) {
            fail(1, format!("no {name} from the peer after 120 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Free device memory of the current context (None where the driver lacks
/// the call, as the fake does).
fn free_bytes() -> Option<usize> {
    std::panic::catch_unwind(cudarc::driver::result::mem_get_info)
        .ok()?
        .ok()
        .map(|(free, _)| free)
}

/// The GPU memory the communicator took: free memory before its init minus
/// free memory after its first round (NCCL connects peers lazily).
fn comm_memory(before: Option<usize>) -> String {
    match (before, free_bytes()) {
        (Some(b), Some(a)) => format!("{:.1} MiB", b.saturating_sub(a) as f64 / (1 << 20) as f64),
        _ => "unknown (no cuMemGetInfo)".into(),
    }
}

/// The peer's liveness: its process still exists.
fn alive_check(pid: i32) -> impl FnMut() -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    move || unsafe { libc::kill(pid, 0) == 0 }
}

fn pools(g: &GpuRelayout, a: &Args, rows: u64, fill: bool) -> Vec<DeviceBuffer> {
    (0..a.layers)
        .map(|l| {
            let len = (rows * a.row_bytes) as usize;
            let b = g
                .stream()
                .alloc(len)
                .unwrap_or_else(|e| fail(3, e.to_string()));
            if fill {
                g.stream().upload(&b, 0, &pattern(l, len)).unwrap();
            } else {
                g.stream().memset(&b, 0).unwrap();
            }
            b
        })
        .collect()
}

fn send(a: &Args, dir: &Path) {
    let (src, dst) = pages(a);
    let req = request(a, &src, &dst);
    let rows = vec![a.row_bytes; a.layers];
    let tx = NcclPlan::build(&req, &rows, NcclRole::Sender, &options(a)).unwrap();
    let id = NcclId::new().unwrap_or_else(|e| fail(3, e.to_string()));
    put(dir, "id", &id.to_hex());
    put(dir, "tx", &tx.digest.to_string());
    put(dir, "send.pid", &std::process::id().to_string());
    let rx: u64 = get(dir, "rx").parse().unwrap();
    check_mirror(&tx, rx).unwrap_or_else(|e| fail(1, e.to_string()));
    let mut alive = alive_check(get(dir, "recv.pid").parse().unwrap());
    let mut g = GpuRelayout::new(a.device).unwrap_or_else(|e| fail(3, e.to_string()));
    let bufs = pools(&g, a, src.len() as u64 * a.page, true);
    let staging = g.stream().alloc(tx.pack.total_bytes as usize).unwrap();
    let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    let ents = relayout::gather_entries(&bases, &rows, staging.ptr(), &tx.pack).unwrap();
    // SAFETY: the entries address the pools and staging above, sized by the plan.
    unsafe { g.gather(&ents, &relayout::gather_spans(&req).unwrap()) }
        .and_then(|ev| ev.wait())
        .unwrap_or_else(|e| fail(1, e.to_string()));
    let before = free_bytes();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut pair = NcclPair::connect(
        &id,
        NcclRole::Sender,
        a.device,
        g.stream().raw(),
        "the receiving rank",
        deadline,
        &mut alive,
        NcclAbort::new(),
    )
    .unwrap_or_else(|e| fail(1, e.to_string()));
    let mut times = Vec::new();
    let mut memory = String::new();
    for i in 0..a.iters.max(1) {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(60);
        // SAFETY: staging holds the pack until wait returns.
        unsafe { pair.post(&tx, staging.ptr(), &[], deadline, &mut alive) }
            .and_then(|()| pair.wait(deadline, &mut alive))
            .unwrap_or_else(|e| fail(1, e.to_string()));
        times.push(t0.elapsed().as_secs_f64());
        if i == 0 {
            memory = comm_memory(before);
        }
    }
    pair.close().unwrap_or_else(|e| fail(1, e.to_string()));
    report("send", &tx, &mut times);
    println!("nccl-check: send communicator GPU memory (free before init - free after round 1): {memory}");
}

fn report(who: &str, plan: &NcclPlan, times: &mut [f64]) {
    times.sort_by(f64::total_cmp);
    let gb = plan.total_bytes() as f64 / 1e9;
    println!(
        "nccl-check: {who} {:?} {} ops in {} groups, {:.3} GB per round: best {:.2} GB/s, median {:.2} GB/s over {} rounds",
        plan.mode,
        plan.ops.len(),
        plan.groups.len(),
        gb,
        gb / times[0],
        gb / times[times.len() / 2],
        times.len()
    );
}

fn recv(a: &Args, dir: &Path) {
    let (src, dst) = pages(a);
    let req = request(a, &src, &dst);
    let rows = vec![a.row_bytes; a.layers];
    let rx = NcclPlan::build(&req, &rows, NcclRole::Receiver, &options(a)).unwrap();
    put(dir, "rx", &rx.digest.to_string());
    put(dir, "recv.pid", &std::process::id().to_string());
    let tx: u64 = get(dir, "tx").parse().unwrap();
    check_mirror(&rx, tx).unwrap_or_else(|e| fail(1, e.to_string()));
    let id = NcclId::from_hex(&get(dir, "id")).unwrap();
    let mut alive = alive_check(get(dir, "send.pid").parse().unwrap());
    let mut g = GpuRelayout::new(a.device).unwrap_or_else(|e| fail(3, e.to_string()));
    let dst_rows = (dst.iter().max().unwrap() + 1) * a.page;
    let bufs = pools(&g, a, dst_rows, false);
    let staging = g.stream().alloc(rx.pack.total_bytes as usize).unwrap();
    g.stream().record(false).unwrap().wait().unwrap();
    let bases: Vec<u64> = bufs.iter().map(|b| b.ptr()).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut pair = NcclPair::connect(
        &id,
        NcclRole::Receiver,
        a.device,
        g.stream().raw(),
        "the sending rank",
        deadline,
        &mut alive,
        NcclAbort::new(),
    )
    .unwrap_or_else(|e| fail(1, e.to_string()));
    let mut times = Vec::new();
    for _ in 0..a.iters.max(1) {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(60);
        // SAFETY: every op lands in staging or a pool sized for the plan; both
        // outlive the wait.
        unsafe { pair.post(&rx, staging.ptr(), &bases, deadline, &mut alive) }
            .and_then(|()| pair.wait(deadline, &mut alive))
            .unwrap_or_else(|e| fail(1, e.to_string()));
        if rx.needs_scatter() {
            let ents = relayout::scatter_entries(&bases, &rows, staging.ptr(), &rx.pack).unwrap();
            // SAFETY: as above.
            unsafe { g.scatter(&ents, &relayout::scatter_spans(&req).unwrap()) }
                .and_then(|ev| ev.wait())
                .unwrap_or_else(|e| fail(1, e.to_string()));
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    pair.close().unwrap_or_else(|e| fail(1, e.to_string()));
    report("recv", &rx, &mut times);
    // every byte against the CPU relayout of the sender's pools
    let src_rows = src.len() as u64 * a.page;
    let srcs: Vec<Vec<u8>> = (0..a.layers)
        .map(|l| pattern(l, (src_rows * a.row_bytes) as usize))
        .collect();
    let pack = PackLayout::new(req.token_count(), &rows).unwrap();
    let mut packed = vec![0u8; pack.total_bytes as usize];
    let refs: Vec<&[u8]> = srcs.iter().map(|v| v.as_slice()).collect();
    cpu::gather(
        &refs,
        &rows,
        &relayout::gather_spans(&req).unwrap(),
        &pack,
        &mut packed,
    )
    .unwrap();
    let mut want: Vec<Vec<u8>> = bufs.iter().map(|b| vec![0u8; b.len()]).collect();
    {
        let mut w: Vec<&mut [u8]> = want.iter_mut().map(|v| v.as_mut_slice()).collect();
        cpu::scatter(
            &packed,
            &pack,
            &rows,
            &relayout::scatter_spans(&req).unwrap(),
            &mut w,
        )
        .unwrap();
    }
    let mut checked = 0usize;
    for (l, (b, w)) in bufs.iter().zip(&want).enumerate() {
        let mut got = vec![0u8; b.len()];
        b.read(0, &mut got).unwrap();
        if &got != w {
            let at = got.iter().zip(w).position(|(x, y)| x != y).unwrap_or(0);
            fail(
                1,
                format!("entry {l}: byte {at} differs from the CPU relayout"),
            );
        }
        checked += got.len();
    }
    println!(
        "nccl-check: recv verified every byte ({checked} B in {} entries)",
        a.layers
    );
}
