//! Test harness: real `pdxfer` processes speaking JSON lines, a private etcd,
//! and [`skip`], which records every skipped test.
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

/// A private etcd on loopback ports; killed (SIGKILL) on drop.
pub struct Etcd {
    child: Child,
    /// Its data directory (removed on drop when [`Etcd::start`] made it).
    pub dir: std::path::PathBuf,
    owns_dir: bool,
    /// Client and peer ports.
    pub client: u16,
    pub peer: u16,
    /// `http://127.0.0.1:<client>`.
    pub url: String,
}

impl Etcd {
    /// The etcd binary: `$PDXFER_ETCD`, else `etcd` on `PATH`, else
    /// `/usr/bin/etcd` or `/usr/local/bin/etcd` (Debian's etcd-server).
    pub fn binary() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os("PDXFER_ETCD") {
            return Some(p.into());
        }
        let on_path = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default();
        on_path
            .into_iter()
            .chain(["/usr/bin".into(), "/usr/local/bin".into()])
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    }

    /// Starts etcd on free ports and a fresh temporary data dir. Without an
    /// etcd binary, records a skip (kind `etcd`) and returns None; a binary
    /// that does not come up healthy fails the test.
    pub fn start() -> Option<Etcd> {
        let Some(bin) = Self::binary() else {
            skip(
                "etcd",
                "no etcd binary ($PDXFER_ETCD, PATH, /usr/bin; install Debian's etcd-server)",
            );
            return None;
        };
        let (client, peer) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("pdxfer-etcd-{}-{client}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = Self::start_at(&bin, &dir, client, peer);
        e.owns_dir = true;
        Some(e)
    }

    /// Starts `bin` on `dir` and the given ports (a restart passes the same
    /// ones) and waits until it reports healthy; panics if it does not within
    /// 15 s. The caller keeps `dir`.
    pub fn start_at(bin: &std::path::Path, dir: &std::path::Path, client: u16, peer: u16) -> Etcd {
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        // etcd's own log goes next to its data, for the failure message
        let log_path = dir.with_extension("etcd.log");
        let spawn = || {
            let log = std::fs::File::create(&log_path)
                .unwrap_or_else(|e| panic!("create {}: {e}", log_path.display()));
            Command::new(bin)
                .args(["--name", "pdxfer-test", "--data-dir"])
                .arg(dir)
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args(["--initial-cluster", &format!("pdxfer-test={peer_url}")])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
        };
        let child = spawn();
        let e = Etcd {
            child,
            dir: dir.to_path_buf(),
            owns_dir: false,
            client,
            peer,
            url: url.clone(),
        };
        let mut e = e;
        // generous: a restart replays the WAL, and CI machines are shared
        let deadline = Instant::now() + Duration::from_secs(30);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(1)))
            .build()
            .into();
        let mut respawns = 0;
        loop {
            if let Ok(mut r) = agent.get(format!("{}/health", e.url)).call() {
                if r.body_mut()
                    .read_to_string()
                    .is_ok_and(|b| b.contains("true"))
                {
                    return e;
                }
            }
            // an etcd that exited at start (a port its predecessor had not
            // released yet) is started again, a few times
            if matches!(e.child.try_wait(), Ok(Some(_))) && respawns < 3 {
                respawns += 1;
                std::thread::sleep(Duration::from_millis(500));
                e.child = spawn();
            }
            if Instant::now() >= deadline {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: String = log.lines().rev().take(15).collect::<Vec<_>>().join("\n");
                panic!(
                    "etcd ({}) did not become healthy on port {client} in 30 s ({respawns} restarts); its last log lines, newest first:\n{tail}",
                    bin.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pdxfer store URL for namespace `ns`.
    pub fn store_url(&self, ns: &str) -> String {
        format!("etcd://127.0.0.1:{}/{ns}", self.client)
    }

    /// SIGKILL and reap: etcd gets no chance to shut down cleanly.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill9();
        if self.owns_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Where [`skip`] records skips: `$PDXFER_SKIP_LOG`, else `skips.txt` in the
/// cargo target directory. `scripts/test.sh` clears it first, prints it at the
/// end and fails on any skip `PDXFER_ALLOW_SKIP` does not name.
pub fn skip_log() -> std::path::PathBuf {
    match std::env::var_os("PDXFER_SKIP_LOG") {
        Some(p) => p.into(),
        None => std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .expect("CARGO_TARGET_TMPDIR is <target>/tmp")
            .join("skips.txt"),
    }
}

/// Records that the running test skips its body because the machine lacks
/// `kind` (`netns`, `etcd`, `cuda-tools`, ...): one line `kind<TAB>test<TAB>reason`
/// appended to [`skip_log`], and printed. The caller returns right after.
pub fn skip(kind: &str, reason: &str) {
    let thread = std::thread::current();
    let test = format!(
        "{}::{}",
        env!("CARGO_CRATE_NAME"),
        thread.name().unwrap_or("?")
    );
    eprintln!("SKIPPED [{kind}] {test}: {reason}");
    let path = skip_log();
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let line = format!("{kind}\t{test}\t{}\n", reason.replace(['\t', '\n'], " "));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .unwrap_or_else(|e| panic!("cannot record the skip in {}: {e}", path.display()));
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
