//! Region descriptors: what a peer needs to address registered memory.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where the bytes of a region live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RegionKind {
    /// Host (CPU) memory of the owning process.
    Host,
    /// CUDA device memory on device `ordinal` of the owning process.
    Device {
        /// CUDA device ordinal.
        ordinal: u32,
    },
}

/// A registered region as peers see it: id, address in the owner's address
/// space, length, kind, and per-transport keys (e.g. an RDMA rkey).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Region id, unique within the owning registry.
    pub id: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or device memory.
    pub kind: RegionKind,
    /// Per-transport keys (transport name -> key), e.g. `"rdma" -> rkey`.
    #[serde(default)]
    pub keys: BTreeMap<String, u64>,
}

impl RegionDesc {
    /// True when `[offset, offset + len)` lies inside the region (overflow-safe).
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Checks `[offset, offset + len)` against this descriptor, with the
    /// typed `OutOfBounds` error naming both sides.
    pub fn check(&self, offset: u64, len: u64) -> crate::Result<()> {
        if self.contains(offset, len) {
            Ok(())
        } else {
            Err(crate::Error::new(
                crate::Status::OutOfBounds,
                format!(
                    "access [{offset}, {offset}+{len}) is outside region {} of {} bytes; nothing was transferred",
                    self.id, self.len
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contains_is_overflow_safe_and_serde_roundtrips() {
        let d = RegionDesc {
            id: 3,
            addr: 0x1000,
            len: 100,
            kind: RegionKind::Device { ordinal: 1 },
            keys: [("rdma".to_string(), 7u64)].into_iter().collect(),
        };
        assert!(d.contains(0, 100));
        assert!(d.contains(100, 0));
        assert!(!d.contains(1, 100));
        assert!(!d.contains(u64::MAX, 2));
        assert_eq!(
            d.check(90, 11).unwrap_err().status(),
            crate::Status::OutOfBounds
        );
        let s = serde_json::to_string(&d).unwrap();
        assert!(s.contains("\"device\""), "{s}");
        let back: RegionDesc = serde_json::from_str(&s).unwrap();
        assert_eq!(back, d);
    }
}
