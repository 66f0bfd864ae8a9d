//! The PD session layer: rooms (one per request) and the `KVPoll` state machine.

pub mod room;

pub use room::{KvPoll, Room, RoomTable};
