//! `PdxKvPoolDesc`: a KV pool described with its page stride (ABI 1.7), the
//! versioned form of `PdxKvPool` that `PdxEngineConfig.pool_descs` takes.

use super::engine::PdxKvPool;
use super::ptr::{self, Versioned};
use crate::engine::KvPool;
use crate::error::{Error, Result, Status};
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

/// The engine's pools from a config's `pools` (`PdxKvPool`, pages end to end)
/// or `pool_descs` (`PdxKvPoolDesc`): one of the two, not both.
pub(super) fn kv_pools(
    pools: *const PdxKvPool,
    num_pools: u64,
    descs: *const PdxKvPoolDesc,
    num_descs: u64,
) -> Result<Vec<KvPool>> {
    let count = |n: u64, what: &str| {
        usize::try_from(n).map_err(|_| Error::invalid(format!("{what} too large")))
    };
    let (n, nd) = (
        count(num_pools, "num_pools")?,
        count(num_descs, "num_pool_descs")?,
    );
    if n > 0 && nd > 0 {
        return Err(Error::invalid(format!(
            "config has {n} pools and {nd} pool_descs: give the pools once, as PdxKvPool (pages end to end) or as PdxKvPoolDesc (with a page stride)"
        )));
    }
    let out: Vec<KvPool> = if nd > 0 {
        let descs = ptr::read_versioned_array(descs, nd, "config.pool_descs")?;
        if let Some((i, d)) = descs.iter().enumerate().find(|(_, d)| d.flags != 0) {
            return Err(Error::invalid(format!(
                "config.pool_descs[{i}].flags=0x{:x}: no flags are defined, pass 0",
                d.flags
            )));
        }
        descs
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
            .collect()
    } else {
        ptr::slice(pools, n, "config.pools")?
            .iter()
            .map(|p| KvPool {
                layer_id: p.layer_id,
                base: p.base as u64,
                page_bytes: p.page_bytes,
                num_pages: p.num_pages,
                page_stride: p.page_bytes,
            })
            .collect()
    };
    let what = if nd > 0 { "pool_descs" } else { "pools" };
    if let Some((i, _)) = out.iter().enumerate().find(|(_, p)| p.base == 0) {
        return Err(Error::new(
            Status::NullArgument,
            format!("config.{what}[{i}].base is NULL"),
        ));
    }
    Ok(out)
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
        let d = [desc(0x1000, 192), desc(0x1040, 0)];
        let p = kv_pools(std::ptr::null(), 0, d.as_ptr(), 2).unwrap();
        assert_eq!((p[0].page_stride, p[1].page_stride), (192, 64));
        assert_eq!((p[0].base, p[0].layer_id, p[0].num_pages), (0x1000, 3, 10));
        // both arrays, a flag, a NULL base, a smaller or ragged struct_size
        let pool = PdxKvPool {
            layer_id: 0,
            reserved: 0,
            base: 0x1000 as *mut c_void,
            page_bytes: 64,
            num_pages: 1,
        };
        let e = kv_pools(&pool, 1, d.as_ptr(), 2).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        let mut f = d;
        f[1].flags = 1;
        assert_eq!(
            kv_pools(std::ptr::null(), 0, f.as_ptr(), 2)
                .unwrap_err()
                .status(),
            Status::InvalidArgument
        );
        let n = [desc(0, 0)];
        assert_eq!(
            kv_pools(std::ptr::null(), 0, n.as_ptr(), 1)
                .unwrap_err()
                .status(),
            Status::NullArgument
        );
        let mut small = d;
        small[0].struct_size = 40;
        assert_eq!(
            kv_pools(std::ptr::null(), 0, small.as_ptr(), 2)
                .unwrap_err()
                .status(),
            Status::AbiMismatch
        );
        let mut ragged = d;
        ragged[1].struct_size = 56;
        assert_eq!(
            kv_pools(std::ptr::null(), 0, ragged.as_ptr(), 2)
                .unwrap_err()
                .status(),
            Status::AbiMismatch
        );
        assert_eq!(
            kv_pools(std::ptr::null(), 0, std::ptr::null(), 2)
                .unwrap_err()
                .status(),
            Status::NullArgument
        );
        // the plain pools: pages end to end
        let p = kv_pools(&pool, 1, std::ptr::null(), 0).unwrap();
        assert_eq!(p[0].page_stride, 64);
    }
}
