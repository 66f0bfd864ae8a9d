//! The engine's rank-to-rank control channel: versioned JSON messages, one per
//! line, over TCP (decode connects to the prefill rank's `ctl` endpoint).
//!
//! Unlike SGLang's positional ZMQ frames, every message is named and typed,
//! carries the sender's instance id and epoch, and the first exchange
//! re-checks what the bootstrap advertised (`bootstrap::peer::verify_peer`).
//!
//! After the three authentication lines every line carries a session MAC
//! ([`crate::auth::SessionMac`]): the message's JSON, a space, and the tag
//! (32 hex digits) over the per-direction sequence number and exactly those
//! JSON bytes. A line with a missing or wrong tag (altered, injected,
//! replayed, reordered, or sent by a relay that only passed the exchange
//! through) is `channel_integrity` and the connection is dropped.

use super::gpu_identity::GpuIdentity;
use crate::auth::{
    AuthChallenge, AuthHello, AuthProof, Channel, ClientAuth, Mode, PeerInstance, SessionKeys,
    SessionMac, TAG_LEN,
};
use crate::bootstrap::schema::PeerHello;
use crate::error::{Error, Result, Status};
use crate::transport::auth_exchange::AuthCodec;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Mutex;

/// Version of the control protocol; a peer with another version is refused.
/// Version 2: every line after the authentication exchange carries a session MAC.
/// Version 3: the decode's Hello lists its KV pools' page strides
/// ([`RegionMap::kv_stride`]), which a version-2 prefill would ignore and
/// write strided pools as if their pages were end to end; the decode tells
/// each dummy target of a room that it needs nothing from it
/// ([`CtlMsg::DummyMeta`]).
pub const CONTROL_VERSION: u32 = 3;
/// Largest accepted control line (a page list of a very long request fits).
pub const MAX_LINE: usize = 64 << 20;
/// Largest line accepted before the peer authenticated (the auth messages
/// are a few hundred bytes).
pub const MAX_UNAUTHENTICATED_LINE: usize = 4 << 10;

/// Where the decode rank's regions are, by purpose.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionMap {
    /// (layer id, region id of that KV entry's pool). A list, not a map:
    /// internally tagged messages cannot carry integer map keys in JSON.
    pub kv: Vec<(u32, u64)>,
    /// Per aux buffer: (region id, item bytes).
    pub aux: Vec<(u64, u64)>,
    /// Per state buffer: (region id, item bytes).
    #[serde(default)]
    pub state: Vec<(u64, u64)>,
    /// (layer id, page stride in bytes) of each KV pool whose pages are not
    /// end to end ([`PoolGeometry`](crate::layout::PoolGeometry)); a layer
    /// not listed has `page_stride == page_bytes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_stride: Vec<(u32, u64)>,
}

impl RegionMap {
    /// The page stride of layer `layer`'s pool (0: its page bytes).
    pub fn kv_page_stride(&self, layer: u32) -> u64 {
        self.kv_stride
            .iter()
            .find(|(l, _)| *l == layer)
            .map_or(0, |(_, s)| *s)
    }

    /// The page step of the decode's pools (1: pages end to end), from its
    /// topology's page bytes and the strides listed; a stride that is no
    /// whole number of pages, or steps that differ between pools, are refused.
    pub fn page_step(&self, topo: &crate::layout::Topology) -> Result<u64> {
        if self.kv_stride.is_empty() {
            return Ok(1);
        }
        let page = u64::from(topo.page_size);
        let geoms = topo
            .entries
            .iter()
            .map(|e| {
                let stride = self.kv_page_stride(e.layer_id);
                crate::layout::PoolGeometry::new(e.row_bytes * page, stride, 1).map_err(|err| {
                    Error::new(
                        err.status(),
                        format!("decode KV pool of layer {}: {}", e.layer_id, err.detail()),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        crate::layout::side_page_step(&geoms)
    }

    /// The region holding layer `layer`'s pool.
    pub fn kv_region(&self, layer: u32) -> Option<u64> {
        self.kv.iter().find(|(l, _)| *l == layer).map(|(_, r)| *r)
    }
}

/// The grant part of a Meta: the token the receiver issued and whom for;
/// the ranges follow from the Meta's pages and rows (the same on both sides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaGrant {
    /// The grant's token.
    pub token: u64,
    /// The decode's epoch of the room (its attempt).
    pub epoch: u64,
    /// The prefill instance the grant is for.
    pub grantee: [u8; 16],
    /// Milliseconds the grant lives from its issue.
    pub expires_in_ms: u64,
}

impl MetaGrant {
    /// The grant as the transport takes it, with its ranges.
    pub(crate) fn with_ranges(
        &self,
        room: u64,
        ranges: Vec<crate::transport::room::GrantRange>,
    ) -> crate::transport::room::RoomGrant {
        crate::transport::room::RoomGrant {
            token: self.token,
            room,
            epoch: self.epoch,
            grantee: self.grantee,
            expires_in_ms: self.expires_in_ms,
            ranges,
        }
    }
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CtlMsg {
    /// Decode -> prefill, the first message of a connection: the decode's
    /// instance id and nonce ([`crate::auth`]).
    AuthHello {
        /// The client's half of the exchange.
        auth: AuthHello,
    },
    /// Prefill -> decode: the prefill's instance id, nonce and proof (the
    /// only answer an unauthenticated peer gets besides a refusal).
    AuthChallenge {
        /// The server's half of the exchange.
        auth: AuthChallenge,
    },
    /// Decode -> prefill: the decode's proof.
    AuthProof {
        /// The client's proof.
        auth: AuthProof,
    },
    /// Decode -> prefill, first message once authenticated: who I am and where my data goes.
    Hello {
        /// Protocol version.
        version: u32,
        /// The decode rank's self-description (instance id, epoch, topology).
        hello: PeerHello,
        /// The decode agent's data address (the prefill connects to it).
        data_addr: String,
        /// The decode rank's regions by purpose.
        regions: RegionMap,
        /// The GPU of the decode's device pools (absent: host pools, or an
        /// older peer).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<GpuIdentity>,
    },
    /// Prefill -> decode: the answer to Hello.
    HelloAck {
        /// Protocol version.
        version: u32,
        /// The prefill rank's self-description.
        hello: PeerHello,
        /// The GPU of the prefill's device pools (absent: host pools, or an
        /// older peer).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<GpuIdentity>,
    },
    /// Decode -> prefill, per room: where the request's KV goes.
    Meta {
        /// Room id.
        room: u64,
        /// The decode room's attempt (echoed in status messages).
        attempt: u64,
        /// Destination (virtual) page ids after the decode prefix.
        dst_pages: Vec<u64>,
        /// Tokens the decode side already holds.
        decode_prefix_len: u64,
        /// Row of the decode aux buffers for this request.
        aux_index: u64,
        /// Row of each decode state buffer for this request (empty: no state).
        #[serde(default)]
        state_indices: Vec<u64>,
        /// How many decode ranks the prefill rank waits for in this room.
        required_dst_info_num: u32,
        /// Room deadline in milliseconds (0: the prefill's default).
        timeout_ms: u64,
        /// The room's grant to this prefill rank, when the decode issued one.
        #[serde(default)]
        grant: Option<MetaGrant>,
    },
    /// Decode -> prefill, per room: this prefill rank is a dummy target of
    /// the room (a TP replica of MLA KV that another prefill rank sends to
    /// this decode rank): it sends nothing and concludes the room with its
    /// last chunk.
    DummyMeta {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
        /// Tokens the decode side already holds (the prefix the prefill's
        /// TP group skips on every rank).
        decode_prefix_len: u64,
    },
    /// Decode -> prefill: give up the room.
    Abort {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
    },
    /// Prefill -> decode: the room ended on this prefill rank.
    Status {
        /// Room id.
        room: u64,
        /// The decode room's attempt this answers.
        attempt: u64,
        /// True when every byte landed and was acknowledged.
        ok: bool,
        /// SGLang's prefill_unique_rank of the sender.
        prefill_rank: u32,
        /// Bytes written for this decode rank.
        bytes: u64,
        /// Failure reason, when not ok.
        reason: Option<String>,
        /// Stable status code of the failure, when not ok.
        code: Option<i32>,
    },
    /// Prefill -> decode: the abort is fenced (no write for the room can still land).
    AbortAck {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
    },
    /// Prefill -> decode (transport nccl): join communicator `generation` of
    /// this link, made from the prefill's NCCL unique id (rank 0 is the
    /// prefill, rank 1 the decode). A later generation replaces an earlier
    /// one (after a failure, or a new peer epoch).
    NcclOpen {
        /// Communicator generation on this link, from 1.
        generation: u64,
        /// `ncclUniqueId`, 256 lower-case hex characters.
        id: String,
    },
    /// Prefill -> decode (transport nccl): the prefill's half of one chunk of
    /// a room. The decode builds the same plan from it and its own geometry,
    /// checks `digest` (`nccl_plan_mismatch`, nothing posted, otherwise),
    /// answers `nccl_accepted`, posts the matching recvs, and answers
    /// `nccl_ready` once they completed.
    NcclChunk {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
        /// The communicator the sends go on.
        generation: u64,
        /// First sequence position of the chunk.
        start: u64,
        /// Sequence positions in the chunk.
        num_tokens: u64,
        /// The prefill's pages of the chunk (they shape the plan's runs).
        src_pages: Vec<u64>,
        /// The decode pages of the room, as the decode's metadata gave them
        /// (the decode refuses a chunk naming others, and plans from its own).
        dst_pages: Vec<u64>,
        /// The decode prefix of the room's metadata (checked the same way).
        decode_prefix_len: u64,
        /// The prefill plan's digest (`NcclPlan::digest`).
        digest: u64,
    },
    /// Decode -> prefill (transport nccl): the chunk's plan matched and its
    /// recvs are being posted (`ok`), or the chunk was refused before
    /// anything was posted on either side (reason and code, e.g.
    /// `nccl_plan_mismatch`); the prefill posts its sends only after `ok`.
    NcclAccepted {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
        /// The communicator of the chunk.
        generation: u64,
        /// The chunk's first position.
        start: u64,
        /// True when the recvs are being posted.
        ok: bool,
        /// Failure reason, when not ok.
        reason: Option<String>,
        /// Stable status code of the failure, when not ok.
        code: Option<i32>,
    },
    /// Decode -> prefill (transport nccl): the chunk's recvs completed on the
    /// decode's stream (and the staged scatter ran): its bytes are in the
    /// pools (`ok`), or they failed (reason and code).
    NcclReady {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
        /// The communicator of the chunk.
        generation: u64,
        /// The chunk's first position.
        start: u64,
        /// True when every byte of the chunk landed.
        ok: bool,
        /// Failure reason, when not ok.
        reason: Option<String>,
        /// Stable status code of the failure, when not ok.
        code: Option<i32>,
    },
}

/// A framed control connection (one writer lock; one reader thread owns the reader).
///
/// Before [`authenticate_to_prefill`] / [`install`] installed the
/// connection's keys it writes bare lines (the three authentication lines);
/// after, every line is sealed: one lock covers the sequence number and the
/// write, so the order of sequence numbers is the order on the wire.
#[derive(Debug)]
pub struct CtlWriter {
    inner: Mutex<WriterState>,
}

#[derive(Debug)]
struct WriterState {
    stream: TcpStream,
    seal: Option<SessionMac>,
}

impl CtlWriter {
    /// Wraps the write half.
    pub fn new(stream: TcpStream) -> CtlWriter {
        CtlWriter {
            inner: Mutex::new(WriterState { stream, seal: None }),
        }
    }

    /// From now on every line is sealed with `key` (this side's send key).
    pub fn seal_with(&self, key: SessionMac) {
        self.lock().seal = Some(key);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WriterState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends one message.
    pub fn send(&self, m: &CtlMsg) -> Result<()> {
        let mut line =
            serde_json::to_vec(m).map_err(|e| Error::new(Status::Protocol, e.to_string()))?;
        let mut st = self.lock();
        if let Some(k) = st.seal.as_mut() {
            let tag = k.seal_hex(&line);
            line.push(b' ');
            line.extend_from_slice(tag.as_bytes());
        }
        line.push(b'\n');
        st.stream.write_all(&line)?;
        drop(st);
        crate::transport::control_counts::engine_sent();
        Ok(())
    }

    /// Closes both directions (wakes the reader).
    pub fn shutdown(&self) {
        let _ = self.lock().stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Reads framed messages; once the connection's keys are installed, every
/// line must carry a valid session MAC.
pub struct CtlReader {
    r: BufReader<std::io::Chain<std::io::Cursor<Vec<u8>>, TcpStream>>,
    buf: Vec<u8>,
    open: Option<(SessionMac, String)>,
}

impl CtlReader {
    /// Wraps the read half.
    pub fn new(stream: TcpStream) -> CtlReader {
        CtlReader::with_prefix(stream, Vec::new())
    }

    /// Wraps the read half, whose first bytes (`prefix`) were already read
    /// from it (by the listener, after the authentication exchange).
    pub fn with_prefix(stream: TcpStream, prefix: Vec<u8>) -> CtlReader {
        CtlReader {
            r: BufReader::new(std::io::Cursor::new(prefix).chain(stream)),
            buf: Vec::new(),
            open: None,
        }
    }

    /// From now on every line must open under `key` (this side's receive
    /// key); `peer` names the sender in a `channel_integrity` error.
    pub fn open_with(&mut self, key: SessionMac, peer: &str) {
        self.open = Some((key, peer.to_string()));
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub fn recv(&mut self) -> Result<Option<CtlMsg>> {
        self.recv_max(MAX_LINE)
    }

    /// The next message of at most `max` bytes (a longer one is refused
    /// once `max + 1` bytes were read, never buffered whole).
    pub fn recv_max(&mut self, max: usize) -> Result<Option<CtlMsg>> {
        self.buf.clear();
        let n = (&mut self.r)
            .take(max as u64 + 1)
            .read_until(b'\n', &mut self.buf)?;
        if n == 0 {
            return Ok(None);
        }
        if self.buf.last() != Some(&b'\n') {
            return Err(Error::new(
                Status::Protocol,
                if n > max {
                    format!("control message longer than {max} bytes")
                } else {
                    "control connection closed in the middle of a message".to_string()
                },
            ));
        }
        crate::transport::control_counts::engine_received();
        let line = &self.buf[..n - 1];
        let Some((key, peer)) = self.open.as_mut() else {
            return decode_line(line).map(Some);
        };
        let (body, tag) = split_tag(line);
        key.open_hex(body, tag).map_err(|e| {
            Error::new(
                e.status(),
                format!("control channel from {peer}: {}", e.detail()),
            )
        })?;
        decode_line(body).map(Some)
    }

    /// The last line read (without its newline), tag included: what a
    /// handshake inspects when it failed its MAC (an older peer's bare line).
    fn last_line(&self) -> &[u8] {
        let b = &self.buf[..];
        b.strip_suffix(b"\n").unwrap_or(b)
    }

    /// [`recv`](Self::recv) of the first line after the authentication
    /// exchange: a bare line (no MAC) of an older control protocol is
    /// refused as that version mismatch (`protocol`, naming both versions and,
    /// as unauthenticated, what the peer said), not as `channel_integrity`.
    pub fn recv_first(&mut self) -> Result<Option<CtlMsg>> {
        match self.recv() {
            Err(e) if e.status() == Status::ChannelIntegrity => {
                let peer = self
                    .open
                    .as_ref()
                    .map(|(_, p)| p.clone())
                    .unwrap_or_default();
                Err(match decode_line(self.last_line()) {
                    Ok(m) => older_peer(&peer, &m).unwrap_or(e),
                    Err(_) => e,
                })
            }
            r => r,
        }
    }
}

/// What an older peer's refusal says (see [`is_older_peer`]).
const OLDER_PEER: &str = "speaks an older control protocol";

/// True for the refusal [`CtlReader::recv_first`] gives a peer of an older
/// control protocol (it reads only bare lines: answer it bare).
pub fn is_older_peer(e: &Error) -> bool {
    e.status() == Status::Protocol && e.detail().contains(OLDER_PEER)
}

/// The refusal of a peer whose first line after authentication came bare:
/// it speaks a control protocol before [`CONTROL_VERSION`].
fn older_peer(peer: &str, m: &CtlMsg) -> Option<Error> {
    let said = match m {
        CtlMsg::Hello { version, .. } | CtlMsg::HelloAck { version, .. } => {
            format!("control protocol {version}")
        }
        CtlMsg::Status {
            ok: false, reason, ..
        } => format!(
            "an unsealed refusal (control protocol 1; unauthenticated: {:?})",
            reason.as_deref().unwrap_or_default()
        ),
        _ => return None,
    };
    Some(Error::new(
        Status::Protocol,
        format!(
            "{peer} {OLDER_PEER}: its first line after authentication carries no session MAC ({said}), this build speaks control protocol {CONTROL_VERSION}; run the same pdxfer version on every rank"
        ),
    ))
}

/// A sealed line's JSON and its tag: the line is `JSON SP TAG`, the tag
/// [`TAG_LEN`] bytes in hex. A line without that shape gives an empty tag
/// (refused by the MAC check).
fn split_tag(line: &[u8]) -> (&[u8], &str) {
    let n = line.len();
    let t = 2 * TAG_LEN;
    if n > t && line[n - t - 1] == b' ' {
        if let Ok(tag) = std::str::from_utf8(&line[n - t..]) {
            return (&line[..n - t - 1], tag);
        }
    }
    (line, "")
}

/// One control message from its line (without the `\n`).
pub fn decode_line(line: &[u8]) -> Result<CtlMsg> {
    serde_json::from_slice(line)
        .map_err(|e| Error::new(Status::Protocol, format!("malformed control message: {e}")))
}

use std::io::Read as _;

/// Decode side of the control channel's authentication: proves the secret
/// and checks that the prefill is `expect` (the instance its bootstrap entry
/// names; `PeerIdentity` naming both otherwise, before this side's proof).
/// `peer` names the prefill in errors. On success the connection's
/// [`SessionKeys`] are installed in `writer` and `reader` (every later line
/// is sealed and checked; no caller can forget to) and the prefill's
/// instance is returned.
pub fn authenticate_to_prefill(
    writer: &CtlWriter,
    reader: &mut CtlReader,
    mode: &Mode,
    instance: [u8; 16],
    expect: PeerInstance,
    peer: &str,
) -> Result<PeerInstance> {
    let ctx = |e: Error| {
        Error::new(
            e.status(),
            format!("control channel to prefill {peer}: {}", e.detail()),
        )
    };
    let (client, hello) = ClientAuth::start(mode, Channel::Control, instance)?;
    writer
        .send(&CtlMsg::AuthHello { auth: hello })
        .map_err(ctx)?;
    let ch = match reader.recv_max(MAX_UNAUTHENTICATED_LINE).map_err(ctx)? {
        Some(CtlMsg::AuthChallenge { auth }) => auth,
        Some(CtlMsg::Status {
            ok: false,
            reason,
            code,
            ..
        }) => {
            return Err(ctx(Error::new(
                code.and_then(Status::from_code).unwrap_or(Status::Protocol),
                format!("refused: {}", reason.unwrap_or_default()),
            )))
        }
        Some(other) => {
            return Err(ctx(Error::new(
                Status::Protocol,
                format!("expected auth_challenge, got {other:?}"),
            )))
        }
        None => {
            return Err(ctx(Error::new(
                Status::PeerUnreachable,
                "closed during authentication",
            )))
        }
    };
    let (proof, got, keys) = client.answer_keyed(&ch).map_err(ctx)?;
    if got != expect {
        return Err(ctx(Error::new(
            Status::PeerIdentity,
            format!(
                "it authenticated as instance {got}, but the bootstrap entry names instance {expect}"
            ),
        )));
    }
    writer
        .send(&CtlMsg::AuthProof { auth: proof })
        .map_err(ctx)?;
    install(writer, reader, keys, &format!("prefill {peer}"));
    Ok(got)
}

/// Every line after the authentication exchange is sealed (`writer`) and
/// checked (`reader`) under the connection's keys; `peer` names the other
/// side in a `channel_integrity` error.
pub fn install(writer: &CtlWriter, reader: &mut CtlReader, keys: SessionKeys, peer: &str) {
    let SessionKeys { send, recv, .. } = keys;
    writer.seal_with(send);
    reader.open_with(recv, peer);
}

/// The answer to a Hello that cannot be accepted.
pub fn refusal(e: &Error) -> CtlMsg {
    CtlMsg::Status {
        room: 0,
        attempt: 0,
        ok: false,
        prefill_rank: 0,
        bytes: 0,
        reason: Some(e.detail().to_string()),
        code: Some(e.status() as i32),
    }
}

/// The control channel's authentication lines as the listener's poll loop
/// reads them: `auth_hello`, then `auth_proof`, each one JSON line of at
/// most [`MAX_UNAUTHENTICATED_LINE`] bytes; the challenge and a refusal are
/// bare lines (no keys exist yet).
pub struct CtlAuth;

impl CtlAuth {
    fn line(m: &[u8]) -> Result<CtlMsg> {
        let line = m.strip_suffix(b"\n").unwrap_or(m);
        if line.len() > MAX_UNAUTHENTICATED_LINE {
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "a {}-byte line: before authenticating, lines are at most {MAX_UNAUTHENTICATED_LINE} bytes",
                    line.len()
                ),
            ));
        }
        decode_line(line)
    }

    fn bare(m: &CtlMsg) -> Result<Vec<u8>> {
        let mut b =
            serde_json::to_vec(m).map_err(|e| Error::new(Status::Protocol, e.to_string()))?;
        b.push(b'\n');
        Ok(b)
    }
}

impl AuthCodec for CtlAuth {
    fn hello(&self, msg: &[u8]) -> Result<AuthHello> {
        crate::transport::control_counts::engine_received();
        match Self::line(msg)? {
            CtlMsg::AuthHello { auth } => Ok(auth),
            _ => Err(Error::new(
                Status::AuthRequired,
                "the first control message must be auth_hello: this prefill accepts only authenticated decode ranks (same pdxfer version and cluster secret)",
            )),
        }
    }

    fn challenge(&self, ch: &AuthChallenge) -> Result<Vec<u8>> {
        let b = Self::bare(&CtlMsg::AuthChallenge { auth: ch.clone() })?;
        crate::transport::control_counts::engine_sent();
        Ok(b)
    }

    fn proof(&self, msg: &[u8]) -> Result<AuthProof> {
        crate::transport::control_counts::engine_received();
        match Self::line(msg)? {
            CtlMsg::AuthProof { auth } => Ok(auth),
            _ => Err(Error::new(
                Status::AuthRequired,
                "expected auth_proof after the challenge",
            )),
        }
    }

    fn refusal(&self, e: &Error) -> Vec<u8> {
        log::warn!("prefill control channel: refused a peer: {e}");
        Self::bare(&refusal(e)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::ServerAuth;
    use std::net::TcpListener;

    #[test]
    fn roundtrip_and_malformed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = CtlReader::new(s.try_clone().unwrap());
            let a = r.recv().unwrap().unwrap();
            let b = r.recv();
            (a, b.map_err(|e| e.status()))
        });
        let s = TcpStream::connect(addr).unwrap();
        let w = CtlWriter::new(s.try_clone().unwrap());
        let m = CtlMsg::Abort {
            room: 7,
            attempt: 2,
        };
        w.send(&m).unwrap();
        let mut raw = s;
        raw.write_all(b"{\"type\":\"nope\"}\n").unwrap();
        let (a, b) = t.join().unwrap();
        assert_eq!(a, m);
        assert_eq!(b.unwrap_err(), Status::Protocol);
    }

    const D: [u8; 16] = [0xD; 16];
    const P: [u8; 16] = [0xE; 16];

    /// The two sides' keys of one exchange: (decode's, prefill's).
    fn keys(m: &Mode) -> (SessionKeys, SessionKeys) {
        let (c, hello) = ClientAuth::start(m, Channel::Control, D).unwrap();
        let (s, ch) = ServerAuth::challenge(m, Channel::Control, P, &hello).unwrap();
        let (proof, _, ck) = c.answer_keyed(&ch).unwrap();
        let (_, sk) = s.verify_keyed(&proof).unwrap();
        (ck, sk)
    }

    fn socket_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// The exact lines a writer sealing with `key` puts on the wire for `msgs`.
    fn wire_lines(key: SessionMac, msgs: &[CtlMsg]) -> Vec<Vec<u8>> {
        let (a, b) = socket_pair();
        let w = CtlWriter::new(a);
        w.seal_with(key);
        let mut r = BufReader::new(b);
        msgs.iter()
            .map(|m| {
                w.send(m).unwrap();
                let mut line = Vec::new();
                r.read_until(b'\n', &mut line).unwrap();
                line
            })
            .collect()
    }

    /// What a reader opening with `key` makes of `lines`, in order (it
    /// stops at the first error, as the connection is then dropped).
    fn read_lines(key: SessionMac, lines: &[Vec<u8>]) -> Vec<Result<CtlMsg>> {
        let (mut a, b) = socket_pair();
        for l in lines {
            a.write_all(l).unwrap();
        }
        drop(a);
        let mut r = CtlReader::new(b);
        r.open_with(key, "prefill p0 at 127.0.0.1:1");
        let mut out = Vec::new();
        while let Some(m) = r.recv().transpose() {
            let stop = m.is_err();
            out.push(m);
            if stop {
                break;
            }
        }
        out
    }

    fn abort(room: u64) -> CtlMsg {
        CtlMsg::Abort { room, attempt: 1 }
    }

    fn integrity(r: &Result<CtlMsg>) -> String {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
        assert!(e.detail().contains("prefill p0 at 127.0.0.1:1"), "{e}");
        e.detail().to_string()
    }

    #[test]
    fn sealed_lines_open_in_order_and_carry_their_tag_as_a_suffix() {
        for m in [
            Mode::from_option(Some("0123456789abcdef-ctl")).unwrap(),
            Mode::Open,
        ] {
            let (d, p) = keys(&m);
            let msgs = [abort(1), abort(2), abort(3)];
            let lines = wire_lines(p.send.clone(), &msgs);
            // JSON, a space, 32 hex digits, the newline
            let l = &lines[0];
            assert_eq!(l[l.len() - 2 * TAG_LEN - 2], b' ');
            assert!(serde_json::from_slice::<CtlMsg>(&l[..l.len() - 2 * TAG_LEN - 2]).is_ok());
            let got: Vec<CtlMsg> = read_lines(d.recv.clone(), &lines)
                .into_iter()
                .map(|r| r.unwrap())
                .collect();
            assert_eq!(got, msgs);
        }
    }

    #[test]
    fn tampered_replayed_reordered_untagged_and_reflected_lines_are_refused() {
        let m = Mode::from_option(Some("0123456789abcdef-ctl")).unwrap();
        let (d, p) = keys(&m);
        let lines = wire_lines(p.send.clone(), &[abort(1), abort(2)]);
        // a tampered byte (room 1 -> room 7): the first line already fails
        let mut bad = lines[0].clone();
        let at = bad.windows(2).position(|w| w == b":1").unwrap() + 1;
        bad[at] = b'7';
        let r = read_lines(d.recv.clone(), &[bad]);
        assert!(integrity(&r[0]).contains("frame 0"), "{:?}", r[0]);
        // a replayed line: the second copy fails
        let r = read_lines(d.recv.clone(), &[lines[0].clone(), lines[0].clone()]);
        assert_eq!(r[0].as_ref().unwrap(), &abort(1));
        integrity(&r[1]);
        // reordered lines
        let r = read_lines(d.recv.clone(), &[lines[1].clone(), lines[0].clone()]);
        assert_eq!(r.len(), 1);
        integrity(&r[0]);
        // a missing tag (a bare line, as before the keys)
        let mut bare = serde_json::to_vec(&abort(1)).unwrap();
        bare.push(b'\n');
        let r = read_lines(d.recv.clone(), &[bare]);
        assert!(
            integrity(&r[0]).contains("no valid session MAC"),
            "{:?}",
            r[0]
        );
        // a line sealed with the other direction's key (the decode's own
        // send key, reflected back at it)
        let reflected = wire_lines(d.send.clone(), &[abort(1)]);
        let r = read_lines(d.recv.clone(), &reflected);
        integrity(&r[0]);
        // another connection's keys open nothing of this one
        let (d2, _) = keys(&m);
        integrity(&read_lines(d2.recv.clone(), &lines)[0]);
        // the untouched stream still opens
        assert_eq!(read_lines(d.recv, &lines).len(), 2);
    }

    /// One side of a control connection.
    type Side = (CtlWriter, CtlReader);

    /// Both sides of a real exchange over a socket, then one sealed line
    /// each way (what the decode and the prefill do).
    fn handshake(
        decode_mode: Mode,
        prefill_mode: Mode,
    ) -> (Result<Side>, std::thread::JoinHandle<Result<Side>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            // as the prefill's listener does: the exchange over CtlAuth, then
            // the keys installed on the connection's writer and reader
            use crate::transport::auth_exchange::AuthExchange;
            use crate::transport::listen::{Exchange, Turn};
            let mut x = AuthExchange::new(prefill_mode, Channel::Control, P, CtlAuth);
            let mut input = BufReader::new(s.try_clone().unwrap());
            let mut out = s.try_clone().unwrap();
            let (peer, keys) = loop {
                let mut line = Vec::new();
                input.read_until(b'\n', &mut line)?;
                match x.on_message(&line) {
                    Turn::Continue(b) => out.write_all(&b)?,
                    Turn::Done(d) => break d,
                    Turn::Refuse(b) => {
                        out.write_all(&b)?;
                        return Err(Error::new(Status::AuthFailed, "refused"));
                    }
                }
            };
            // what arrived after the proof is the start of the next line
            let rest = input.buffer().to_vec();
            let w = CtlWriter::new(out);
            let mut r = CtlReader::with_prefix(s, rest);
            install(
                &w,
                &mut r,
                keys,
                &format!("decode instance {peer} at 127.0.0.1:2"),
            );
            Ok((w, r))
        });
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let w = CtlWriter::new(s.try_clone().unwrap());
        let mut r = CtlReader::new(s);
        let c = authenticate_to_prefill(&w, &mut r, &decode_mode, D, PeerInstance(P), "p0")
            .map(|_| (w, r));
        (c, t)
    }

    #[test]
    fn the_exchange_installs_the_keys_on_both_sides_in_secret_and_open_mode() {
        for m in [
            Mode::from_option(Some("0123456789abcdef-ctl")).unwrap(),
            Mode::Open,
        ] {
            let (c, t) = handshake(m.clone(), m);
            let (dw, mut dr) = c.unwrap();
            let (pw, mut pr) = t.join().unwrap().unwrap();
            dw.send(&abort(4)).unwrap();
            assert_eq!(pr.recv_first().unwrap().unwrap(), abort(4));
            pw.send(&abort(5)).unwrap();
            assert_eq!(dr.recv_first().unwrap().unwrap(), abort(5));
            // a bare line after the exchange is refused
            dw.lock()
                .stream
                .write_all(b"{\"type\":\"abort\",\"room\":1,\"attempt\":1}\n")
                .unwrap();
            let e = pr.recv().unwrap_err();
            assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
            assert!(
                e.detail()
                    .contains(&format!("decode instance {}", PeerInstance(D))),
                "{e}"
            );
        }
    }

    #[test]
    fn an_older_peer_is_refused_naming_both_versions() {
        let m = Mode::from_option(Some("0123456789abcdef-ctl")).unwrap();
        let (c, t) = handshake(m.clone(), m);
        let (dw, mut dr) = c.unwrap();
        let (pw, mut pr) = t.join().unwrap().unwrap();
        // a version-1 decode's bare Hello
        use crate::bootstrap::schema::{InstanceId, Registration, Role};
        let reg = Registration::new(
            "c",
            Role::Decode,
            InstanceId(7),
            crate::layout::Topology::single_mla(64, 2, 1152),
        );
        let hello = CtlMsg::Hello {
            version: 1,
            hello: PeerHello::from(&reg),
            data_addr: "127.0.0.1:9".into(),
            regions: RegionMap::default(),
            gpu: None,
        };
        let mut line = serde_json::to_vec(&hello).unwrap();
        line.push(b'\n');
        dw.lock().stream.write_all(&line).unwrap();
        let e = pr.recv_first().unwrap_err();
        assert!(is_older_peer(&e), "{e}");
        assert!(
            e.detail().contains("control protocol 1")
                && e.detail()
                    .contains(&format!("control protocol {CONTROL_VERSION}")),
            "{e}"
        );
        // a version-1 prefill's bare refusal of a sealed Hello
        let refusal = CtlMsg::Status {
            room: 0,
            attempt: 0,
            ok: false,
            prefill_rank: 0,
            bytes: 0,
            reason: Some("malformed control message: trailing characters".into()),
            code: Some(Status::Protocol as i32),
        };
        let mut line = serde_json::to_vec(&refusal).unwrap();
        line.push(b'\n');
        pw.lock().stream.write_all(&line).unwrap();
        let e = dr.recv_first().unwrap_err();
        assert!(is_older_peer(&e), "{e}");
        assert!(
            e.detail().contains("prefill p0") && e.detail().contains("trailing characters"),
            "{e}"
        );
    }
}
