//! The shape of the PD request the request benches move ([`RequestShape`]):
//! the arguments `pdxfer bench-request` and `pdxfer bench-cp` share.

use clap::Args;

/// Requests, their size and the prefill's staging, as both request benches take them.
#[derive(Args, Debug, Clone)]
pub struct RequestShape {
    /// Requests per mode (the first is reported apart from the median of the rest).
    #[arg(long, default_value_t = 6)]
    pub requests: u32,
    /// Tokens per request.
    #[arg(long, default_value_t = 8192)]
    pub tokens: u64,
    /// KV entries (layers).
    #[arg(long, default_value_t = 61)]
    pub layers: u32,
    /// Bytes per token row (a multiple of 8).
    #[arg(long, default_value_t = 1152)]
    pub row_bytes: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u64,
    /// Prefill staging (pack) buffer per worker, MiB; 0 writes unpacked rows.
    #[arg(long, default_value_t = 64)]
    pub staging_mib: u64,
}
