//! `PdxKvPoolDesc`: a KV pool described with its page stride (ABI 1.7), the
//! versioned form of `PdxKvPool` that `PdxEngineConfig.pool_descs` takes.

use super::ptr::{self, Versioned};
use crate::engine::KvPool;
use crate::error::{Error, Result};
use std::ffi::c_void;

/// One KV entry's pool (ABI 1.7): `num_pages` pages of `page_bytes`, page `p`
/// at `base + p * page_stride`. `page_stride` 0 means `page_bytes` (pages end
/// to end); a larger stride (block-outermost or padded layouts) must be a
/// whole number of pages, the same number for every pool of the engine
/// (docs/engine.md, "Page stride"). An array of these is `struct_size` bytes
/// an element.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PdxKvPoolDesc {
    /// `sizeof(PdxKvPoolDesc)`, set by the caller in every element.
    pub struct_size: u64,
    /// Global layer id (the topology entry's).
    pub layer_id: u32,
    /// Reserved flags, zero.
    pub flags: u32,
    /// Start of the pool (its page 0): host memory, or a CUDA device address
    /// with `PDXFER_POOL_CUDA`.
    pub base: *mut c_void,
    /// Bytes of one page (`page_size * row_bytes` of the entry).
    pub page_bytes: u64,
    /// Bytes from one page's start to the next's (0: `page_bytes`).
    pub page_stride: u64,
    /// Pages in the pool.
    pub num_pages: u64,
}

// SAFETY: repr(C), starts with u64 struct_size, integers and raw pointers only (zero is valid).
unsafe impl Versioned for PdxKvPoolDesc {
    const MIN_SIZE: usize = std::mem::size_of::<PdxKvPoolDesc>();
    const NAME: &'static str = "PdxKvPoolDesc";
}

/// The engine's pools from a config's `pool_descs` (`num` of them, `struct_size`
/// bytes an element): unknown flags are refused, a stride 0 is the page bytes.
pub(super) fn kv_pools(descs: *const PdxKvPoolDesc, num: u64) -> Result<Vec<KvPool>> {
    let n = usize::try_from(num).map_err(|_| Error::invalid("num_pool_descs too large"))?;
    let descs = ptr::read_versioned_array(descs, n, "config.pool_descs")?;
    if let Some((i, d)) = descs.iter().enumerate().find(|(_, d)| d.flags != 0) {
        return Err(Error::invalid(format!(
            "config.pool_descs[{i}].flags=0x{:x}: no flags are defined, pass 0",
            d.flags
        )));
    }
    Ok(descs
        .iter()
        .map(|d| KvPool {
            layer_id: d.layer_id,
            base: d.base as u64,
            page_bytes: d.page_bytes,
            num_pages: d.num_pages,
            page_stride: if d.page_stride == 0 {
                d.page_bytes
            } else {
                d.page_stride
            },
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(base: usize, stride: u64) -> PdxKvPoolDesc {
        PdxKvPoolDesc {
            struct_size: std::mem::size_of::<PdxKvPoolDesc>() as u64,
            layer_id: 3,
            flags: 0,
            base: base as *mut c_void,
            page_bytes: 64,
            page_stride: stride,
            num_pages: 10,
        }
    }

    #[test]
    fn size_is_pinned() {
        assert_eq!(std::mem::size_of::<PdxKvPoolDesc>(), 48);
    }

    #[test]
    fn descs_carry_the_stride_and_refuse_what_they_cannot_mean() {
        use crate::error::Status;
        let d = [desc(0x1000, 192), desc(0x1040, 0)];
        let p = kv_pools(d.as_ptr(), 2).unwrap();
        assert_eq!((p[0].page_stride, p[1].page_stride), (192, 64));
        assert_eq!((p[0].base, p[0].layer_id, p[0].num_pages), (0x1000, 3, 10));
        // a flag, a smaller or ragged struct_size, NULL with a count
        let mut f = d;
        f[1].flags = 1;
        assert_eq!(
            kv_pools(f.as_ptr(), 2).unwrap_err().status(),
            Status::InvalidArgument
        );
        let mut small = d;
        small[0].struct_size = 40;
        assert_eq!(
            kv_pools(small.as_ptr(), 2).unwrap_err().status(),
            Status::AbiMismatch
        );
        let mut ragged = d;
        ragged[1].struct_size = 56;
        assert_eq!(
            kv_pools(ragged.as_ptr(), 2).unwrap_err().status(),
            Status::AbiMismatch
        );
        assert_eq!(
            kv_pools(std::ptr::null(), 2).unwrap_err().status(),
            Status::NullArgument
        );
        assert!(kv_pools(std::ptr::null(), 0).unwrap().is_empty());
    }
}
