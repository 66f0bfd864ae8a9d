//! Rooms named by string keys (request ids) over the C ABI: the key's room,
//! and binding a key to a room on one engine (see `engine::room_keys`).

use super::engine::{eng, PdxEngine};
use super::{boundary, ok, ptr, PdxStatus};
use crate::engine::{room_for_key, MAX_ROOM_KEY_BYTES};
use crate::error::Result;

/// The longest room key `pdxfer_room_for_key` and `pdxfer_engine_bind_room_key` accept, in bytes.
pub const PDXFER_MAX_ROOM_KEY_BYTES: usize = 4096;
const _: () = assert!(PDXFER_MAX_ROOM_KEY_BYTES == MAX_ROOM_KEY_BYTES);

fn key<'a>(k: *const u8, len: usize) -> Result<&'a [u8]> {
    ptr::slice(k, len, "key")
}

/// The room id of the `len` bytes at `key` (a request id, 1 to
/// `PDXFER_MAX_ROOM_KEY_BYTES` bytes) into `*out_room`: the same on every
/// host and release (SHA-256 based, below 2^63). Binds nothing; use
/// `pdxfer_engine_bind_room_key` on an engine to have collisions refused.
#[no_mangle]
pub extern "C" fn pdxfer_room_for_key(
    key_bytes: *const u8,
    len: usize,
    out_room: *mut u64,
) -> PdxStatus {
    boundary(|| {
        ptr::check_out(out_room, "out_room")?;
        let r = room_for_key(key(key_bytes, len)?)?;
        ptr::write_out(out_room, r, "out_room")?;
        ok()
    })
}

/// Binds the key (a request id) on the engine until its room is cleared and
/// writes its room (as `pdxfer_room_for_key`) into `*out_room`. Binding the
/// same key again gives the same room; a different key whose room is bound
/// on this engine is refused with `PDX_STATUS_ROOM_KEY_COLLISION` (the
/// detail names both keys) and nothing changes.
#[no_mangle]
pub extern "C" fn pdxfer_engine_bind_room_key(
    engine: *const PdxEngine,
    key_bytes: *const u8,
    len: usize,
    out_room: *mut u64,
) -> PdxStatus {
    boundary(|| {
        ptr::check_out(out_room, "out_room")?;
        let k = key(key_bytes, len)?;
        let r = eng(engine)?.bind_room_key(k)?;
        ptr::write_out(out_room, r, "out_room")?;
        ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_for_key_over_the_abi() {
        let mut r = 0u64;
        let k = b"cmpl-7";
        assert_eq!(
            pdxfer_room_for_key(k.as_ptr(), k.len(), &mut r),
            PdxStatus::Ok
        );
        assert_eq!(r, room_for_key(k).unwrap());
        let mut r2 = 5u64;
        assert_eq!(
            pdxfer_room_for_key(k.as_ptr(), 0, &mut r2),
            PdxStatus::InvalidArgument
        );
        assert_eq!(r2, 5, "a refused call writes nothing");
        assert_eq!(
            pdxfer_room_for_key(std::ptr::null(), 3, &mut r2),
            PdxStatus::NullArgument
        );
        assert_eq!(
            pdxfer_room_for_key(k.as_ptr(), k.len(), std::ptr::null_mut()),
            PdxStatus::NullArgument
        );
        assert_eq!(
            pdxfer_engine_bind_room_key(std::ptr::null(), k.as_ptr(), k.len(), &mut r2),
            PdxStatus::NullArgument
        );
    }
}
