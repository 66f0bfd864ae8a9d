//! Who may hold a place among the connections that have not proved anything
//! yet: a bounded table of pre-authentication (or header-phase) connections
//! with eviction instead of refusal, shared by the agent's data port, the
//! engine's control port and the bootstrap server.
//!
//! Two rules decide which connection makes room for a newcomer:
//!
//! - **per source**: a source holding [`AdmitLimits::per_source`] entries
//!   loses its oldest one, if that one has been waiting at least
//!   [`AdmitLimits::grace`] (a real peer's handshake takes milliseconds; an
//!   idle one holds its place only for the grace). A younger one is kept,
//!   and the newcomer admitted over the source's share while the table has
//!   room, so a burst of real peers from one host (every rank of a
//!   single-host cluster shares the loopback source) is never cut short;
//! - **table full** ([`AdmitLimits::max`]): the oldest entry of the source
//!   holding the most entries is evicted, so a flood from one source evicts
//!   only its own connections while another source's peers keep theirs.
//!
//! A source is the peer's IP address; an IPv6 address counts by its `/64`
//! prefix, which one host usually holds whole. Every loopback address
//! (`127.0.0.0/8`, `::1`, their v4-mapped forms) is one address, since a
//! local process can bind any of them, and loopback peers are told apart by
//! the uid owning the peer's socket, asked of the kernel (`sock_diag`): a
//! local user of another uid floods only its own share, while the ranks of
//! a single-host cluster (one uid) share theirs. A process of the same uid
//! shares the real peers' share (it could ptrace them anyway); what keeps
//! them served then is the eviction of the oldest.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Where a connection comes from, as far as its share of a table goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// Any loopback address: this host; the uid owning the peer's socket
    /// where the kernel said.
    Loopback(Option<u32>),
    /// An IPv4 address.
    V4(u32),
    /// The `/64` prefix of an IPv6 address.
    V6(u64),
}

impl Source {
    /// The source of the peer of an accepted connection (for a loopback
    /// peer, with the uid owning its socket).
    pub fn of_stream(s: &TcpStream) -> Source {
        let Ok(peer) = s.peer_addr() else {
            return Source::Loopback(None);
        };
        match Source::of(&peer) {
            Source::Loopback(_) => Source::Loopback(
                s.local_addr()
                    .ok()
                    .and_then(|local| loopback_peer_uid(&peer, &local)),
            ),
            other => other,
        }
    }

    /// The source of a peer at `addr` (a loopback one without its uid).
    pub fn of(addr: &SocketAddr) -> Source {
        let ip = match addr.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if ip.is_loopback() {
            return Source::Loopback(None);
        }
        match ip {
            IpAddr::V4(v4) => Source::V4(u32::from(v4)),
            IpAddr::V6(v6) => Source::V6((u128::from(v6) >> 64) as u64),
        }
    }
}

/// The uid owning the TCP socket at `peer` connected to `local` on this
/// host, asked of the kernel with one `sock_diag` lookup of that exact
/// socket; `None` when it cannot say.
fn loopback_peer_uid(peer: &SocketAddr, local: &SocketAddr) -> Option<u32> {
    fn v4(a: &SocketAddr) -> Option<[u8; 4]> {
        match a {
            SocketAddr::V4(a) => Some(a.ip().octets()),
            SocketAddr::V6(a) => a.ip().to_ipv4_mapped().map(|v| v.octets()),
        }
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    let family = match (v4(peer), v4(local)) {
        (Some(p), Some(l)) => {
            src[..4].copy_from_slice(&p);
            dst[..4].copy_from_slice(&l);
            libc::AF_INET
        }
        _ => match (peer, local) {
            (SocketAddr::V6(p), SocketAddr::V6(l)) => {
                src = p.ip().octets();
                dst = l.ip().octets();
                libc::AF_INET6
            }
            _ => return None,
        },
    };
    // nlmsghdr (16 bytes), then inet_diag_req_v2 (56 bytes)
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    let mut req = [0u8; 72];
    req[0..4].copy_from_slice(&72u32.to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16] = family as u8;
    req[17] = libc::IPPROTO_TCP as u8;
    req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req[24..26].copy_from_slice(&peer.port().to_be_bytes());
    req[26..28].copy_from_slice(&local.port().to_be_bytes());
    req[28..44].copy_from_slice(&src);
    req[44..60].copy_from_slice(&dst);
    req[64..72].copy_from_slice(&[0xff; 8]); // INET_DIAG_NOCOOKIE
                                             // SAFETY: plain socket creation; the fd is owned by `fd` below.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if raw < 0 {
        return None;
    }
    // SAFETY: raw is a fresh descriptor nothing else owns.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 100_000,
    };
    // SAFETY: tv is a valid timeval of the given size for the call.
    unsafe {
        libc::setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    // SAFETY: an all-zero sockaddr_nl is valid; the family is set below.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: req and kernel are valid for their lengths during the call.
    let sent = unsafe {
        libc::sendto(
            raw,
            req.as_ptr() as *const libc::c_void,
            req.len(),
            0,
            &kernel as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent != req.len() as isize {
        return None;
    }
    let mut buf = [0u8; 1024];
    // SAFETY: buf is valid for writes of its length during the call.
    let n = unsafe { libc::recv(raw, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
    // the answer: nlmsghdr, then inet_diag_msg, whose idiag_uid is at 64
    if n < 84 || u16::from_ne_bytes([buf[4], buf[5]]) != SOCK_DIAG_BY_FAMILY {
        return None;
    }
    Some(u32::from_ne_bytes([buf[80], buf[81], buf[82], buf[83]]))
}

/// Bounds of an [`Admission`] table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmitLimits {
    /// Entries held at most; a newcomer past it evicts the oldest entry of
    /// the source holding the most.
    pub max: usize,
    /// Entries one source holds before its oldest makes room (once that one
    /// has waited [`grace`](Self::grace)).
    pub per_source: usize,
    /// How long an entry is safe from the per-source rule.
    pub grace: Duration,
}

/// Default share of one source in a pre-authentication table.
pub const DEFAULT_PER_SOURCE: usize = 8;
/// Default time an entry is safe from its own source's newcomers.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(1);

struct Entry<T> {
    id: u64,
    source: Source,
    since: Instant,
    item: T,
}

/// A bounded table of waiting connections (`T`: whatever closes or wakes
/// one), oldest first.
pub struct Admission<T> {
    limits: AdmitLimits,
    entries: Vec<Entry<T>>,
}

impl<T> Admission<T> {
    /// An empty table.
    pub fn new(limits: AdmitLimits) -> Admission<T> {
        Admission {
            limits,
            entries: Vec::new(),
        }
    }

    /// New bounds (entries already held stay until they make room).
    pub fn set_limits(&mut self, limits: AdmitLimits) {
        self.limits = limits;
    }

    /// Removes the oldest entry.
    pub fn take_oldest(&mut self) -> Option<T> {
        (!self.entries.is_empty()).then(|| self.entries.remove(0).item)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries held for `source`.
    pub fn count(&self, source: Source) -> usize {
        self.entries.iter().filter(|e| e.source == source).count()
    }

    /// Makes room for a newcomer from `source` by the two rules; returns
    /// the evicted entries' items, for the caller to close.
    pub fn make_room(&mut self, source: Source, now: Instant) -> Vec<T> {
        let mut out = Vec::new();
        let per = self.limits.per_source.max(1);
        if self.count(source) >= per {
            if let Some(i) = self.entries.iter().position(|e| e.source == source) {
                if now.saturating_duration_since(self.entries[i].since) >= self.limits.grace {
                    out.push(self.entries.remove(i).item);
                }
            }
        }
        while self.entries.len() >= self.limits.max.max(1) {
            match self.evict_one() {
                Some(x) => out.push(x),
                None => break,
            }
        }
        out
    }

    /// Evicts the oldest entry of the source holding the most (among equal
    /// counts, the source with the oldest entry).
    pub fn evict_one(&mut self) -> Option<T> {
        let mut best: Option<(usize, usize)> = None; // (count, index of its oldest)
        for (i, e) in self.entries.iter().enumerate() {
            if self.entries[..i].iter().any(|o| o.source == e.source) {
                continue; // not this source's oldest
            }
            let n = self.count(e.source);
            if best.is_none_or(|(m, _)| n > m) {
                best = Some((n, i));
            }
        }
        best.map(|(_, i)| self.entries.remove(i).item)
    }

    /// Holds `item` for `id`, a connection from `source` waiting since
    /// `since` (call [`make_room`](Self::make_room) first).
    pub fn insert(&mut self, id: u64, source: Source, since: Instant, item: T) {
        let at = self.entries.partition_point(|e| e.since <= since);
        self.entries.insert(
            at,
            Entry {
                id,
                source,
                since,
                item,
            },
        );
    }

    /// Removes `id`'s entry (it proved itself, or it ended).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        Some(self.entries.remove(i).item)
    }

    /// Removes the entries `take` picks (given their id, item and start),
    /// oldest first, and returns them.
    pub fn take_if(&mut self, mut take: impl FnMut(u64, &mut T, Instant) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.entries.len() {
            let e = &mut self.entries[i];
            if take(e.id, &mut e.item, e.since) {
                out.push(self.entries.remove(i).item);
            } else {
                i += 1;
            }
        }
        out
    }

    /// The items, oldest first.
    pub fn items_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries.iter_mut().map(|e| &mut e.item)
    }

    /// When the oldest entry started waiting.
    pub fn oldest_since(&self) -> Option<Instant> {
        self.entries.first().map(|e| e.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_is_one_source_and_v6_counts_by_prefix() {
        let lo = Source::Loopback(None);
        assert_eq!(Source::of(&addr("127.0.0.1:1")), lo);
        assert_eq!(Source::of(&addr("127.0.3.9:1")), lo);
        assert_eq!(Source::of(&addr("[::1]:1")), lo);
        assert_eq!(Source::of(&addr("[::ffff:127.0.0.2]:1")), lo);
        assert_eq!(
            Source::of(&addr("[::ffff:10.0.0.2]:1")),
            Source::of(&addr("10.0.0.2:9"))
        );
        assert_ne!(
            Source::of(&addr("10.0.0.2:1")),
            Source::of(&addr("10.0.0.3:1"))
        );
        assert_eq!(
            Source::of(&addr("[2001:db8::1]:1")),
            Source::of(&addr("[2001:db8::ffff:2]:1"))
        );
        assert_ne!(
            Source::of(&addr("[2001:db8::1]:1")),
            Source::of(&addr("[2001:db8:0:1::1]:1"))
        );
    }

    /// The kernel names the uid of a loopback peer's socket.
    #[test]
    fn a_loopback_peer_is_known_by_its_uid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        // SAFETY: getuid has no preconditions.
        let me = unsafe { libc::getuid() };
        assert_eq!(Source::of_stream(&s), Source::Loopback(Some(me)));
        drop(c);
    }

    #[test]
    fn a_full_table_evicts_the_largest_sources_oldest() {
        let limits = AdmitLimits {
            max: 4,
            per_source: 100,
            grace: Duration::from_secs(1),
        };
        let mut t = Admission::new(limits);
        let (a, b) = (Source::V4(1), Source::V4(2));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        t.insert(0, b, at(0), "b0");
        for i in 1..4 {
            assert!(t.make_room(a, at(i)).is_empty());
            t.insert(i, a, at(i), "a");
        }
        // full: a holds three, so a's oldest goes, not b's older one
        assert_eq!(t.make_room(b, at(10)), vec!["a"]);
        t.insert(10, b, at(10), "b1");
        assert_eq!(t.count(a), 2);
        assert_eq!(t.count(b), 2);
        // equal counts: the source whose oldest is older (b)
        assert_eq!(t.make_room(a, at(11)), vec!["b0"]);
        assert_eq!(t.remove(10), Some("b1"));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn a_source_over_its_share_loses_only_entries_past_the_grace() {
        let limits = AdmitLimits {
            max: 100,
            per_source: 2,
            grace: Duration::from_millis(500),
        };
        let mut t = Admission::new(limits);
        let s = Source::Loopback(Some(0));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        t.insert(0, s, at(0), 0);
        t.insert(1, s, at(100), 1);
        // a burst: nothing is old enough, the newcomer is admitted over its share
        assert!(t.make_room(s, at(200)).is_empty());
        t.insert(2, s, at(200), 2);
        // later the oldest has waited past the grace and makes room
        assert_eq!(t.make_room(s, at(600)), vec![0]);
        // another source is not touched by s's share
        assert!(t.make_room(Source::V4(7), at(2000)).is_empty());
        let mut n = 0;
        let taken = t.take_if(|_, _, since| {
            n += 1;
            since < at(150)
        });
        assert_eq!((taken, n), (vec![1], 2));
        assert_eq!(t.oldest_since(), Some(at(200)));
    }
}
