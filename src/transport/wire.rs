//! Versioned framing of the control and data channels.
//!
//! Control frame: `magic u32 | version u16 | type u16 | len u32 | payload`.
//! Handshake payloads are JSON; batch messages are fixed little-endian
//! records. Data frame (tcp streams): a 48-byte header
//! `magic u32 | version u16 | type u16 | flags u32 | reserved u32 |
//! batch u64 | region u64 | offset u64 | len u64`, then `len` payload bytes
//! that the receiver reads straight into the validated destination.
//!
//! After the authentication exchange every control frame is sealed
//! ([`write_frame_sealed`]): its `len` counts a [`TAG_LEN`]-byte
//! [`SessionMac`] tag after the payload, over the sequence number, the
//! 12-byte header and the payload. Data frames (tcp payload bytes and their
//! headers) are not sealed: the receiver checks each against its own grants.

pub use super::frame_type::FrameType;
use crate::auth::{SessionMac, TAG_LEN};
use crate::error::{Error, Result, Status};
use std::io::{Read, Write};

/// `"PDXF"` as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"PDXF");
/// Wire protocol version; peers with another version are refused at the handshake.
pub const VERSION: u16 = 3;
/// Largest control payload accepted (descriptor lists, write intents).
pub const MAX_CONTROL_PAYLOAD: u32 = 64 << 20;
/// Size of a data frame header.
pub const DATA_HEADER_LEN: usize = 48;
/// Largest frame accepted before the peer authenticated (the auth messages
/// are a few hundred bytes): an unauthenticated peer cannot make the
/// receiver allocate more.
pub const MAX_UNAUTHENTICATED_PAYLOAD: u32 = 4 << 10;

fn proto(detail: String) -> Error {
    Error::new(Status::Protocol, detail)
}

fn check_magic_version(magic: u32, version: u16) -> Result<()> {
    if magic != MAGIC {
        return Err(proto(format!(
            "bad frame magic 0x{magic:08x} (expected 0x{MAGIC:08x} \"PDXF\"): the peer is not pdxfer or the stream is out of sync"
        )));
    }
    if version != VERSION {
        return Err(proto(format!(
            "peer speaks wire version {version}, this build speaks {VERSION}: upgrade one side"
        )));
    }
    Ok(())
}

/// Writes one control frame.
pub fn write_frame(w: &mut impl Write, ty: FrameType, payload: &[u8]) -> Result<()> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l <= MAX_CONTROL_PAYLOAD)
        .ok_or_else(|| {
            Error::invalid(format!(
                "control payload of {} bytes is too large",
                payload.len()
            ))
        })?;
    let mut buf = Vec::with_capacity(12 + payload.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&(ty as u16).to_le_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()?;
    super::control_counts::frame_sent(ty);
    Ok(())
}

/// Reads one control frame: its type and payload.
pub fn read_frame(r: &mut impl Read) -> Result<(FrameType, Vec<u8>)> {
    read_frame_max(r, MAX_CONTROL_PAYLOAD)
}

/// Reads one control frame whose payload is at most `max` bytes (larger
/// ones are refused from the header, before any allocation).
pub fn read_frame_max(r: &mut impl Read, max: u32) -> Result<(FrameType, Vec<u8>)> {
    let mut h = [0u8; 12];
    r.read_exact(&mut h)?;
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let version = u16::from_le_bytes([h[4], h[5]]);
    check_magic_version(magic, version)?;
    let ty = u16::from_le_bytes([h[6], h[7]]);
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let ty = FrameType::from_u16(ty).ok_or_else(|| proto(format!("unknown frame type {ty}")))?;
    if len > max {
        return Err(proto(format!(
            "{ty:?} frame of {len} bytes exceeds the {max}-byte limit"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    super::control_counts::frame_received(ty);
    Ok((ty, payload))
}

/// Writes one control frame sealed with `mac` (its tag after the payload).
pub fn write_frame_sealed(
    w: &mut impl Write,
    ty: FrameType,
    payload: &[u8],
    mac: &mut SessionMac,
) -> Result<()> {
    let mut buf = Vec::with_capacity(12 + payload.len() + TAG_LEN);
    seal_frame(&mut buf, ty, payload, mac)?;
    w.write_all(&buf)?;
    w.flush()?;
    super::control_counts::frame_sent(ty);
    Ok(())
}

/// Appends one control frame sealed with `mac` to `out` (written later, in
/// the order sealed: the tags are sequenced).
pub fn seal_frame(
    out: &mut Vec<u8>,
    ty: FrameType,
    payload: &[u8],
    mac: &mut SessionMac,
) -> Result<()> {
    let len = u32::try_from(payload.len() + TAG_LEN)
        .ok()
        .filter(|&l| l <= MAX_CONTROL_PAYLOAD)
        .ok_or_else(|| {
            Error::invalid(format!(
                "control payload of {} bytes is too large",
                payload.len()
            ))
        })?;
    let start = out.len();
    out.reserve(12 + payload.len() + TAG_LEN);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(ty as u16).to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    let tag = mac.seal(&out[start..]);
    out.extend_from_slice(&tag);
    Ok(())
}

/// Reads one sealed control frame (payload at most `max` bytes) and checks
/// its tag with `mac`: a frame without one, or with a wrong one, is
/// `ChannelIntegrity` (the caller drops the connection).
pub fn read_frame_sealed(
    r: &mut impl Read,
    max: u32,
    mac: &mut SessionMac,
) -> Result<(FrameType, Vec<u8>)> {
    let mut h = [0u8; 12];
    r.read_exact(&mut h)?;
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let version = u16::from_le_bytes([h[4], h[5]]);
    check_magic_version(magic, version)?;
    let ty = u16::from_le_bytes([h[6], h[7]]);
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let ty = FrameType::from_u16(ty).ok_or_else(|| proto(format!("unknown frame type {ty}")))?;
    if (len as usize) < TAG_LEN {
        return Err(Error::new(
            Status::ChannelIntegrity,
            format!(
                "{ty:?} frame of {len} bytes carries no session MAC (every frame after the \
                 authentication exchange ends with a {TAG_LEN}-byte tag): dropped"
            ),
        ));
    }
    if len > max.saturating_add(TAG_LEN as u32) {
        return Err(proto(format!(
            "{ty:?} frame of {len} bytes exceeds the {max}-byte limit"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    let tag = body.split_off(len as usize - TAG_LEN);
    mac.open_parts(&[&h, &body], &tag)
        .map_err(|e| Error::new(e.status(), format!("{ty:?} frame: {}", e.detail())))?;
    super::control_counts::frame_received(ty);
    Ok((ty, body))
}

/// [`write_json`] sealed with `mac`.
pub fn write_json_sealed<T: serde::Serialize>(
    w: &mut impl Write,
    ty: FrameType,
    v: &T,
    mac: &mut SessionMac,
) -> Result<()> {
    let b = serde_json::to_vec(v).map_err(|e| Error::invalid(format!("encode {ty:?}: {e}")))?;
    write_frame_sealed(w, ty, &b, mac)
}

/// [`read_json`] of a sealed frame, opened with `mac`.
pub fn read_json_sealed<T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
    want: FrameType,
    mac: &mut SessionMac,
) -> Result<T> {
    let (ty, p) = read_frame_sealed(r, MAX_CONTROL_PAYLOAD, mac)?;
    if ty == FrameType::Error {
        return Err(decode_error(&p));
    }
    if ty != want {
        return Err(proto(format!("expected a {want:?} frame, got {ty:?}")));
    }
    serde_json::from_slice(&p).map_err(|e| proto(format!("malformed {want:?} payload: {e}")))
}

/// Serializes `v` as JSON into a control frame.
pub fn write_json<T: serde::Serialize>(w: &mut impl Write, ty: FrameType, v: &T) -> Result<()> {
    let b = serde_json::to_vec(v).map_err(|e| Error::invalid(format!("encode {ty:?}: {e}")))?;
    write_frame(w, ty, &b)
}

/// Reads a control frame of type `want` and decodes its JSON payload; an
/// `Error` frame becomes the error it carries.
pub fn read_json<T: serde::de::DeserializeOwned>(r: &mut impl Read, want: FrameType) -> Result<T> {
    read_json_max(r, want, MAX_CONTROL_PAYLOAD)
}

/// [`read_json`] with a payload limit of `max` bytes.
pub fn read_json_max<T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
    want: FrameType,
    max: u32,
) -> Result<T> {
    let (ty, p) = read_frame_max(r, max)?;
    if ty == FrameType::Error {
        return Err(decode_error(&p));
    }
    if ty != want {
        return Err(proto(format!("expected a {want:?} frame, got {ty:?}")));
    }
    serde_json::from_slice(&p).map_err(|e| proto(format!("malformed {want:?} payload: {e}")))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct WireError {
    code: i32,
    detail: String,
}

/// Encodes an error for an `Error` frame.
pub fn encode_error(e: &Error) -> Vec<u8> {
    serde_json::to_vec(&WireError {
        code: e.status() as i32,
        detail: e.detail().to_string(),
    })
    .unwrap_or_default()
}

/// Decodes the payload of an `Error` frame.
pub fn decode_error(p: &[u8]) -> Error {
    match serde_json::from_slice::<WireError>(p) {
        Ok(w) => Error::new(
            Status::from_code(w.code).unwrap_or(Status::Protocol),
            format!("peer refused: {}", w.detail),
        ),
        Err(_) => proto("peer sent an undecodable error frame".into()),
    }
}

/// A little-endian record reader over a payload.
pub struct Cursor<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    /// Reads fields of the `what` message from `b`.
    pub fn new(b: &'a [u8], what: &'static str) -> Self {
        Cursor { b, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(proto(format!("truncated {} message", self.what)));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    /// Next u64.
    pub fn u64(&mut self) -> Result<u64> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
    }

    /// Next u32.
    pub fn u32(&mut self) -> Result<u32> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
    }

    /// Next i32.
    pub fn i32(&mut self) -> Result<i32> {
        Ok(self.u32()? as i32)
    }

    /// The remaining bytes as UTF-8 text (lossy).
    pub fn rest_str(&mut self) -> String {
        let s = String::from_utf8_lossy(self.b).into_owned();
        self.b = &[];
        s
    }

    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(proto(format!(
                "{} trailing bytes in {} message",
                self.b.len(),
                self.what
            )))
        }
    }
}

/// One destination range of a cma write intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Destination region id.
    pub region: u64,
    /// Offset inside the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Encodes an intent: `batch u64 | n u32 | n x (region, offset, len)`.
pub fn encode_intent(batch: u64, ranges: &[Range]) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + 24 * ranges.len());
    b.extend_from_slice(&batch.to_le_bytes());
    b.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for r in ranges {
        b.extend_from_slice(&r.region.to_le_bytes());
        b.extend_from_slice(&r.offset.to_le_bytes());
        b.extend_from_slice(&r.len.to_le_bytes());
    }
    b
}

/// Decodes an intent.
pub fn decode_intent(p: &[u8]) -> Result<(u64, Vec<Range>)> {
    let mut c = Cursor::new(p, "intent");
    let batch = c.u64()?;
    let n = c.u32()? as usize;
    if p.len() != 12 + 24 * n {
        return Err(proto(format!(
            "intent says {n} ranges but carries {} bytes",
            p.len()
        )));
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(Range {
            region: c.u64()?,
            offset: c.u64()?,
            len: c.u64()?,
        });
    }
    Ok((batch, v))
}

/// The commit record: sent after the last byte of a batch was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Batch id.
    pub batch: u64,
    /// Total bytes written.
    pub bytes: u64,
    /// Checksum over the written pieces, when requested.
    pub checksum: Option<u64>,
    /// Caller tag (room id).
    pub room: u64,
    /// Caller epoch.
    pub epoch: u64,
}

/// Encodes a commit.
pub fn encode_commit(c: &Commit) -> Vec<u8> {
    let mut b = Vec::with_capacity(44);
    b.extend_from_slice(&c.batch.to_le_bytes());
    b.extend_from_slice(&c.bytes.to_le_bytes());
    b.extend_from_slice(&u32::from(c.checksum.is_some()).to_le_bytes());
    b.extend_from_slice(&c.checksum.unwrap_or(0).to_le_bytes());
    b.extend_from_slice(&c.room.to_le_bytes());
    b.extend_from_slice(&c.epoch.to_le_bytes());
    b
}

/// Decodes a commit.
pub fn decode_commit(p: &[u8]) -> Result<Commit> {
    let mut c = Cursor::new(p, "commit");
    let batch = c.u64()?;
    let bytes = c.u64()?;
    let has = c.u32()?;
    let sum = c.u64()?;
    let room = c.u64()?;
    let epoch = c.u64()?;
    c.finish()?;
    Ok(Commit {
        batch,
        bytes,
        checksum: (has != 0).then_some(sum),
        room,
        epoch,
    })
}

/// Encodes `batch u64 | code i32 | reason` (Refuse, Nack).
pub fn encode_reason(batch: u64, e: &Error) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&batch.to_le_bytes());
    b.extend_from_slice(&(e.status() as i32).to_le_bytes());
    b.extend_from_slice(e.detail().as_bytes());
    b
}

/// Decodes a Refuse/Nack payload into the batch id and the error it names.
pub fn decode_reason(p: &[u8]) -> Result<(u64, Error)> {
    let mut c = Cursor::new(p, "refusal");
    let batch = c.u64()?;
    let code = c.i32()?;
    let detail = c.rest_str();
    Ok((
        batch,
        Error::new(
            Status::from_code(code).unwrap_or(Status::BatchFailed),
            format!("receiver refused: {detail}"),
        ),
    ))
}

/// Decodes a payload that is only a batch id (Grant, Ack, Abort).
pub fn decode_batch(p: &[u8]) -> Result<u64> {
    let mut c = Cursor::new(p, "batch id");
    let b = c.u64()?;
    c.finish()?;
    Ok(b)
}

/// Data frame flag: the receiver sums piece checksums for this batch.
pub const DATA_FLAG_CHECKSUM: u32 = 1;
/// Data frame flag: a piece of a granted room; the header's batch field
/// carries the room grant's token, and the piece is checked against it.
pub const DATA_FLAG_ROOM: u32 = 2;

/// Header of one tcp data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// `DATA_FLAG_*` bits.
    pub flags: u32,
    /// Batch id (with [`DATA_FLAG_ROOM`]: the room grant's token).
    pub batch: u64,
    /// Destination region.
    pub region: u64,
    /// Offset in the destination region.
    pub offset: u64,
    /// Payload bytes following the header.
    pub len: u64,
}

impl DataHeader {
    /// The 48 header bytes.
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut b = [0u8; DATA_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(FrameType::Data as u16).to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.batch.to_le_bytes());
        b[24..32].copy_from_slice(&self.region.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses and checks magic, version and type.
    pub fn decode(b: &[u8; DATA_HEADER_LEN]) -> Result<DataHeader> {
        let u64at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        check_magic_version(
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            u16::from_le_bytes([b[4], b[5]]),
        )?;
        let ty = u16::from_le_bytes([b[6], b[7]]);
        if ty != FrameType::Data as u16 {
            return Err(proto(format!(
                "expected a data frame on a data stream, got type {ty}"
            )));
        }
        Ok(DataHeader {
            flags: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            batch: u64at(16),
            region: u64at(24),
            offset: u64at(32),
            len: u64at(40),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_roundtrip_and_bad_magic_version_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FrameType::Grant, &7u64.to_le_bytes()).unwrap();
        let (ty, p) = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(ty, FrameType::Grant);
        assert_eq!(decode_batch(&p).unwrap(), 7);
        let mut bad = buf.clone();
        bad[0] ^= 1;
        assert_eq!(
            read_frame(&mut bad.as_slice()).unwrap_err().status(),
            Status::Protocol
        );
        let mut bad = buf.clone();
        bad[4] = 9;
        let e = read_frame(&mut bad.as_slice()).unwrap_err();
        assert!(e.detail().contains("version 9"), "{e}");
        let mut huge = buf.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            read_frame(&mut huge.as_slice()).unwrap_err().status(),
            Status::Protocol
        );
        // Truncated stream: the peer went away.
        let e = read_frame(&mut &buf[..5]).unwrap_err();
        assert_eq!(e.status(), Status::PeerUnreachable);
    }

    fn keys() -> (crate::auth::SessionKeys, crate::auth::SessionKeys) {
        use crate::auth::{Channel, ClientAuth, Mode, ServerAuth};
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let (c, hello) = ClientAuth::start(&m, Channel::Data, [1; 16]).unwrap();
        let (s, ch) = ServerAuth::challenge(&m, Channel::Data, [2; 16], &hello).unwrap();
        let (p, _, ck) = c.answer_keyed(&ch).unwrap();
        let (_, sk) = s.verify_keyed(&p).unwrap();
        (ck, sk)
    }

    #[test]
    fn sealed_frames_refuse_tampering_replay_reordering_and_plain_frames() {
        let (mut c, s) = keys();
        let mut buf = Vec::new();
        write_frame_sealed(&mut buf, FrameType::Grant, &7u64.to_le_bytes(), &mut c.send).unwrap();
        let first = buf.clone();
        write_frame_sealed(&mut buf, FrameType::Ack, &8u64.to_le_bytes(), &mut c.send).unwrap();
        let second = buf[first.len()..].to_vec();
        // In order: both open.
        let mut r = buf.as_slice();
        let mut rx = s.recv.clone();
        assert_eq!(
            read_frame_sealed(&mut r, MAX_CONTROL_PAYLOAD, &mut rx).unwrap(),
            (FrameType::Grant, 7u64.to_le_bytes().to_vec())
        );
        assert_eq!(
            read_frame_sealed(&mut r, MAX_CONTROL_PAYLOAD, &mut rx)
                .unwrap()
                .0,
            FrameType::Ack
        );
        let integrity = |bytes: &[u8], mac: &mut SessionMac| {
            let e = read_frame_sealed(&mut &bytes[..], MAX_CONTROL_PAYLOAD, mac).unwrap_err();
            assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
            e
        };
        // A payload byte, the type, or the tag altered.
        for at in [12, 6, first.len() - 1] {
            let mut bad = first.clone();
            bad[at] ^= 1;
            if at == 6 {
                bad[at] = FrameType::Ack as u8;
            }
            integrity(&bad, &mut s.recv.clone());
        }
        // Reordered: the second frame first.
        integrity(&second, &mut s.recv.clone());
        // Replayed: the first frame twice.
        let mut rx = s.recv.clone();
        read_frame_sealed(&mut first.as_slice(), MAX_CONTROL_PAYLOAD, &mut rx).unwrap();
        integrity(&first, &mut rx);
        // A plain (unsealed) frame: no tag, or a payload read as one.
        let mut plain = Vec::new();
        write_frame(&mut plain, FrameType::Keepalive, &[]).unwrap();
        let e = integrity(&plain, &mut s.recv.clone());
        assert!(e.detail().contains("no session MAC"), "{e}");
        let mut plain = Vec::new();
        write_frame(&mut plain, FrameType::Grant, &[0; 24]).unwrap();
        integrity(&plain, &mut s.recv.clone());
        // The other direction's key does not open it.
        integrity(&first, &mut c.recv);
    }

    #[test]
    fn records_roundtrip_and_truncation_is_protocol() {
        let r = vec![
            Range {
                region: 1,
                offset: 2,
                len: 3,
            },
            Range {
                region: 4,
                offset: 5,
                len: 6,
            },
        ];
        let p = encode_intent(9, &r);
        assert_eq!(decode_intent(&p).unwrap(), (9, r));
        assert_eq!(
            decode_intent(&p[..p.len() - 1]).unwrap_err().status(),
            Status::Protocol
        );
        let c = Commit {
            batch: 1,
            bytes: 2,
            checksum: Some(3),
            room: 4,
            epoch: 5,
        };
        assert_eq!(decode_commit(&encode_commit(&c)).unwrap(), c);
        let c2 = Commit {
            checksum: None,
            ..c
        };
        assert_eq!(decode_commit(&encode_commit(&c2)).unwrap(), c2);
        let (b, e) =
            decode_reason(&encode_reason(5, &Error::new(Status::OutOfBounds, "x"))).unwrap();
        assert_eq!((b, e.status()), (5, Status::OutOfBounds));
        let h = DataHeader {
            flags: 1,
            batch: 2,
            region: 3,
            offset: 4,
            len: 5,
        };
        assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[6] = 3;
        assert!(DataHeader::decode(&bad).is_err());
    }
}
