//! The arguments of `pdxfer bench` ([`BenchArgs`]) and the size parser
//! ([`parse_size`]), shared by the sweep (`bench`) and its nccl mode
//! (`nccl_bench`).

use clap::Args;
use pdxfer::error::{Error, Result};

/// Arguments of `pdxfer bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Transport: cma, tcp, rdma, local or auto (rdma: one-sided RDMA WRITE
    /// through the agent's RDMA link; needs a usable NIC on both sides), or
    /// nccl (engines with device pools on two GPUs; --block-sizes are KV
    /// bytes per room).
    #[arg(long, default_value = "cma")]
    pub transport: String,
    /// Use an already running target at this address instead of spawning one.
    #[arg(long)]
    pub connect: Option<String>,
    /// Block sizes to sweep (suffixes K, M, G: binary).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M")]
    pub block_sizes: Vec<String>,
    /// Blocks per batch to sweep.
    #[arg(long, value_delimiter = ',', default_value = "16")]
    pub batch_sizes: Vec<usize>,
    /// cma writer threads or tcp streams to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub threads: Vec<u32>,
    /// Batches kept in flight.
    #[arg(long, default_value_t = 2)]
    pub depth: usize,
    /// Measured batches per point (at most; see --max-ms).
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// Time budget per point in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub max_ms: u64,
    /// Ask the receiver to verify a checksum of every batch.
    #[arg(long)]
    pub checksum: bool,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    /// Spawned target registers heap buffers (cma then uses process_vm_writev, not memcpy into mapped memfd regions).
    #[arg(long)]
    pub heap_target: bool,
    /// Draw GB/s against block size into this PNG.
    #[arg(long)]
    pub plot: Option<String>,
    /// Write every point's batches under one room grant of the target (no
    /// per-batch round trip where the transport supports grants: cma, tcp, rdma);
    /// the room closes with one round trip after the point.
    #[arg(long)]
    pub room_grant: bool,
    /// tcp: encrypt the payload (both this sender and the spawned target
    /// get `PDXFER_TCP_ENCRYPT=1`; an already running target must have it
    /// too). Without the flag, `PDXFER_TCP_ENCRYPT` is honoured.
    #[arg(long)]
    pub encrypt: bool,
    #[command(flatten)]
    pub layerwise: crate::layerwise_bench::LayerwiseArgs,
    /// --transport nccl: the prefill's and the decode's GPU (default 0,1).
    #[arg(long)]
    pub nccl_gpus: Option<String>,
}

/// Parses `4K`, `1M`, `123` (binary suffixes).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::invalid(format!("bad size {s:?} (e.g. 4K, 1M)")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("123").unwrap(), 123);
        assert!(parse_size("0").is_err());
        assert!(parse_size("x").is_err());
    }
}
