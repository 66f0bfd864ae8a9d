//! A private etcd for the bootstrap and fault tests; without an etcd binary
//! the test records a skip (kind `etcd`).

use super::{free_port, skip};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
