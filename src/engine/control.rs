//! The engine's rank-to-rank control channel: versioned JSON messages, one per
//! line, over TCP (decode connects to the prefill rank's `ctl` endpoint).
//!
//! Unlike SGLang's positional ZMQ frames, every message is named and typed,
//! carries the sender's instance id and epoch, and the first exchange
//! re-checks what the bootstrap advertised (`bootstrap::peer::verify_peer`).

use crate::auth::{
    AuthChallenge, AuthHello, AuthProof, Channel, ClientAuth, Mode, PeerInstance, ServerAuth,
};
use crate::bootstrap::schema::PeerHello;
use crate::error::{Error, Result, Status};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Mutex;

/// Version of the control protocol; a peer with another version is refused.
pub const CONTROL_VERSION: u32 = 1;
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
}

impl RegionMap {
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
    },
    /// Prefill -> decode: the answer to Hello.
    HelloAck {
        /// Protocol version.
        version: u32,
        /// The prefill rank's self-description.
        hello: PeerHello,
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
        /// (the decode checks they lie inside its pools).
        dst_pages: Vec<u64>,
        /// The decode prefix of the room's metadata.
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
#[derive(Debug)]
pub struct CtlWriter {
    stream: Mutex<TcpStream>,
}

impl CtlWriter {
    /// Wraps the write half.
    pub fn new(stream: TcpStream) -> CtlWriter {
        CtlWriter {
            stream: Mutex::new(stream),
        }
    }

    /// Sends one message.
    pub fn send(&self, m: &CtlMsg) -> Result<()> {
        let mut line =
            serde_json::to_vec(m).map_err(|e| Error::new(Status::Protocol, e.to_string()))?;
        line.push(b'\n');
        let mut s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        s.write_all(&line)?;
        crate::transport::control_counts::engine_sent();
        Ok(())
    }

    /// Closes both directions (wakes the reader).
    pub fn shutdown(&self) {
        let s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// Reads framed messages.
pub struct CtlReader {
    r: BufReader<TcpStream>,
    buf: Vec<u8>,
}

impl CtlReader {
    /// Wraps the read half.
    pub fn new(stream: TcpStream) -> CtlReader {
        CtlReader {
            r: BufReader::new(stream),
            buf: Vec::new(),
        }
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
        decode_line(&self.buf[..n - 1]).map(Some)
    }
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
/// `peer` names the prefill in errors.
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
    let (proof, got) = client.answer(&ch).map_err(ctx)?;
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
    Ok(got)
}

/// Prefill side: the first line (`first`, read whole by the listener, its
/// newline stripped) must be an `auth_hello` of at most
/// [`MAX_UNAUTHENTICATED_LINE`] bytes; answers with the challenge and checks
/// the proof. Returns the decode's authenticated instance; the caller sends
/// the refusal on error.
pub fn authenticate_decode(
    writer: &CtlWriter,
    reader: &mut CtlReader,
    mode: &Mode,
    instance: [u8; 16],
    first: &[u8],
) -> Result<PeerInstance> {
    if first.len() > MAX_UNAUTHENTICATED_LINE {
        return Err(Error::new(
            Status::Protocol,
            format!(
                "a {}-byte first line: before authenticating, lines are at most {MAX_UNAUTHENTICATED_LINE} bytes",
                first.len()
            ),
        ));
    }
    let hello = match decode_line(first)? {
        CtlMsg::AuthHello { auth } => auth,
        _ => {
            return Err(Error::new(
                Status::AuthRequired,
                "the first control message must be auth_hello: this prefill accepts only authenticated decode ranks (same pdxfer version and cluster secret)",
            ))
        }
    };
    let (server, ch) = ServerAuth::challenge(mode, Channel::Control, instance, &hello)?;
    writer.send(&CtlMsg::AuthChallenge { auth: ch })?;
    match reader.recv_max(MAX_UNAUTHENTICATED_LINE)? {
        Some(CtlMsg::AuthProof { auth }) => server.verify(&auth),
        None => Err(Error::new(
            Status::PeerUnreachable,
            "closed during authentication",
        )),
        Some(_) => Err(Error::new(
            Status::AuthRequired,
            "expected auth_proof after the challenge",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
