//! The RC queue-pair state machine RESET -> INIT -> RTR -> RTS as pure data.
//!
//! [`init_attrs`], [`rtr_attrs`] and [`rts_attrs`] compute each transition's
//! attributes and the `ibv_qp_attr_mask` bits they set from the negotiated
//! handshake, so they are unit-tested without a NIC; the verbs layer copies them
//! into `ibv_qp_attr` and calls `ibv_modify_qp`. [`QpAttrs::describe`] is what a
//! failed transition reports, so the error shows every value that was tried.

use super::handshake::{Gid, Mtu, Negotiated};
use serde::Serialize;

/// `IBV_ACCESS_LOCAL_WRITE`.
pub(crate) const ACCESS_LOCAL_WRITE: u32 = 1;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub(crate) const ACCESS_REMOTE_WRITE: u32 = 2;
/// `IBV_ACCESS_REMOTE_READ`.
pub(crate) const ACCESS_REMOTE_READ: u32 = 4;
/// `IBV_ACCESS_RELAXED_ORDERING` (memory regions only, never a QP's access).
#[allow(dead_code)]
pub(crate) const ACCESS_RELAXED_ORDERING: u32 = 1 << 20;

/// `ibv_qp_attr_mask` bits (values from verbs.h).
pub(crate) mod mask {
    /// `IBV_QP_STATE`.
    pub(crate) const STATE: u32 = 1;
    /// `IBV_QP_ACCESS_FLAGS`.
    pub(crate) const ACCESS_FLAGS: u32 = 1 << 3;
    /// `IBV_QP_PKEY_INDEX`.
    pub(crate) const PKEY_INDEX: u32 = 1 << 4;
    /// `IBV_QP_PORT`.
    pub(crate) const PORT: u32 = 1 << 5;
    /// `IBV_QP_AV`.
    pub(crate) const AV: u32 = 1 << 7;
    /// `IBV_QP_PATH_MTU`.
    pub(crate) const PATH_MTU: u32 = 1 << 8;
    /// `IBV_QP_TIMEOUT`.
    pub(crate) const TIMEOUT: u32 = 1 << 9;
    /// `IBV_QP_RETRY_CNT`.
    pub(crate) const RETRY_CNT: u32 = 1 << 10;
    /// `IBV_QP_RNR_RETRY`.
    pub(crate) const RNR_RETRY: u32 = 1 << 11;
    /// `IBV_QP_RQ_PSN`.
    pub(crate) const RQ_PSN: u32 = 1 << 12;
    /// `IBV_QP_MAX_QP_RD_ATOMIC`.
    pub(crate) const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    /// `IBV_QP_MIN_RNR_TIMER`.
    pub(crate) const MIN_RNR_TIMER: u32 = 1 << 15;
    /// `IBV_QP_SQ_PSN`.
    pub(crate) const SQ_PSN: u32 = 1 << 16;
    /// `IBV_QP_MAX_DEST_RD_ATOMIC`.
    pub(crate) const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    /// `IBV_QP_DEST_QPN`.
    pub(crate) const DEST_QPN: u32 = 1 << 20;
}

/// QP states (values of `enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[repr(u32)]
pub enum QpState {
    /// `IBV_QPS_RESET`.
    Reset = 0,
    /// `IBV_QPS_INIT`.
    Init = 1,
    /// `IBV_QPS_RTR` (ready to receive).
    Rtr = 2,
    /// `IBV_QPS_RTS` (ready to send).
    Rts = 3,
    /// `IBV_QPS_ERR`.
    Err = 6,
}

/// Timeouts and retry counts of an RC QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QpTuning {
    /// Local ACK timeout exponent: 4.096 us * 2^timeout per attempt.
    ///
    /// Default 18 (about 1.07 s per attempt; with `retry_cnt` 7, about 8.6 s
    /// without an ACK before `IBV_WC_RETRY_EXC_ERR`). 14 (67 ms, about 0.5 s
    /// in all) turns a short congestion episode, a link flap or a subnet
    /// manager sweep into a QP error; NCCL's default is 20 for the same
    /// reason. 18 rides out about a second of silence while a dead peer is
    /// still noticed well within a batch deadline (30 s by default).
    pub timeout: u8,
    /// Transport retries before the WR fails with RETRY_EXC_ERR (0..=7).
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs this side issues (clamped to the device's max).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs this side serves (clamped to the device's max).
    pub max_dest_rd_atomic: u8,
    /// Service level.
    pub sl: u8,
    /// GRH traffic class (RoCE DSCP << 2), `PDXFER_RDMA_TRAFFIC_CLASS`.
    ///
    /// Default 0 (DSCP 0, the default class): which class a fabric keeps
    /// lossless (PFC/ECN) is its operator's choice (commonly 106, DSCP 26),
    /// and a class the switches do not know is worse than the default, so
    /// pdxfer does not guess; every RoCE rail logs the class in use.
    pub traffic_class: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// P_Key index.
    pub pkey_index: u16,
}

impl Default for QpTuning {
    fn default() -> Self {
        QpTuning {
            timeout: 18,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            sl: 0,
            traffic_class: 0,
            hop_limit: 64,
            pkey_index: 0,
        }
    }
}

/// The address vector of the RTR transition (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AddressVector {
    /// Destination LID (0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Local port.
    pub port_num: u8,
    /// Whether the GRH is present (`is_global`).
    pub is_global: bool,
    /// Destination GID.
    pub dgid: Gid,
    /// Local GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// The attributes of one transition and the mask of those that are set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QpAttrs {
    /// The target state.
    pub state: QpState,
    /// `ibv_qp_attr_mask` bits.
    pub mask: u32,
    /// `pkey_index` (INIT).
    pub pkey_index: u16,
    /// `port_num` (INIT).
    pub port_num: u8,
    /// `qp_access_flags` (INIT).
    pub access: u32,
    /// `path_mtu` (RTR).
    pub path_mtu: Option<Mtu>,
    /// `dest_qp_num` (RTR).
    pub dest_qpn: u32,
    /// `rq_psn` (RTR).
    pub rq_psn: u32,
    /// `max_dest_rd_atomic` (RTR).
    pub max_dest_rd_atomic: u8,
    /// `min_rnr_timer` (RTR).
    pub min_rnr_timer: u8,
    /// `ah_attr` (RTR).
    pub av: Option<AddressVector>,
    /// `sq_psn` (RTS).
    pub sq_psn: u32,
    /// `timeout` (RTS).
    pub timeout: u8,
    /// `retry_cnt` (RTS).
    pub retry_cnt: u8,
    /// `rnr_retry` (RTS).
    pub rnr_retry: u8,
    /// `max_rd_atomic` (RTS).
    pub max_rd_atomic: u8,
}

impl QpAttrs {
    fn empty(state: QpState) -> Self {
        QpAttrs {
            state,
            mask: mask::STATE,
            pkey_index: 0,
            port_num: 0,
            access: 0,
            path_mtu: None,
            dest_qpn: 0,
            rq_psn: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            av: None,
            sq_psn: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            max_rd_atomic: 0,
        }
    }

    /// The values this transition sets, for error messages
    /// (e.g. `path_mtu=1024 dest_qpn=0x12 rq_psn=0x5 dlid=0 gid=fe80:... sgid_index=3`).
    pub fn describe(&self) -> String {
        let mut s = format!("{:?}:", self.state);
        if self.mask & mask::PORT != 0 {
            s += &format!(
                " port={} pkey_index={} access={:#x}",
                self.port_num, self.pkey_index, self.access
            );
        }
        if let Some(m) = self.path_mtu {
            s += &format!(" path_mtu={m}");
        }
        if self.mask & mask::DEST_QPN != 0 {
            s += &format!(
                " dest_qpn={:#x} rq_psn={:#x} max_dest_rd_atomic={} min_rnr_timer={}",
                self.dest_qpn, self.rq_psn, self.max_dest_rd_atomic, self.min_rnr_timer
            );
        }
        if let Some(av) = self.av {
            s += &format!(" dlid={:#x} sl={} port={}", av.dlid, av.sl, av.port_num);
            if av.is_global {
                s += &format!(
                    " gid={} sgid_index={} hop_limit={} traffic_class={}",
                    av.dgid, av.sgid_index, av.hop_limit, av.traffic_class
                );
            }
        }
        if self.mask & mask::SQ_PSN != 0 {
            s += &format!(
                " sq_psn={:#x} timeout={} retry_cnt={} rnr_retry={} max_rd_atomic={}",
                self.sq_psn, self.timeout, self.retry_cnt, self.rnr_retry, self.max_rd_atomic
            );
        }
        s
    }
}

/// RESET -> INIT: port, P_Key index and the remote access the QP allows.
pub fn init_attrs(port: u8, tuning: &QpTuning, remote_read: bool) -> QpAttrs {
    let mut a = QpAttrs::empty(QpState::Init);
    a.mask |= mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
    a.port_num = port;
    a.pkey_index = tuning.pkey_index;
    a.access =
        ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | if remote_read { ACCESS_REMOTE_READ } else { 0 };
    a
}

/// INIT -> RTR: the negotiated path MTU, the peer's QPN and PSN, and the address
/// vector (LID on InfiniBand, GRH with the peer's GID and our GID index on RoCE).
/// `device_max_rd_atom` clamps `max_dest_rd_atomic`.
pub fn rtr_attrs(n: &Negotiated, tuning: &QpTuning, device_max_rd_atom: u8) -> QpAttrs {
    let mut a = QpAttrs::empty(QpState::Rtr);
    a.mask |= mask::AV
        | mask::PATH_MTU
        | mask::DEST_QPN
        | mask::RQ_PSN
        | mask::MAX_DEST_RD_ATOMIC
        | mask::MIN_RNR_TIMER;
    a.path_mtu = Some(n.mtu);
    a.dest_qpn = n.remote_qpn;
    a.rq_psn = n.remote_psn;
    a.max_dest_rd_atomic = tuning.max_dest_rd_atomic.min(device_max_rd_atom).max(1);
    a.min_rnr_timer = tuning.min_rnr_timer;
    a.av = Some(AddressVector {
        dlid: n.dlid,
        sl: tuning.sl,
        port_num: n.port,
        is_global: n.use_grh,
        dgid: if n.use_grh { n.dgid } else { Gid::default() },
        sgid_index: if n.use_grh { n.sgid_index } else { 0 },
        hop_limit: if n.use_grh { tuning.hop_limit } else { 0 },
        traffic_class: if n.use_grh { tuning.traffic_class } else { 0 },
    });
    a
}

/// RTR -> RTS: our send PSN, ACK timeout, retry counts and outstanding READs.
pub fn rts_attrs(n: &Negotiated, tuning: &QpTuning, device_max_rd_atom: u8) -> QpAttrs {
    let mut a = QpAttrs::empty(QpState::Rts);
    a.mask |=
        mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    a.sq_psn = n.local_psn;
    a.timeout = tuning.timeout.min(31);
    a.retry_cnt = tuning.retry_cnt.min(7);
    a.rnr_retry = tuning.rnr_retry.min(7);
    a.max_rd_atomic = tuning.max_rd_atomic.min(device_max_rd_atom).max(1);
    a
}

/// The three transitions, in order.
pub fn transitions(
    n: &Negotiated,
    tuning: &QpTuning,
    device_max_rd_atom: u8,
    remote_read: bool,
) -> [QpAttrs; 3] {
    [
        init_attrs(n.port, tuning, remote_read),
        rtr_attrs(n, tuning, device_max_rd_atom),
        rts_attrs(n, tuning, device_max_rd_atom),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::handshake::LinkLayer;
    use super::*;

    fn negotiated(ll: LinkLayer) -> Negotiated {
        Negotiated {
            mtu: Mtu::Mtu1024,
            local_mtu: Mtu::Mtu4096,
            remote_mtu: Mtu::Mtu1024,
            port: 1,
            link_layer: ll,
            remote_qpn: 0x77,
            remote_psn: 0x123,
            local_psn: 0x456,
            dlid: if ll == LinkLayer::InfiniBand { 9 } else { 0 },
            use_grh: ll == LinkLayer::Ethernet,
            dgid: Gid::parse("0000:0000:0000:0000:0000:ffff:0a00:0002").unwrap(),
            sgid_index: 3,
        }
    }

    #[test]
    fn mask_values_match_verbs_h() {
        // Spot checks against enum ibv_qp_attr_mask.
        assert_eq!(mask::AV, 128);
        assert_eq!(mask::PATH_MTU, 256);
        assert_eq!(mask::DEST_QPN, 1_048_576);
        assert_eq!(mask::SQ_PSN, 65_536);
        assert_eq!(mask::MAX_DEST_RD_ATOMIC, 131_072);
    }

    #[test]
    fn init_sets_port_and_access() {
        let a = init_attrs(2, &QpTuning::default(), false);
        assert_eq!(a.state, QpState::Init);
        assert_eq!(
            a.mask,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS
        );
        assert_eq!(a.port_num, 2);
        assert_eq!(a.access, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE);
        assert_eq!(
            init_attrs(1, &QpTuning::default(), true).access & ACCESS_REMOTE_READ,
            ACCESS_REMOTE_READ
        );
    }

    #[test]
    fn rtr_on_roce_uses_grh_and_negotiated_mtu() {
        let n = negotiated(LinkLayer::Ethernet);
        let a = rtr_attrs(&n, &QpTuning::default(), 8);
        assert_eq!(a.path_mtu, Some(Mtu::Mtu1024));
        assert_eq!((a.dest_qpn, a.rq_psn), (0x77, 0x123));
        assert_eq!(a.max_dest_rd_atomic, 8, "clamped to the device");
        let av = a.av.unwrap();
        assert!(av.is_global);
        assert_eq!(av.dgid, n.dgid);
        assert_eq!(av.sgid_index, 3);
        assert_eq!(av.hop_limit, 64);
        assert_eq!(a.mask & mask::AV, mask::AV);
        assert_eq!(a.mask & mask::SQ_PSN, 0, "RTR must not set RTS attributes");
        let d = a.describe();
        assert!(
            d.contains("path_mtu=1024")
                && d.contains("sgid_index=3")
                && d.contains("dest_qpn=0x77"),
            "{d}"
        );
    }

    #[test]
    fn rtr_on_ib_uses_lid_without_grh() {
        let a = rtr_attrs(&negotiated(LinkLayer::InfiniBand), &QpTuning::default(), 16);
        let av = a.av.unwrap();
        assert!(!av.is_global);
        assert_eq!(av.dlid, 9);
        assert!(av.dgid.is_zero());
        assert!(!a.describe().contains("gid="));
    }

    #[test]
    fn rts_uses_our_psn_and_clamps() {
        let t = QpTuning {
            timeout: 40,
            retry_cnt: 9,
            rnr_retry: 9,
            ..QpTuning::default()
        };
        let a = rts_attrs(&negotiated(LinkLayer::Ethernet), &t, 0);
        assert_eq!(a.sq_psn, 0x456);
        assert_eq!((a.timeout, a.retry_cnt, a.rnr_retry), (31, 7, 7));
        assert_eq!(a.max_rd_atomic, 1, "at least one outstanding read");
        assert_eq!(a.mask & mask::DEST_QPN, 0);
        let [i, r, s] = transitions(&negotiated(LinkLayer::Ethernet), &t, 4, true);
        assert_eq!(
            (i.state, r.state, s.state),
            (QpState::Init, QpState::Rtr, QpState::Rts)
        );
    }
}
