//! The IPv4 prefix length of a RoCE port's address, read from its net device
//! (`getifaddrs(3)`): what a rail's handshake carries so the peer can compute
//! the rail's IPv4 network and pair rails by subnet (`pairing`).

use std::ffi::CStr;
use std::net::Ipv4Addr;

/// The prefix length of `addr` on net device `netdev` (1..=32), or `None` when
/// the device is not visible here (another network namespace), does not hold
/// the address, or `getifaddrs` fails.
pub fn ipv4_prefix_len(netdev: &str, addr: Ipv4Addr) -> Option<u8> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we own and free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        if name.to_bytes() != netdev.as_bytes() {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the list.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address and its netmask are sockaddr_in.
        let (a, m) = unsafe {
            (
                (*(ifa.ifa_addr as *const libc::sockaddr_in))
                    .sin_addr
                    .s_addr,
                (*(ifa.ifa_netmask as *const libc::sockaddr_in))
                    .sin_addr
                    .s_addr,
            )
        };
        if Ipv4Addr::from(u32::from_be(a)) == addr {
            let len = u32::from_be(m).leading_ones();
            found = u8::try_from(len).ok().filter(|l| (1..=32).contains(l));
            break;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_a_slash_8_and_unknown_devices_are_none() {
        // Every Linux network namespace has `lo` with 127.0.0.1/8.
        assert_eq!(ipv4_prefix_len("lo", Ipv4Addr::LOCALHOST), Some(8));
        assert_eq!(ipv4_prefix_len("lo", Ipv4Addr::new(10, 9, 8, 7)), None);
        assert_eq!(
            ipv4_prefix_len("pdxfer-no-such-dev", Ipv4Addr::LOCALHOST),
            None
        );
    }
}
