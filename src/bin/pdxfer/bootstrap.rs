//! `pdxfer bootstrap`: the standalone bootstrap server.

use clap::Args;
use pdxfer::bootstrap::{BootstrapServer, ServerConfig};
use std::io::Write;

/// Arguments of `pdxfer bootstrap`.
#[derive(Args, Debug)]
pub struct BootstrapArgs {
    /// Address to listen on (port 0 picks a free one; the bound URL is printed).
    #[arg(long, default_value = "127.0.0.1:8998")]
    listen: String,
    /// Shared token for writes and endpoint reads (better: PDXFER_BOOTSTRAP_TOKEN).
    #[arg(long, env = "PDXFER_BOOTSTRAP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = pdxfer::bootstrap::server::DEFAULT_MAX_BODY)]
    max_body: usize,
    /// Most connections served at once; past it a newcomer evicts the oldest
    /// connection still sending its request (none such: 503 and close).
    #[arg(long, default_value_t = pdxfer::bootstrap::server::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Connections one source address (all of loopback is one) holds while
    /// sending requests before its oldest is evicted for its newcomer.
    #[arg(long, default_value_t = pdxfer::admission::DEFAULT_PER_SOURCE)]
    max_per_source: usize,
    /// Milliseconds a client has to send its request line and headers (then 408).
    #[arg(long, default_value_t = pdxfer::bootstrap::server::DEFAULT_HEADER_TIMEOUT.as_millis() as u64)]
    header_timeout_ms: u64,
    /// Milliseconds a client has to send its body once the headers are in (then 408).
    #[arg(long, default_value_t = pdxfer::bootstrap::server::DEFAULT_BODY_TIMEOUT.as_millis() as u64)]
    body_timeout_ms: u64,
    /// Most live entries held (bounds memory; new keys beyond it get 503).
    #[arg(long, default_value_t = pdxfer::bootstrap::store::DEFAULT_MAX_ENTRIES)]
    max_entries: usize,
    /// Largest serialized size of all live entries together, in bytes
    /// (bounds memory; a registration past it gets 507).
    #[arg(long, default_value_t = pdxfer::bootstrap::store::DEFAULT_MAX_STORE_BYTES)]
    max_store_bytes: usize,
    /// Serve a non-loopback --listen address without a token (refused otherwise).
    #[arg(long)]
    insecure: bool,
}

/// Runs the server until the process is killed.
pub fn run(a: &BootstrapArgs) -> pdxfer::Result<()> {
    let server = BootstrapServer::start(ServerConfig {
        listen: a.listen.clone(),
        token: a.token.clone(),
        max_body_bytes: a.max_body,
        max_connections: a.max_connections,
        max_per_source: a.max_per_source,
        header_timeout: std::time::Duration::from_millis(a.header_timeout_ms),
        body_timeout: std::time::Duration::from_millis(a.body_timeout_ms),
        max_entries: a.max_entries,
        max_store_bytes: a.max_store_bytes,
        insecure: a.insecure,
    })?;
    let line = serde_json::json!({
        "event": "listening",
        "url": server.url(),
        "token_required": a.token.is_some(),
    });
    let mut out = std::io::stdout().lock();
    // If stdout is gone the server still serves; nothing else to report to.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
    drop(out);
    loop {
        std::thread::park();
    }
}
