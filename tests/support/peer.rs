//! The harness for `pdxfer-fault-peer` processes, shared by the fault tests
//! (`tests/faults.rs`, through `#[path]`) and the soak driver (`examples/soak.rs`).

#![allow(dead_code)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Room deadline given to the ranks.
pub const DEADLINE: Duration = Duration::from_secs(4);
/// Slack on top of a deadline for a report to arrive.
pub const SLACK: Duration = Duration::from_secs(3);

/// One `pdxfer-fault-peer` process driven over its stdin/stdout.
pub struct Peer {
    /// See the harness.
    pub name: String,
    /// See the harness.
    pub child: Child,
    /// See the harness.
    pub stdin: Option<ChildStdin>,
    /// See the harness.
    pub rx: Receiver<Value>,
    /// See the harness.
    pub seen: Vec<Value>,
}

impl Peer {
    /// Starts `bin` with the common arguments and `args`; waits for `ready`.
    pub fn spawn_bin(
        bin: &str,
        name: &str,
        url: &str,
        cluster: &str,
        args: &[(&str, String)],
    ) -> Peer {
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
    ) -> Peer {
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
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn pdxfer-fault-peer");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        let mut p = Peer {
            name: name.to_string(),
            stdin: child.stdin.take(),
            child,
            rx,
            seen: Vec::new(),
        };
        let r = p.expect(|v| v["event"] == "ready" || v["event"] == "error", SLACK);
        assert_eq!(r["event"], "ready", "{name} did not start: {r}");
        p
    }

    pub fn cmd(&mut self, v: Value) {
        let s = self.stdin.as_mut().expect("stdin open");
        writeln!(s, "{v}").expect("write command");
        s.flush().unwrap();
    }

    /// The first event matching `f` (earlier unmatched events are kept), within `within`.
    pub fn expect(&mut self, f: impl Fn(&Value) -> bool, within: Duration) -> Value {
        if let Some(i) = self.seen.iter().position(&f) {
            return self.seen.remove(i);
        }
        let end = Instant::now() + within;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(v) if f(&v) => return v,
                Ok(v) => {
                    // unmatched events are kept for a later expect(), but not
                    // forever: a long run would grow without bound
                    if self.seen.len() >= 4096 {
                        self.seen.drain(..2048);
                    }
                    self.seen.push(v)
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "{}: no matching event within {within:?}; saw {:?}",
                        self.name, self.seen
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("{}: exited; saw {:?}", self.name, self.seen)
                }
            }
        }
    }

    pub fn done(&mut self, room: u64, within: Duration) -> Value {
        self.expect(|v| v["event"] == "done" && v["room"] == room, within)
    }

    pub fn kill9(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(r, 0, "kill -9 {}", self.name);
        let _ = self.child.wait();
    }

    pub fn check_canaries(&mut self) {
        self.cmd(json!({"cmd": "check"}));
        let c = self.expect(|v| v["event"] == "canaries", SLACK);
        assert_eq!(c["damaged"], 0, "{}: canary bytes changed", self.name);
    }

    /// Tells the peer to exit; asserts it does so in bounded time with intact canaries.
    pub fn exit(mut self) {
        self.cmd(json!({"cmd": "exit"}));
        let c = self.expect(
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

impl Drop for Peer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
