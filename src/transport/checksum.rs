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
}
