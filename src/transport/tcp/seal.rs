//! Encrypted tcp pieces (the agent's `tcp_encrypt` option): each piece's
//! payload is sealed with ChaCha20-Poly1305 (RFC 8439) under the data
//! stream's own payload key (HKDF over its authentication exchange, see
//! [`crate::auth::PayloadKeys`]), its 48-byte header as associated data,
//! and its 16-byte tag sent after the ciphertext. The nonce is the piece's
//! number on the stream in that direction (a counter from 0): a key serves
//! one stream and one direction, so no nonce repeats under a key.
//!
//! A sealed piece carries at most [`SEALED_PIECE_BYTES`] of payload (the
//! sender cuts longer destination runs), so the receiver decrypts each one
//! in its own bounded buffer and copies it into the destination only after
//! the tag verified: a piece that fails it writes nothing, fails its batch
//! and drops the stream (`ChannelIntegrity`).

use crate::error::{Error, Result, Status};
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};

/// Bytes of a sealed piece's tag (after its ciphertext).
pub(crate) const SEAL_TAG_LEN: usize = 16;

/// Most payload bytes one sealed piece carries (the receiver's decryption
/// buffer per stream, with the tag).
pub(crate) const SEALED_PIECE_BYTES: u64 = 256 << 10;

/// The nonce of piece `n`: its number, little-endian, in the low 8 bytes.
fn nonce(n: u64) -> Nonce {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&n.to_le_bytes());
    Nonce::from(b)
}

/// Seals the pieces one data stream sends.
pub(crate) struct PieceSealer {
    cipher: ChaCha20Poly1305,
    next: u64,
}

impl PieceSealer {
    pub(crate) fn new(key: &[u8; 32]) -> PieceSealer {
        PieceSealer {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
            next: 0,
        }
    }

    /// Encrypts `payload` in place under the next nonce, `header` as
    /// associated data: the tag to send after it.
    pub(crate) fn seal(&mut self, header: &[u8], payload: &mut [u8]) -> Result<[u8; SEAL_TAG_LEN]> {
        let n = self.next;
        // 2^64 pieces cannot be sent on one stream; refusing keeps the nonce unique regardless
        self.next = n.checked_add(1).ok_or_else(|| {
            Error::new(
                Status::ChannelIntegrity,
                "piece counter exhausted on this stream",
            )
        })?;
        let tag = self
            .cipher
            .encrypt_in_place_detached(&nonce(n), header, payload)
            .map_err(|_| Error::new(Status::ChannelIntegrity, "piece encryption failed"))?;
        Ok(tag.into())
    }

    /// Number of the next piece sealed.
    #[cfg(test)]
    pub(crate) fn next(&self) -> u64 {
        self.next
    }
}

/// Opens the pieces one data stream receives, in the order they were sealed.
pub(crate) struct PieceOpener {
    cipher: ChaCha20Poly1305,
    next: u64,
}

impl PieceOpener {
    pub(crate) fn new(key: &[u8; 32]) -> PieceOpener {
        PieceOpener {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
            next: 0,
        }
    }

    /// Verifies `tag` over `header` and the ciphertext `buf` (the next
    /// piece's) and decrypts `buf` in place. A wrong tag (an altered header,
    /// payload or tag, a piece dropped, replayed or moved, another key) is
    /// `ChannelIntegrity`; `buf` must then not be used (it holds neither the
    /// ciphertext nor the plaintext).
    pub(crate) fn open(&mut self, header: &[u8], buf: &mut [u8], tag: &[u8]) -> Result<()> {
        let n = self.next;
        if tag.len() != SEAL_TAG_LEN {
            return Err(bad_piece(n));
        }
        self.cipher
            .decrypt_in_place_detached(&nonce(n), header, buf, Tag::from_slice(tag))
            .map_err(|_| bad_piece(n))?;
        self.next = n + 1;
        Ok(())
    }
}

fn bad_piece(n: u64) -> Error {
    Error::new(
        Status::ChannelIntegrity,
        format!(
            "encrypted tcp piece {n} failed its authentication tag: its header, payload or tag was \
             altered, or a piece was dropped, replayed or reordered on the way; nothing of it was \
             written and the stream is dropped"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const HDR: [u8; 48] = [7u8; 48];

    fn pair() -> (PieceSealer, PieceOpener) {
        let k = [42u8; 32];
        (PieceSealer::new(&k), PieceOpener::new(&k))
    }

    #[test]
    fn sealed_pieces_open_in_order_byte_exact() {
        let (mut s, mut o) = pair();
        for len in [0usize, 1, 4096, 256 << 10] {
            let plain: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut buf = plain.clone();
            let tag = s.seal(&HDR, &mut buf).unwrap();
            if len > 16 {
                assert_ne!(buf, plain, "the payload travels encrypted");
            }
            o.open(&HDR, &mut buf, &tag).unwrap();
            assert_eq!(buf, plain);
        }
    }

    #[test]
    fn a_flipped_bit_in_ciphertext_tag_or_header_is_refused() {
        let plain = vec![5u8; 1000];
        for what in ["ciphertext", "tag", "header"] {
            let (mut s, mut o) = pair();
            let mut buf = plain.clone();
            let mut tag = s.seal(&HDR, &mut buf).unwrap();
            let mut hdr = HDR;
            match what {
                "ciphertext" => buf[500] ^= 0x10,
                "tag" => tag[3] ^= 1,
                _ => hdr[40] ^= 0x80,
            }
            let e = o.open(&hdr, &mut buf, &tag).unwrap_err();
            assert_eq!(e.status(), Status::ChannelIntegrity, "{what}: {e}");
            // a short tag is refused too
            assert!(o.open(&HDR, &mut buf, &tag[..8]).is_err());
        }
    }

    #[test]
    fn replayed_dropped_or_reordered_pieces_are_refused() {
        let (mut s, mut o) = pair();
        let mut p0 = vec![1u8; 64];
        let t0 = s.seal(&HDR, &mut p0).unwrap();
        let mut p1 = vec![2u8; 64];
        let t1 = s.seal(&HDR, &mut p1).unwrap();
        // piece 1 first (piece 0 dropped or moved): refused
        let mut x = p1.clone();
        assert!(o.open(&HDR, &mut x, &t1).is_err());
        o.open(&HDR, &mut p0, &t0).unwrap();
        // piece 0 again (a replay): refused
        let mut y = vec![1u8; 64];
        let mut s2 = PieceSealer::new(&[42u8; 32]);
        let ty = s2.seal(&HDR, &mut y).unwrap();
        assert!(o.open(&HDR, &mut y, &ty).is_err());
        o.open(&HDR, &mut p1, &t1).unwrap();
        assert_eq!(p1, vec![2u8; 64]);
    }

    #[test]
    fn nonces_never_repeat_across_pieces() {
        let (mut s, _) = pair();
        let mut seen = std::collections::HashSet::new();
        let mut tags = std::collections::HashSet::new();
        for i in 0..1000u64 {
            assert_eq!(s.next(), i);
            assert!(seen.insert(nonce(s.next())), "nonce of piece {i} repeats");
            // the same plaintext and header seal differently each time
            let mut buf = vec![0u8; 32];
            let t = s.seal(&HDR, &mut buf).unwrap();
            assert!(
                tags.insert((buf, t)),
                "piece {i} sealed like an earlier one"
            );
        }
        // an exhausted counter refuses instead of wrapping
        s.next = u64::MAX;
        assert!(s.seal(&HDR, &mut [0u8; 4]).is_err());
    }
}
