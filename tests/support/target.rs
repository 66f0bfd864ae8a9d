//! A `pdxfer target` process (a registered region behind an agent's data
//! port, driven over stdin) on the one child-process harness ([`Proc`]).

use super::Proc;
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

/// Longest wait for one line of a target.
const LINE_WAIT: Duration = Duration::from_secs(20);

/// A running `pdxfer target`; killed on drop (by its [`Proc`]).
pub struct Target {
    /// The process and its JSON lines.
    pub proc: Proc,
    /// Its agent's data address.
    pub addr: String,
    /// Its pid.
    pub pid: u32,
    /// The id of its one registered region.
    pub region: u64,
}

impl Target {
    /// Starts `pdxfer target --listen 127.0.0.1:0 --size SIZE ARGS`, under
    /// `nofile` descriptors when given, and waits for its ready line.
    pub fn spawn(size: u64, args: &[&str], nofile: Option<u64>) -> Target {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdxfer"));
        cmd.args(["target", "--listen", "127.0.0.1:0", "--size"])
            .arg(size.to_string())
            .args(args);
        if let Some(n) = nofile {
            // SAFETY: the closure only calls setrlimit, which is async-signal-safe.
            unsafe {
                cmd.pre_exec(move || {
                    let r = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let proc = Proc::start("pdxfer target", cmd);
        let ready = proc.expect_match(|v| v.get("ready").is_some(), LINE_WAIT);
        assert_eq!(ready["ready"], true, "{ready}");
        Target {
            addr: ready["addr"].as_str().unwrap().to_string(),
            pid: ready["pid"].as_u64().unwrap() as u32,
            region: ready["regions"][0]["id"].as_u64().unwrap(),
            proc,
        }
    }

    /// The next line that has `key` (within 20 s).
    pub fn line(&self, key: &str) -> Value {
        self.proc.expect_match(|v| v.get(key).is_some(), LINE_WAIT)
    }

    /// One command line to its stdin.
    pub fn cmd(&mut self, c: &str) {
        self.proc.send(c);
    }

    /// Every byte of the target's region, read back through a file it writes.
    pub fn dump(&mut self) -> Vec<u8> {
        let path =
            std::env::temp_dir().join(format!("pdxfer-dump-{}-{}", std::process::id(), self.pid));
        self.cmd(&format!("dump {}", path.display()));
        self.line("dumped");
        let b = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        b
    }

    /// Unregisters the target's region, waiting up to `ms` for its pins.
    pub fn unregister(&mut self, ms: u64) -> Value {
        let c = format!("unregister {} {ms}", self.region);
        self.cmd(&c);
        self.line("unregistered")
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        self.proc.kill();
    }
}
