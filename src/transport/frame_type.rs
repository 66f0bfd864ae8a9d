//! [`FrameType`]: the type numbers of the control and data frames of
//! [`wire`](super::wire), which re-exports it. A leaf, so that the frame
//! counters ([`control_counts`](super::control_counts)) and the framing
//! both use it without using each other.

/// Control and data frame types.
#[repr(u16)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameType {
    /// Client hello (JSON [`super::handshake::Hello`]).
    Hello = 1,
    /// Server answer (JSON [`super::handshake::HelloAck`]).
    HelloAck = 2,
    /// Transport selection (JSON [`super::handshake::Select`]).
    Select = 3,
    /// Selection accepted (empty JSON object).
    SelectOk = 4,
    /// Attach a tcp data stream (JSON [`super::handshake::Attach`]).
    Attach = 5,
    /// Data stream attached.
    AttachOk = 6,
    /// A refusal of the handshake: JSON `{code, detail}`.
    Error = 7,
    /// Write intent (cma): batch id and the destination ranges.
    Intent = 10,
    /// The receiver validated and pinned an intent.
    Grant = 11,
    /// The receiver refused a batch: code and reason.
    Refuse = 12,
    /// Sender: all data of a batch was written.
    Commit = 13,
    /// Receiver: the batch landed and its completion was delivered.
    Ack = 14,
    /// Receiver: the batch did not land; code and reason.
    Nack = 15,
    /// Sender: the batch was abandoned; release its pins.
    Abort = 16,
    /// Read intent (cma): like `Intent`, the ranges are read, not written.
    ReadIntent = 17,
    /// Sender: the control connection is idle but alive (empty payload).
    Keepalive = 18,
    /// tcp data frame.
    Data = 20,
    /// Client -> server, first frame of every connection (JSON [`crate::auth::AuthHello`]).
    AuthHello = 30,
    /// Server -> client: its half and proof (JSON [`crate::auth::AuthChallenge`]).
    AuthChallenge = 31,
    /// Client -> server: its proof (JSON [`crate::auth::AuthProof`]).
    AuthProof = 32,
    /// Sender: every batch of a granted room was written (token, room,
    /// epoch, batches, bytes).
    RoomEnd = 40,
    /// Receiver: the room's totals were accepted and its grant released.
    RoomAck = 41,
    /// Receiver: the room end was refused (token, code, reason).
    RoomRefuse = 42,
    /// Receiver (cma): these regions (u64 ids) are granted for the
    /// connection's life; batches into them need no intent.
    StandingGrant = 43,
    /// Receiver: the standing grant of this region (u64 id) is revoked (its
    /// unregister began); answered by `Fenced`.
    Revoke = 44,
    /// Sender: no write under the revoked standing grant of this region (u64
    /// id) is in flight, and none follows.
    Fenced = 45,
    /// Sender: a batch under standing grants was written (a commit record);
    /// the receiver delivers its completion, nothing is answered.
    StandingCommit = 46,
    /// Sender (tcp, after a redial in the middle of a room): which bytes of
    /// the room grant (u64 token) landed?
    RoomQuery = 47,
    /// Receiver: the bytes of the grant that landed (token, bytes, ranges),
    /// or a `RoomRefuse` when the token names no live grant of the sender.
    RoomLanded = 48,
}

impl FrameType {
    /// The frame type numbered `v`, if any.
    pub(crate) fn from_u16(v: u16) -> Option<FrameType> {
        use FrameType::*;
        Some(match v {
            1 => Hello,
            2 => HelloAck,
            3 => Select,
            4 => SelectOk,
            5 => Attach,
            6 => AttachOk,
            7 => Error,
            10 => Intent,
            11 => Grant,
            12 => Refuse,
            13 => Commit,
            14 => Ack,
            15 => Nack,
            16 => Abort,
            17 => ReadIntent,
            18 => Keepalive,
            20 => Data,
            30 => AuthHello,
            31 => AuthChallenge,
            32 => AuthProof,
            40 => RoomEnd,
            41 => RoomAck,
            42 => RoomRefuse,
            43 => StandingGrant,
            44 => Revoke,
            45 => Fenced,
            46 => StandingCommit,
            47 => RoomQuery,
            48 => RoomLanded,
            _ => return None,
        })
    }
}
