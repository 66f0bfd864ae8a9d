//! The engine rank processes `pdxfer demo` and `pdxfer bench-request`
//! drive: each a child of this binary running a hidden rank subcommand,
//! spoken to in JSON lines on stdin, answering in JSON lines on stdout.

use crossbeam::channel::Sender;
use pdxfer::error::{Error, Result, Status};
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
