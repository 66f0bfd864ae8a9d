//! The one harness for child processes that speak JSON lines on stdout: the
//! `pdxfer` CLI (`bootstrap`, `rank`), `pdxfer-fault-peer` engine ranks, and
//! anything else started from a [`Command`]. Shared by the integration tests
//! (`tests/support/mod.rs`) and the soak driver (`examples/soak.rs`, through
//! `#[path]`), so it names no cargo test-only variable.

#![allow(dead_code)]

use serde_json::{json, Value};
use std::cell::RefCell;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Longest wait for one expected event of [`Proc::expect`].
pub const WAIT: Duration = Duration::from_secs(10);
/// Room deadline given to `pdxfer-fault-peer` ranks.
pub const DEADLINE: Duration = Duration::from_secs(4);
/// Slack on top of a deadline for a report to arrive.
pub const SLACK: Duration = Duration::from_secs(3);

/// A spawned child driven over its stdin (one line per command) and stdout
/// (one JSON object per line, read by a thread); killed on drop.
pub struct Proc {
    /// Its name in messages.
    pub name: String,
    /// The process.
    pub child: Child,
    /// Its stdin, until [`Proc::exit`] closes it.
    pub stdin: Option<ChildStdin>,
    rx: Receiver<Value>,
    /// Lines [`Proc::expect_match`] read past, kept for a later call.
    seen: RefCell<Vec<Value>>,
}

impl Proc {
    /// Starts `cmd` with piped stdin and stdout (stderr inherited).
    pub fn start(name: &str, mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let out = child.stdout.take().expect("piped stdout");
        let (tx, rx) = channel();
        let n = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) => {
                        if tx.send(v).is_err() {
                            return;
                        }
                    }
                    Err(_) => eprintln!("[{n}] non-JSON line: {line}"),
                }
            }
        });
        Proc {
            name: name.to_string(),
            stdin: child.stdin.take(),
            child,
            rx,
            seen: RefCell::new(Vec::new()),
        }
    }

    /// Starts the `pdxfer-fault-peer` binary `bin` with the common arguments
    /// (name, bootstrap URL, cluster, room deadline [`DEADLINE`]) and `args`
    /// (`--key value`); waits for its `ready` line.
    pub fn spawn_bin(
        bin: &str,
        name: &str,
        url: &str,
        cluster: &str,
        args: &[(&str, String)],
    ) -> Proc {
        Self::spawn_wrapped(&[], bin, name, url, cluster, args)
    }

    /// Like [`spawn_bin`](Self::spawn_bin), run through `wrap` (e.g. `ip netns exec NS`).
    pub fn spawn_wrapped(
        wrap: &[&str],
        bin: &str,
        name: &str,
        url: &str,
        cluster: &str,
        args: &[(&str, String)],
    ) -> Proc {
        let mut cmd = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.args(["--name", name, "--bootstrap", url, "--cluster", cluster]);
        cmd.args(["--timeout-ms", &DEADLINE.as_millis().to_string()]);
        for (k, v) in args {
            cmd.arg(format!("--{k}")).arg(v);
        }
        let p = Proc::start(name, cmd);
        let r = p.expect_match(|v| v["event"] == "ready" || v["event"] == "error", SLACK);
        assert_eq!(r["event"], "ready", "{name} did not start: {r}");
        p
    }

    /// Waits (at most [`WAIT`]) for the next line whose `"event"` is `event`;
    /// the lines before it are printed and dropped.
    pub fn expect(&self, event: &str) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(v) if v["event"] == event => return v,
                Ok(v) => eprintln!("[{}] skipping {v}", self.name),
                Err(_) => panic!("{}: no {event:?} event within {WAIT:?}", self.name),
            }
        }
    }

    /// The first line matching `f` within `within`, earlier unmatched lines
    /// included (they are kept for a later call, the oldest dropped past 4096).
    pub fn expect_match(&self, f: impl Fn(&Value) -> bool, within: Duration) -> Value {
        let mut seen = self.seen.borrow_mut();
        if let Some(i) = seen.iter().position(&f) {
            return seen.remove(i);
        }
        let end = Instant::now() + within;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(v) if f(&v) => return v,
                Ok(v) => {
                    // a long run would otherwise grow without bound
                    if seen.len() >= 4096 {
                        seen.drain(..2048);
                    }
                    seen.push(v)
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "{}: no matching event within {within:?}; saw {:?}",
                        self.name, seen
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("{}: exited; saw {:?}", self.name, seen)
                }
            }
        }
    }

    /// Lines already printed, without waiting.
    pub fn drain(&self) -> Vec<Value> {
        self.rx.try_iter().collect()
    }

    /// Writes one line to its stdin.
    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin open");
        writeln!(s, "{line}").expect("write to child stdin");
        s.flush().expect("flush child stdin");
    }

    /// Writes one JSON command to its stdin.
    pub fn cmd(&mut self, v: Value) {
        self.send(&v.to_string());
    }

    /// A fault peer's `done` report of `room`, within `within`.
    pub fn done(&self, room: u64, within: Duration) -> Value {
        self.expect_match(|v| v["event"] == "done" && v["room"] == room, within)
    }

    /// SIGKILL and reap: the process gets no chance to deregister.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGKILL (asserted delivered) and reap.
    pub fn kill9(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(r, 0, "kill -9 {}", self.name);
        let _ = self.child.wait();
    }

    /// Asks a fault peer for its canaries; asserts none changed.
    pub fn check_canaries(&mut self) {
        self.cmd(json!({"cmd": "check"}));
        let c = self.expect_match(|v| v["event"] == "canaries", SLACK);
        assert_eq!(c["damaged"], 0, "{}: canary bytes changed", self.name);
    }

    /// Tells a fault peer to exit; asserts it does so in bounded time with
    /// intact canaries.
    pub fn exit(mut self) {
        self.cmd(json!({"cmd": "exit"}));
        let c = self.expect_match(
            |v| v["event"] == "canaries" && v["final"] == true,
            DEADLINE + SLACK,
        );
        assert_eq!(c["damaged"], 0, "{}: canary bytes changed", self.name);
        drop(self.stdin.take());
        let end = Instant::now() + SLACK;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "{} exited with {st}", self.name);
                return;
            }
            assert!(Instant::now() < end, "{} hangs at exit", self.name);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}
