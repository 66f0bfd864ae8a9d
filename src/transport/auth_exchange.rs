//! The authentication exchange ([`crate::auth`]) as the bounded listener's
//! poll loop drives it ([`listen::Exchange`](crate::transport::listen::Exchange)): the AuthHello is answered with
//! the challenge and the AuthProof checked, message by message, without a
//! thread, so a peer that stalls in the middle holds only a place in the
//! poll set (evicted when newer ones need it). [`AuthCodec`] says how the
//! three messages look on a channel: [`WireAuth`] for the agent's data plane
//! (wire frames); the engine's control channel (JSON lines) implements it
//! over its own message type.

use crate::auth::{
    AuthChallenge, AuthHello, AuthProof, Channel, Mode, PeerInstance, ServerAuth, SessionKeys,
};
use crate::error::{Error, Result, Status};
use crate::transport::listen::{Exchange, Turn};
use crate::transport::wire::{self, FrameType, MAX_UNAUTHENTICATED_PAYLOAD};

/// How the authentication messages of one channel are framed.
pub trait AuthCodec {
    /// The client's first message (whole, framing included) as its hello.
    fn hello(&self, msg: &[u8]) -> Result<AuthHello>;
    /// The challenge, framed.
    fn challenge(&self, ch: &AuthChallenge) -> Result<Vec<u8>>;
    /// The client's second message as its proof.
    fn proof(&self, msg: &[u8]) -> Result<AuthProof>;
    /// A refusal, framed (sent before the connection is closed).
    fn refusal(&self, e: &Error) -> Vec<u8>;
}

/// The accepting side of the exchange on one connection.
pub struct AuthExchange<C> {
    mode: Mode,
    channel: Channel,
    instance: [u8; 16],
    codec: C,
    server: Option<ServerAuth>,
}

impl<C: AuthCodec> AuthExchange<C> {
    /// An exchange proving `instance` on `channel` under `mode`.
    pub fn new(mode: Mode, channel: Channel, instance: [u8; 16], codec: C) -> Self {
        AuthExchange {
            mode,
            channel,
            instance,
            codec,
            server: None,
        }
    }

    fn step(&mut self, msg: &[u8]) -> Result<Turn<(PeerInstance, SessionKeys)>> {
        match self.server.take() {
            None => {
                let hello = self.codec.hello(msg)?;
                let (server, ch) =
                    ServerAuth::challenge(&self.mode, self.channel, self.instance, &hello)?;
                let bytes = self.codec.challenge(&ch)?;
                self.server = Some(server);
                Ok(Turn::Continue(bytes))
            }
            Some(server) => {
                let proof = self.codec.proof(msg)?;
                Ok(Turn::Done(server.verify_keyed(&proof)?))
            }
        }
    }
}

impl<C: AuthCodec> Exchange for AuthExchange<C> {
    /// The authenticated peer and the connection's session keys.
    type Done = (PeerInstance, SessionKeys);

    fn on_message(&mut self, msg: &[u8]) -> Turn<(PeerInstance, SessionKeys)> {
        self.step(msg)
            .unwrap_or_else(|e| Turn::Refuse(self.codec.refusal(&e)))
    }
}

/// The agent data plane's framing: the three messages are wire frames.
#[derive(Debug, Clone, Copy, Default)]
pub struct WireAuth;

impl AuthCodec for WireAuth {
    fn hello(&self, msg: &[u8]) -> Result<AuthHello> {
        let (ty, p) = wire::read_frame_max(&mut &msg[..], MAX_UNAUTHENTICATED_PAYLOAD)?;
        if ty != FrameType::AuthHello {
            return Err(Error::new(
                Status::AuthRequired,
                format!(
                    "the first frame must be AuthHello, got {ty:?}: this agent accepts only \
                     authenticated peers (same pdxfer version and cluster secret)"
                ),
            ));
        }
        serde_json::from_slice(&p)
            .map_err(|e| Error::new(Status::Protocol, format!("malformed AuthHello: {e}")))
    }

    fn challenge(&self, ch: &AuthChallenge) -> Result<Vec<u8>> {
        let mut b = Vec::new();
        wire::write_json(&mut b, FrameType::AuthChallenge, ch)?;
        Ok(b)
    }

    fn proof(&self, msg: &[u8]) -> Result<AuthProof> {
        wire::read_json_max(
            &mut &msg[..],
            FrameType::AuthProof,
            MAX_UNAUTHENTICATED_PAYLOAD,
        )
    }

    fn refusal(&self, e: &Error) -> Vec<u8> {
        let mut b = Vec::new();
        let _ = wire::write_frame(&mut b, FrameType::Error, &wire::encode_error(e));
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::ClientAuth;

    fn frame<T: serde::Serialize>(ty: FrameType, v: &T) -> Vec<u8> {
        let mut b = Vec::new();
        wire::write_json(&mut b, ty, v).unwrap();
        b
    }

    #[test]
    fn the_exchange_answers_the_hello_and_checks_the_proof() {
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let mut x = AuthExchange::new(m.clone(), Channel::Data, [7; 16], WireAuth);
        let (client, hello) = ClientAuth::start(&m, Channel::Data, [9; 16]).unwrap();
        let Turn::Continue(ch) = x.on_message(&frame(FrameType::AuthHello, &hello)) else {
            panic!("no challenge")
        };
        let ch: AuthChallenge =
            wire::read_json_max(&mut &ch[..], FrameType::AuthChallenge, 4096).unwrap();
        let (proof, server) = client.answer(&ch).unwrap();
        assert_eq!(server, PeerInstance([7; 16]));
        match x.on_message(&frame(FrameType::AuthProof, &proof)) {
            Turn::Done((p, _)) => assert_eq!(p, PeerInstance([9; 16])),
            t => panic!("{t:?}"),
        }
    }

    #[test]
    fn a_wrong_secret_or_frame_is_refused_with_an_error_frame() {
        let m = Mode::from_option(Some("0123456789abcdef-cluster")).unwrap();
        let other = Mode::from_option(Some("0123456789abcdef-another")).unwrap();
        let mut x = AuthExchange::new(m, Channel::Data, [7; 16], WireAuth);
        let (client, hello) = ClientAuth::start(&other, Channel::Data, [9; 16]).unwrap();
        let Turn::Continue(ch) = x.on_message(&frame(FrameType::AuthHello, &hello)) else {
            panic!("no challenge")
        };
        let ch: AuthChallenge =
            wire::read_json_max(&mut &ch[..], FrameType::AuthChallenge, 4096).unwrap();
        // the client sees the server's proof fail; a forged proof is refused
        assert!(client.answer(&ch).is_err());
        let forged = AuthProof {
            proof: "00".repeat(32),
        };
        let Turn::Refuse(b) = x.on_message(&frame(FrameType::AuthProof, &forged)) else {
            panic!("a forged proof was accepted")
        };
        let (ty, _) = wire::read_frame(&mut &b[..]).unwrap();
        assert_eq!(ty, FrameType::Error);
        // a Hello before authenticating is refused
        let mut y = AuthExchange::new(Mode::Open, Channel::Data, [7; 16], WireAuth);
        let Turn::Refuse(b) = y.on_message(&frame(FrameType::Hello, &serde_json::json!({}))) else {
            panic!("an unauthenticated Hello was accepted")
        };
        let (ty, p) = wire::read_frame(&mut &b[..]).unwrap();
        assert_eq!(ty, FrameType::Error);
        assert!(String::from_utf8_lossy(&p).contains("AuthHello"));
    }
}
