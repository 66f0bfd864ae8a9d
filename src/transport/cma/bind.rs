//! The kernel's word for which process a cma sender writes into.
//!
//! The receiver of a same-host control connection listens, for that session
//! only, on a Unix-domain socket in the abstract namespace whose name it
//! advertises in its HelloAck. The sender connects to it and takes the
//! target's pid and uid from `SO_PEERCRED` of that connection (the process
//! that listens on it, vouched for by the kernel) and a pidfd from
//! `SO_PEERPIDFD` (else `pidfd_open` of that pid, re-checked once the receiver
//! answered on the socket), never from a message. A HelloAck naming another
//! process than the one at the end of the socket is refused by name; no
//! claimed process is ever read or written.

use crate::error::{Error, Result, Status};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// `SO_PEERPIDFD` (Linux 6.5+; the generic socket option number).
const SO_PEERPIDFD: libc::c_int = 77;

/// The byte the receiver writes on an accepted binding connection.
const BOUND: u8 = 0xb1;

/// The receiver's end: a per-session listener in the abstract namespace.
pub(crate) struct BindListener {
    l: UnixListener,
    name: String,
}

impl BindListener {
    /// Binds a fresh, unguessable abstract name.
    pub(crate) fn new() -> Result<BindListener> {
        let name = format!(
            "pdxfer-cma-{}-{}",
            std::process::id(),
            crate::transport::handshake::random_token()?
        );
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let l = UnixListener::bind_addr(&addr)?;
        l.set_nonblocking(true)?;
        Ok(BindListener { l, name })
    }

    /// The name the HelloAck advertises.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Waits up to `timeout` for the sender's binding connection and
    /// answers it (so the sender knows this process is still the one at
    /// the end of the socket).
    pub(crate) fn accept(&self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            match self.l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_write_timeout(Some(timeout))?;
                    s.write_all(&[BOUND])?;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if t0.elapsed() >= timeout {
                        return Err(Error::new(
                            Status::PeerIdentity,
                            format!(
                                "cma selected, but the sender did not connect to this session's \
                                 binding socket within {timeout:?}: the kernel cannot vouch for \
                                 the process it would write into; use tcp"
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The sender's end: the receiver process as the kernel names it.
pub(crate) struct Vouched {
    /// Pid of the process listening on the binding socket.
    pub(crate) pid: u32,
    /// Its effective uid.
    pub(crate) uid: u32,
    /// A pidfd for it (`None` only on kernels without pidfds).
    pub(crate) pidfd: Option<OwnedFd>,
    /// The binding connection (the receiver's answer is read from it).
    s: UnixStream,
    /// The process's start time as read right after `pidfd_open`, for the
    /// re-check (only when the pidfd did not come from `SO_PEERPIDFD`).
    recheck: Option<u64>,
}

impl Vouched {
    /// Connects to the abstract socket `name` the peer at `addr` advertised
    /// and reads the listening process's credentials.
    pub(crate) fn connect(name: &str, addr: &str, timeout: Duration) -> Result<Vouched> {
        let ctx = |what: &str, e: std::io::Error| {
            Error::new(
                Status::PeerIdentity,
                format!(
                    "cma binding socket {name:?} advertised by the peer at {addr}: {what}: {e} \
                     (the peer is not on this host, in this network namespace, or not the \
                     process it names); use tcp"
                ),
            )
        };
        let sa = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| ctx("bad name", e))?;
        let s = UnixStream::connect_addr(&sa).map_err(|e| ctx("connect", e))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| ctx("timeout", e))?;
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: cred/len are a valid out-buffer of the option's size.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut cred as *mut libc::ucred as *mut libc::c_void,
                &mut len,
            )
        };
        if r != 0 || cred.pid <= 0 {
            return Err(ctx("SO_PEERCRED", std::io::Error::last_os_error()));
        }
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: fd/len are a valid out-buffer of the option's size.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                &mut fd as *mut libc::c_int as *mut libc::c_void,
                &mut len,
            )
        };
        let (pidfd, recheck) = if r == 0 && fd >= 0 {
            // SAFETY: the kernel handed us a fresh pidfd we own.
            (Some(unsafe { OwnedFd::from_raw_fd(fd) }), None)
        } else {
            // No SO_PEERPIDFD: pidfd_open the vouched pid, re-checked once
            // the receiver answered (its socket end still open then).
            // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) };
            let pidfd = (fd >= 0).then(|| {
                // SAFETY: fd is a fresh descriptor we own.
                unsafe { OwnedFd::from_raw_fd(fd as i32) }
            });
            let st = crate::transport::identity::start_time_of(cred.pid as u32).ok();
            (pidfd, st)
        };
        Ok(Vouched {
            pid: cred.pid as u32,
            uid: cred.uid,
            pidfd,
            s,
            recheck,
        })
    }

    /// Reads the receiver's answer on the binding socket (sent once it
    /// accepted the cma selection) and re-checks that the vouched pid still
    /// names the process the pidfd was opened for.
    pub(crate) fn confirm(&mut self, addr: &str) -> Result<()> {
        let mut b = [0u8; 1];
        self.s.read_exact(&mut b).map_err(|e| {
            Error::new(
                Status::PeerIdentity,
                format!(
                    "the peer at {addr} (pid {}) did not answer on its cma binding socket: {e}",
                    self.pid
                ),
            )
        })?;
        if b[0] != BOUND {
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "unexpected byte {:#x} on the cma binding socket of {addr}",
                    b[0]
                ),
            ));
        }
        if let Some(st) = self.recheck {
            let now = crate::transport::identity::start_time_of(self.pid)?;
            if now != st {
                return Err(Error::new(
                    Status::PeerIdentity,
                    format!(
                        "pid {} of the peer at {addr} was reused while binding (start tick {now} != {st})",
                        self.pid
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_names_the_listening_process() {
        let l = BindListener::new().unwrap();
        let mut v = Vouched::connect(l.name(), "test", Duration::from_secs(5)).unwrap();
        assert_eq!(v.pid, std::process::id());
        // SAFETY: geteuid has no preconditions.
        assert_eq!(v.uid, unsafe { libc::geteuid() });
        l.accept(Duration::from_secs(5)).unwrap();
        v.confirm("test").unwrap();
        // No sender: the receiver refuses by name.
        let l2 = BindListener::new().unwrap();
        let e = l2.accept(Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity, "{e}");
        // A name nobody listens on.
        let e = Vouched::connect("pdxfer-cma-nobody", "test", Duration::from_secs(1))
            .err()
            .unwrap();
        assert_eq!(e.status(), Status::PeerIdentity, "{e}");
        assert!(e.detail().contains("pdxfer-cma-nobody"), "{e}");
    }
}
