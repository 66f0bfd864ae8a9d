//! The RDMA connection handshake: what each side sends over the control channel,
//! its versioned binary encoding, and the negotiation of the connection
//! parameters from both sides' values.
//!
//! Each side sends one [`Handshake`] holding one [`RailInfo`] per NIC ("rail"):
//! QP number, LID, GID and the GID index it came from, the prefix length of an
//! IPv4 GID's address (so the peer can compute the rail's network), the starting
//! PSN, the port's active MTU, the link layer and the remote-accessible regions
//! with their rkeys on that NIC. Which local rail connects to which remote rail
//! is decided by subnet in `pairing`. [`negotiate`] turns a (local, remote) pair into the
//! [`Negotiated`] attributes the QP moves to RTR/RTS with: the path MTU is the
//! **smaller** of the two active MTUs, and every failure names the field that is
//! wrong ([`HandshakeField`]) together with both sides' values, instead of one
//! "check mtu, gid, lid, qpn" line.

use crate::error::{Error, Status};
use serde::Serialize;
use std::fmt;

// Not `pub const` at module level: cbindgen would export them into pdxfer.h.
const HANDSHAKE_MAGIC: [u8; 4] = Handshake::MAGIC;
const HANDSHAKE_VERSION: u16 = Handshake::VERSION;
const MAX_24BIT: u32 = Handshake::MAX_24BIT;
const MAX_RAILS: usize = Handshake::MAX_RAILS;
const MAX_REGIONS: usize = Handshake::MAX_REGIONS;

/// A path MTU, with the numeric values of `enum ibv_mtu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// The MTU for an `ibv_mtu` value (1..=5).
    pub fn from_ibv(v: u32) -> Option<Mtu> {
        Some(match v {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The `ibv_mtu` value.
    pub fn to_ibv(self) -> u32 {
        self as u32
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128u32 << (self as u32)
    }

    /// The largest IB MTU that fits in `bytes` (an Ethernet MTU for RoCE), if any.
    pub fn fitting(bytes: u32) -> Option<Mtu> {
        [
            Mtu::Mtu4096,
            Mtu::Mtu2048,
            Mtu::Mtu1024,
            Mtu::Mtu512,
            Mtu::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= bytes)
    }
}

impl Serialize for Mtu {
    /// As the number of bytes (`4096`).
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u32(self.bytes())
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// The link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[repr(u8)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID; a GID is optional.
    InfiniBand = 1,
    /// Ethernet (RoCE): addressed by GID; a GRH is always needed.
    Ethernet = 2,
}

impl LinkLayer {
    /// From the byte used on the wire and by `ibv_port_attr.link_layer`
    /// (0 = unspecified, which verbs reports for InfiniBand).
    pub fn from_u8(v: u8) -> Option<LinkLayer> {
        match v {
            0 | 1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
        })
    }
}

/// A 128-bit GID in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// True for the all-zero GID (an unpopulated GID table entry).
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|b| *b == 0)
    }

    /// Parses the sysfs form `fe80:0000:0000:0000:0202:c9ff:fe00:0001`
    /// (eight groups of four hex digits).
    pub fn parse(s: &str) -> Option<Gid> {
        let groups: Vec<&str> = s.trim().split(':').collect();
        if groups.len() != 8 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, g) in groups.iter().enumerate() {
            if g.is_empty() || g.len() > 4 {
                return None;
            }
            let v = u16::from_str_radix(g, 16).ok()?;
            out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
        }
        Some(Gid(out))
    }

    /// True when the GID is an IPv4-mapped address (`::ffff:a.b.c.d`, RoCE v2 over IPv4).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10].iter().all(|b| *b == 0) && self.0[10] == 0xff && self.0[11] == 0xff
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for i in 0..8 {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", self.0[2 * i], self.0[2 * i + 1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl Serialize for Gid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A region the peer may write into (or read from) through one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct RemoteRegion {
    /// Start address in the peer's address space (host VA or GPU VA).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The rkey of the region on this rail's NIC.
    pub rkey: u32,
}

/// What one side tells the other about one of its rails (one NIC, one QP).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RailInfo {
    /// The NIC name (e.g. `mlx5_0`), for messages; at most 255 bytes.
    pub device: String,
    /// The port number on that NIC (1-based).
    pub port: u8,
    /// The port's link layer.
    pub link_layer: LinkLayer,
    /// The QP number (24-bit, never 0 for an RC QP).
    pub qpn: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID at `gid_index` (all-zero is invalid on RoCE).
    pub gid: Gid,
    /// The GID table index `gid` was read from.
    pub gid_index: u8,
    /// For an IPv4-mapped RoCE GID: the prefix length of that address on the
    /// port's net device (1..=32), so both ends can compute its network; 0 when
    /// it is not known or the GID is not IPv4.
    pub prefix_len: u8,
    /// The first packet sequence number this side sends with (24-bit).
    pub psn: u32,
    /// The port's active MTU.
    pub mtu: Mtu,
    /// The remote-accessible regions, with their rkeys on this NIC.
    pub regions: Vec<RemoteRegion>,
}

/// One side's whole handshake message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Handshake {
    /// Random per process start; lets the peer detect a restarted process.
    pub instance_id: u64,
    /// One entry per rail, in rail order.
    pub rails: Vec<RailInfo>,
    /// This side asks for rails paired by index instead of by subnet
    /// (`PDXFER_RDMA_PAIRING=index`; flag bit 0).
    pub pair_by_index: bool,
}

/// The handshake field a failure is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum HandshakeField {
    /// Magic bytes or encoding version.
    Version,
    /// The message is truncated or has trailing bytes.
    Length,
    /// Number of rails.
    Rails,
    /// Device name.
    Device,
    /// Port number.
    Port,
    /// Link layer.
    LinkLayer,
    /// Path MTU.
    Mtu,
    /// GID.
    Gid,
    /// GID table index.
    GidIndex,
    /// LID.
    Lid,
    /// QP number.
    Qpn,
    /// Packet sequence number.
    Psn,
    /// Region list.
    Regions,
    /// IPv4 prefix length.
    PrefixLen,
    /// The rails' subnets: no rail of one side can reach a rail of the other.
    Subnet,
}

impl HandshakeField {
    /// The lower-case name used in messages (`mtu`, `gid`, `lid`, `qpn`, `psn`, ...).
    pub fn name(self) -> &'static str {
        match self {
            HandshakeField::Version => "version",
            HandshakeField::Length => "length",
            HandshakeField::Rails => "rails",
            HandshakeField::Device => "device",
            HandshakeField::Port => "port",
            HandshakeField::LinkLayer => "link_layer",
            HandshakeField::Mtu => "mtu",
            HandshakeField::Gid => "gid",
            HandshakeField::GidIndex => "gid_index",
            HandshakeField::Lid => "lid",
            HandshakeField::Qpn => "qpn",
            HandshakeField::Psn => "psn",
            HandshakeField::Regions => "regions",
            HandshakeField::PrefixLen => "prefix_len",
            HandshakeField::Subnet => "subnet",
        }
    }
}

impl fmt::Display for HandshakeField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A handshake failure: which field, and why (both sides' values, the fix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeError {
    /// The failing field.
    pub field: HandshakeField,
    /// What is wrong with it.
    pub detail: String,
}

impl HandshakeError {
    pub(crate) fn new(field: HandshakeField, detail: impl Into<String>) -> Self {
        HandshakeError {
            field,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RDMA handshake: field `{}`: {}", self.field, self.detail)
    }
}

impl std::error::Error for HandshakeError {}

impl From<HandshakeError> for Error {
    fn from(e: HandshakeError) -> Self {
        Error::new(Status::RdmaHandshake, e.to_string())
    }
}

// ---------------------------------------------------------------- encoding

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: HandshakeField) -> Result<&'a [u8], HandshakeError> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(HandshakeError::new(
                HandshakeField::Length,
                format!(
                    "message truncated while reading `{field}`: need {n} byte(s) at offset {}, message has {}",
                    self.pos,
                    self.buf.len()
                ),
            )),
        }
    }
    fn u8(&mut self, f: HandshakeField) -> Result<u8, HandshakeError> {
        Ok(self.take(1, f)?[0])
    }
    fn u16(&mut self, f: HandshakeField) -> Result<u16, HandshakeError> {
        let b = self.take(2, f)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, f: HandshakeField) -> Result<u32, HandshakeError> {
        let b = self.take(4, f)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, f: HandshakeField) -> Result<u64, HandshakeError> {
        let b = self.take(8, f)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl Handshake {
    /// First bytes of every encoded handshake.
    pub const MAGIC: [u8; 4] = *b"PDXR";
    /// The handshake encoding this build writes (and the newest it reads).
    /// Version 2 added each rail's IPv4 prefix length (rails are paired by subnet).
    pub const VERSION: u16 = 2;
    /// Largest valid QP number / PSN (both are 24-bit on the wire).
    pub const MAX_24BIT: u32 = 0x00ff_ffff;
    /// Most rails (NICs) one handshake may carry.
    pub const MAX_RAILS: usize = 64;
    /// Most regions one rail may advertise.
    pub const MAX_REGIONS: usize = 1 << 20;

    /// Encodes the handshake (little-endian, version [`Handshake::VERSION`]).
    ///
    /// Layout: magic `PDXR`, u16 version, u16 flags (bit 0: pair rails by index),
    /// u64 instance id, u16 rail
    /// count, then per rail: u8 name length + name, u8 port, u8 link layer, u8 GID
    /// index, u8 MTU (`ibv_mtu`), u32 QPN, u16 LID, u32 PSN, 16-byte GID, u8 IPv4
    /// prefix length, u32 region count, then per region u64 addr, u64 len, u32 rkey.
    pub fn encode(&self) -> Result<Vec<u8>, HandshakeError> {
        if self.rails.is_empty() || self.rails.len() > MAX_RAILS {
            return Err(HandshakeError::new(
                HandshakeField::Rails,
                format!("{} rails; need 1..={MAX_RAILS}", self.rails.len()),
            ));
        }
        let mut w = Writer(Vec::with_capacity(64 + self.rails.len() * 64));
        w.bytes(&HANDSHAKE_MAGIC);
        w.u16(HANDSHAKE_VERSION);
        w.u16(u16::from(self.pair_by_index));
        w.u64(self.instance_id);
        w.u16(self.rails.len() as u16);
        for (i, r) in self.rails.iter().enumerate() {
            let name = r.device.as_bytes();
            if name.len() > 255 {
                return Err(HandshakeError::new(
                    HandshakeField::Device,
                    format!("rail {i}: device name is {} bytes (max 255)", name.len()),
                ));
            }
            if r.regions.len() > MAX_REGIONS {
                return Err(HandshakeError::new(
                    HandshakeField::Regions,
                    format!("rail {i}: {} regions (max {MAX_REGIONS})", r.regions.len()),
                ));
            }
            w.u8(name.len() as u8);
            w.bytes(name);
            w.u8(r.port);
            w.u8(r.link_layer as u8);
            w.u8(r.gid_index);
            w.u8(r.mtu as u8);
            w.u32(r.qpn);
            w.u16(r.lid);
            w.u32(r.psn);
            w.bytes(&r.gid.0);
            w.u8(r.prefix_len);
            w.u32(r.regions.len() as u32);
            for g in &r.regions {
                w.u64(g.addr);
                w.u64(g.len);
                w.u32(g.rkey);
            }
        }
        Ok(w.0)
    }

    /// Decodes and validates a handshake: every field must be in range, and the
    /// error names the first field that is not.
    pub fn decode(buf: &[u8]) -> Result<Handshake, HandshakeError> {
        use HandshakeField as F;
        let mut r = Reader { buf, pos: 0 };
        let magic = r.take(4, F::Version)?;
        if magic != HANDSHAKE_MAGIC {
            return Err(HandshakeError::new(
                F::Version,
                format!(
                    "bad magic {magic:02x?} (expected \"PDXR\"): the peer is not a pdxfer RDMA endpoint"
                ),
            ));
        }
        let version = r.u16(F::Version)?;
        if version != HANDSHAKE_VERSION {
            return Err(HandshakeError::new(
                F::Version,
                format!(
                    "peer speaks handshake version {version}, this build speaks {HANDSHAKE_VERSION}: upgrade the older side"
                ),
            ));
        }
        let flags = r.u16(F::Version)?;
        let instance_id = r.u64(F::Version)?;
        let n = r.u16(F::Rails)? as usize;
        if n == 0 || n > MAX_RAILS {
            return Err(HandshakeError::new(
                F::Rails,
                format!("{n} rails; need 1..={MAX_RAILS}"),
            ));
        }
        let mut rails = Vec::with_capacity(n);
        for i in 0..n {
            let nl = r.u8(F::Device)? as usize;
            let device = std::str::from_utf8(r.take(nl, F::Device)?)
                .map_err(|_| {
                    HandshakeError::new(F::Device, format!("rail {i}: device name is not UTF-8"))
                })?
                .to_string();
            let port = r.u8(F::Port)?;
            if port == 0 {
                return Err(HandshakeError::new(
                    F::Port,
                    format!("rail {i} ({device}): port 0 (ports are numbered from 1)"),
                ));
            }
            let ll = r.u8(F::LinkLayer)?;
            let link_layer = LinkLayer::from_u8(ll).ok_or_else(|| {
                HandshakeError::new(
                    F::LinkLayer,
                    format!("rail {i} ({device}): unknown link layer {ll}"),
                )
            })?;
            let gid_index = r.u8(F::GidIndex)?;
            let m = r.u8(F::Mtu)?;
            let mtu = Mtu::from_ibv(m as u32).ok_or_else(|| {
                HandshakeError::new(
                    F::Mtu,
                    format!(
                        "rail {i} ({device}): MTU code {m} is not an IB MTU (1..=5 = 256..4096)"
                    ),
                )
            })?;
            let qpn = r.u32(F::Qpn)?;
            let lid = r.u16(F::Lid)?;
            let psn = r.u32(F::Psn)?;
            let mut gid = [0u8; 16];
            gid.copy_from_slice(r.take(16, F::Gid)?);
            let prefix_len = r.u8(F::PrefixLen)?;
            if prefix_len > 32 {
                return Err(HandshakeError::new(
                    F::PrefixLen,
                    format!("rail {i} ({device}): IPv4 prefix length {prefix_len} (max 32)"),
                ));
            }
            let nr = r.u32(F::Regions)? as usize;
            if nr > MAX_REGIONS {
                return Err(HandshakeError::new(
                    F::Regions,
                    format!("rail {i} ({device}): {nr} regions (max {MAX_REGIONS})"),
                ));
            }
            // Each region is 20 bytes; refuse a count the rest of the message cannot hold
            // before allocating for it.
            if nr.saturating_mul(20) > buf.len() - r.pos {
                return Err(HandshakeError::new(
                    F::Length,
                    format!(
                        "rail {i} ({device}): {nr} regions announced, only {} bytes left",
                        buf.len() - r.pos
                    ),
                ));
            }
            let mut regions = Vec::with_capacity(nr);
            for _ in 0..nr {
                let addr = r.u64(F::Regions)?;
                let len = r.u64(F::Regions)?;
                let rkey = r.u32(F::Regions)?;
                if addr.checked_add(len).is_none() {
                    return Err(HandshakeError::new(
                        F::Regions,
                        format!(
                            "rail {i} ({device}): region {addr:#x}+{len} wraps the address space"
                        ),
                    ));
                }
                regions.push(RemoteRegion { addr, len, rkey });
            }
            let info = RailInfo {
                device,
                port,
                link_layer,
                qpn,
                lid,
                gid: Gid(gid),
                gid_index,
                prefix_len,
                psn,
                mtu,
                regions,
            };
            check_ranges(i, &info)?;
            rails.push(info);
        }
        if r.pos != buf.len() {
            return Err(HandshakeError::new(
                F::Length,
                format!("{} trailing byte(s) after the last rail", buf.len() - r.pos),
            ));
        }
        Ok(Handshake {
            instance_id,
            rails,
            pair_by_index: flags & 1 != 0,
        })
    }
}

/// Largest encoded handshake [`read_handshake`] accepts (64 MiB).
const MAX_ENCODED: u32 = 64 << 20;

/// Sends `h` over a control channel (any byte stream): a little-endian u32 length,
/// then [`Handshake::encode`]'s bytes.
pub fn write_handshake(w: &mut impl std::io::Write, h: &Handshake) -> crate::error::Result<()> {
    let b = h.encode()?;
    let n = u32::try_from(b.len())
        .ok()
        .filter(|n| *n <= MAX_ENCODED)
        .ok_or_else(|| Error::invalid(format!("handshake of {} bytes is too large", b.len())))?;
    w.write_all(&n.to_le_bytes())?;
    w.write_all(&b)?;
    w.flush()?;
    Ok(())
}

/// Receives a handshake written by [`write_handshake`]; a malformed one is
/// [`Status::RdmaHandshake`] naming the field, a closed stream
/// [`Status::PeerUnreachable`].
pub fn read_handshake(r: &mut impl std::io::Read) -> crate::error::Result<Handshake> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len);
    if n > MAX_ENCODED {
        return Err(HandshakeError::new(
            HandshakeField::Length,
            format!(
                "peer announced a {n}-byte handshake (max {MAX_ENCODED}): not a pdxfer RDMA peer?"
            ),
        )
        .into());
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(Handshake::decode(&b)?)
}

/// Exchanges handshakes over a control channel: sends ours, then reads theirs
/// (both sides may call it at the same time: the stream buffers our message).
pub fn exchange<S: std::io::Read + std::io::Write>(
    s: &mut S,
    local: &Handshake,
) -> crate::error::Result<Handshake> {
    write_handshake(s, local)?;
    read_handshake(s)
}

fn check_ranges(i: usize, r: &RailInfo) -> Result<(), HandshakeError> {
    if r.qpn == 0 || r.qpn > MAX_24BIT {
        return Err(HandshakeError::new(
            HandshakeField::Qpn,
            format!(
                "rail {i} ({}): QP number {:#x} is outside 1..=0xffffff",
                r.device, r.qpn
            ),
        ));
    }
    if r.psn > MAX_24BIT {
        return Err(HandshakeError::new(
            HandshakeField::Psn,
            format!(
                "rail {i} ({}): PSN {:#x} is wider than 24 bits",
                r.device, r.psn
            ),
        ));
    }
    Ok(())
}

// ------------------------------------------------------------- negotiation

/// The connection attributes agreed for one rail, fed to the QP's RTR/RTS transitions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Negotiated {
    /// The path MTU: the smaller of both sides' active MTUs.
    pub mtu: Mtu,
    /// This side's active MTU (for messages).
    pub local_mtu: Mtu,
    /// The peer's active MTU (for messages).
    pub remote_mtu: Mtu,
    /// The local port.
    pub port: u8,
    /// The link layer both sides share.
    pub link_layer: LinkLayer,
    /// The peer's QP number (`dest_qp_num`).
    pub remote_qpn: u32,
    /// The PSN the peer sends with (our `rq_psn`).
    pub remote_psn: u32,
    /// The PSN we send with (our `sq_psn`).
    pub local_psn: u32,
    /// The destination LID (0 on RoCE).
    pub dlid: u16,
    /// Whether a GRH (global route) is used: always on RoCE.
    pub use_grh: bool,
    /// The destination GID when `use_grh`.
    pub dgid: Gid,
    /// The local GID index the GRH is sent from.
    pub sgid_index: u8,
}

/// Negotiates one rail: `local` is what this side sent, `remote` what the peer sent.
///
/// Rules: both sides must share the link layer; the path MTU is the minimum of
/// both active MTUs; on RoCE (Ethernet) both GIDs must be non-zero (an all-zero GID
/// means the GID index points at an unpopulated entry); on InfiniBand the peer's
/// LID must be a valid unicast LID unless it sent a GID to route by; QP numbers and
/// PSNs must fit in 24 bits and the QP number must not be 0.
pub fn negotiate(local: &RailInfo, remote: &RailInfo) -> Result<Negotiated, HandshakeError> {
    use HandshakeField as F;
    let who = format!(
        "local {} port {} <-> remote {} port {}",
        local.device, local.port, remote.device, remote.port
    );
    check_ranges(0, local)
        .map_err(|e| HandshakeError::new(e.field, format!("{who}: local {}", e.detail)))?;
    check_ranges(0, remote)
        .map_err(|e| HandshakeError::new(e.field, format!("{who}: remote {}", e.detail)))?;
    if local.link_layer != remote.link_layer {
        return Err(HandshakeError::new(
            F::LinkLayer,
            format!(
                "{who}: link layers differ (local {}, remote {}): an InfiniBand port cannot talk to a RoCE port; pick NICs on the same fabric",
                local.link_layer, remote.link_layer
            ),
        ));
    }
    let mtu = local.mtu.min(remote.mtu);
    let (dlid, use_grh) = match local.link_layer {
        LinkLayer::Ethernet => {
            if local.gid.is_zero() {
                return Err(HandshakeError::new(
                    F::Gid,
                    format!(
                        "{who}: the local GID at index {} is all zero (unpopulated entry); choose a populated GID index (PDXFER_RDMA_GID_INDEX, see `pdxfer info`)",
                        local.gid_index
                    ),
                ));
            }
            if remote.gid.is_zero() {
                return Err(HandshakeError::new(
                    F::Gid,
                    format!(
                        "{who}: the remote GID at index {} is all zero (unpopulated entry); the peer must choose a populated GID index",
                        remote.gid_index
                    ),
                ));
            }
            (0u16, true)
        }
        LinkLayer::InfiniBand => {
            let valid_lid = |l: u16| (1..0xc000).contains(&l);
            if valid_lid(remote.lid) {
                (remote.lid, false)
            } else if !remote.gid.is_zero() && !local.gid.is_zero() {
                // No unicast LID: route globally by GID.
                (0, true)
            } else {
                return Err(HandshakeError::new(
                    F::Lid,
                    format!(
                        "{who}: remote LID {:#x} is not a unicast LID (1..0xc000) and no GID to route by (remote GID {}, local GID {}): is the subnet manager running (port state ACTIVE)?",
                        remote.lid, remote.gid, local.gid
                    ),
                ));
            }
        }
    };
    Ok(Negotiated {
        mtu,
        local_mtu: local.mtu,
        remote_mtu: remote.mtu,
        port: local.port,
        link_layer: local.link_layer,
        remote_qpn: remote.qpn,
        remote_psn: remote.psn,
        local_psn: local.psn,
        dlid,
        use_grh,
        dgid: remote.gid,
        sgid_index: local.gid_index,
    })
}

/// A random 24-bit PSN (from the OS's random source mixed with the time).
pub fn random_psn() -> u32 {
    random_u64() as u32 & MAX_24BIT
}

/// A random 64-bit value (for instance ids and PSNs; not for cryptography).
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rail(ll: LinkLayer, mtu: Mtu) -> RailInfo {
        RailInfo {
            device: "mlx5_0".into(),
            port: 1,
            link_layer: ll,
            qpn: 0x1234,
            lid: if ll == LinkLayer::InfiniBand { 7 } else { 0 },
            gid: Gid::parse("fe80:0000:0000:0000:0202:c9ff:fe00:0001").unwrap(),
            gid_index: 3,
            prefix_len: 0,
            psn: 0x00ab_cdef,
            mtu,
            regions: vec![
                RemoteRegion {
                    addr: 0x7f00_0000_0000,
                    len: 1 << 30,
                    rkey: 0xdead_beef,
                },
                RemoteRegion {
                    addr: 0x1000,
                    len: 4096,
                    rkey: 7,
                },
            ],
        }
    }

    fn hs(rails: Vec<RailInfo>) -> Handshake {
        Handshake {
            instance_id: 0x0102_0304_0506_0708,
            rails,
            pair_by_index: false,
        }
    }

    #[test]
    fn mtu_values_match_ibv() {
        assert_eq!(Mtu::Mtu256.bytes(), 256);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::Mtu1024.to_ibv(), 3);
        for v in 1..=5 {
            assert_eq!(Mtu::from_ibv(v).unwrap().to_ibv(), v);
        }
        assert_eq!(Mtu::from_ibv(0), None);
        assert_eq!(Mtu::from_ibv(6), None);
        assert_eq!(Mtu::fitting(1500), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::fitting(9000), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::fitting(100), None);
    }

    #[test]
    fn gid_parse_display_roundtrip() {
        let s = "fe80:0000:0000:0000:0202:c9ff:fe00:0001";
        let g = Gid::parse(s).unwrap();
        assert_eq!(g.0[0], 0xfe);
        assert_eq!(g.0[15], 0x01);
        assert_eq!(g.to_string(), s);
        assert!(!g.is_zero());
        assert!(Gid::parse("0000:0000:0000:0000:0000:0000:0000:0000")
            .unwrap()
            .is_zero());
        assert!(Gid::parse("0000:0000:0000:0000:0000:ffff:0a00:0001")
            .unwrap()
            .is_ipv4_mapped());
        assert_eq!(Gid::parse("fe80::1"), None);
        assert_eq!(Gid::parse("zz80:0000:0000:0000:0000:0000:0000:0000"), None);
    }

    #[test]
    fn encode_decode_roundtrip() {
        let mut r2 = rail(LinkLayer::Ethernet, Mtu::Mtu1024);
        r2.device = "mlx5_1".into();
        r2.regions.clear();
        r2.gid = Gid::parse("0000:0000:0000:0000:0000:ffff:0a00:0102").unwrap();
        r2.prefix_len = 24;
        let mut h = hs(vec![rail(LinkLayer::Ethernet, Mtu::Mtu4096), r2]);
        let bytes = h.encode().unwrap();
        assert_eq!(&bytes[..4], b"PDXR");
        assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), HANDSHAKE_VERSION);
        let back = Handshake::decode(&bytes).unwrap();
        assert_eq!(back, h);
        h.pair_by_index = true;
        let bytes = h.encode().unwrap();
        assert_eq!(u16::from_le_bytes([bytes[6], bytes[7]]), 1);
        assert_eq!(Handshake::decode(&bytes).unwrap(), h);
    }

    #[test]
    fn decode_names_the_failing_field() {
        let h = hs(vec![rail(LinkLayer::InfiniBand, Mtu::Mtu4096)]);
        let good = h.encode().unwrap();
        // Offsets: magic 4, version 2, flags 2, instance 8, nrails 2 = 18; name len 1 + 6.
        let rail0 = 18 + 1 + 6;
        let (port, ll, mtu, qpn, psn) = (rail0, rail0 + 1, rail0 + 3, rail0 + 4, rail0 + 10);

        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Version
        );

        let mut b = good.clone();
        b[4] = 9;
        let e = Handshake::decode(&b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Version);
        assert!(e.detail.contains("version 9"), "{e}");

        // A peer of the previous encoding (no prefix lengths, rails paired by
        // index) is refused naming both versions.
        let mut b = good.clone();
        b[4..6].copy_from_slice(&1u16.to_le_bytes());
        let e = Handshake::decode(&b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Version);
        assert!(
            e.detail.contains("version 1") && e.detail.contains("speaks 2"),
            "{e}"
        );
        let err: Error = e.into();
        assert_eq!(err.status(), Status::RdmaHandshake);

        let mut b = good.clone();
        b[port] = 0;
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Port
        );

        let mut b = good.clone();
        b[ll] = 9;
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::LinkLayer
        );

        let mut b = good.clone();
        b[mtu] = 7;
        let e = Handshake::decode(&b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Mtu);
        assert!(e.to_string().contains("field `mtu`"), "{e}");

        let mut b = good.clone();
        b[qpn..qpn + 4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Qpn
        );

        let mut b = good.clone();
        b[psn..psn + 4].copy_from_slice(&0x0100_0000u32.to_le_bytes());
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Psn
        );

        // Truncation anywhere is a length error, never a panic.
        for cut in 0..good.len() {
            let e = Handshake::decode(&good[..cut]).unwrap_err();
            assert!(
                matches!(e.field, HandshakeField::Length | HandshakeField::Version),
                "cut {cut}: {e}"
            );
        }
        let mut b = good.clone();
        b.push(0);
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Length
        );

        // An IPv4 prefix length past 32 is named.
        let plen = psn + 4 + 16;
        let mut b = good.clone();
        b[plen] = 33;
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::PrefixLen
        );

        // A huge region count is refused before allocating.
        let nreg = plen + 1;
        let mut b = good;
        b[nreg..nreg + 4].copy_from_slice(&100_000u32.to_le_bytes());
        assert_eq!(
            Handshake::decode(&b).unwrap_err().field,
            HandshakeField::Length
        );
    }

    #[test]
    fn encode_refuses_bad_rail_counts() {
        assert_eq!(
            hs(vec![]).encode().unwrap_err().field,
            HandshakeField::Rails
        );
        let mut r = rail(LinkLayer::InfiniBand, Mtu::Mtu4096);
        r.device = "x".repeat(300);
        assert_eq!(
            hs(vec![r]).encode().unwrap_err().field,
            HandshakeField::Device
        );
    }

    #[test]
    fn negotiation_takes_the_smaller_mtu() {
        let a = rail(LinkLayer::Ethernet, Mtu::Mtu4096);
        let mut b = rail(LinkLayer::Ethernet, Mtu::Mtu1024);
        b.qpn = 0x99;
        b.psn = 5;
        let n = negotiate(&a, &b).unwrap();
        assert_eq!(n.mtu, Mtu::Mtu1024);
        assert_eq!((n.local_mtu, n.remote_mtu), (Mtu::Mtu4096, Mtu::Mtu1024));
        assert_eq!(n.remote_qpn, 0x99);
        assert_eq!(n.remote_psn, 5);
        assert_eq!(n.local_psn, a.psn);
        assert!(n.use_grh);
        assert_eq!(n.dgid, b.gid);
        assert_eq!(n.sgid_index, 3);
        // Symmetric: the other side agrees on the same MTU.
        assert_eq!(negotiate(&b, &a).unwrap().mtu, Mtu::Mtu1024);
    }

    #[test]
    fn roce_rejects_zero_gid_naming_side_and_index() {
        let a = rail(LinkLayer::Ethernet, Mtu::Mtu4096);
        let mut b = a.clone();
        b.gid = Gid::default();
        b.gid_index = 5;
        let e = negotiate(&a, &b).unwrap_err();
        assert_eq!(e.field, HandshakeField::Gid);
        assert!(e.detail.contains("remote GID at index 5"), "{e}");
        let e = negotiate(&b, &a).unwrap_err();
        assert_eq!(e.field, HandshakeField::Gid);
        assert!(e.detail.contains("local GID at index 5"), "{e}");
        let err: Error = e.into();
        assert_eq!(err.status(), Status::RdmaHandshake);
        assert!(err.detail().contains("field `gid`"));
    }

    #[test]
    fn ib_uses_lid_or_falls_back_to_gid() {
        let a = rail(LinkLayer::InfiniBand, Mtu::Mtu4096);
        let b = rail(LinkLayer::InfiniBand, Mtu::Mtu2048);
        let n = negotiate(&a, &b).unwrap();
        assert_eq!((n.dlid, n.use_grh, n.mtu), (7, false, Mtu::Mtu2048));
        let mut c = b.clone();
        c.lid = 0;
        let n = negotiate(&a, &c).unwrap();
        assert!(n.use_grh);
        c.gid = Gid::default();
        let e = negotiate(&a, &c).unwrap_err();
        assert_eq!(e.field, HandshakeField::Lid);
        c.lid = 0xffff;
        assert_eq!(negotiate(&a, &c).unwrap_err().field, HandshakeField::Lid);
    }

    #[test]
    fn mismatched_link_layers_and_bad_qpn_are_named() {
        let a = rail(LinkLayer::InfiniBand, Mtu::Mtu4096);
        let b = rail(LinkLayer::Ethernet, Mtu::Mtu4096);
        assert_eq!(
            negotiate(&a, &b).unwrap_err().field,
            HandshakeField::LinkLayer
        );
        let mut c = a.clone();
        c.qpn = 0;
        let e = negotiate(&a, &c).unwrap_err();
        assert_eq!(e.field, HandshakeField::Qpn);
        assert!(e.detail.contains("remote"), "{e}");
        let mut c = a.clone();
        c.psn = 1 << 24;
        let e = negotiate(&c, &a).unwrap_err();
        assert_eq!(e.field, HandshakeField::Psn);
        assert!(e.detail.contains("local"), "{e}");
    }

    #[test]
    fn exchange_over_a_stream_pair() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
        }
        let ha = hs(vec![rail(LinkLayer::Ethernet, Mtu::Mtu4096)]);
        let mut hb = ha.clone();
        hb.instance_id = 99;
        hb.rails[0].mtu = Mtu::Mtu1024;
        let hb2 = hb.clone();
        let t = std::thread::spawn(move || exchange(&mut b, &hb2));
        let got_b = exchange(&mut a, &ha).unwrap();
        let got_a = t.join().unwrap().unwrap();
        assert_eq!(got_b, hb);
        assert_eq!(got_a, ha);
        assert_eq!(
            negotiate(&ha.rails[0], &got_b.rails[0]).unwrap().mtu,
            Mtu::Mtu1024
        );

        // A closed stream is PeerUnreachable; garbage names the field.
        let (mut c, d) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(d);
        assert_eq!(
            read_handshake(&mut c).unwrap_err().status(),
            Status::PeerUnreachable
        );
        let mut junk: &[u8] = &[4, 0, 0, 0, b'H', b'T', b'T', b'P'];
        let e = read_handshake(&mut junk).unwrap_err();
        assert_eq!(e.status(), Status::RdmaHandshake);
        assert!(e.detail().contains("field `version`"), "{e}");
        let mut huge: &[u8] = &[0xff, 0xff, 0xff, 0xff];
        assert!(read_handshake(&mut huge)
            .unwrap_err()
            .detail()
            .contains("field `length`"));
    }

    #[test]
    fn random_psn_fits_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= MAX_24BIT);
        }
        assert_ne!(random_u64(), random_u64());
    }
}
