//! Test harness: real `pdxfer` processes speaking JSON lines, and a private etcd.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// Longest wait for one expected event.
pub const WAIT: Duration = Duration::from_secs(10);

/// A spawned `pdxfer` process; killed on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    rx: Receiver<Value>,
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pdxfer"))
            .args(args)
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
        let stdin = child.stdin.take();
        Proc {
            name: name.to_string(),
            child,
            stdin,
            rx,
        }
    }

    /// Waits (bounded) for the next line whose "event" is `event`; other lines are returned in `skipped`.
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

    /// Lines already printed, without waiting.
    pub fn drain(&self) -> Vec<Value> {
        self.rx.try_iter().collect()
    }

    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin open");
        writeln!(s, "{line}").expect("write to child stdin");
        s.flush().expect("flush child stdin");
    }

    /// SIGKILL and reap: the process gets no chance to deregister.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Starts `pdxfer bootstrap` on a free port; returns the process and its URL.
pub fn bootstrap_server(extra: &[&str]) -> (Proc, String) {
    let mut args = vec!["bootstrap", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let p = Proc::spawn("bootstrap", &args);
    let url = p.expect("listening")["url"]
        .as_str()
        .expect("url")
        .to_string();
    (p, url)
}

/// Arguments of a `pdxfer rank`.
pub fn rank_args(store: &str, cluster: &str, role: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "rank",
        "--store",
        store,
        "--cluster",
        cluster,
        "--role",
        role,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Spawns a rank and waits for its registration.
pub fn rank(name: &str, store: &str, cluster: &str, role: &str, extra: &[&str]) -> (Proc, Value) {
    let args = rank_args(store, cluster, role, extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let p = Proc::spawn(name, &refs);
    let ev = p.expect("registered");
    (p, ev)
}

/// A private etcd on free loopback ports with a temporary data dir.
pub struct Etcd {
    child: Child,
    dir: std::path::PathBuf,
    pub url: String,
}

impl Etcd {
    /// Starts etcd, or returns None (after printing why) when the binary is absent.
    pub fn start() -> Option<Etcd> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(bin) = bin else {
            eprintln!("SKIP: etcd binary not found (install Debian's etcd-server)");
            return None;
        };
        let (cp, pp) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("pdxfer-etcd-{}-{cp}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let client = format!("http://127.0.0.1:{cp}");
        let peer = format!("http://127.0.0.1:{pp}");
        let child = Command::new(bin)
            .args([
                "--name",
                "pdxfer-test",
                "--data-dir",
                dir.to_str().expect("utf-8 temp dir"),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("pdxfer-test={peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd");
        let e = Etcd {
            child,
            dir,
            url: client,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(1)))
            .build()
            .into();
        loop {
            if let Ok(mut r) = agent.get(format!("{}/health", e.url)).call() {
                if r.body_mut()
                    .read_to_string()
                    .is_ok_and(|b| b.contains("true"))
                {
                    return Some(e);
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy in 15 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pdxfer store URL for namespace `ns`.
    pub fn store_url(&self, ns: &str) -> String {
        format!("etcd://{}/{ns}", self.url.trim_start_matches("http://"))
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` every 50 ms until it returns Some, for at most `limit`.
pub fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
