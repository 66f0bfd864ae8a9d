//! The optional batch checksum: a sum over written pieces of a keyed 64-bit
//! hash of (region, offset, bytes). A sum makes it independent of the order
//! in which pieces land (tcp streams interleave); both sides split a batch
//! into the same pieces.

const K: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Hash of one written piece.
pub fn piece(region: u64, offset: u64, data: &[u8]) -> u64 {
    let mut h = mix(region ^ K).wrapping_add(mix(offset.wrapping_add(K)));
    let mut lanes = [K, K.rotate_left(17), K.rotate_left(31), K.rotate_left(47)];
    let mut chunks = data.chunks_exact(32);
    for c in &mut chunks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            *lane = (*lane ^ w).wrapping_mul(K).rotate_left(29);
        }
    }
    for (i, &b) in chunks.remainder().iter().enumerate() {
        lanes[i & 3] = (lanes[i & 3] ^ u64::from(b)).wrapping_mul(K).rotate_left(7);
    }
    for l in lanes {
        h = mix(h ^ l);
    }
    mix(h ^ data.len() as u64)
}

/// [`piece`] computed incrementally: feed the piece's bytes in any split
/// with [`update`](Self::update); [`finish`](Self::finish) equals `piece`
/// over their concatenation (for receivers that land a piece in slices).
#[derive(Debug, Clone)]
pub struct PieceHasher {
    h: u64,
    lanes: [u64; 4],
    tail: [u8; 32],
    buffered: usize,
    len: u64,
}

impl PieceHasher {
    /// Starts the hash of the piece written at `offset` of `region`.
    pub fn new(region: u64, offset: u64) -> PieceHasher {
        PieceHasher {
            h: mix(region ^ K).wrapping_add(mix(offset.wrapping_add(K))),
            lanes: [K, K.rotate_left(17), K.rotate_left(31), K.rotate_left(47)],
            tail: [0; 32],
            buffered: 0,
            len: 0,
        }
    }

    fn absorb(lanes: &mut [u64; 4], c: &[u8]) {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            *lane = (*lane ^ w).wrapping_mul(K).rotate_left(29);
        }
    }

    /// Adds the next bytes of the piece.
    pub fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if self.buffered > 0 {
            let take = (32 - self.buffered).min(data.len());
            self.tail[self.buffered..self.buffered + take].copy_from_slice(&data[..take]);
            self.buffered += take;
            data = &data[take..];
            if self.buffered < 32 {
                return;
            }
            let tail = self.tail;
            Self::absorb(&mut self.lanes, &tail);
            self.buffered = 0;
        }
        let mut chunks = data.chunks_exact(32);
        for c in &mut chunks {
            Self::absorb(&mut self.lanes, c);
        }
        let rest = chunks.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.buffered = rest.len();
    }

    /// The hash of the whole piece.
    pub fn finish(&self) -> u64 {
        let mut lanes = self.lanes;
        for (i, &b) in self.tail[..self.buffered].iter().enumerate() {
            lanes[i & 3] = (lanes[i & 3] ^ u64::from(b)).wrapping_mul(K).rotate_left(7);
        }
        let mut h = self.h;
        for l in lanes {
            h = mix(h ^ l);
        }
        mix(h ^ self.len)
    }
}

/// Combines piece hashes (order-independent).
pub fn combine(acc: u64, piece: u64) -> u64 {
    acc.wrapping_add(piece)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_to_bytes_position_and_length() {
        let a = vec![7u8; 100];
        let mut b = a.clone();
        b[99] = 8;
        assert_ne!(piece(1, 0, &a), piece(1, 0, &b));
        assert_ne!(piece(1, 0, &a), piece(1, 8, &a));
        assert_ne!(piece(1, 0, &a), piece(2, 0, &a));
        assert_ne!(piece(1, 0, &a[..99]), piece(1, 0, &a));
        let mut c = a.clone();
        c[3] = 0;
        assert_ne!(piece(1, 0, &a), piece(1, 0, &c));
        let s1 = combine(combine(0, piece(1, 0, &a)), piece(1, 100, &b));
        let s2 = combine(combine(0, piece(1, 100, &b)), piece(1, 0, &a));
        assert_eq!(s1, s2);
    }

    #[test]
    fn incremental_hash_equals_piece_for_every_split() {
        let data: Vec<u8> = (0..301u32).map(|i| (i * 37 % 251) as u8).collect();
        for len in [0usize, 1, 31, 32, 33, 64, 100, 301] {
            let d = &data[..len];
            let want = piece(9, 4096, d);
            for step in [1usize, 3, 7, 31, 32, 33, 50, 300] {
                let mut h = PieceHasher::new(9, 4096);
                for c in d.chunks(step) {
                    h.update(c);
                }
                assert_eq!(h.finish(), want, "len {len} step {step}");
            }
            // uneven splits: a short slice, then the rest
            for cut in [0usize, 5, 32, 40] {
                let cut = cut.min(len);
                let mut h = PieceHasher::new(9, 4096);
                h.update(&d[..cut]);
                h.update(&d[cut..]);
                assert_eq!(h.finish(), want, "len {len} cut {cut}");
            }
        }
        let mut h = PieceHasher::new(9, 4096);
        h.update(&data[..10]);
        assert_ne!(h.finish(), piece(9, 4096, &data[..11]));
    }
}
