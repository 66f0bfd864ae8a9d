//! The authentication exchange ([`crate::auth`]) on an agent connection: the
//! first three frames of every data-plane connection (control connections and
//! tcp data streams alike), before any other frame is read, any session
//! state is created or anything about this process is said. Both sides
//! come out of it with the connection's [`SessionKeys`]: every frame after
//! the three is sealed with them ([`wire::write_frame_sealed`]).

use crate::auth::ServerAuth;
use crate::auth::{
    AuthChallenge, AuthHello, AuthProof, Channel, ClientAuth, Mode, PeerInstance, SessionKeys,
};
use crate::error::{Error, Result, Status};
use crate::transport::wire::{self, FrameType, MAX_UNAUTHENTICATED_PAYLOAD};
use std::io::{Read, Write};

/// The connecting side: proves the secret, checks the server's proof and,
/// with `expect`, that the server is that instance (`PeerIdentity` naming
/// both ids otherwise, before this side's proof is sent). `addr` names the
/// peer in errors.
pub fn authenticate_client<S: Read + Write>(
    s: &mut S,
    mode: &Mode,
    instance: [u8; 16],
    expect: Option<PeerInstance>,
    addr: &str,
) -> Result<(PeerInstance, SessionKeys)> {
    let ctx = |e: Error| {
        Error::new(
            e.status(),
            format!("authenticating to the agent at {addr}: {}", e.detail()),
        )
    };
    let (client, hello) = ClientAuth::start(mode, Channel::Data, instance)?;
    wire::write_json(s, FrameType::AuthHello, &hello).map_err(ctx)?;
    let ch: AuthChallenge =
        wire::read_json_max(s, FrameType::AuthChallenge, MAX_UNAUTHENTICATED_PAYLOAD)
            .map_err(ctx)?;
    let (proof, peer, keys) = client.answer_keyed(&ch).map_err(ctx)?;
    if let Some(want) = expect {
        if want != peer {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "the agent at {addr} authenticated as instance {peer}, but the peer this \
                     connection is for is instance {want}: its data address does not belong to it"
                ),
            ));
        }
    }
    wire::write_json(s, FrameType::AuthProof, &proof).map_err(ctx)?;
    Ok((peer, keys))
}

/// The accepting side: the first frame must be an [`AuthHello`] of at most
/// [`MAX_UNAUTHENTICATED_PAYLOAD`] bytes; answers with the challenge (the
/// only thing an unauthenticated peer ever receives besides a refusal) and
/// checks the client's proof. A failure is sent to the peer as an `Error`
/// frame and returned.
pub fn authenticate_server<S: Read + Write>(
    s: &mut S,
    mode: &Mode,
    instance: [u8; 16],
) -> Result<(PeerInstance, SessionKeys)> {
    let r = server_exchange(s, mode, instance);
    if let Err(e) = &r {
        if e.status() != Status::PeerUnreachable {
            let _ = wire::write_frame(s, FrameType::Error, &wire::encode_error(e));
        }
    }
    r
}

fn server_exchange<S: Read + Write>(
    s: &mut S,
    mode: &Mode,
    instance: [u8; 16],
) -> Result<(PeerInstance, SessionKeys)> {
    let (ty, p) = wire::read_frame_max(s, MAX_UNAUTHENTICATED_PAYLOAD)?;
    if ty != FrameType::AuthHello {
        return Err(Error::new(
            Status::AuthRequired,
            format!(
                "the first frame must be AuthHello, got {ty:?}: this agent accepts only \
                 authenticated peers (same pdxfer version and cluster secret)"
            ),
        ));
    }
    let hello: AuthHello = serde_json::from_slice(&p)
        .map_err(|e| Error::new(Status::Protocol, format!("malformed AuthHello: {e}")))?;
    let (server, ch) = ServerAuth::challenge(mode, Channel::Data, instance, &hello)?;
    wire::write_json(s, FrameType::AuthChallenge, &ch)?;
    let proof: AuthProof =
        wire::read_json_max(s, FrameType::AuthProof, MAX_UNAUTHENTICATED_PAYLOAD)?;
    server.verify_keyed(&proof)
}

/// A connection whose first bytes were already read (by the listener, which
/// waits for a whole first frame without a thread): reads those bytes first,
/// then the socket; writes go to the socket.
pub struct Prefixed<'a, S> {
    first: &'a [u8],
    s: &'a mut S,
}

impl<'a, S: Read + Write> Prefixed<'a, S> {
    /// `first` comes before what `s` still holds.
    pub fn new(first: &'a [u8], s: &'a mut S) -> Self {
        Prefixed { first, s }
    }

    /// True when every byte of `first` was read.
    pub fn drained(&self) -> bool {
        self.first.is_empty()
    }
}

impl<S: Read + Write> Read for Prefixed<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.first.is_empty() {
            return self.s.read(buf);
        }
        let n = buf.len().min(self.first.len());
        buf[..n].copy_from_slice(&self.first[..n]);
        self.first = &self.first[n..];
        Ok(n)
    }
}

impl<S: Read + Write> Write for Prefixed<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.s.flush()
    }
}

/// A raw-wire client's connection after the exchange (tests and tools that
/// speak the frames by hand): what is written as plain frames goes out
/// sealed with the session's `send` MAC (data frames, which are never
/// sealed, unchanged), and sealed frames read back are checked with `recv`
/// and handed out as plain frames. A MAC failure reads as an I/O error of
/// kind `InvalidData` naming it.
pub struct Sealed<S> {
    inner: S,
    keys: SessionKeys,
    wbuf: Vec<u8>,
    /// Payload bytes of the data frame being written still to pass unsealed.
    raw_left: u64,
    rbuf: Vec<u8>,
    rpos: usize,
}

impl<S: Read + Write> Sealed<S> {
    /// Wraps `inner`, whose exchange produced `keys`.
    pub fn new(inner: S, keys: SessionKeys) -> Self {
        Sealed {
            inner,
            keys,
            wbuf: Vec::new(),
            raw_left: 0,
            rbuf: Vec::new(),
            rpos: 0,
        }
    }

    /// The session keys (a test may seal frames itself, or tamper).
    pub fn keys(&mut self) -> &mut SessionKeys {
        &mut self.keys
    }

    /// The underlying stream (raw bytes, unsealed).
    pub fn raw(&mut self) -> &mut S {
        &mut self.inner
    }

    fn drain_writes(&mut self) -> std::io::Result<()> {
        loop {
            // the rest of a data frame's payload passes as it comes
            if self.raw_left > 0 {
                let n = (self.wbuf.len() as u64).min(self.raw_left) as usize;
                self.inner.write_all(&self.wbuf[..n])?;
                self.wbuf.drain(..n);
                self.raw_left -= n as u64;
                if self.raw_left > 0 {
                    return Ok(());
                }
            }
            if self.wbuf.len() < 12 {
                return Ok(());
            }
            let ty = u16::from_le_bytes([self.wbuf[6], self.wbuf[7]]);
            if ty == FrameType::Data as u16 {
                if self.wbuf.len() < wire::DATA_HEADER_LEN {
                    return Ok(());
                }
                let mut l = [0u8; 8];
                l.copy_from_slice(&self.wbuf[40..48]);
                self.inner.write_all(&self.wbuf[..wire::DATA_HEADER_LEN])?;
                self.wbuf.drain(..wire::DATA_HEADER_LEN);
                self.raw_left = u64::from_le_bytes(l);
                continue;
            }
            let len = u32::from_le_bytes([self.wbuf[8], self.wbuf[9], self.wbuf[10], self.wbuf[11]])
                as usize;
            if self.wbuf.len() < 12 + len {
                return Ok(());
            }
            let rest = self.wbuf.split_off(12 + len);
            let ty = FrameType::from_u16(ty).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "unknown frame type")
            })?;
            wire::write_frame_sealed(&mut self.inner, ty, &self.wbuf[12..], &mut self.keys.send)
                .map_err(std::io::Error::other)?;
            self.wbuf = rest;
        }
    }
}

impl<S> std::ops::Deref for Sealed<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.inner
    }
}

impl<S> std::ops::DerefMut for Sealed<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: Read + Write> Read for Sealed<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.rpos == self.rbuf.len() {
            let (ty, p) = wire::read_frame_sealed(
                &mut self.inner,
                wire::MAX_CONTROL_PAYLOAD,
                &mut self.keys.recv,
            )
            .map_err(|e| match e.status() {
                Status::PeerUnreachable => {
                    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, e.to_string())
                }
                _ => std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
            })?;
            self.rbuf.clear();
            self.rpos = 0;
            self.rbuf.extend_from_slice(&wire::MAGIC.to_le_bytes());
            self.rbuf.extend_from_slice(&wire::VERSION.to_le_bytes());
            self.rbuf.extend_from_slice(&(ty as u16).to_le_bytes());
            self.rbuf.extend_from_slice(&(p.len() as u32).to_le_bytes());
            self.rbuf.extend_from_slice(&p);
        }
        let n = buf.len().min(self.rbuf.len() - self.rpos);
        buf[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        Ok(n)
    }
}

impl<S: Read + Write> Write for Sealed<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.wbuf.extend_from_slice(buf);
        self.drain_writes()?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn pair(
        server_mode: Mode,
        client_mode: Mode,
        expect: Option<PeerInstance>,
    ) -> (Result<PeerInstance>, Result<PeerInstance>) {
        let (r, s) = pair_keyed(server_mode, client_mode, expect);
        (r.map(|x| x.0), s.map(|x| x.0))
    }

    type Keyed = Result<(PeerInstance, SessionKeys)>;

    fn pair_keyed(
        server_mode: Mode,
        client_mode: Mode,
        expect: Option<PeerInstance>,
    ) -> (Keyed, Keyed) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            authenticate_server(&mut s, &server_mode, [7; 16])
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let r = authenticate_client(&mut c, &client_mode, [9; 16], expect, "test");
        drop(c);
        (r, t.join().unwrap())
    }

    #[test]
    fn both_sides_learn_the_other_instance_and_a_wrong_one_is_named() {
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let (c, s) = pair(m.clone(), m.clone(), Some(PeerInstance([7; 16])));
        assert_eq!(
            (c.unwrap(), s.unwrap()),
            (PeerInstance([7; 16]), PeerInstance([9; 16]))
        );
        let (c, s) = pair(m.clone(), m.clone(), Some(PeerInstance([8; 16])));
        let e = c.unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity);
        assert!(
            e.detail().contains(&PeerInstance([7; 16]).to_string()),
            "{e}"
        );
        assert!(
            e.detail().contains(&PeerInstance([8; 16]).to_string()),
            "{e}"
        );
        // the server never saw a proof
        assert!(s.is_err());
        let other = Mode::from_option(Some("0123456789abcdef-another")).unwrap();
        let (c, _) = pair(m, other, None);
        assert_eq!(c.unwrap_err().status(), Status::AuthFailed);
    }

    #[test]
    fn both_sides_derive_matching_session_keys() {
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let (c, s) = pair_keyed(m.clone(), m, None);
        let (mut c, mut s) = (c.unwrap().1, s.unwrap().1);
        let t = c.send.seal(b"hello");
        s.recv.open(b"hello", &t).unwrap();
        let t = s.send.seal(b"ack");
        c.recv.open(b"ack", &t).unwrap();
    }

    #[test]
    fn any_other_first_frame_is_refused_and_large_ones_before_reading() {
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let mut buf = Vec::new();
        wire::write_frame(&mut buf, FrameType::Hello, b"{}").unwrap();
        let mut io = std::io::Cursor::new(buf);
        let e = server_exchange(&mut io, &m, [1; 16]).unwrap_err();
        assert_eq!(e.status(), Status::AuthRequired, "{e}");
        // A 64 KiB AuthHello is refused from its header.
        let mut h = Vec::new();
        wire::write_frame(&mut h, FrameType::AuthHello, &vec![b' '; 64 << 10]).unwrap();
        h.truncate(12);
        let mut io = std::io::Cursor::new(h);
        let e = server_exchange(&mut io, &m, [1; 16]).unwrap_err();
        assert_eq!(e.status(), Status::Protocol, "{e}");
        assert!(e.detail().contains("4096"), "{e}");
    }
}
