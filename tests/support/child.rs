//! Child tests: a test re-runs its own binary for one `#[ignore]`d child test
//! (a canary, an attacker, a relay), as uid/gid 65534 when the tests run as
//! root, and reads the child's reports from marked lines of its stdout.

use serde_json::Value;
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// The uid and gid an attacker child runs as when the tests run as root.
pub const NOBODY: u32 = 65534;
/// Marks a child's report lines (the harness prints others, and may print
/// `test NAME ... ` on the same line first).
pub const MARK: &str = "@@pdxfer-child ";

/// True when the tests run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A command that re-runs this test binary for the ignored child test
/// `name` of the module `module_path` (`module_path!()` of the caller), with
/// `env_key=name` set (the child's [`is_child`]) and no cluster secret in its
/// environment; as uid/gid [`NOBODY`] when `nobody` and root (printed when
/// not root: the child then runs as this same uid). The caller sets stdio and
/// further variables, then spawns it.
pub fn command(module_path: &str, name: &str, env_key: &str, nobody: bool) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        super::test_name(module_path, name).as_str(),
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(env_key, name)
    .env_remove(pdxfer::transport::CLUSTER_SECRET_ENV);
    if nobody && is_root() {
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            c.pre_exec(|| {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(NOBODY) != 0
                    || libc::setuid(NOBODY) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    } else if nobody {
        println!("not root: child {name} runs as this same uid");
    }
    c
}

/// True in the child process run for `name` (see [`command`]).
pub fn is_child(env_key: &str, name: &str) -> bool {
    std::env::var(env_key).as_deref() == Ok(name)
}

/// A child's report to its parent: one marked JSON line.
pub fn report(v: Value) {
    println!("{MARK}{v}");
}

/// The next report of child `c` on its stdout `r` (bounded by the child's
/// own timeouts: it reports or ends).
pub fn next_report(c: &Child, r: &mut impl BufRead) -> Value {
    let mut line = String::new();
    loop {
        line.clear();
        let n = r.read_line(&mut line).unwrap();
        assert!(n > 0, "child {} ended without a report", c.id());
        if let Some(i) = line.find(MARK) {
            return serde_json::from_str(line[i + MARK.len()..].trim_end()).unwrap();
        }
    }
}

/// A child test the parent talks to: stdin lines one way, marked reports
/// the other; its first report is [`Talker::info`]. Killed on drop.
pub struct Talker {
    /// The process.
    pub child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    /// Its first report.
    pub info: Value,
}

impl Talker {
    /// Spawns `cmd` (from [`command`]) with piped stdin and stdout and waits
    /// for its first report.
    pub fn spawn(mut cmd: Command) -> Talker {
        let mut child = cmd
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn child test");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let info = next_report(&child, &mut out);
        Talker { child, out, info }
    }

    /// Sends `line` and returns the child's next report.
    pub fn ask(&mut self, line: &str) -> Value {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        next_report(&self.child, &mut self.out)
    }

    /// A [`run_canary`] child's count of changed bytes.
    pub fn changed(&mut self) -> u64 {
        self.ask("check")["changed"].as_u64().unwrap()
    }
}

impl Drop for Talker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a canary child: 64 KiB of `byte`; reports its identity and
/// the buffer's address, then on each stdin line how many bytes changed.
/// Ends by itself after 60 s.
pub fn run_canary(byte: u8) {
    let buf = vec![byte; 64 << 10];
    report(serde_json::json!({
        "identity": pdxfer::transport::ProcIdentity::current().unwrap(),
        "addr": buf.as_ptr() as u64,
        "len": buf.len(),
    }));
    let t0 = std::time::Instant::now();
    for _ in std::io::stdin().lock().lines() {
        let changed = std::hint::black_box(&buf)
            .iter()
            .filter(|&&b| b != byte)
            .count();
        report(serde_json::json!({ "changed": changed }));
        if t0.elapsed() > std::time::Duration::from_secs(60) {
            break;
        }
    }
}
