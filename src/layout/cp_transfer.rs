//! What a prefill publishes about its attention context parallelism (CP):
//! which CP ranks send ([`CpMode`]) and how they store the KV ([`CpStorage`]).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Which prefill CP ranks send KV.
#[repr(u32)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpMode {
    /// CP rank 0 sends everything; the others conclude locally (SGLang's default).
    #[default]
    Rank0 = 0,
    /// Every CP rank sends its page range (SGLang's all-CP-ranks transfer).
    AllCp = 1,
}

impl CpMode {
    /// The mode for a C value (`PDXFER_CP_MODE_*`).
    pub fn from_u32(v: u32) -> Result<CpMode> {
        match v {
            0 => Ok(CpMode::Rank0),
            1 => Ok(CpMode::AllCp),
            _ => Err(Error::invalid(format!(
                "unknown CP send mode {v} (0 rank0, 1 all-CP-ranks)"
            ))),
        }
    }

    /// `rank0` or `all-cp` (also accepts `all_cp`).
    pub fn parse(s: &str) -> Result<CpMode> {
        match s {
            "rank0" => Ok(CpMode::Rank0),
            "all-cp" | "all_cp" => Ok(CpMode::AllCp),
            _ => Err(Error::invalid(format!(
                "unknown CP send mode {s:?}: use rank0 or all-cp"
            ))),
        }
    }

    /// The mode's name.
    pub fn as_str(self) -> &'static str {
        match self {
            CpMode::Rank0 => "rank0",
            CpMode::AllCp => "all-cp",
        }
    }
}

/// How the prefill's CP ranks store the KV.
#[repr(u32)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpStorage {
    /// Every CP rank holds every token (SGLang's prefill CP for MLA).
    #[default]
    Replicated = 0,
    /// Each CP rank holds a subset of the layers (`--enable-dsa-cache-layer-split`).
    LayerSplit = 1,
    /// Pages are sharded by page id (`--enable-kv-cache-sharding`).
    KvSharded = 2,
}

impl CpStorage {
    /// The storage for a C value (`PDXFER_CP_STORAGE_*`).
    pub fn from_u32(v: u32) -> Result<CpStorage> {
        match v {
            0 => Ok(CpStorage::Replicated),
            1 => Ok(CpStorage::LayerSplit),
            2 => Ok(CpStorage::KvSharded),
            _ => Err(Error::invalid(format!(
                "unknown CP storage {v} (0 replicated, 1 layer split, 2 KV sharding)"
            ))),
        }
    }

    /// The storage's name.
    pub fn as_str(self) -> &'static str {
        match self {
            CpStorage::Replicated => "replicated",
            CpStorage::LayerSplit => "layer_split",
            CpStorage::KvSharded => "kv_sharded",
        }
    }

    /// The SGLang launch flag that selects this storage, if any.
    pub fn sglang_flag(self) -> Option<&'static str> {
        match self {
            CpStorage::Replicated => None,
            CpStorage::LayerSplit => Some("--enable-dsa-cache-layer-split"),
            CpStorage::KvSharded => Some("--enable-kv-cache-sharding"),
        }
    }
}

/// What a prefill publishes about its CP transfer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CpTransfer {
    /// Which CP ranks send.
    #[serde(default)]
    pub mode: CpMode,
    /// How the CP ranks store the KV.
    #[serde(default)]
    pub storage: CpStorage,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for m in [CpMode::Rank0, CpMode::AllCp] {
            assert_eq!(CpMode::parse(m.as_str()).unwrap(), m);
            assert_eq!(CpMode::from_u32(m as u32).unwrap(), m);
        }
        assert!(CpMode::parse("all").is_err());
        for s in [
            CpStorage::Replicated,
            CpStorage::LayerSplit,
            CpStorage::KvSharded,
        ] {
            assert_eq!(CpStorage::from_u32(s as u32).unwrap(), s);
        }
        assert!(CpStorage::from_u32(3).is_err());
        let j = serde_json::to_string(&CpTransfer::default()).unwrap();
        assert_eq!(j, r#"{"mode":"rank0","storage":"replicated"}"#);
        let t: CpTransfer = serde_json::from_str("{}").unwrap();
        assert_eq!(t, CpTransfer::default());
    }
}
