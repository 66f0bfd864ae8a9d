//! Peer authentication: a mutual challenge-response over the cluster secret.
//!
//! Every connection between two pdxfer processes (the engine's control channel,
//! the agent's data plane) starts with three messages before anything else is
//! said or allocated:
//!
//! 1. client -> server [`AuthHello`]: the client's instance id and a fresh nonce;
//! 2. server -> client [`AuthChallenge`]: the server's instance id, its nonce and
//!    its proof, an HMAC-SHA256 under the secret of the transcript
//!    (channel, both instance ids, both nonces) labelled `server`;
//! 3. client -> server [`AuthProof`]: the client's proof of the same transcript
//!    labelled `client`.
//!
//! The secret never crosses the wire, each proof is bound to both instance ids
//! and both nonces (no replay into another connection, no reflection: the two
//! proofs carry different labels), and the channel name keeps a proof for the
//! control channel from opening a data connection. Before step 3 succeeds the
//! server has revealed only what authentication needs: its instance id and
//! nonce.
//!
//! Without a secret on both sides the same messages flow with empty proofs
//! ([`Mode::Open`]); callers allow that only on loopback-bound listeners.
//!
//! The exchange also yields [`SessionKeys`]: HKDF-SHA256 under the secret over
//! the same transcript, one key per direction. Every control frame (or
//! control line) after the three messages carries a [`SessionMac`] tag over a
//! per-direction sequence number and the frame, so a relay that passed the
//! exchange through cannot rewrite, inject, replay or reorder what follows. In
//! open mode the keys come from the public nonces alone: they catch framing
//! bugs, but authenticate nothing (anyone who saw the nonces can compute them).

use crate::error::{Error, Result, Status};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::fmt;
use subtle::ConstantTimeEq;

/// Version of the authentication exchange.
pub const AUTH_VERSION: u32 = 1;

/// Shortest secret accepted (bytes).
pub const MIN_SECRET_BYTES: usize = 16;

/// The cluster's shared secret. `Debug` never prints it.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// A secret from its text form (the bootstrap token or `PDXFER_CLUSTER_SECRET`).
    pub fn new(text: &str) -> Result<ClusterSecret> {
        if text.len() < MIN_SECRET_BYTES {
            return Err(Error::invalid(format!(
                "the cluster secret is {} bytes; use at least {MIN_SECRET_BYTES} random bytes \
                 (e.g. `openssl rand -hex 32`)",
                text.len()
            )));
        }
        Ok(ClusterSecret(text.as_bytes().to_vec()))
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Whether peers prove knowledge of a secret.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Peers must prove the secret.
    Secret(ClusterSecret),
    /// No secret configured: proofs are empty (loopback-only listeners).
    Open,
}

impl Mode {
    /// `Secret` when a secret is given, else `Open`.
    pub fn from_option(secret: Option<&str>) -> Result<Mode> {
        match secret {
            Some(s) => Ok(Mode::Secret(ClusterSecret::new(s)?)),
            None => Ok(Mode::Open),
        }
    }

    /// True when peers must prove a secret.
    pub fn is_secret(&self) -> bool {
        matches!(self, Mode::Secret(_))
    }
}

/// Which connection the proofs open (part of the transcript).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// The engine's rank-to-rank control channel.
    Control,
    /// The agent's data plane (cma, tcp, rdma setup).
    Data,
}

impl Channel {
    fn label(self) -> &'static [u8] {
        match self {
            Channel::Control => b"control",
            Channel::Data => b"data",
        }
    }
}

/// Client -> server, the first message of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthHello {
    /// [`AUTH_VERSION`] of the client.
    pub version: u32,
    /// The client's instance id (32 hex digits).
    pub instance: String,
    /// The client's nonce (64 hex digits).
    pub nonce: String,
    /// Whether the client holds a secret (so a mismatch is named, not guessed).
    pub secret: bool,
}

/// Server -> client: the server's half and its proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthChallenge {
    /// [`AUTH_VERSION`] of the server.
    pub version: u32,
    /// The server's instance id (32 hex digits).
    pub instance: String,
    /// The server's nonce (64 hex digits).
    pub nonce: String,
    /// HMAC of the transcript labelled `server` (64 hex digits); empty in open mode.
    pub proof: String,
}

/// Client -> server: the client's proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthProof {
    /// HMAC of the transcript labelled `client` (64 hex digits); empty in open mode.
    pub proof: String,
}

/// The client side of one exchange, between [`AuthHello`] and [`AuthChallenge`].
#[derive(Debug)]
pub struct ClientAuth {
    mode: Mode,
    channel: Channel,
    instance: [u8; 16],
    nonce: [u8; 32],
}

/// The server side of one exchange, between [`AuthChallenge`] and [`AuthProof`].
#[derive(Debug)]
pub struct ServerAuth {
    mode: Mode,
    channel: Channel,
    client: [u8; 16],
    server: [u8; 16],
    client_nonce: [u8; 32],
    server_nonce: [u8; 32],
}

/// The authenticated peer: its instance id, proven (or, in open mode, claimed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInstance(pub [u8; 16]);

impl fmt::Display for PeerInstance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl ClientAuth {
    /// Starts an exchange as the connecting side.
    pub fn start(
        mode: &Mode,
        channel: Channel,
        instance: [u8; 16],
    ) -> Result<(ClientAuth, AuthHello)> {
        let nonce = random_nonce()?;
        let hello = AuthHello {
            version: AUTH_VERSION,
            instance: hex(&instance),
            nonce: hex(&nonce),
            secret: mode.is_secret(),
        };
        Ok((
            ClientAuth {
                mode: mode.clone(),
                channel,
                instance,
                nonce,
            },
            hello,
        ))
    }

    /// Checks the server's proof; returns the client's proof and the server's id.
    pub fn answer(self, ch: &AuthChallenge) -> Result<(AuthProof, PeerInstance)> {
        self.answer_keyed(ch).map(|(p, peer, _)| (p, peer))
    }

    /// [`answer`](Self::answer), with the connection's [`SessionKeys`] (this
    /// side's `send` key is the client-to-server one).
    pub fn answer_keyed(
        self,
        ch: &AuthChallenge,
    ) -> Result<(AuthProof, PeerInstance, SessionKeys)> {
        check_version(ch.version)?;
        let server: [u8; 16] = unhex(&ch.instance, "instance")?;
        let server_nonce: [u8; 32] = unhex(&ch.nonce, "nonce")?;
        let t = Transcript {
            channel: self.channel,
            client: &self.instance,
            server: &server,
            client_nonce: &self.nonce,
            server_nonce: &server_nonce,
        };
        let proof = match &self.mode {
            Mode::Open => {
                if !ch.proof.is_empty() {
                    return Err(auth_failed(format!(
                        "peer {} requires the cluster secret and this process has none: \
                         configure the same secret (engine `token`, PDXFER_CLUSTER_SECRET) on every rank",
                        hex(&server)
                    )));
                }
                String::new()
            }
            Mode::Secret(s) => {
                if ch.proof.is_empty() {
                    return Err(auth_failed(format!(
                        "peer {} has no cluster secret configured while this process has one: \
                         configure the same secret on every rank",
                        hex(&server)
                    )));
                }
                let got: [u8; 32] = unhex(&ch.proof, "proof")?;
                if !bool::from(t.mac(s, b"server").ct_eq(&got)) {
                    return Err(auth_failed(format!(
                        "peer {} failed authentication (its proof does not match the cluster secret): \
                         it holds another secret, or it is not a rank of this cluster",
                        hex(&server)
                    )));
                }
                hex(&t.mac(s, b"client"))
            }
        };
        let (c2s, s2c) = t.session_keys(&self.mode);
        let (pc2s, ps2c) = t.payload_keys(&self.mode);
        let keys = SessionKeys {
            send: SessionMac::new(&c2s, "client-to-server"),
            recv: SessionMac::new(&s2c, "server-to-client"),
            payload: PayloadKeys {
                send: pc2s,
                recv: ps2c,
            },
        };
        Ok((AuthProof { proof }, PeerInstance(server), keys))
    }
}

impl ServerAuth {
    /// Answers a client's hello with this side's challenge and proof.
    pub fn challenge(
        mode: &Mode,
        channel: Channel,
        instance: [u8; 16],
        hello: &AuthHello,
    ) -> Result<(ServerAuth, AuthChallenge)> {
        check_version(hello.version)?;
        let client: [u8; 16] = unhex(&hello.instance, "instance")?;
        let client_nonce: [u8; 32] = unhex(&hello.nonce, "nonce")?;
        let server_nonce = random_nonce()?;
        let sa = ServerAuth {
            mode: mode.clone(),
            channel,
            client,
            server: instance,
            client_nonce,
            server_nonce,
        };
        let proof = match &sa.mode {
            Mode::Open => String::new(),
            Mode::Secret(s) => hex(&sa.transcript().mac(s, b"server")),
        };
        let ch = AuthChallenge {
            version: AUTH_VERSION,
            instance: hex(&instance),
            nonce: hex(&server_nonce),
            proof,
        };
        Ok((sa, ch))
    }

    /// Checks the client's proof; returns the client's instance id.
    pub fn verify(self, p: &AuthProof) -> Result<PeerInstance> {
        self.verify_keyed(p).map(|(peer, _)| peer)
    }

    /// [`verify`](Self::verify), with the connection's [`SessionKeys`] (this
    /// side's `send` key is the server-to-client one).
    pub fn verify_keyed(self, p: &AuthProof) -> Result<(PeerInstance, SessionKeys)> {
        match &self.mode {
            Mode::Open => {
                if !p.proof.is_empty() {
                    return Err(auth_failed(format!(
                        "peer {} sent a proof but this process has no cluster secret",
                        hex(&self.client)
                    )));
                }
            }
            Mode::Secret(s) => {
                let got: [u8; 32] = if p.proof.is_empty() {
                    return Err(auth_failed(format!(
                        "peer {} has no cluster secret configured (this process requires one)",
                        hex(&self.client)
                    )));
                } else {
                    unhex(&p.proof, "proof")?
                };
                if !bool::from(self.transcript().mac(s, b"client").ct_eq(&got)) {
                    return Err(auth_failed(format!(
                        "peer {} failed authentication (its proof does not match the cluster secret)",
                        hex(&self.client)
                    )));
                }
            }
        }
        let (c2s, s2c) = self.transcript().session_keys(&self.mode);
        let (pc2s, ps2c) = self.transcript().payload_keys(&self.mode);
        let keys = SessionKeys {
            send: SessionMac::new(&s2c, "server-to-client"),
            recv: SessionMac::new(&c2s, "client-to-server"),
            payload: PayloadKeys {
                send: ps2c,
                recv: pc2s,
            },
        };
        Ok((PeerInstance(self.client), keys))
    }

    fn transcript(&self) -> Transcript<'_> {
        Transcript {
            channel: self.channel,
            client: &self.client,
            server: &self.server,
            client_nonce: &self.client_nonce,
            server_nonce: &self.server_nonce,
        }
    }
}

struct Transcript<'a> {
    channel: Channel,
    client: &'a [u8; 16],
    server: &'a [u8; 16],
    client_nonce: &'a [u8; 32],
    server_nonce: &'a [u8; 32],
}

impl Transcript<'_> {
    fn mac(&self, secret: &ClusterSecret, role: &[u8]) -> [u8; 32] {
        // Any key length is accepted by HMAC; the error arm cannot happen.
        let mut m = match Hmac::<Sha256>::new_from_slice(&secret.0) {
            Ok(m) => m,
            Err(_) => return [0; 32],
        };
        for part in [
            b"pdxfer-auth-v1".as_slice(),
            self.channel.label(),
            role,
            self.client,
            self.server,
            self.client_nonce,
            self.server_nonce,
        ] {
            m.update(&(part.len() as u32).to_le_bytes());
            m.update(part);
        }
        m.finalize().into_bytes().into()
    }
}

impl Transcript<'_> {
    /// The two directions' MAC keys (client-to-server, server-to-client):
    /// HKDF-SHA256 with the secret as input key material (none in open mode)
    /// and the transcript (channel, both ids, both nonces) as info.
    fn session_keys(&self, mode: &Mode) -> ([u8; 32], [u8; 32]) {
        self.derive(mode, b"pdxfer-session-v1")
    }

    /// The two directions' payload encryption keys (client-to-server,
    /// server-to-client): the same derivation as [`Self::session_keys`]
    /// under its own label, so they are independent of the MAC keys.
    fn payload_keys(&self, mode: &Mode) -> ([u8; 32], [u8; 32]) {
        self.derive(mode, b"pdxfer-tcp-payload-v1")
    }

    /// HKDF-SHA256 under `label` (the salt) of 64 bytes, cut into two keys.
    fn derive(&self, mode: &Mode, label: &[u8]) -> ([u8; 32], [u8; 32]) {
        let ikm: &[u8] = match mode {
            Mode::Secret(s) => &s.0,
            Mode::Open => b"",
        };
        let hk = Hkdf::<Sha256>::new(Some(label), ikm);
        let mut info = Vec::with_capacity(160);
        for part in [
            self.channel.label(),
            self.client.as_slice(),
            self.server,
            self.client_nonce,
            self.server_nonce,
        ] {
            info.extend_from_slice(&(part.len() as u32).to_le_bytes());
            info.extend_from_slice(part);
        }
        let mut okm = [0u8; 64];
        // 64 bytes is far below HKDF-SHA256's 8160-byte limit: the error arm cannot happen.
        if hk.expand(&info, &mut okm).is_err() {
            okm = [0; 64];
        }
        let mut c2s = [0u8; 32];
        let mut s2c = [0u8; 32];
        c2s.copy_from_slice(&okm[..32]);
        s2c.copy_from_slice(&okm[32..]);
        (c2s, s2c)
    }
}

/// Bytes of a frame's MAC tag (HMAC-SHA256 truncated to 128 bits).
pub const TAG_LEN: usize = 16;

/// One direction of an authenticated connection's frame MAC: HMAC-SHA256
/// under the direction's session key over the frame's sequence number in
/// that direction (from 0, as a little-endian u64) and the frame's bytes,
/// truncated to [`TAG_LEN`] bytes. The sender seals frames in the order it
/// writes them; the receiver opens them in the order it reads them, so a
/// frame that was altered, injected, dropped, replayed or moved fails.
/// Usable by any framing: a binary frame, or a text line whose tag travels
/// with it.
#[derive(Clone)]
pub struct SessionMac {
    key: Hmac<Sha256>,
    seq: u64,
    direction: &'static str,
}

impl fmt::Debug for SessionMac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionMac({}, seq {})", self.direction, self.seq)
    }
}

impl SessionMac {
    fn new(key: &[u8; 32], direction: &'static str) -> SessionMac {
        // Any key length is accepted by HMAC; the fallback cannot happen.
        let key = Hmac::<Sha256>::new_from_slice(key)
            .unwrap_or_else(|_| <Hmac<Sha256> as Mac>::new(&Default::default()));
        SessionMac {
            key,
            seq: 0,
            direction,
        }
    }

    fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut m = self.key.clone();
        m.update(&self.seq.to_le_bytes());
        for p in parts {
            m.update(p);
        }
        let full = m.finalize().into_bytes();
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&full[..TAG_LEN]);
        t
    }

    /// The tag of the next frame sent, whose bytes are `frame`.
    pub fn seal(&mut self, frame: &[u8]) -> [u8; TAG_LEN] {
        self.seal_parts(&[frame])
    }

    /// [`seal`](Self::seal) of a frame given as consecutive parts.
    pub fn seal_parts(&mut self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let t = self.tag(parts);
        self.seq += 1;
        t
    }

    /// Checks the tag of the next frame received; a missing, short or wrong
    /// tag is `ChannelIntegrity`, and the connection must then be dropped
    /// (the sequence does not advance past a bad frame).
    pub fn open(&mut self, frame: &[u8], tag: &[u8]) -> Result<()> {
        self.open_parts(&[frame], tag)
    }

    /// [`open`](Self::open) of a frame given as consecutive parts.
    pub fn open_parts(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<()> {
        let want = self.tag(parts);
        if tag.len() != TAG_LEN || !bool::from(want.ct_eq(tag)) {
            return Err(Error::new(
                Status::ChannelIntegrity,
                format!(
                    "{} frame {} failed its session MAC{}: it was altered, injected, replayed \
                     or reordered on the way (or the peer is not the one that authenticated); \
                     the connection is dropped",
                    self.direction,
                    self.seq,
                    if tag.len() == TAG_LEN {
                        String::new()
                    } else {
                        format!(" (its tag is {} bytes, not {TAG_LEN})", tag.len())
                    }
                ),
            ));
        }
        self.seq += 1;
        Ok(())
    }

    /// Sequence number of the next frame in this direction.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// [`seal`](Self::seal) for a text channel: the tag in hex (32 digits),
    /// to travel with the line it covers (e.g. as a field or a suffix).
    pub fn seal_hex(&mut self, line: &[u8]) -> String {
        hex(&self.seal(line))
    }

    /// [`open`](Self::open) of a line whose tag came as hex; a tag that is
    /// not 32 hex digits is `ChannelIntegrity` like a wrong one.
    pub fn open_hex(&mut self, line: &[u8], tag: &str) -> Result<()> {
        let t: [u8; TAG_LEN] = unhex(tag, "tag").map_err(|_| {
            Error::new(
                Status::ChannelIntegrity,
                format!(
                    "{} line {} carries no valid session MAC (expected {} hex digits): dropped",
                    self.direction,
                    self.seq,
                    2 * TAG_LEN
                ),
            )
        })?;
        self.open(line, &t)
    }
}

/// The two MAC directions of one authenticated connection, as this side sees them.
#[derive(Debug, Clone)]
pub struct SessionKeys {
    /// Seals what this side sends.
    pub send: SessionMac,
    /// Opens what this side receives.
    pub recv: SessionMac,
    /// The connection's payload encryption keys (a tcp data stream that
    /// encrypts its pieces).
    pub payload: PayloadKeys,
}

/// One connection's two payload encryption keys (ChaCha20-Poly1305, 256
/// bits each), derived from the exchange like the MAC keys but under their
/// own label. In open mode they come from the public nonces alone: they
/// encrypt, but keep nothing secret. `Debug` never prints them.
#[derive(Clone)]
pub struct PayloadKeys {
    /// Encrypts what this side sends.
    pub send: [u8; 32],
    /// Decrypts what this side receives.
    pub recv: [u8; 32],
}

impl fmt::Debug for PayloadKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PayloadKeys(<redacted>)")
    }
}

fn auth_failed(detail: String) -> Error {
    Error::new(Status::AuthFailed, detail)
}

fn check_version(v: u32) -> Result<()> {
    if v != AUTH_VERSION {
        return Err(auth_failed(format!(
            "peer speaks authentication version {v}, this process {AUTH_VERSION}: run the same pdxfer major version on every rank"
        )));
    }
    Ok(())
}

fn random_nonce() -> Result<[u8; 32]> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| {
        Error::new(
            Status::Io,
            format!("getrandom failed for an auth nonce: {e}"),
        )
    })?;
    Ok(n)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str, field: &str) -> Result<[u8; N]> {
    let bad = || {
        Error::new(
            Status::Protocol,
            format!(
                "auth {field}: expected {} hex digits, got {:?}",
                2 * N,
                s.chars().take(80).collect::<String>()
            ),
        )
    };
    if s.len() != 2 * N || !s.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: [u8; 16] = [1; 16];
    const B: [u8; 16] = [2; 16];

    fn secret(s: &str) -> Mode {
        Mode::from_option(Some(s)).unwrap()
    }

    fn run(client: &Mode, server: &Mode) -> (Result<PeerInstance>, Result<PeerInstance>) {
        let (c, hello) = ClientAuth::start(client, Channel::Control, A).unwrap();
        let (s, ch) = ServerAuth::challenge(server, Channel::Control, B, &hello).unwrap();
        match c.answer(&ch) {
            Ok((proof, peer)) => (Ok(peer), s.verify(&proof)),
            Err(e) => (
                Err(e),
                Err(Error::new(Status::AuthFailed, "client gave up")),
            ),
        }
    }

    #[test]
    fn same_secret_authenticates_both_instance_ids() {
        let m = secret("0123456789abcdef-cluster");
        let (c, s) = run(&m, &m);
        assert_eq!(c.unwrap(), PeerInstance(B));
        assert_eq!(s.unwrap(), PeerInstance(A));
    }

    #[test]
    fn another_secret_or_none_fails_with_a_named_reason() {
        let a = secret("0123456789abcdef-cluster");
        let b = secret("0123456789abcdef-other!!");
        let (c, _) = run(&a, &b);
        let e = c.unwrap_err();
        assert_eq!(e.status(), Status::AuthFailed);
        assert!(e.detail().contains("does not match"), "{}", e.detail());
        let (c, _) = run(&Mode::Open, &a);
        assert!(c.unwrap_err().detail().contains("has none"));
        let (c, _) = run(&a, &Mode::Open);
        assert!(c.unwrap_err().detail().contains("no cluster secret"));
        let (c, s) = run(&Mode::Open, &Mode::Open);
        assert_eq!((c.unwrap(), s.unwrap()), (PeerInstance(B), PeerInstance(A)));
    }

    #[test]
    fn a_client_without_the_secret_cannot_forge_or_replay_a_proof() {
        let m = secret("0123456789abcdef-cluster");
        // An attacker replays a proof seen on another connection.
        let (c1, h1) = ClientAuth::start(&m, Channel::Control, A).unwrap();
        let (s1, ch1) = ServerAuth::challenge(&m, Channel::Control, B, &h1).unwrap();
        let (p1, _) = c1.answer(&ch1).unwrap();
        s1.verify(&p1).unwrap();
        let (s2, _) = ServerAuth::challenge(&m, Channel::Control, B, &h1).unwrap();
        assert_eq!(s2.verify(&p1).unwrap_err().status(), Status::AuthFailed);
        // Reflection: the server's own proof sent back as the client's.
        let (s3, ch3) = ServerAuth::challenge(&m, Channel::Control, B, &h1).unwrap();
        let reflected = AuthProof {
            proof: ch3.proof.clone(),
        };
        assert_eq!(
            s3.verify(&reflected).unwrap_err().status(),
            Status::AuthFailed
        );
        // An empty proof against a server with a secret.
        let (s4, _) = ServerAuth::challenge(&m, Channel::Control, B, &h1).unwrap();
        let empty = AuthProof {
            proof: String::new(),
        };
        assert_eq!(s4.verify(&empty).unwrap_err().status(), Status::AuthFailed);
    }

    #[test]
    fn a_control_proof_does_not_open_a_data_connection() {
        let m = secret("0123456789abcdef-cluster");
        let (c, hello) = ClientAuth::start(&m, Channel::Control, A).unwrap();
        let (_, ch) = ServerAuth::challenge(&m, Channel::Data, B, &hello).unwrap();
        assert_eq!(c.answer(&ch).unwrap_err().status(), Status::AuthFailed);
    }

    fn keyed(client: &Mode, server: &Mode) -> (SessionKeys, SessionKeys) {
        let (c, hello) = ClientAuth::start(client, Channel::Data, A).unwrap();
        let (s, ch) = ServerAuth::challenge(server, Channel::Data, B, &hello).unwrap();
        let (proof, _, ck) = c.answer_keyed(&ch).unwrap();
        let (_, sk) = s.verify_keyed(&proof).unwrap();
        (ck, sk)
    }

    #[test]
    fn session_macs_refuse_tampered_replayed_reordered_and_missing_tags() {
        for m in [secret("0123456789abcdef-cluster"), Mode::Open] {
            let (mut c, mut s) = keyed(&m, &m);
            // In order, both directions.
            let t0 = c.send.seal(b"hello");
            let t1 = c.send.seal(b"select");
            s.recv.open(b"hello", &t0).unwrap();
            s.recv.open(b"select", &t1).unwrap();
            let back = s.send.seal(b"ack");
            c.recv.open(b"ack", &back).unwrap();
            // A frame's tag does not open it in the other direction (no reflection).
            let t2 = c.send.seal(b"grant");
            let mut c2 = c.recv.clone();
            assert_eq!(
                c2.open(b"grant", &t2).unwrap_err().status(),
                Status::ChannelIntegrity
            );
            // Tampered bytes.
            let mut r = s.recv.clone();
            let e = r.open(b"grand", &t2).unwrap_err();
            assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
            assert!(e.detail().contains("client-to-server frame 2"), "{e}");
            // Replay of an earlier frame at this position.
            let mut r = s.recv.clone();
            assert!(r.open(b"select", &t1).is_err());
            // Missing / truncated tag.
            let mut r = s.recv.clone();
            let e = r.open(b"grant", &t2[..8]).unwrap_err();
            assert!(e.detail().contains("8 bytes"), "{e}");
            assert!(r.open(b"grant", &[]).is_err());
            // Reordered: the next frame's tag arrives first.
            let t3 = c.send.seal(b"commit");
            let mut r = s.recv.clone();
            assert!(r.open(b"commit", &t3).is_err());
            // The untouched stream still opens in order.
            s.recv.open(b"grant", &t2).unwrap();
            s.recv.open(b"commit", &t3).unwrap();
            assert_eq!(s.recv.seq(), 4);
        }
    }

    #[test]
    fn payload_keys_pair_up_and_differ_from_the_mac_keys() {
        let m = secret("0123456789abcdef-cluster");
        let (c, s) = keyed(&m, &m);
        assert_eq!(c.payload.send, s.payload.recv);
        assert_eq!(c.payload.recv, s.payload.send);
        assert_ne!(c.payload.send, c.payload.recv);
        let (c2, _) = keyed(&m, &m);
        assert_ne!(c.payload.send, c2.payload.send, "one key per connection");
        assert_eq!(format!("{:?}", c.payload), "PayloadKeys(<redacted>)");
    }

    #[test]
    fn line_tags_travel_as_hex() {
        let m = secret("0123456789abcdef-cluster");
        let (mut c, mut s) = keyed(&m, &m);
        let line = br#"{"type":"meta","room":7}"#;
        let tag = c.send.seal_hex(line);
        assert_eq!(tag.len(), 2 * TAG_LEN);
        let mut r = s.recv.clone();
        assert_eq!(
            r.open_hex(line, "zz").unwrap_err().status(),
            Status::ChannelIntegrity
        );
        assert_eq!(
            r.open_hex(br#"{"type":"meta","room":8}"#, &tag)
                .unwrap_err()
                .status(),
            Status::ChannelIntegrity
        );
        s.recv.open_hex(line, &tag).unwrap();
    }

    #[test]
    fn session_keys_differ_per_connection_and_per_secret() {
        let a = secret("0123456789abcdef-cluster");
        let (mut c1, _) = keyed(&a, &a);
        let (_, mut s2) = keyed(&a, &a);
        // Another connection's keys (other nonces) open nothing of this one.
        let t = c1.send.seal(b"hello");
        assert!(s2.recv.open(b"hello", &t).is_err());
        // Open mode: per-connection too.
        let (mut c3, _) = keyed(&Mode::Open, &Mode::Open);
        let (_, mut s4) = keyed(&Mode::Open, &Mode::Open);
        let t = c3.send.seal(b"hello");
        assert!(s4.recv.open(b"hello", &t).is_err());
    }

    #[test]
    fn malformed_fields_are_protocol_errors_and_short_secrets_refused() {
        let m = secret("0123456789abcdef-cluster");
        let (_, mut hello) = ClientAuth::start(&m, Channel::Data, A).unwrap();
        hello.nonce = "zz".into();
        let e = ServerAuth::challenge(&m, Channel::Data, B, &hello).unwrap_err();
        assert_eq!(e.status(), Status::Protocol);
        assert!(e.detail().contains("nonce"));
        hello.version = 9;
        assert_eq!(
            ServerAuth::challenge(&m, Channel::Data, B, &hello)
                .unwrap_err()
                .status(),
            Status::AuthFailed
        );
        assert_eq!(
            ClusterSecret::new("short").unwrap_err().status(),
            Status::InvalidArgument
        );
        assert!(!format!("{:?}", m).contains("0123"));
    }
}
