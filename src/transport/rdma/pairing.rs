//! Which local rail connects to which rail of the peer: rails are paired by
//! the subnet their GIDs are on, never by position, so a rail on a network
//! that does not join the two hosts (a storage or management port, a second
//! fabric) is left out instead of failing with RETRY_EXC seconds later.
//!
//! A rail's [`Subnet`]: on InfiniBand the GID's subnet prefix (its upper 64
//! bits); on RoCE v2 over IPv4 (an IPv4-mapped GID) the IPv4 network of the
//! address with the prefix length the peer sent in its handshake; on RoCE
//! over IPv6 the GID's /64. An IPv4 GID whose prefix length is not known
//! (0) has no known subnet.
//!
//! [`pair_rails`] is pure. Each RC queue pair connects to exactly one peer
//! QP, so the result is a one-to-one matching: every local rail takes the
//! first free peer rail on its subnet (so two local rails never pile on one
//! peer rail while another on that subnet is free), then rails of unknown
//! subnet take any free rail of the same link layer. Both ends must compute
//! the same matching from swapped inputs, so it is always computed from the
//! side that [`leads`] and flipped on the other. Rails left without a
//! partner are reported; no pair at all is a [`HandshakeField::Subnet`]
//! error naming both sides' rails and subnets. When either side asks for it
//! ([`Handshake::pair_by_index`]: a fabric routed between subnets), rail `i`
//! pairs with the peer's rail `i` instead.

use super::handshake::{
    negotiate, Handshake, HandshakeError, HandshakeField, LinkLayer, Negotiated, RailInfo,
};
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The network a rail's GID is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subnet {
    /// InfiniBand: the GID's subnet prefix (upper 64 bits).
    Ib(u64),
    /// RoCE v2 over IPv4: the network address and its prefix length.
    Ipv4 {
        /// The address with the host bits cleared.
        network: Ipv4Addr,
        /// The prefix length (1..=32).
        prefix_len: u8,
    },
    /// RoCE over IPv6: the GID's /64.
    Ipv6(u64),
    /// An IPv4-mapped GID whose prefix length is not known.
    UnknownIpv4(Ipv4Addr),
}

impl Subnet {
    /// The subnet of `rail`, from its GID, link layer and IPv4 prefix length.
    pub fn of(rail: &RailInfo) -> Subnet {
        let g = rail.gid.0;
        let upper = u64::from_be_bytes(g[..8].try_into().unwrap_or([0; 8]));
        match rail.link_layer {
            LinkLayer::InfiniBand => Subnet::Ib(upper),
            LinkLayer::Ethernet if rail.gid.is_ipv4_mapped() => {
                let addr = Ipv4Addr::new(g[12], g[13], g[14], g[15]);
                match rail.prefix_len {
                    1..=32 => {
                        let mask = u32::MAX << (32 - u32::from(rail.prefix_len));
                        Subnet::Ipv4 {
                            network: Ipv4Addr::from(u32::from(addr) & mask),
                            prefix_len: rail.prefix_len,
                        }
                    }
                    _ => Subnet::UnknownIpv4(addr),
                }
            }
            LinkLayer::Ethernet => Subnet::Ipv6(upper),
        }
    }

    /// Whether the subnet is known (two rails can be compared by it).
    pub fn is_known(&self) -> bool {
        !matches!(self, Subnet::UnknownIpv4(_))
    }

    fn link_layer(&self) -> LinkLayer {
        match self {
            Subnet::Ib(_) => LinkLayer::InfiniBand,
            _ => LinkLayer::Ethernet,
        }
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v6 = |p: u64| Ipv6Addr::from(u128::from(p) << 64);
        match self {
            Subnet::Ib(p) => write!(f, "IB subnet {}/64", v6(*p)),
            Subnet::Ipv4 {
                network,
                prefix_len,
            } => write!(f, "{network}/{prefix_len}"),
            Subnet::Ipv6(p) => write!(f, "{}/64", v6(*p)),
            Subnet::UnknownIpv4(a) => write!(f, "{a} (prefix length unknown)"),
        }
    }
}

/// One connected pair: rail `local` of this side with rail `remote` of the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RailPair {
    /// Index into this side's rails.
    pub local: usize,
    /// Index into the peer's rails.
    pub remote: usize,
}

/// The outcome of pairing: the pairs, in local rail order, and the rails of
/// each side left without a partner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailPairing {
    /// The pairs, sorted by local rail.
    pub pairs: Vec<RailPair>,
    /// Local rails with no peer rail on their subnet.
    pub unpaired_local: Vec<usize>,
    /// Peer rails with no local rail on their subnet.
    pub unpaired_remote: Vec<usize>,
}

/// Whether `a` computes the matching for both ends: the side with the smaller
/// (instance id, QP numbers); two identical handshakes give the same result
/// either way.
pub fn leads(a: &Handshake, b: &Handshake) -> bool {
    let key = |h: &Handshake| {
        (
            h.instance_id,
            h.rails.iter().map(|r| r.qpn).collect::<Vec<_>>(),
        )
    };
    key(a) <= key(b)
}

/// The matching computed from the leading side `a`: `(a index, b index)` pairs.
fn match_from(a: &[Subnet], b: &[Subnet]) -> Vec<(usize, usize)> {
    let mut taken = vec![false; b.len()];
    let mut paired = vec![false; a.len()];
    let mut out = Vec::new();
    // Known subnets first: each rail takes the first free peer rail on its subnet.
    for (i, sa) in a.iter().enumerate().filter(|(_, s)| s.is_known()) {
        if let Some(j) = (0..b.len()).find(|j| !taken[*j] && b[*j] == *sa) {
            taken[j] = true;
            paired[i] = true;
            out.push((i, j));
        }
    }
    // Then a rail of unknown subnet (either side) takes any free rail of its link layer.
    for (i, sa) in a.iter().enumerate() {
        if paired[i] {
            continue;
        }
        let fits = |j: usize| {
            !taken[j]
                && b[j].link_layer() == sa.link_layer()
                && (!sa.is_known() || !b[j].is_known())
        };
        if let Some(j) = (0..b.len()).find(|j| fits(*j)) {
            taken[j] = true;
            out.push((i, j));
        }
    }
    out
}

/// Pairs this side's rails with the peer's by subnet (see the module doc).
/// No pair at all is a [`HandshakeField::Subnet`] error naming every rail of
/// both sides with its subnet.
pub fn pair_rails(local: &Handshake, remote: &Handshake) -> Result<RailPairing, HandshakeError> {
    let ls: Vec<Subnet> = local.rails.iter().map(Subnet::of).collect();
    let rs: Vec<Subnet> = remote.rails.iter().map(Subnet::of).collect();
    let mut pairs: Vec<RailPair> = if local.pair_by_index || remote.pair_by_index {
        (0..ls.len().min(rs.len()))
            .map(|i| RailPair {
                local: i,
                remote: i,
            })
            .collect()
    } else if leads(local, remote) {
        match_from(&ls, &rs)
            .into_iter()
            .map(|(l, r)| RailPair {
                local: l,
                remote: r,
            })
            .collect()
    } else {
        match_from(&rs, &ls)
            .into_iter()
            .map(|(r, l)| RailPair {
                local: l,
                remote: r,
            })
            .collect()
    };
    if pairs.is_empty() {
        let lls = |s: &[Subnet]| {
            let mut v: Vec<LinkLayer> = Vec::new();
            for l in s.iter().map(Subnet::link_layer) {
                if !v.contains(&l) {
                    v.push(l);
                }
            }
            v
        };
        let (ll, rl) = (lls(&ls), lls(&rs));
        if !ll.iter().any(|l| rl.contains(l)) {
            let names = |v: &[LinkLayer]| {
                v.iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join("+")
            };
            return Err(HandshakeError::new(
                HandshakeField::LinkLayer,
                format!(
                    "link layers differ (local {}, remote {}): an InfiniBand port cannot talk to a RoCE port; pick NICs on the same fabric (local rails {}; remote rails {})",
                    names(&ll),
                    names(&rl),
                    describe(&local.rails, &ls),
                    describe(&remote.rails, &rs)
                ),
            ));
        }
        return Err(HandshakeError::new(
            HandshakeField::Subnet,
            format!(
                "no rail of this side shares a subnet with a rail of the peer: local rails {}; remote rails {}. Connect both hosts' NICs to a common network, choose the rails that reach the peer with PDXFER_RDMA_DEVICES, or on a fabric routed between subnets set PDXFER_RDMA_PAIRING=index",
                describe(&local.rails, &ls),
                describe(&remote.rails, &rs)
            ),
        ));
    }
    pairs.sort_by_key(|p| p.local);
    let unpaired_local = (0..ls.len())
        .filter(|i| !pairs.iter().any(|p| p.local == *i))
        .collect();
    let unpaired_remote = (0..rs.len())
        .filter(|j| !pairs.iter().any(|p| p.remote == *j))
        .collect();
    Ok(RailPairing {
        pairs,
        unpaired_local,
        unpaired_remote,
    })
}

/// `mlx5_0 port 1 (10.0.1.0/24), mlx5_1 port 1 (10.0.2.0/24)`.
fn describe(rails: &[RailInfo], subnets: &[Subnet]) -> String {
    if rails.is_empty() {
        return "none".into();
    }
    rails
        .iter()
        .zip(subnets)
        .map(|(r, s)| format!("{} port {} ({s})", r.device, r.port))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A pair of rails and the attributes negotiated for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairedRail {
    /// Which rails.
    pub pair: RailPair,
    /// The attributes the local QP is brought up with.
    pub negotiated: Negotiated,
}

/// Pairs the rails by subnet ([`pair_rails`]), logs a warning naming every
/// rail left out on either side, and negotiates each pair; an error names the
/// pair that cannot be negotiated.
pub fn negotiate_paired(
    local: &Handshake,
    remote: &Handshake,
) -> Result<Vec<PairedRail>, HandshakeError> {
    let pairing = pair_rails(local, remote)?;
    for (side, rails, left) in [
        ("local", &local.rails, &pairing.unpaired_local),
        ("peer", &remote.rails, &pairing.unpaired_remote),
    ] {
        for i in left {
            let r = &rails[*i];
            log::warn!(
                "rdma: {side} rail {i} ({} port {}, {}) has no rail on its subnet at the other end: left out of this connection",
                r.device,
                r.port,
                Subnet::of(r)
            );
        }
    }
    pairing
        .pairs
        .into_iter()
        .map(|p| {
            let n = negotiate(&local.rails[p.local], &remote.rails[p.remote]).map_err(|e| {
                HandshakeError::new(
                    e.field,
                    format!("rail {} <-> peer rail {}: {}", p.local, p.remote, e.detail),
                )
            })?;
            Ok(PairedRail {
                pair: p,
                negotiated: n,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::handshake::{Gid, Mtu};

    fn v4(a: [u8; 4]) -> Gid {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        Gid(g)
    }

    fn ib(prefix: u64, guid: u64) -> Gid {
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(&prefix.to_be_bytes());
        g[8..].copy_from_slice(&guid.to_be_bytes());
        Gid(g)
    }

    fn rail(name: &str, ll: LinkLayer, gid: Gid, prefix_len: u8, qpn: u32) -> RailInfo {
        RailInfo {
            device: name.into(),
            port: 1,
            link_layer: ll,
            qpn,
            lid: if ll == LinkLayer::InfiniBand { 3 } else { 0 },
            gid,
            gid_index: 3,
            prefix_len,
            psn: 1,
            mtu: Mtu::Mtu4096,
            regions: Vec::new(),
        }
    }

    fn roce(name: &str, a: [u8; 4], len: u8) -> RailInfo {
        rail(name, LinkLayer::Ethernet, v4(a), len, 0x10)
    }

    fn hs(id: u64, rails: Vec<RailInfo>) -> Handshake {
        Handshake {
            instance_id: id,
            rails,
            pair_by_index: false,
        }
    }

    fn pairs(p: &RailPairing) -> Vec<(usize, usize)> {
        p.pairs.iter().map(|p| (p.local, p.remote)).collect()
    }

    /// Pairs from both ends and checks they agree (a's pair (l, r) is b's (r, l)).
    fn both(a: &Handshake, b: &Handshake) -> Result<RailPairing, HandshakeError> {
        let pa = pair_rails(a, b);
        let pb = pair_rails(b, a);
        match (&pa, &pb) {
            (Ok(x), Ok(y)) => {
                let mut flipped: Vec<(usize, usize)> =
                    pairs(y).into_iter().map(|(l, r)| (r, l)).collect();
                flipped.sort();
                assert_eq!(pairs(x), flipped, "both ends agree on the pairs");
                assert_eq!(x.unpaired_local, y.unpaired_remote);
            }
            (Err(x), Err(y)) => assert_eq!(x.field, y.field),
            _ => panic!("one end paired, the other did not: {pa:?} / {pb:?}"),
        }
        pa
    }

    #[test]
    fn subnets_from_ib_prefix_ipv4_network_and_ipv6_64() {
        let r = rail("ib0", LinkLayer::InfiniBand, ib(0xfe80 << 48, 7), 0, 1);
        assert_eq!(Subnet::of(&r), Subnet::Ib(0xfe80 << 48));
        assert_eq!(Subnet::of(&r).to_string(), "IB subnet fe80::/64");
        let r = roce("e0", [10, 0, 1, 17], 24);
        assert_eq!(
            Subnet::of(&r),
            Subnet::Ipv4 {
                network: Ipv4Addr::new(10, 0, 1, 0),
                prefix_len: 24
            }
        );
        assert_eq!(Subnet::of(&r).to_string(), "10.0.1.0/24");
        assert_eq!(
            Subnet::of(&roce("e", [10, 0, 1, 17], 32)).to_string(),
            "10.0.1.17/32"
        );
        assert_eq!(
            Subnet::of(&roce("e", [10, 9, 1, 17], 1)).to_string(),
            "0.0.0.0/1"
        );
        let r = roce("e0", [10, 0, 1, 17], 0);
        assert!(!Subnet::of(&r).is_known());
        let g6 = Gid::parse("fd00:0000:0000:0007:0202:c9ff:fe00:0001").unwrap();
        let r = rail("e6", LinkLayer::Ethernet, g6, 0, 1);
        assert_eq!(Subnet::of(&r), Subnet::Ipv6(0xfd00_0000_0000_0007));
        assert_eq!(Subnet::of(&r).to_string(), "fd00:0:0:7::/64");
    }

    #[test]
    fn same_subnet_pairs_and_different_subnets_do_not() {
        let a = hs(1, vec![roce("a0", [10, 0, 1, 1], 24)]);
        let b = hs(2, vec![roce("b0", [10, 0, 1, 2], 24)]);
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 0)]);
        assert!(p.unpaired_local.is_empty() && p.unpaired_remote.is_empty());

        let c = hs(2, vec![roce("c0", [10, 0, 2, 2], 24)]);
        let e = both(&a, &c).unwrap_err();
        assert_eq!(e.field, HandshakeField::Subnet);
        // Both ends' rails and subnets are named.
        assert!(e.detail.contains("a0 port 1 (10.0.1.0/24)"), "{e}");
        assert!(e.detail.contains("c0 port 1 (10.0.2.0/24)"), "{e}");
        assert!(e.detail.contains("PDXFER_RDMA_DEVICES"), "{e}");
        assert!(e.detail.contains("PDXFER_RDMA_PAIRING=index"), "{e}");
        // The same address bits under different prefix lengths are different networks.
        let d = hs(2, vec![roce("d0", [10, 0, 1, 2], 16)]);
        assert_eq!(both(&a, &d).unwrap_err().field, HandshakeField::Subnet);
    }

    #[test]
    fn crossed_2x2_pairs_by_subnet_not_by_index() {
        let a = hs(
            5,
            vec![roce("a0", [10, 0, 1, 1], 24), roce("a1", [10, 0, 2, 1], 24)],
        );
        let b = hs(
            9,
            vec![roce("b0", [10, 0, 2, 2], 24), roce("b1", [10, 0, 1, 2], 24)],
        );
        assert_eq!(pairs(&both(&a, &b).unwrap()), [(0, 1), (1, 0)]);
        assert_eq!(pairs(&both(&b, &a).unwrap()), [(0, 1), (1, 0)]);
    }

    #[test]
    fn two_against_one_leaves_the_extra_rail_out() {
        let a = hs(
            1,
            vec![roce("a0", [10, 0, 1, 1], 24), roce("a1", [10, 0, 1, 3], 24)],
        );
        let b = hs(2, vec![roce("b0", [10, 0, 1, 2], 24)]);
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 0)]);
        assert_eq!(p.unpaired_local, [1]);
        assert!(p.unpaired_remote.is_empty());
        // From the other end (which may or may not lead) the same pair.
        let p = both(&b, &a).unwrap();
        assert_eq!(pairs(&p), [(0, 0)]);
        assert_eq!(p.unpaired_remote, [1]);
    }

    #[test]
    fn several_rails_on_one_subnet_spread_over_the_peer_rails() {
        // Four local rails, two peer rails on the shared subnet and one elsewhere:
        // each peer rail on the subnet is taken once, never twice.
        let a = hs(
            1,
            vec![
                roce("a0", [10, 0, 1, 1], 24),
                roce("a1", [10, 0, 1, 3], 24),
                roce("a2", [10, 0, 1, 5], 24),
                roce("a3", [192, 168, 0, 1], 24),
            ],
        );
        let b = hs(
            2,
            vec![
                roce("b0", [172, 16, 0, 1], 16),
                roce("b1", [10, 0, 1, 2], 24),
                roce("b2", [10, 0, 1, 4], 24),
            ],
        );
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 1), (1, 2)]);
        assert_eq!(p.unpaired_local, [2, 3]);
        assert_eq!(p.unpaired_remote, [0]);
    }

    #[test]
    fn none_matching_names_every_rail() {
        let a = hs(
            1,
            vec![roce("a0", [10, 0, 1, 1], 24), roce("a1", [10, 0, 2, 1], 24)],
        );
        let b = hs(
            2,
            vec![roce("b0", [10, 1, 1, 2], 24), roce("b1", [10, 1, 2, 2], 24)],
        );
        let e = both(&a, &b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Subnet);
        for name in [
            "a0 port 1 (10.0.1.0/24)",
            "a1 port 1 (10.0.2.0/24)",
            "b0 port 1 (10.1.1.0/24)",
            "b1 port 1 (10.1.2.0/24)",
        ] {
            assert!(e.detail.contains(name), "{name}: {e}");
        }
        let err: crate::error::Error = e.into();
        assert_eq!(err.status(), crate::error::Status::RdmaHandshake);
        assert!(err.detail().contains("field `subnet`"), "{err}");
    }

    #[test]
    fn ib_prefix_never_pairs_with_roce() {
        let prefix = 0x0000_0000_0000_0000u64;
        // An IB rail whose prefix is 0 and a RoCE IPv6 rail whose /64 is 0.
        let a = hs(
            1,
            vec![
                rail("ib0", LinkLayer::InfiniBand, ib(prefix, 1), 0, 1),
                rail("ib1", LinkLayer::InfiniBand, ib(0xfe80 << 48, 2), 0, 2),
            ],
        );
        let b = hs(
            2,
            vec![rail("e0", LinkLayer::Ethernet, ib(prefix, 9), 0, 3)],
        );
        let e = both(&a, &b).unwrap_err();
        assert_eq!(e.field, HandshakeField::LinkLayer);
        assert!(
            e.detail.contains("local InfiniBand, remote Ethernet"),
            "{e}"
        );
        // A RoCE rail among them pairs with the RoCE peer rail, the IB ones stay out.
        let mut a2 = a.clone();
        a2.rails
            .push(rail("e1", LinkLayer::Ethernet, ib(prefix, 5), 0, 9));
        let p = both(&a2, &b).unwrap();
        assert_eq!(pairs(&p), [(2, 0)]);
        assert_eq!(p.unpaired_local, [0, 1]);
        // IB rails pair by subnet prefix: ib1 with the peer's fe80 rail.
        let c = hs(
            2,
            vec![
                rail("ib7", LinkLayer::InfiniBand, ib(0xfe80 << 48, 9), 0, 4),
                rail("ib8", LinkLayer::InfiniBand, ib(0xfec0 << 48, 9), 0, 5),
            ],
        );
        let p = both(&a, &c).unwrap();
        assert_eq!(pairs(&p), [(1, 0)]);
        assert_eq!(p.unpaired_local, [0]);
        assert_eq!(p.unpaired_remote, [1]);
    }

    #[test]
    fn unknown_prefix_lengths_pair_in_order_with_what_is_left() {
        // A RoCE rail whose prefix length could not be read pairs with a free
        // rail of the same link layer once the known subnets are matched.
        let a = hs(
            1,
            vec![roce("a0", [10, 0, 2, 1], 24), roce("a1", [10, 0, 9, 1], 0)],
        );
        let b = hs(
            2,
            vec![roce("b0", [10, 0, 3, 2], 24), roce("b1", [10, 0, 2, 2], 24)],
        );
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 1), (1, 0)]);
        // Every rail unknown on both ends: pairs in order.
        let u = |n: &str, x: u8| roce(n, [10, 0, 0, x], 0);
        let a = hs(7, vec![u("a0", 1), u("a1", 3)]);
        let b = hs(3, vec![u("b0", 2), u("b1", 4), u("b2", 6)]);
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 0), (1, 1)]);
        assert_eq!(p.unpaired_remote, [2]);
    }

    #[test]
    fn either_end_asking_for_index_pairing_pairs_by_index() {
        // A routed fabric: every rail on its own /31, no subnet in common.
        let a = hs(
            1,
            vec![roce("a0", [10, 0, 0, 0], 31), roce("a1", [10, 0, 0, 2], 31)],
        );
        let mut b = hs(
            2,
            vec![roce("b0", [10, 0, 1, 0], 31), roce("b1", [10, 0, 1, 2], 31)],
        );
        assert_eq!(both(&a, &b).unwrap_err().field, HandshakeField::Subnet);
        b.pair_by_index = true;
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 0), (1, 1)]);
        b.rails.pop();
        let p = both(&a, &b).unwrap();
        assert_eq!(pairs(&p), [(0, 0)]);
        assert_eq!(p.unpaired_local, [1]);
    }

    #[test]
    fn negotiate_paired_names_the_pair_that_fails() {
        let mut bad = roce("b1", [10, 0, 1, 2], 24);
        bad.gid_index = 5;
        bad.qpn = 0;
        let a = hs(
            1,
            vec![roce("a0", [10, 0, 2, 1], 24), roce("a1", [10, 0, 1, 1], 24)],
        );
        let b = hs(2, vec![roce("b0", [10, 0, 2, 2], 24), bad]);
        let e = negotiate_paired(&a, &b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Qpn);
        assert!(e.detail.starts_with("rail 1 <-> peer rail 1:"), "{e}");
        let ok = hs(
            2,
            vec![roce("b0", [10, 0, 1, 2], 24), roce("b1", [10, 0, 2, 2], 24)],
        );
        let n = negotiate_paired(&a, &ok).unwrap();
        assert_eq!(n.len(), 2);
        assert_eq!((n[0].pair.local, n[0].pair.remote), (0, 1));
        assert_eq!(n[0].negotiated.dgid, ok.rails[1].gid);
        assert_eq!(n[1].negotiated.dgid, ok.rails[0].gid);
    }
}
