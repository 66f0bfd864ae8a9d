//! The engine rank processes `pdxfer demo` and `pdxfer bench-request`
//! drive: each a child of this binary running a hidden rank subcommand,
//! spoken to in JSON lines on stdin, answering in JSON lines on stdout.

use clap::Args;
use crossbeam::channel::Sender;
use pdxfer::bootstrap::schema::Role;
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::EngineConfig;
use pdxfer::error::{Error, Result, Status};
use pdxfer::transport::TransportKind;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

/// A line one rank printed: (the rank's index, the JSON value). A rank
/// whose stdout closed sends `{"event": "exit"}` last.
pub type Event = (usize, Value);

/// One rank process.
pub struct Proc {
    pub child: Child,
    stdin: ChildStdin,
}

impl Proc {
    /// Sends one command line.
    pub fn send(&mut self, v: &Value) -> Result<()> {
        writeln!(self.stdin, "{v}")?;
        self.stdin.flush()?;
        Ok(())
    }
}

/// Starts `pdxfer SUBCOMMAND ARGS` as rank `idx`, with this run's cluster
/// secret (the ranks authenticate each other with it); its stdout lines are
/// forwarded to `tx`.
pub fn spawn(
    subcommand: &str,
    args: &[String],
    idx: usize,
    secret: &str,
    tx: Sender<Event>,
) -> Result<Proc> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .arg(subcommand)
        .args(args)
        .env("PDXFER_CLUSTER_SECRET", secret)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| Error::new(Status::Io, "no stdin"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| Error::new(Status::Io, "no stdout"))?;
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send((idx, v));
            }
        }
        let _ = tx.send((idx, json!({"event": "exit"})));
    });
    Ok(Proc { child, stdin })
}

/// The page ids under key `k` of a command.
pub fn pages_of(v: &Value, k: &str) -> Vec<u64> {
    v[k].as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// What every rank process of `demo` and `bench-request` is started with:
/// who it is, where the bootstrap is, and its synthetic KV geometry.
#[derive(Args, Debug)]
pub struct EngineRankArgs {
    /// prefill or decode.
    #[arg(long)]
    pub role: String,
    /// Bootstrap URL.
    #[arg(long)]
    pub bootstrap: String,
    /// Cluster name.
    #[arg(long)]
    pub cluster: String,
    /// DCP size of this side.
    #[arg(long, default_value_t = 1)]
    pub dcp_size: u32,
    /// DCP rank.
    #[arg(long, default_value_t = 0)]
    pub rank: u32,
    /// Layers.
    #[arg(long)]
    pub layers: u32,
    /// Bytes per token row.
    #[arg(long)]
    pub row_bytes: u64,
    /// Tokens per page.
    #[arg(long)]
    pub page_size: u64,
    /// Pages per layer pool.
    #[arg(long)]
    pub pages: u64,
    /// Transport.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Staging (pack) buffer per prefill worker, MiB (0: unpacked writes).
    #[arg(long, default_value_t = 64)]
    pub staging_mib: u64,
}

impl EngineRankArgs {
    /// The rank's engine configuration over `pools` (role, cluster,
    /// bootstrap, topology, KV and aux buffers, transport, staging).
    pub fn engine_config(&self, pools: &SyntheticPools) -> Result<EngineConfig> {
        let mut cfg = EngineConfig::new(
            Role::parse(&self.role)?,
            &self.cluster,
            &self.bootstrap,
            pools.topology(self.dcp_size, self.rank),
            pools.kv_pools(),
        );
        cfg.aux = pools.aux_buffers();
        cfg.transport = TransportKind::parse(&self.transport)?;
        cfg.staging_bytes = self.staging_mib << 20;
        Ok(cfg)
    }
}
