//! The versioned bootstrap schema: what a rank registers, what the bootstrap
//! answers, and what a rank says about itself on a direct connection.
//!
//! Every value here travels as JSON (HTTP bodies, etcd values, hello lines).
//! [`SCHEMA_VERSION`] is bumped on any incompatible change; a registration or
//! hello of another version is refused with a message naming both versions.

use crate::error::{Error, Result, Status};
use crate::layout::{CpTransfer, KvDtype, PoolKind, Topology};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

/// Version of the bootstrap JSON schema written and accepted by this build.
/// cbindgen:ignore
pub const SCHEMA_VERSION: u32 = 1;

/// Most endpoints one registration may carry.
/// cbindgen:ignore
pub const MAX_ENDPOINTS: usize = 32;
/// Most region descriptors one registration may carry.
/// cbindgen:ignore
pub const MAX_REGIONS: usize = 65_536;
/// Longest cluster name (it is part of URLs and etcd keys).
/// cbindgen:ignore
pub const MAX_CLUSTER_LEN: usize = 64;
/// Largest size of any one parallel dimension (dp, attention TP, attention
/// CP, pipeline, DCP) a registration may claim.
/// cbindgen:ignore
pub const MAX_PARALLEL_SIZE: u32 = 1024;
/// Most ranks one instance may claim (`dp_size * attn_tp_size * attn_cp_size * pp_size`).
/// cbindgen:ignore
pub const MAX_INSTANCE_RANKS: u64 = 65_536;
/// Largest page size (tokens per page) a registration may claim.
/// cbindgen:ignore
pub const MAX_PAGE_SIZE: u32 = 65_536;
/// Most KV entries (layers, or K and V of each layer) one pool may list.
/// cbindgen:ignore
pub const MAX_KV_ENTRIES: usize = 16_384;
/// Largest layer id a KV entry may carry. Ids are labels, not counts: the
/// SGLang adapter gives an MHA pool's V entries ids in bands of 2^20 and draft
/// entries ids from 2^24, so the cap only keeps ids clear of the sign bit.
/// cbindgen:ignore
pub const MAX_LAYER_ID: u32 = (1 << 30) - 1;
/// Largest bytes of one token row of one KV entry.
/// cbindgen:ignore
pub const MAX_ROW_BYTES: u64 = 1 << 30;

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Random bytes from the operating system.
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| Error::new(Status::Io, format!("OS random source failed: {e}")))?;
    Ok(b)
}

/// A random 128-bit id, drawn once per process start (per engine instance);
/// written as 32 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(pub u128);

impl InstanceId {
    /// A fresh random id from the OS random source.
    pub fn random() -> Result<InstanceId> {
        Ok(InstanceId(u128::from_le_bytes(random_bytes::<16>()?)))
    }

    /// Parses 32 hex digits.
    pub fn parse(s: &str) -> Result<InstanceId> {
        if s.len() != 32 {
            return Err(Error::invalid(format!(
                "instance_id must be 32 hex digits, got {} characters",
                s.len()
            )));
        }
        u128::from_str_radix(s, 16)
            .map(InstanceId)
            .map_err(|_| Error::invalid(format!("instance_id {s:?} is not hexadecimal")))
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl Serialize for InstanceId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for InstanceId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        InstanceId::parse(&s).map_err(|e| serde::de::Error::custom(e.detail()))
    }
}

/// Which side of the PD pair a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes KV and sends it.
    Prefill,
    /// Receives KV.
    Decode,
}

impl Role {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Parses `"prefill"` or `"decode"`.
    pub fn parse(s: &str) -> Result<Role> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(Error::invalid(format!(
                "role must be \"prefill\" or \"decode\", got {s:?}"
            ))),
        }
    }

    /// The other side.
    pub fn peer(self) -> Role {
        match self {
            Role::Prefill => Role::Decode,
            Role::Decode => Role::Prefill,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a rank sits in its instance: one entry per key per (cluster, role).
///
/// The DCP rank is not part of the key: it is derived from the TP rank by the
/// engine, and a restart with another DCP layout must replace the entry at
/// the same key, not sit beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RankKey {
    /// Data-parallel group.
    pub dp: u32,
    /// Attention TP rank.
    pub tp: u32,
    /// Attention CP rank.
    pub cp: u32,
    /// Pipeline rank.
    pub pp: u32,
}

impl RankKey {
    /// Parses the path form `dp0-tp1-cp0-pp0`.
    pub fn parse(s: &str) -> Result<RankKey> {
        let bad = || {
            Error::invalid(format!(
                "rank key must look like dp0-tp1-cp0-pp0, got {s:?}"
            ))
        };
        let parts: Vec<&str> = s.split('-').collect();
        if parts.len() != 4 {
            return Err(bad());
        }
        let mut v = [0u32; 4];
        for (i, (p, name)) in parts.iter().zip(["dp", "tp", "cp", "pp"]).enumerate() {
            v[i] = p
                .strip_prefix(name)
                .and_then(|n| n.parse().ok())
                .ok_or_else(bad)?;
        }
        Ok(RankKey {
            dp: v[0],
            tp: v[1],
            cp: v[2],
            pp: v[3],
        })
    }
}

impl fmt::Display for RankKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp{}-tp{}-cp{}-pp{}", self.dp, self.tp, self.cp, self.pp)
    }
}

/// A memory region a rank exposes to its peers (the data-plane layer fills it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// Region id, unique within the registering rank.
    pub id: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What the region holds ("kv", "aux", "state", "staging", ...).
    pub kind: String,
    /// Transport-specific keys (rkey, IPC handle, ...).
    #[serde(default)]
    pub keys: BTreeMap<String, String>,
}

/// One rank's bootstrap entry.
///
/// `epoch` and `registered_at_ms` are assigned by the store when the entry is
/// written (the in-memory store counts; etcd uses the key's revision), so a
/// re-registration always has a larger epoch than the entry it replaces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Schema version ([`SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// Cluster name: isolates deployments sharing one bootstrap namespace.
    pub cluster: String,
    /// Prefill or decode.
    pub role: Role,
    /// Random id of the registering process (per process start).
    pub instance_id: InstanceId,
    /// Store-assigned, strictly increasing per (cluster, role) on every write.
    #[serde(default)]
    pub epoch: u64,
    /// Store-assigned registration time (ms since the Unix epoch).
    #[serde(default)]
    pub registered_at_ms: u64,
    /// Data-parallel size of the instance.
    pub dp_size: u32,
    /// Data-parallel group of this rank.
    pub dp_rank: u32,
    /// Parallel topology and KV geometry (from the layout core).
    pub topology: Topology,
    /// Transport name -> address (`"tcp" -> "10.0.0.1:7000"`, `"hello" -> ...`).
    #[serde(default)]
    pub endpoints: BTreeMap<String, String>,
    /// Regions peers may access.
    #[serde(default)]
    pub regions: Vec<RegionDescriptor>,
}

/// The instance-wide part of a topology: two entries with different layouts
/// belong to different cluster layouts, and only the newest layout is current.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel size.
    pub dp_size: u32,
    /// Attention TP size.
    pub attn_tp_size: u32,
    /// Attention CP size.
    pub attn_cp_size: u32,
    /// Pipeline size.
    pub pp_size: u32,
    /// DCP size.
    pub dcp_size: u32,
    /// DCP interleave.
    pub dcp_interleave: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// KV dtype.
    pub kv_dtype: KvDtype,
    /// Pool kind.
    pub pool: PoolKind,
    /// Which attention CP ranks send and how they store the KV (prefill).
    #[serde(default)]
    pub cp: CpTransfer,
}

impl Layout {
    /// Ranks one instance of this layout has (`dp * tp * cp * pp`).
    pub fn expected_ranks(&self) -> u64 {
        u64::from(self.dp_size)
            * u64::from(self.attn_tp_size)
            * u64::from(self.attn_cp_size)
            * u64::from(self.pp_size)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dp={} tp={} cp={} pp={} dcp={} interleave={} page_size={} dtype={} pool={}",
            self.dp_size,
            self.attn_tp_size,
            self.attn_cp_size,
            self.pp_size,
            self.dcp_size,
            self.dcp_interleave,
            self.page_size,
            self.kv_dtype.as_str(),
            self.pool.as_str()
        )
    }
}

/// Checks a cluster name: 1..=64 characters of `[A-Za-z0-9_.-]`.
pub fn validate_cluster(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_CLUSTER_LEN {
        return Err(Error::invalid(format!(
            "cluster: name must be 1..={MAX_CLUSTER_LEN} characters, got {}",
            name.len()
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(Error::invalid(format!(
            "cluster: name {name:?} has the character {c:?}; use [A-Za-z0-9_.-]"
        )));
    }
    Ok(())
}

impl Registration {
    /// A registration of `topology` for `cluster`/`role` with no endpoints or regions yet.
    pub fn new(
        cluster: &str,
        role: Role,
        instance_id: InstanceId,
        topology: Topology,
    ) -> Registration {
        Registration {
            schema_version: SCHEMA_VERSION,
            cluster: cluster.to_string(),
            role,
            instance_id,
            epoch: 0,
            registered_at_ms: 0,
            dp_size: 1,
            dp_rank: 0,
            topology,
            endpoints: BTreeMap::new(),
            regions: Vec::new(),
        }
    }

    /// The entry's key within its (cluster, role).
    pub fn key(&self) -> RankKey {
        RankKey {
            dp: self.dp_rank,
            tp: self.topology.attn_tp_rank,
            cp: self.topology.attn_cp_rank,
            pp: self.topology.pp_rank,
        }
    }

    /// The instance-wide layout this entry belongs to.
    pub fn layout(&self) -> Layout {
        let t = &self.topology;
        Layout {
            dp_size: self.dp_size,
            attn_tp_size: t.attn_tp_size,
            attn_cp_size: t.attn_cp_size,
            pp_size: t.pp_size,
            dcp_size: t.dcp_size,
            dcp_interleave: t.dcp_interleave,
            page_size: t.page_size,
            kv_dtype: t.kv_dtype,
            pool: t.pool,
            cp: t.cp,
        }
    }

    /// One line naming the entry: role, cluster, key, DCP rank, instance, epoch, time.
    pub fn describe(&self) -> String {
        format!(
            "{} {}/{} (dcp_rank={}/{}) instance {} epoch {} registered at {} ms",
            self.role,
            self.cluster,
            self.key(),
            self.topology.dcp_rank,
            self.topology.dcp_size,
            self.instance_id,
            self.epoch,
            self.registered_at_ms
        )
    }

    /// Checks every field a store relies on; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(Error::invalid(format!(
                "schema_version: this bootstrap speaks version {SCHEMA_VERSION}, the registration has {}; upgrade the older side",
                self.schema_version
            )));
        }
        validate_cluster(&self.cluster)?;
        self.validate_caps()?;
        if self.dp_size == 0 || self.dp_rank >= self.dp_size {
            return Err(Error::new(
                Status::InvalidTopology,
                format!(
                    "dp_rank: {} is not below dp_size={}",
                    self.dp_rank, self.dp_size
                ),
            ));
        }
        self.topology
            .validate("topology")
            .map_err(|e| Error::new(e.status(), e.detail().to_string()))?;
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(Error::invalid(format!(
                "endpoints: {} given, at most {MAX_ENDPOINTS}",
                self.endpoints.len()
            )));
        }
        if self.regions.len() > MAX_REGIONS {
            return Err(Error::invalid(format!(
                "regions: {} given, at most {MAX_REGIONS}",
                self.regions.len()
            )));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(Error::invalid(format!(
                    "regions[{i}]: addr={:#x} len={} is empty or wraps around",
                    r.addr, r.len
                )));
            }
        }
        Ok(())
    }
}

impl Registration {
    /// Refuses values above the sane maxima (a `pp_size` of 2^31 would make
    /// every real entry of the cluster stale); the error names the field.
    fn validate_caps(&self) -> Result<()> {
        let t = &self.topology;
        let too_big = |field: &str, v: u64, max: u64| {
            Error::new(
                Status::InvalidTopology,
                format!("{field}: {v} is above the maximum {max}"),
            )
        };
        let sizes = [
            ("dp_size", self.dp_size),
            ("topology.attn_tp_size", t.attn_tp_size),
            ("topology.attn_cp_size", t.attn_cp_size),
            ("topology.pp_size", t.pp_size),
            ("topology.dcp_size", t.dcp_size),
        ];
        for (field, v) in sizes {
            if v > MAX_PARALLEL_SIZE {
                return Err(too_big(field, v.into(), MAX_PARALLEL_SIZE.into()));
            }
        }
        let ranks = self.layout().expected_ranks();
        if ranks > MAX_INSTANCE_RANKS {
            return Err(too_big(
                "dp_size*topology.attn_tp_size*topology.attn_cp_size*topology.pp_size",
                ranks,
                MAX_INSTANCE_RANKS,
            ));
        }
        if u64::from(t.engine_rank) >= MAX_INSTANCE_RANKS {
            return Err(too_big(
                "topology.engine_rank",
                t.engine_rank.into(),
                MAX_INSTANCE_RANKS - 1,
            ));
        }
        if t.page_size > MAX_PAGE_SIZE {
            return Err(too_big(
                "topology.page_size",
                t.page_size.into(),
                MAX_PAGE_SIZE.into(),
            ));
        }
        if t.dcp_interleave > MAX_PAGE_SIZE {
            return Err(too_big(
                "topology.dcp_interleave",
                t.dcp_interleave.into(),
                MAX_PAGE_SIZE.into(),
            ));
        }
        if t.entries.len() > MAX_KV_ENTRIES {
            return Err(Error::new(
                Status::GeometryMismatch,
                format!(
                    "topology.entries: {} given, at most {MAX_KV_ENTRIES}",
                    t.entries.len()
                ),
            ));
        }
        for (i, e) in t.entries.iter().enumerate() {
            if e.layer_id > MAX_LAYER_ID {
                return Err(too_big(
                    &format!("topology.entries[{i}].layer_id"),
                    e.layer_id.into(),
                    MAX_LAYER_ID.into(),
                ));
            }
            if e.row_bytes > MAX_ROW_BYTES {
                return Err(too_big(
                    &format!("topology.entries[{i}].row_bytes"),
                    e.row_bytes,
                    MAX_ROW_BYTES,
                ));
            }
        }
        Ok(())
    }
}

/// Answer to a registration: the identity the store gave the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterAck {
    /// Epoch of the written entry.
    pub epoch: u64,
    /// Registration time of the written entry.
    pub registered_at_ms: u64,
    /// Lease the entry is bound to; keep it alive or the entry expires.
    pub lease_id: u64,
    /// Lease time-to-live in milliseconds.
    pub ttl_ms: u64,
    /// True when an existing entry at the same key was replaced.
    pub replaced: bool,
}

/// Body of a registration request (the HTTP route and the C ABI).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The entry.
    pub registration: Registration,
    /// Requested lease time-to-live in milliseconds.
    pub ttl_ms: u64,
}

/// A short view of one entry, as listed in a [`Summary`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankBrief {
    /// The rank key.
    pub key: RankKey,
    /// The DCP rank.
    pub dcp_rank: u32,
    /// Instance id.
    pub instance_id: InstanceId,
    /// Epoch.
    pub epoch: u64,
    /// Registration time.
    pub registered_at_ms: u64,
}

impl From<&Registration> for RankBrief {
    fn from(r: &Registration) -> Self {
        RankBrief {
            key: r.key(),
            dcp_rank: r.topology.dcp_rank,
            instance_id: r.instance_id,
            epoch: r.epoch,
            registered_at_ms: r.registered_at_ms,
        }
    }
}

/// Topology and readiness of one (cluster, role): no endpoints or regions,
/// so it is readable without the token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Schema version.
    pub schema_version: u32,
    /// Cluster name.
    pub cluster: String,
    /// Role.
    pub role: Role,
    /// The current layout (that of the newest entry), if any entry is live.
    pub layout: Option<Layout>,
    /// First epoch of the current layout (entries below it are stale).
    pub current_epoch: u64,
    /// Ranks the current layout has.
    pub expected_ranks: u64,
    /// Distinct rank keys registered in the current epoch.
    pub registered_ranks: u64,
    /// `registered_ranks == expected_ranks` (and > 0).
    pub ready: bool,
    /// Current entries, by key.
    pub ranks: Vec<RankBrief>,
    /// Live entries of older layouts, never handed out as peers.
    pub stale: Vec<RankBrief>,
}

/// What a rank says about itself on a direct connection (the handshake's
/// first message), so the peer can re-check what the bootstrap advertised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerHello {
    /// Schema version.
    pub schema_version: u32,
    /// Cluster name.
    pub cluster: String,
    /// Role.
    pub role: Role,
    /// Instance id of the process answering.
    pub instance_id: InstanceId,
    /// Epoch of its current registration.
    pub epoch: u64,
    /// Time of its current registration.
    pub registered_at_ms: u64,
    /// Data-parallel group.
    pub dp_rank: u32,
    /// Its topology as it runs now.
    pub topology: Topology,
}

impl From<&Registration> for PeerHello {
    fn from(r: &Registration) -> Self {
        PeerHello {
            schema_version: SCHEMA_VERSION,
            cluster: r.cluster.clone(),
            role: r.role,
            instance_id: r.instance_id,
            epoch: r.epoch,
            registered_at_ms: r.registered_at_ms,
            dp_rank: r.dp_rank,
            topology: r.topology.clone(),
        }
    }
}

/// Parses JSON into `T`; the error names the path of the offending field.
pub fn from_json<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let field = if path == "." || path.is_empty() {
            String::new()
        } else {
            format!("field `{path}`: ")
        };
        Error::invalid(format!("malformed {what}: {field}{inner}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_id_roundtrips_and_is_random() {
        let a = InstanceId::random().unwrap();
        let b = InstanceId::random().unwrap();
        assert_ne!(a, b);
        let s = a.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(InstanceId::parse(&s).unwrap(), a);
        assert!(InstanceId::parse("xyz").is_err());
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<InstanceId>(&j).unwrap(), a);
    }

    #[test]
    fn rank_key_path_form() {
        let k = RankKey {
            dp: 1,
            tp: 3,
            cp: 0,
            pp: 2,
        };
        assert_eq!(k.to_string(), "dp1-tp3-cp0-pp2");
        assert_eq!(RankKey::parse("dp1-tp3-cp0-pp2").unwrap(), k);
        for bad in ["", "dp1-tp3-cp0", "tp1-dp3-cp0-pp2", "dp1-tpx-cp0-pp0"] {
            assert!(RankKey::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validation_names_the_field() {
        let mut r = Registration::new(
            "c1",
            Role::Decode,
            InstanceId(7),
            Topology::single_mla(64, 2, 1152),
        );
        r.validate().unwrap();
        r.cluster = "a/b".into();
        assert!(r.validate().unwrap_err().detail().starts_with("cluster:"));
        r.cluster = "ok".into();
        r.schema_version = 9;
        assert!(r
            .validate()
            .unwrap_err()
            .detail()
            .contains("schema_version"));
        r.schema_version = SCHEMA_VERSION;
        r.topology.dcp_rank = 3;
        assert_eq!(r.validate().unwrap_err().status(), Status::InvalidTopology);
    }

    #[test]
    fn topology_values_above_the_caps_are_refused_naming_the_field() {
        let good = Registration::new(
            "c1",
            Role::Prefill,
            InstanceId(7),
            Topology::single_mla(64, 2, 1152),
        );
        good.validate().unwrap();
        type Edit = fn(&mut Registration);
        let cases: [(&str, Edit); 12] = [
            ("dp_size", |r| r.dp_size = 1 << 31),
            ("topology.attn_tp_size", |r| r.topology.attn_tp_size = 4096),
            ("topology.attn_cp_size", |r| r.topology.attn_cp_size = 1025),
            ("topology.pp_size", |r| r.topology.pp_size = 1 << 31),
            ("topology.dcp_size", |r| r.topology.dcp_size = u32::MAX),
            ("dp_size*topology.attn_tp_size", |r| {
                r.dp_size = 1024;
                r.topology.attn_tp_size = 1024;
            }),
            ("topology.engine_rank", |r| {
                r.topology.engine_rank = u32::MAX
            }),
            ("topology.page_size", |r| r.topology.page_size = 1 << 20),
            ("topology.dcp_interleave", |r| {
                r.topology.dcp_interleave = 1 << 20
            }),
            ("topology.entries:", |r| {
                let e = r.topology.entries[0];
                r.topology.entries = vec![e; MAX_KV_ENTRIES + 1];
            }),
            ("topology.entries[1].layer_id", |r| {
                r.topology.entries[1].layer_id = 1 << 30
            }),
            ("topology.entries[0].row_bytes", |r| {
                r.topology.entries[0].row_bytes = 1 << 40
            }),
        ];
        for (field, edit) in cases {
            let mut r = good.clone();
            edit(&mut r);
            let e = r.validate().unwrap_err();
            assert!(e.detail().starts_with(field), "{field}: {}", e.detail());
            // refused as a bad request (the server answers these 400)
            assert!(
                matches!(
                    e.status(),
                    Status::InvalidArgument
                        | Status::InvalidTopology
                        | Status::InvalidLayout
                        | Status::GeometryMismatch
                ),
                "{field}: {e}"
            );
        }
        // The largest values under the caps still pass.
        let mut r = good.clone();
        r.topology.pp_size = MAX_PARALLEL_SIZE;
        r.topology.pp_rank = MAX_PARALLEL_SIZE - 1;
        r.topology.page_size = MAX_PAGE_SIZE;
        r.validate().unwrap();
    }

    #[test]
    fn malformed_json_names_the_path() {
        let r = Registration::new(
            "c1",
            Role::Decode,
            InstanceId(7),
            Topology::single_mla(64, 2, 1152),
        );
        let mut v = serde_json::to_value(&r).unwrap();
        v["topology"]["dcp_size"] = serde_json::json!("four");
        let e = from_json::<Registration>(v.to_string().as_bytes(), "registration").unwrap_err();
        assert!(e.detail().contains("topology.dcp_size"), "{}", e.detail());
        let e = from_json::<Registration>(b"{\"schema_version\":1}", "registration").unwrap_err();
        assert!(
            e.detail().contains("missing field `cluster`"),
            "{}",
            e.detail()
        );
    }
}
