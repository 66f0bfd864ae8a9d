//! Rooms named by string keys (a serving engine's own request ids, e.g.
//! vLLM's): [`room_for_key`] maps a key to a room id the same way on every
//! side, and [`RoomKeys`] holds the keys an engine has bound so that two
//! different keys that map to one room are refused instead of one silently
//! superseding the other's live room.

use crate::error::{Error, Result, Status};
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// The longest key accepted, in bytes.
pub const MAX_ROOM_KEY_BYTES: usize = 4096;

/// The room id of `key`: the first 8 bytes (big-endian) of SHA-256 over a
/// domain tag and the key, with the top bit cleared (rooms stay positive as
/// `int64_t` in the C and Python APIs). The same on every host and release.
pub fn room_for_key(key: &[u8]) -> Result<u64> {
    check_key(key)?;
    let mut h = Sha256::new();
    h.update(b"pdxfer.room_key.v1\0");
    h.update(key);
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    Ok(u64::from_be_bytes(b) & (u64::MAX >> 1))
}

fn check_key(key: &[u8]) -> Result<()> {
    if key.is_empty() || key.len() > MAX_ROOM_KEY_BYTES {
        return Err(Error::invalid(format!(
            "a room key must be 1..={MAX_ROOM_KEY_BYTES} bytes, got {}",
            key.len()
        )));
    }
    Ok(())
}

/// The keys bound to rooms on one engine.
#[derive(Debug, Default)]
pub struct RoomKeys {
    by_room: HashMap<u64, Vec<u8>>,
}

impl RoomKeys {
    /// Binds `key` and returns its room; binding the same key again returns
    /// the same room. A different key already bound to that room is refused
    /// (`room_key_collision`) and nothing changes.
    pub fn bind(&mut self, key: &[u8]) -> Result<u64> {
        let room = room_for_key(key)?;
        match self.by_room.get(&room) {
            Some(k) if k.as_slice() == key => Ok(room),
            Some(k) => Err(Error::new(
                Status::RoomKeyCollision,
                format!(
                    "room key {:?} maps to room {room}, which key {:?} holds on this engine; clear that room first or use another request id",
                    String::from_utf8_lossy(key),
                    String::from_utf8_lossy(k)
                ),
            )),
            None => {
                self.by_room.insert(room, key.to_vec());
                Ok(room)
            }
        }
    }

    /// The key bound to `room`, if any.
    pub fn key(&self, room: u64) -> Option<&[u8]> {
        self.by_room.get(&room).map(Vec::as_slice)
    }

    /// Forgets `room`'s key (when the room is cleared).
    pub fn release(&mut self, room: u64) {
        self.by_room.remove(&room);
    }

    /// Keys bound.
    pub fn len(&self) -> usize {
        self.by_room.len()
    }

    /// Whether no key is bound.
    pub fn is_empty(&self) -> bool {
        self.by_room.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_room_everywhere() {
        let a = room_for_key(b"cmpl-1234-0").unwrap();
        assert_eq!(a, room_for_key(b"cmpl-1234-0").unwrap());
        assert_ne!(a, room_for_key(b"cmpl-1234-1").unwrap());
        assert!(a < 1 << 63);
        // pinned: both sides of a transfer (and other releases) must agree
        let d = Sha256::digest(b"pdxfer.room_key.v1\0cmpl-1234-0");
        let want = u64::from_be_bytes(d[..8].try_into().unwrap()) & (u64::MAX >> 1);
        assert_eq!(a, want);
    }

    #[test]
    fn bad_keys_refused() {
        assert!(room_for_key(b"").is_err());
        assert!(room_for_key(&vec![b'x'; MAX_ROOM_KEY_BYTES + 1]).is_err());
        assert!(room_for_key(&vec![b'x'; MAX_ROOM_KEY_BYTES]).is_ok());
    }

    #[test]
    fn rebinding_and_collisions() {
        let mut k = RoomKeys::default();
        let r = k.bind(b"req-a").unwrap();
        assert_eq!(k.bind(b"req-a").unwrap(), r);
        assert_eq!(k.len(), 1);
        // a forged collision: another key already holding req-a's room
        let mut c = RoomKeys::default();
        c.by_room.insert(r, b"req-b".to_vec());
        let e = c.bind(b"req-a").unwrap_err();
        assert_eq!(e.status(), Status::RoomKeyCollision);
        assert_eq!(
            c.key(r),
            Some(&b"req-b"[..]),
            "a refused bind changes nothing"
        );
        c.release(r);
        assert_eq!(c.bind(b"req-a").unwrap(), r);
        assert_eq!(c.key(r), Some(&b"req-a"[..]));
    }
}
