//! The PD session layer: an [`Engine`] per rank, rooms (one per request) and
//! the `KVPoll` state machine, the rank-to-rank control channel.

pub mod control;
pub mod core;
mod device;
pub mod room;
pub mod synthetic;

pub use self::core::{AuxBuffer, Engine, EngineConfig, KvPool};
pub use room::{KvPoll, Room, RoomTable};
