//! `pdxfer rdma-bench`: RDMA WRITE/READ bandwidth through pdxfer's own RDMA
//! transport, on one host (two endpoints of one process, like `ib_write_bw` on
//! loopback) or between two hosts (`--serve` on one, `--connect` on the other,
//! handshakes exchanged over TCP). Settings come from `PDXFER_RDMA_*`.

use clap::Args;

/// Arguments of `pdxfer rdma-bench`.
#[derive(Args, Debug, Clone)]
pub struct RdmaBenchArgs {
    /// Bytes per block (one span; split into messages of at most the port's max message size).
    #[arg(long, default_value_t = 65536)]
    pub block_size: u64,
    /// Blocks per batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: u64,
    /// Batches to time.
    #[arg(long, default_value_t = 200)]
    pub iters: u32,
    /// Batches kept in flight.
    #[arg(long, default_value_t = 4)]
    pub depth: u32,
    /// Use RDMA READ instead of WRITE (one host only).
    #[arg(long)]
    pub read: bool,
    /// Two hosts: serve on this address (e.g. 0.0.0.0:18600) and receive.
    #[arg(long, conflicts_with = "connect")]
    pub serve: Option<String>,
    /// Two hosts: connect to a `--serve` peer at this address and send.
    #[arg(long)]
    pub connect: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark.
pub fn run(a: &RdmaBenchArgs) -> pdxfer::Result<()> {
    if a.block_size == 0 || a.batch_size == 0 || a.iters == 0 || a.depth == 0 {
        return Err(pdxfer::Error::invalid(
            "block-size, batch-size, iters and depth must be > 0",
        ));
    }
    if a.read && (a.serve.is_some() || a.connect.is_some()) {
        return Err(pdxfer::Error::invalid(
            "--read runs on one host only (the two-host server counts write completion records)",
        ));
    }
    #[cfg(feature = "rdma")]
    {
        imp::run(a)
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(pdxfer::Error::new(
            pdxfer::Status::Unsupported,
            "built without the `rdma` feature",
        ))
    }
}

#[cfg(feature = "rdma")]
mod imp {
    use super::RdmaBenchArgs;
    use pdxfer::error::{Error, Result, Status};
    use pdxfer::transport::rdma::handshake::exchange;
    use pdxfer::transport::rdma::{
        BatchState, Direction, RdmaConfig, RdmaEndpoint, Span, VerbsNic,
    };
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    const WAIT: Duration = Duration::from_secs(60);

    fn buffer(len: u64, seed: u8) -> Result<Vec<u8>> {
        let n = usize::try_from(len).map_err(|_| Error::invalid("buffer too large"))?;
        Ok((0..n)
            .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
            .collect())
    }

    fn spans(a: &RdmaBenchArgs, local: u64, remote: u64) -> Vec<Span> {
        (0..a.batch_size)
            .map(|k| Span {
                local_addr: local + k * a.block_size,
                remote_addr: remote + k * a.block_size,
                len: a.block_size,
            })
            .collect()
    }

    /// Posts `iters` batches with `depth` in flight; returns the elapsed time.
    fn drive(
        ep: &RdmaEndpoint,
        a: &RdmaBenchArgs,
        dir: Direction,
        sp: &[Span],
    ) -> Result<Duration> {
        let id = |i: u32| i % (1 << 24);
        let finish = |i: u32| -> Result<()> {
            match ep.wait(id(i), WAIT)? {
                BatchState::Done { .. } => Ok(()),
                BatchState::Failed(e) => Err(e),
                BatchState::InProgress => Err(Error::new(Status::Timeout, "batch still in flight")),
            }
        };
        let start = Instant::now();
        for i in 0..a.iters {
            if i >= a.depth {
                finish(i - a.depth)?;
            }
            ep.post_batch(id(i), dir, sp)?;
        }
        for i in a.iters.saturating_sub(a.depth)..a.iters {
            finish(i)?;
        }
        Ok(start.elapsed())
    }

    fn report(a: &RdmaBenchArgs, mode: &str, t: &VerbsNic, elapsed: Duration, reg_ms: f64) {
        let bytes = a.block_size * a.batch_size * a.iters as u64;
        let s = elapsed.as_secs_f64().max(1e-9);
        let v = serde_json::json!({
            "transport": "rdma",
            "mode": mode,
            "op": if a.read { "read" } else { "write" },
            "block_size": a.block_size,
            "batch_size": a.batch_size,
            "iters": a.iters,
            "depth": a.depth,
            "bytes": bytes,
            "seconds": s,
            "gbit_per_s": bytes as f64 * 8.0 / s / 1e9,
            "gib_per_s": bytes as f64 / s / (1u64 << 30) as f64,
            "batches_per_s": a.iters as f64 / s,
            "registration_ms": reg_ms,
            "rails": t.rails().iter().map(|r| format!("{}:{}", r.device, r.port)).collect::<Vec<_>>(),
        });
        if a.json {
            println!("{v}");
        } else {
            println!(
                "pdxfer rdma {mode} {}: {} x {} B per batch, {} batches, depth {}: {:.2} Gb/s ({:.2} GiB/s, {:.0} batches/s) over {}",
                v["op"].as_str().unwrap_or(""),
                a.batch_size,
                a.block_size,
                a.iters,
                a.depth,
                v["gbit_per_s"].as_f64().unwrap_or(0.0),
                v["gib_per_s"].as_f64().unwrap_or(0.0),
                v["batches_per_s"].as_f64().unwrap_or(0.0),
                v["rails"]
            );
        }
    }

    pub(super) fn run(a: &RdmaBenchArgs) -> Result<()> {
        let t = VerbsNic::new(RdmaConfig::from_env()?)?;
        let total = a
            .block_size
            .checked_mul(a.batch_size)
            .ok_or_else(|| Error::invalid("block-size * batch-size overflows"))?;
        let dir = if a.read {
            Direction::Read
        } else {
            Direction::Write
        };
        if let Some(addr) = &a.serve {
            let dst = buffer(total, 0)?;
            // SAFETY: `dst` lives until the end of this function, after the endpoint.
            let reg = unsafe { t.register_host(&[(dst.as_ptr() as u64, total)])? };
            let l = std::net::TcpListener::bind(addr)?;
            eprintln!("pdxfer rdma-bench: serving on {addr}, {total} B region");
            let (mut s, peer) = l.accept()?;
            s.set_read_timeout(Some(WAIT))?;
            let mut ep = t.endpoint()?;
            let remote = exchange(&mut s, ep.local_handshake())?;
            ep.connect(&remote)?;
            let start = Instant::now();
            let mut seen = 0u32;
            let deadline = Instant::now() + WAIT;
            while seen < a.iters {
                match ep.next_incoming() {
                    Some(_) => seen += 1,
                    None if Instant::now() > deadline => {
                        return Err(Error::new(
                            Status::Timeout,
                            format!("received {seen} of {} batch records from {peer} (does the client use PDXFER_RDMA_RECORD=imm?)", a.iters),
                        ))
                    }
                    None => std::thread::sleep(Duration::from_micros(20)),
                }
            }
            s.write_all(b"done")?;
            report(
                a,
                "server",
                &t,
                start.elapsed(),
                reg.elapsed.as_secs_f64() * 1e3,
            );
            drop(ep);
            drop(dst);
            return Ok(());
        }
        let src = buffer(total, 7)?;
        if let Some(addr) = &a.connect {
            // SAFETY: `src` outlives the endpoint (both dropped at the end, endpoint first).
            let reg = unsafe { t.register_host(&[(src.as_ptr() as u64, total)])? };
            let mut s = std::net::TcpStream::connect(addr)?;
            s.set_read_timeout(Some(WAIT))?;
            let mut ep = t.endpoint()?;
            let remote = exchange(&mut s, ep.local_handshake())?;
            ep.connect(&remote)?;
            let region = remote
                .rails
                .first()
                .and_then(|r| r.regions.first())
                .copied()
                .ok_or_else(|| Error::new(Status::Protocol, "the server advertised no region"))?;
            if region.len < total {
                return Err(Error::invalid(format!(
                    "the server's region is {} B, the batch needs {total}: use the same --block-size/--batch-size",
                    region.len
                )));
            }
            let sp = spans(a, src.as_ptr() as u64, region.addr);
            let elapsed = drive(&ep, a, dir, &sp)?;
            let mut done = [0u8; 4];
            s.read_exact(&mut done)?;
            report(a, "client", &t, elapsed, reg.elapsed.as_secs_f64() * 1e3);
            drop(ep);
            drop(src);
            return Ok(());
        }
        // One host: two endpoints of this process connected to each other.
        let dst = buffer(total, 0)?;
        // SAFETY: `src` and `dst` outlive both endpoints (dropped explicitly below).
        let reg = unsafe {
            t.register_host(&[(src.as_ptr() as u64, total), (dst.as_ptr() as u64, total)])?
        };
        let mut e1 = t.endpoint()?;
        let mut e2 = t.endpoint()?;
        let (h1, h2) = (e1.local_handshake().clone(), e2.local_handshake().clone());
        e1.connect(&h2)?;
        e2.connect(&h1)?;
        let (local, remote) = if a.read {
            (dst.as_ptr() as u64, src.as_ptr() as u64)
        } else {
            (src.as_ptr() as u64, dst.as_ptr() as u64)
        };
        let sp = spans(a, local, remote);
        let elapsed = drive(&e1, a, dir, &sp)?;
        drop(e1);
        drop(e2);
        if src != dst {
            return Err(Error::new(
                Status::BatchFailed,
                "data check failed: the destination differs from the source after the transfers",
            ));
        }
        report(a, "loopback", &t, elapsed, reg.elapsed.as_secs_f64() * 1e3);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_devices_the_bench_is_a_typed_error() {
        let a = RdmaBenchArgs {
            block_size: 4096,
            batch_size: 2,
            iters: 1,
            depth: 1,
            read: false,
            serve: None,
            connect: None,
            json: true,
        };
        match run(&a) {
            Ok(()) => {} // a host with NICs
            Err(e) => assert!(
                matches!(
                    e.status(),
                    pdxfer::Status::NoRdmaDevice | pdxfer::Status::Unsupported
                ),
                "{e}"
            ),
        }
        let remote_read = RdmaBenchArgs {
            read: true,
            connect: Some("127.0.0.1:1".into()),
            ..a.clone()
        };
        assert_eq!(
            run(&remote_read).unwrap_err().status(),
            pdxfer::Status::InvalidArgument
        );
        let bad = RdmaBenchArgs { iters: 0, ..a };
        assert_eq!(
            run(&bad).unwrap_err().status(),
            pdxfer::Status::InvalidArgument
        );
    }
}
