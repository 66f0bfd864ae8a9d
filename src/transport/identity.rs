//! Who a process is: pid, start time, boot id and host name. Peers exchange
//! it in the handshake; cma checks it (same boot id, same start time) so a
//! recycled pid or a process on another host is refused by name.

use crate::error::{Error, Result, Status};
use serde::{Deserialize, Serialize};

/// The identity of one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcIdentity {
    /// Process id (in the sender's pid namespace).
    pub pid: u32,
    /// Start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`).
    pub start_time: u64,
    /// `/proc/sys/kernel/random/boot_id`: equal exactly on the same host and boot.
    pub boot_id: String,
    /// Host name.
    pub hostname: String,
}

/// Start time of `pid` from `/proc/<pid>/stat` (clock ticks since boot).
pub fn start_time_of(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| {
        Error::new(
            Status::PeerUnreachable,
            format!("process {pid} is gone or invisible here (/proc/{pid}/stat: {e})"),
        )
    })?;
    // The command name (field 2) may hold spaces and ')': fields restart after the last ')'.
    let rest = s
        .rfind(')')
        .map(|i| &s[i + 1..])
        .ok_or_else(|| Error::new(Status::Io, format!("unparsable /proc/{pid}/stat")))?;
    // rest starts at field 3 (state); start time is field 22, i.e. index 19 here.
    rest.split_whitespace()
        .nth(19)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::new(Status::Io, format!("no start time in /proc/{pid}/stat")))
}

/// Real and effective uid of `pid` (the `Uid:` line of `/proc/<pid>/status`).
pub fn uids_of(pid: u32) -> Result<(u32, u32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| {
        Error::new(
            Status::PeerUnreachable,
            format!("process {pid} is gone or invisible here (/proc/{pid}/status: {e})"),
        )
    })?;
    let line = s
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .ok_or_else(|| Error::new(Status::Io, format!("no Uid line in /proc/{pid}/status")))?;
    let mut f = line.split_whitespace().map(|v| v.parse::<u32>());
    match (f.next(), f.next()) {
        (Some(Ok(real)), Some(Ok(eff))) => Ok((real, eff)),
        _ => Err(Error::new(
            Status::Io,
            format!("unparsable Uid line in /proc/{pid}/status"),
        )),
    }
}

impl ProcIdentity {
    /// The identity of this process.
    pub fn current() -> Result<ProcIdentity> {
        let pid = std::process::id();
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .map_err(|e| Error::new(Status::Io, format!("read boot_id: {e}")))?;
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Ok(ProcIdentity {
            pid,
            start_time: start_time_of(pid)?,
            boot_id,
            hostname,
        })
    }

    /// True when `other` runs on this host in this boot.
    pub fn same_host(&self, other: &ProcIdentity) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id
    }

    /// Checks that `claimed` is a live process on this host: same boot id,
    /// and `/proc/<pid>/stat` shows the claimed start time (pid not reused).
    pub fn verify_local_peer(&self, claimed: &ProcIdentity) -> Result<()> {
        if !self.same_host(claimed) {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "peer pid {} on host {:?} (boot {}) is not on this host {:?} (boot {}): cma needs the same host; use tcp",
                    claimed.pid, claimed.hostname, claimed.boot_id, self.hostname, self.boot_id
                ),
            ));
        }
        let now = start_time_of(claimed.pid).map_err(|e| {
            Error::new(
                Status::PeerIdentity,
                format!(
                    "peer claims pid {} but {} (another pid namespace, or it exited)",
                    claimed.pid,
                    e.detail()
                ),
            )
        })?;
        if now != claimed.start_time {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "pid {} started at tick {now}, but the peer claims start tick {}: the pid was reused by another process (or a pid namespace differs)",
                    claimed.pid, claimed.start_time
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_identity_verifies_and_mismatches_are_named() {
        let me = ProcIdentity::current().unwrap();
        assert_eq!(me.pid, std::process::id());
        me.verify_local_peer(&me).unwrap();
        // SAFETY: getuid/geteuid have no preconditions.
        let (uid, euid) = unsafe { (libc::getuid(), libc::geteuid()) };
        assert_eq!(uids_of(me.pid).unwrap(), (uid, euid));
        let reused = ProcIdentity {
            start_time: me.start_time + 1,
            ..me.clone()
        };
        let e = me.verify_local_peer(&reused).unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity);
        assert!(e.detail().contains("reused"), "{e}");
        let other_host = ProcIdentity {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..me.clone()
        };
        let e = me.verify_local_peer(&other_host).unwrap_err();
        assert!(e.detail().contains("not on this host"), "{e}");
    }
}
