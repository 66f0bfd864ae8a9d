//! Child tests: a test re-runs its own binary for one `#[ignore]`d child test
//! (a canary, an attacker, a relay), as uid/gid 65534 when the tests run as
//! root, and reads the child's reports from marked lines of its stdout.

use serde_json::Value;
use std::io::BufRead;
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
