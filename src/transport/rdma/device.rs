//! RDMA device discovery from sysfs and NIC selection (no verbs calls here).
//!
//! [`scan`] reads `<root>/class/infiniband/*` (root is `/sys` in production, a
//! fake tree in tests): per device its PCI address and NUMA node, per port its
//! state, link layer, LID, rate, GID table (with RoCE types and net devices) and,
//! for RoCE, the active MTU implied by the net device's MTU. [`select_rails`]
//! picks the NICs a transport uses: by name, or the ones closest to the memory
//! (same PCIe switch as the GPU first, then same NUMA node), and says why for
//! each one so the choice can be logged one line per rail.

use super::handshake::{Gid, LinkLayer, Mtu};
use crate::error::{Error, Result, Status};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One populated GID table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GidEntry {
    /// Index in the port's GID table.
    pub index: u8,
    /// The GID.
    pub gid: Gid,
    /// `IB/RoCE v1` or `RoCE v2`, when sysfs says.
    pub kind: Option<String>,
    /// The net device the GID belongs to (RoCE).
    pub netdev: Option<String>,
}

/// One port of a device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RdmaPort {
    /// Port number (1-based).
    pub num: u8,
    /// State name (`ACTIVE`, `DOWN`, `INIT`, ...).
    pub state: String,
    /// Whether the port can carry traffic (`ACTIVE`).
    pub active: bool,
    /// Physical state (`LinkUp`, `Disabled`, ...).
    pub phys_state: String,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// LID (InfiniBand).
    pub lid: u16,
    /// Rate as sysfs prints it (`200 Gb/sec (4X HDR)`).
    pub rate: String,
    /// Rate in Gb/s, when parseable.
    pub rate_gbps: Option<f64>,
    /// Active MTU: from verbs when a device could be opened, else derived from the
    /// RoCE net device's MTU; unknown for InfiniBand without verbs.
    pub active_mtu: Option<Mtu>,
    /// Populated (non-zero) GID entries.
    pub gids: Vec<GidEntry>,
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RdmaDevice {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// Node GUID as sysfs prints it.
    pub node_guid: Option<String>,
    /// Firmware version.
    pub fw_ver: Option<String>,
    /// PCI address (`0000:17:00.0`).
    pub pci_addr: Option<String>,
    /// Canonical sysfs path of the PCI function (for PCIe distance).
    #[serde(skip)]
    pub pci_path: Option<PathBuf>,
    /// NUMA node, if the platform reports one.
    pub numa_node: Option<i32>,
    /// Ports.
    pub ports: Vec<RdmaPort>,
    /// Why libibverbs could not open this device, when it could not.
    pub verbs_error: Option<String>,
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

fn parse_state(s: &str) -> (String, u32) {
    // "4: ACTIVE"
    match s.split_once(':') {
        Some((n, name)) => (name.trim().to_string(), n.trim().parse().unwrap_or(0)),
        None => (s.trim().to_string(), 0),
    }
}

fn parse_rate(s: &str) -> Option<f64> {
    s.split_whitespace().next()?.parse().ok()
}

fn parse_lid(s: &str) -> u16 {
    let t = s.trim();
    let t = t.strip_prefix("0x").unwrap_or(t);
    u16::from_str_radix(t, 16).unwrap_or(0)
}

fn sorted_numeric_entries(dir: &Path) -> Vec<(u32, PathBuf)> {
    let mut v: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let n: u32 = e.file_name().to_str()?.parse().ok()?;
                    Some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|(n, _)| *n);
    v
}

fn scan_port(root: &Path, num: u8, dir: &Path) -> RdmaPort {
    let (state, code) = parse_state(&read(&dir.join("state")).unwrap_or_default());
    let (phys_state, _) = parse_state(&read(&dir.join("phys_state")).unwrap_or_default());
    let link_layer = match read(&dir.join("link_layer")).as_deref() {
        Some("Ethernet") => LinkLayer::Ethernet,
        _ => LinkLayer::InfiniBand,
    };
    let rate = read(&dir.join("rate")).unwrap_or_default();
    let mut gids = Vec::new();
    for (i, p) in sorted_numeric_entries(&dir.join("gids")) {
        let Some(gid) = read(&p).and_then(|s| Gid::parse(&s)) else {
            continue;
        };
        if gid.is_zero() || i > 255 {
            continue;
        }
        gids.push(GidEntry {
            index: i as u8,
            gid,
            // Reading an unpopulated entry's type fails with EINVAL: None.
            kind: read(&dir.join("gid_attrs/types").join(i.to_string())).filter(|s| !s.is_empty()),
            netdev: read(&dir.join("gid_attrs/ndevs").join(i.to_string()))
                .filter(|s| !s.is_empty()),
        });
    }
    let active_mtu = if link_layer == LinkLayer::Ethernet {
        gids.iter()
            .find_map(|g| g.netdev.as_ref())
            .and_then(|nd| read(&root.join("class/net").join(nd).join("mtu")))
            .and_then(|m| m.parse::<u32>().ok())
            .and_then(Mtu::fitting)
    } else {
        None
    };
    RdmaPort {
        num,
        active: code == 4 || state == "ACTIVE",
        state,
        phys_state,
        link_layer,
        lid: read(&dir.join("lid")).map(|s| parse_lid(&s)).unwrap_or(0),
        rate_gbps: parse_rate(&rate),
        rate,
        active_mtu,
        gids,
    }
}

/// Reads every RDMA device under `<root>/class/infiniband`.
///
/// A missing or empty directory is [`Status::NoRdmaDevice`] with the reason.
pub fn scan(root: &Path) -> Result<Vec<RdmaDevice>> {
    let ib = root.join("class/infiniband");
    let entries = match std::fs::read_dir(&ib) {
        Ok(e) => e,
        Err(e) => {
            return Err(Error::new(
                Status::NoRdmaDevice,
                format!(
                    "no RDMA device: cannot read {} ({e}): the kernel has no RDMA support (ib_core / ib_uverbs not loaded) or this machine has no RDMA NIC",
                    ib.display()
                ),
            ))
        }
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(Error::new(
            Status::NoRdmaDevice,
            format!(
                "no RDMA device: {} is empty: no RDMA NIC driver is bound (mlx5_ib, irdma, bnxt_re, efa, ...)",
                ib.display()
            ),
        ));
    }
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let d = ib.join(&name);
        let pci_path = std::fs::canonicalize(d.join("device")).ok();
        let pci_addr = pci_path
            .as_ref()
            .and_then(|p| p.file_name())
            .and_then(|f| f.to_str())
            .map(String::from);
        let numa_node = read(&d.join("device/numa_node"))
            .and_then(|s| s.parse::<i32>().ok())
            .filter(|n| *n >= 0);
        let ports = sorted_numeric_entries(&d.join("ports"))
            .into_iter()
            .filter(|(n, _)| (1..=255).contains(n))
            .map(|(n, p)| scan_port(root, n as u8, &p))
            .collect();
        out.push(RdmaDevice {
            node_guid: read(&d.join("node_guid")),
            fw_ver: read(&d.join("fw_ver")),
            pci_addr,
            pci_path,
            numa_node,
            ports,
            verbs_error: None,
            name,
        });
    }
    Ok(out)
}

/// The GID index to use on a port when none is configured: on RoCE a RoCE v2
/// IPv4-mapped GID first (routable), then any RoCE v2, then the first populated
/// entry; on InfiniBand index 0 when populated.
pub fn default_gid_index(port: &RdmaPort) -> Option<u8> {
    let v2 = |g: &&GidEntry| g.kind.as_deref().is_some_and(|k| k.contains("v2"));
    match port.link_layer {
        LinkLayer::Ethernet => port
            .gids
            .iter()
            .filter(v2)
            .find(|g| g.gid.is_ipv4_mapped())
            .or_else(|| port.gids.iter().find(v2))
            .or_else(|| port.gids.first())
            .map(|g| g.index),
        LinkLayer::InfiniBand => port.gids.first().map(|g| g.index),
    }
}

/// The kernel modules that let a NIC reach GPU memory directly (GPUDirect RDMA),
/// as `<root>/module` shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuDirect {
    /// `nvidia_peermem` (or the older `nv_peer_mem`) is loaded: `ibv_reg_mr` accepts
    /// device pointers.
    pub peermem: bool,
    /// The NVIDIA driver is loaded (`nvidia`); with CUDA 11.7+ and an open kernel
    /// module, dma-buf export (`cuMemGetHandleForAddressRange`) may work without peermem.
    pub nvidia: bool,
}

/// Reads which GPUDirect RDMA routes the kernel offers.
pub fn gpudirect(root: &Path) -> GpuDirect {
    let m = root.join("module");
    GpuDirect {
        peermem: m.join("nvidia_peermem").exists() || m.join("nv_peer_mem").exists(),
        nvidia: m.join("nvidia").exists(),
    }
}

/// Where the memory a transport serves lives, for choosing the nearest NICs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affinity {
    /// NUMA node of the memory (host pool) or of the GPU.
    pub numa_node: Option<i32>,
    /// Canonical sysfs path of the GPU's PCI function.
    pub pci_path: Option<PathBuf>,
}

impl Affinity {
    /// The affinity of a GPU given its PCI bus id (`0000:3b:00.0`), read from
    /// `<root>/bus/pci/devices/<bus id>`; empty when sysfs does not know it.
    pub fn of_pci(root: &Path, bus_id: &str) -> Affinity {
        let dev = root
            .join("bus/pci/devices")
            .join(bus_id.to_ascii_lowercase());
        Affinity {
            numa_node: read(&dev.join("numa_node"))
                .and_then(|s| s.parse::<i32>().ok())
                .filter(|n| *n >= 0),
            pci_path: std::fs::canonicalize(&dev).ok(),
        }
    }
}

/// One chosen NIC port ("rail").
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RailChoice {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// GID index to use.
    pub gid_index: u8,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// The device's NUMA node.
    pub numa_node: Option<i32>,
    /// Relative weight for slicing (the port rate in Gb/s, 1 when unknown).
    pub weight: u64,
    /// Why it was chosen (for the per-rail log line).
    pub reason: String,
}

/// How to pick NICs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NicPolicy {
    /// These devices, in this order (`mlx5_0` or `mlx5_0:2` for port 2).
    Named(Vec<String>),
    /// The active ports nearest to the memory ([`Affinity`]).
    #[default]
    Nearest,
}

/// Where a NIC sits on PCIe relative to the GPU whose memory it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PciRelation {
    /// Unknown (no GPU given, or sysfs does not place one of them).
    Unknown,
    /// Under another PCIe root complex (another host bridge or socket):
    /// GPUDirect traffic crosses the CPU interconnect.
    OtherRoot,
    /// Under the GPU's root complex, sharing `bridges` PCIe bridges below it
    /// (0: only the root port's host bridge; 1 or more: a common switch).
    SameRoot {
        /// PCIe bridges (switch ports) shared below the root complex.
        bridges: usize,
    },
}

/// The PCIe relation of two canonical sysfs device paths
/// (`.../devices/pci0000:00/0000:00:01.0/0000:01:00.0`).
pub fn pci_relation(gpu: &Path, nic: &Path) -> PciRelation {
    // from the root complex (`pciDDDD:BB`) down to the function itself
    let below_root = |p: &Path| -> Option<Vec<String>> {
        let c: Vec<String> = p
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let r = c.iter().position(|x| x.starts_with("pci"))?;
        Some(c[r..].to_vec())
    };
    let (Some(a), Some(b)) = (below_root(gpu), below_root(nic)) else {
        return PciRelation::Unknown;
    };
    if a[0] != b[0] {
        return PciRelation::OtherRoot;
    }
    // shared components after the root, not counting the devices themselves
    let shared = a[1..a.len() - 1]
        .iter()
        .zip(&b[1..b.len() - 1])
        .take_while(|(x, y)| x == y)
        .count();
    PciRelation::SameRoot { bridges: shared }
}

/// One active port and whether [`nearest`] chose it, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NearestChoice {
    /// Index into the devices.
    pub dev: usize,
    /// Index into the device's ports.
    pub port: usize,
    /// Where it sits relative to the GPU.
    pub relation: PciRelation,
    /// Whether it is used.
    pub chosen: bool,
    /// Why it is used or left out.
    pub reason: String,
}

/// Ranks every ACTIVE port for memory at `affinity`, as NCCL and Mooncake
/// do: with the GPU's PCI path known, only the NICs nearest to it on PCIe
/// (the most bridges shared under its root complex: its own switch where
/// there is one) are chosen, since GPUDirect RDMA through a farther NIC
/// crosses the root complex or the socket, and storage or management NICs
/// of other switches may not even reach the peer. Without a NIC under the
/// GPU's root complex, or without a GPU, the memory's NUMA node decides
/// (NICs on other nodes are left out when one shares it). With no locality
/// at all (cloud VMs often show a flat PCIe tree and NUMA node -1), only the
/// first active port by name is used: other ports may sit on networks that
/// do not reach the peer (storage, management), and a rail that cannot
/// reach it fails only after the QP's retries (about 8.6 s), on every
/// redial; `PDXFER_RDMA_DEVICES` names more. Chosen ports come first,
/// nearest first, then by name.
pub fn nearest(devs: &[RdmaDevice], affinity: &Affinity) -> Vec<NearestChoice> {
    let mut all: Vec<NearestChoice> = Vec::new();
    for (di, d) in devs.iter().enumerate() {
        for (pi, p) in d.ports.iter().enumerate() {
            if !p.active {
                continue;
            }
            let relation = match (&affinity.pci_path, &d.pci_path) {
                (Some(g), Some(n)) => pci_relation(g, n),
                _ => PciRelation::Unknown,
            };
            all.push(NearestChoice {
                dev: di,
                port: pi,
                relation,
                chosen: false,
                reason: String::new(),
            });
        }
    }
    let best = all.iter().map(|c| c.relation).max();
    let numa_of = |c: &NearestChoice| devs[c.dev].numa_node;
    let numa_match =
        |c: &NearestChoice| affinity.numa_node.is_some() && numa_of(c) == affinity.numa_node;
    let any_numa = all.iter().any(numa_match);
    for c in &mut all {
        match best {
            Some(PciRelation::SameRoot { bridges: best_b }) => {
                if c.relation == (PciRelation::SameRoot { bridges: best_b }) {
                    c.chosen = true;
                    c.reason = if best_b > 0 {
                        format!("nearest to the GPU on PCIe: behind the same PCIe switch ({best_b} bridge(s) shared)")
                    } else {
                        "nearest to the GPU on PCIe: same root complex (no shared switch)"
                            .to_string()
                    };
                } else {
                    c.reason = match c.relation {
                        PciRelation::SameRoot { bridges } => format!(
                            "farther from the GPU on PCIe ({bridges} bridge(s) shared, the nearest NIC shares {best_b})"
                        ),
                        PciRelation::OtherRoot => {
                            "under another PCIe root complex than the GPU".to_string()
                        }
                        PciRelation::Unknown => "not placed on PCIe by sysfs".to_string(),
                    };
                }
            }
            _ => {
                // no NIC under the GPU's root complex, or no GPU: NUMA decides
                let gpu = affinity.pci_path.is_some();
                let numa = numa_match(c);
                if any_numa && !numa {
                    c.reason = format!(
                        "NUMA node {:?}, memory on {:?}",
                        numa_of(c),
                        affinity.numa_node
                    );
                    continue;
                }
                c.chosen = true;
                let mut why = Vec::new();
                if gpu {
                    why.push("no NIC under the GPU's PCIe root complex".to_string());
                }
                why.push(match (affinity.numa_node, numa) {
                    (Some(n), true) => format!("same NUMA node {n} as the memory"),
                    (Some(n), false) => format!("no NIC on the memory's NUMA node {n}: cross-NUMA"),
                    (None, _) => "memory locality unknown".to_string(),
                });
                c.reason = why.join(", ");
            }
        }
    }
    all.sort_by(|a, b| {
        b.chosen
            .cmp(&a.chosen)
            .then(b.relation.cmp(&a.relation))
            .then(devs[a.dev].name.cmp(&devs[b.dev].name))
            .then(
                devs[a.dev].ports[a.port]
                    .num
                    .cmp(&devs[b.dev].ports[b.port].num),
            )
    });
    let placed = matches!(best, Some(PciRelation::SameRoot { .. })) || any_numa;
    if !placed {
        for (i, c) in all.iter_mut().enumerate() {
            if i == 0 {
                c.reason = format!(
                    "{}: the only port used, since locality is unknown (name more in PDXFER_RDMA_DEVICES)",
                    c.reason
                );
            } else {
                c.chosen = false;
                c.reason = "locality unknown: only the first active port by name is used (name more in PDXFER_RDMA_DEVICES)".to_string();
            }
        }
    }
    all
}

fn choose_gid(dev: &RdmaDevice, port: &RdmaPort, forced: Option<u8>) -> Result<u8> {
    match forced {
        Some(i) => {
            if port.gids.iter().any(|g| g.index == i) {
                Ok(i)
            } else {
                Err(Error::invalid(format!(
                    "gid_index {i} on {} port {}: the entry is all zero (unpopulated); populated entries: [{}]",
                    dev.name,
                    port.num,
                    port.gids
                        .iter()
                        .map(|g| format!("{}={} {}", g.index, g.gid, g.kind.as_deref().unwrap_or("")))
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        }
        None => match (default_gid_index(port), port.link_layer) {
            (Some(i), _) => Ok(i),
            (None, LinkLayer::InfiniBand) => Ok(0),
            (None, LinkLayer::Ethernet) => Err(Error::new(
                Status::NoRdmaDevice,
                format!(
                    "{} port {} is RoCE but has no populated GID (is an IP address configured on its net device?)",
                    dev.name, port.num
                ),
            )),
        },
    }
}

/// Picks the rails a transport uses, at most `max_rails` (0 = no limit).
///
/// `Named`: each named device (and port, default the first active one) must have an
/// ACTIVE port, else the error names its state. `Nearest`: see [`nearest`]: only
/// the NICs nearest to the GPU on PCIe, else those of the memory's NUMA node
/// (cross-NUMA NICs cost 3-5x latency); every port left out is logged with why.
/// `gid_index` forces one GID index on every rail.
pub fn select_rails(
    devs: &[RdmaDevice],
    policy: &NicPolicy,
    affinity: &Affinity,
    gid_index: Option<u8>,
    max_rails: usize,
) -> Result<Vec<RailChoice>> {
    let mk = |d: &RdmaDevice, p: &RdmaPort, reason: String| -> Result<RailChoice> {
        Ok(RailChoice {
            device: d.name.clone(),
            port: p.num,
            gid_index: choose_gid(d, p, gid_index)?,
            link_layer: p.link_layer,
            numa_node: d.numa_node,
            weight: p
                .rate_gbps
                .map(|r| r.round() as u64)
                .filter(|w| *w > 0)
                .unwrap_or(1),
            reason,
        })
    };
    let mut out = Vec::new();
    match policy {
        NicPolicy::Named(names) => {
            for n in names {
                let (dn, pn) =
                    match n.split_once(':') {
                        Some((d, p)) => (
                            d,
                            Some(p.parse::<u8>().map_err(|_| {
                                Error::invalid(format!("bad port in NIC name {n:?}"))
                            })?),
                        ),
                        None => (n.as_str(), None),
                    };
                let d = devs.iter().find(|d| d.name == dn).ok_or_else(|| {
                    Error::new(
                        Status::NoRdmaDevice,
                        format!(
                            "RDMA device {dn:?} not found; present: [{}]",
                            devs.iter()
                                .map(|d| d.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    )
                })?;
                let port = match pn {
                    Some(p) => d.ports.iter().find(|x| x.num == p),
                    None => d.ports.iter().find(|x| x.active).or(d.ports.first()),
                }
                .ok_or_else(|| {
                    Error::new(
                        Status::NoRdmaDevice,
                        format!("{dn} has no port {}", pn.unwrap_or(1)),
                    )
                })?;
                if !port.active {
                    return Err(Error::new(
                        Status::NoRdmaDevice,
                        format!(
                            "{dn} port {} is {} (physical state {}), not ACTIVE: check the cable, the switch, or the subnet manager",
                            port.num, port.state, port.phys_state
                        ),
                    ));
                }
                out.push(mk(d, port, "named in the configuration".to_string())?);
            }
        }
        NicPolicy::Nearest => {
            let decided = nearest(devs, affinity);
            if decided.is_empty() {
                return Err(Error::new(
                    Status::NoRdmaDevice,
                    format!(
                        "no ACTIVE RDMA port: {}",
                        devs.iter()
                            .flat_map(|d| d
                                .ports
                                .iter()
                                .map(move |p| format!("{} port {} {}", d.name, p.num, p.state)))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            let left_out = decided.iter().filter(|c| !c.chosen).count();
            if let Some(c) = decided
                .first()
                .filter(|c| c.reason.contains("locality is unknown"))
            {
                log::warn!(
                    "rdma: the locality of the memory served is unknown (no NIC under the GPU's PCIe root complex, none on its NUMA node): using {} port {} only and leaving {left_out} other active port(s) out, since a port on a network that does not reach the peer fails every room after the QP's retries; set PDXFER_RDMA_DEVICES to choose the NICs (e.g. mlx5_0,mlx5_1)",
                    devs[c.dev].name,
                    devs[c.dev].ports[c.port].num
                );
            }
            for c in decided {
                let (d, p) = (&devs[c.dev], &devs[c.dev].ports[c.port]);
                if !c.chosen {
                    log::info!("rdma: skipping {} port {}: {}", d.name, p.num, c.reason);
                    continue;
                }
                out.push(mk(d, p, c.reason)?);
            }
        }
    }
    if max_rails > 0 {
        out.truncate(max_rails);
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::fs;

    /// A fake sysfs tree in a fresh temp dir; removed on drop.
    pub(crate) struct FakeSys(pub PathBuf);

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn w(p: &Path, s: &str) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, s).unwrap();
    }

    impl FakeSys {
        pub(crate) fn new(tag: &str) -> FakeSys {
            let p = std::env::temp_dir().join(format!(
                "pdxfer-sysfs-{tag}-{}-{}",
                std::process::id(),
                super::super::handshake::random_u64()
            ));
            fs::create_dir_all(&p).unwrap();
            FakeSys(p)
        }

        /// Adds a NIC at `pci` (e.g. `pci0000:00/0000:00:01.0/0000:01:00.0`) on `numa`.
        pub(crate) fn nic(
            &self,
            name: &str,
            pci: &str,
            numa: i32,
            ll: &str,
            state: &str,
            gids: &[(u32, &str, &str)],
        ) {
            let dev = self.0.join("devices").join(pci);
            w(&dev.join("numa_node"), &format!("{numa}\n"));
            let ib = self.0.join("class/infiniband").join(name);
            fs::create_dir_all(&ib).unwrap();
            std::os::unix::fs::symlink(&dev, ib.join("device")).unwrap();
            w(&ib.join("node_guid"), "0002:c903:0000:0001\n");
            w(&ib.join("fw_ver"), "28.39.1002\n");
            let port = ib.join("ports/1");
            w(&port.join("state"), state);
            w(&port.join("phys_state"), "5: LinkUp\n");
            w(&port.join("link_layer"), ll);
            w(&port.join("lid"), "0x0005\n");
            w(&port.join("rate"), "200 Gb/sec (4X HDR)\n");
            // An unpopulated entry, as the kernel shows it.
            w(
                &port.join("gids/7"),
                "0000:0000:0000:0000:0000:0000:0000:0000\n",
            );
            for (i, g, kind) in gids {
                w(&port.join("gids").join(i.to_string()), g);
                w(&port.join("gid_attrs/types").join(i.to_string()), kind);
                w(
                    &port.join("gid_attrs/ndevs").join(i.to_string()),
                    &format!("eth_{name}\n"),
                );
            }
            w(
                &self
                    .0
                    .join("class/net")
                    .join(format!("eth_{name}"))
                    .join("mtu"),
                "9000\n",
            );
        }

        pub(crate) fn gpu(&self, bus: &str, pci: &str, numa: i32) {
            let dev = self.0.join("devices").join(pci);
            w(&dev.join("numa_node"), &format!("{numa}\n"));
            fs::create_dir_all(self.0.join("bus/pci/devices")).unwrap();
            std::os::unix::fs::symlink(&dev, self.0.join("bus/pci/devices").join(bus)).unwrap();
        }
    }

    const V1: &str = "IB/RoCE v1\n";
    const V2: &str = "RoCE v2\n";
    const LL: &str = "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:0a00:0001\n";

    /// Two NUMA nodes; node 0 has mlx5_0 (next to GPU 0000:02:00.0) and mlx5_1;
    /// node 1 has mlx5_2 and a DOWN mlx5_3.
    pub(crate) fn four_nics() -> FakeSys {
        let s = FakeSys::new("four");
        let g = [(0, LL, V1), (1, LL, V2), (2, V4, V1), (3, V4, V2)];
        s.nic(
            "mlx5_0",
            "pci0000:00/0000:00:01.0/0000:01:00.0",
            0,
            "Ethernet\n",
            "4: ACTIVE\n",
            &g,
        );
        s.nic(
            "mlx5_1",
            "pci0000:00/0000:00:02.0/0000:03:00.0",
            0,
            "Ethernet\n",
            "4: ACTIVE\n",
            &g,
        );
        s.nic(
            "mlx5_2",
            "pci0000:80/0000:80:01.0/0000:81:00.0",
            1,
            "Ethernet\n",
            "4: ACTIVE\n",
            &g,
        );
        s.nic(
            "mlx5_3",
            "pci0000:80/0000:80:02.0/0000:82:00.0",
            1,
            "Ethernet\n",
            "1: DOWN\n",
            &g,
        );
        s.gpu("0000:02:00.0", "pci0000:00/0000:00:01.0/0000:02:00.0", 0);
        s
    }

    #[test]
    fn missing_sysfs_is_a_typed_no_device_error() {
        let s = FakeSys::new("empty");
        let e = scan(&s.0).unwrap_err();
        assert_eq!(e.status(), Status::NoRdmaDevice);
        assert!(e.detail().contains("class/infiniband"), "{e}");
        assert!(e.detail().contains("kernel has no RDMA support"), "{e}");
        fs::create_dir_all(s.0.join("class/infiniband")).unwrap();
        let e = scan(&s.0).unwrap_err();
        assert_eq!(e.status(), Status::NoRdmaDevice);
        assert!(e.detail().contains("is empty"), "{e}");
    }

    #[test]
    fn scan_reads_ports_gids_numa_and_mtu() {
        let s = four_nics();
        let devs = scan(&s.0).unwrap();
        assert_eq!(
            devs.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
            ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
        );
        let d = &devs[2];
        assert_eq!(d.numa_node, Some(1));
        assert_eq!(d.pci_addr.as_deref(), Some("0000:81:00.0"));
        assert_eq!(d.fw_ver.as_deref(), Some("28.39.1002"));
        let p = &d.ports[0];
        assert_eq!(p.num, 1);
        assert!(p.active);
        assert_eq!(p.state, "ACTIVE");
        assert_eq!(p.link_layer, LinkLayer::Ethernet);
        assert_eq!(p.lid, 5);
        assert_eq!(p.rate_gbps, Some(200.0));
        assert_eq!(p.active_mtu, Some(Mtu::Mtu4096), "9000-byte netdev MTU");
        assert_eq!(p.gids.len(), 4, "the all-zero entry 7 is not listed");
        assert_eq!(p.gids[3].kind.as_deref(), Some("RoCE v2"));
        assert_eq!(p.gids[3].netdev.as_deref(), Some("eth_mlx5_2"));
        assert!(!devs[3].ports[0].active);
        assert_eq!(devs[3].ports[0].state, "DOWN");
        assert_eq!(default_gid_index(p), Some(3), "RoCE v2 IPv4-mapped first");
    }

    #[test]
    fn nearest_prefers_the_gpus_pcie_switch_then_numa_and_skips_other_nodes() {
        let s = four_nics();
        let devs = scan(&s.0).unwrap();
        let aff = Affinity::of_pci(&s.0, "0000:02:00.0");
        assert_eq!(aff.numa_node, Some(0));
        let r = select_rails(&devs, &NicPolicy::Nearest, &aff, None, 0).unwrap();
        // Only the NIC behind the GPU's own switch: mlx5_1 (same root complex,
        // another switch) and mlx5_2 (another root complex) are left out.
        assert_eq!(
            r.iter().map(|c| c.device.as_str()).collect::<Vec<_>>(),
            ["mlx5_0"]
        );
        assert!(r[0].reason.contains("same PCIe switch"), "{}", r[0].reason);
        let all = nearest(&devs, &aff);
        let why = |n: &str| {
            all.iter()
                .find(|c| devs[c.dev].name == n)
                .map(|c| (c.chosen, c.reason.clone()))
                .unwrap()
        };
        assert_eq!(all.len(), 3, "the three active ports");
        assert!(
            !why("mlx5_1").0 && why("mlx5_1").1.contains("farther"),
            "{:?}",
            why("mlx5_1")
        );
        assert!(!why("mlx5_2").0 && why("mlx5_2").1.contains("another PCIe root"));
        assert_eq!(r[0].gid_index, 3);
        assert_eq!(r[0].weight, 200);
        // One rail: the one on the GPU's switch.
        let r = select_rails(&devs, &NicPolicy::Nearest, &aff, None, 1).unwrap();
        assert_eq!(r[0].device, "mlx5_0");
        // Host memory on node 1: mlx5_2 only (mlx5_3 is down).
        let aff1 = Affinity {
            numa_node: Some(1),
            pci_path: None,
        };
        let r = select_rails(&devs, &NicPolicy::Nearest, &aff1, None, 0).unwrap();
        assert_eq!(
            r.iter().map(|c| c.device.as_str()).collect::<Vec<_>>(),
            ["mlx5_2"]
        );
        // Unknown locality: the first active port by name only, saying why;
        // the others are left out with the way to name them.
        let r = select_rails(&devs, &NicPolicy::Nearest, &Affinity::default(), None, 0).unwrap();
        assert_eq!(
            r.iter().map(|c| c.device.as_str()).collect::<Vec<_>>(),
            ["mlx5_0"]
        );
        assert!(
            r[0].reason.contains("locality is unknown"),
            "{}",
            r[0].reason
        );
        let all = nearest(&devs, &Affinity::default());
        assert_eq!(all.len(), 3, "the three active ports are still listed");
        assert!(all[1..]
            .iter()
            .all(|c| !c.chosen && c.reason.contains("PDXFER_RDMA_DEVICES")));
        // ...unless the configuration names them
        let named = NicPolicy::Named(vec!["mlx5_0".into(), "mlx5_1".into(), "mlx5_2".into()]);
        let r = select_rails(&devs, &named, &Affinity::default(), None, 0).unwrap();
        assert_eq!(r.len(), 3);
        // A node without NICs: one port too, flagged cross-NUMA.
        let aff5 = Affinity {
            numa_node: Some(5),
            pci_path: None,
        };
        let r = select_rails(&devs, &NicPolicy::Nearest, &aff5, None, 0).unwrap();
        assert_eq!(r.len(), 1);
        assert!(r[0].reason.contains("cross-NUMA"), "{}", r[0].reason);
    }

    #[test]
    fn pci_relation_counts_shared_bridges_under_one_root() {
        let p = |s: &str| PathBuf::from(format!("/sys/devices/{s}"));
        let gpu = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0");
        assert_eq!(
            pci_relation(
                &gpu,
                &p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:06:00.0")
            ),
            PciRelation::SameRoot { bridges: 2 }
        );
        assert_eq!(
            pci_relation(&gpu, &p("pci0000:00/0000:00:03.0/0000:09:00.0")),
            PciRelation::SameRoot { bridges: 0 }
        );
        assert_eq!(
            pci_relation(&gpu, &p("pci0000:80/0000:80:01.0/0000:81:00.0")),
            PciRelation::OtherRoot
        );
        assert_eq!(
            pci_relation(&gpu, Path::new("/nowhere")),
            PciRelation::Unknown
        );
        assert!(PciRelation::SameRoot { bridges: 2 } > PciRelation::SameRoot { bridges: 0 });
        assert!(PciRelation::SameRoot { bridges: 0 } > PciRelation::OtherRoot);
    }

    #[test]
    fn a_gpu_without_a_nic_on_its_root_complex_falls_back_to_numa() {
        let s = four_nics();
        // a GPU under its own root complex on node 1, no NIC there
        s.gpu("0000:41:00.0", "pci0000:40/0000:40:01.0/0000:41:00.0", 1);
        let devs = scan(&s.0).unwrap();
        let aff = Affinity::of_pci(&s.0, "0000:41:00.0");
        let r = select_rails(&devs, &NicPolicy::Nearest, &aff, None, 0).unwrap();
        assert_eq!(
            r.iter().map(|c| c.device.as_str()).collect::<Vec<_>>(),
            ["mlx5_2"]
        );
        assert!(
            r[0].reason
                .contains("no NIC under the GPU's PCIe root complex"),
            "{}",
            r[0].reason
        );
        assert!(r[0].reason.contains("same NUMA node 1"), "{}", r[0].reason);
    }

    #[test]
    fn named_selection_checks_state_and_gid_index() {
        let s = four_nics();
        let devs = scan(&s.0).unwrap();
        let aff = Affinity::default();
        let named = |v: &[&str]| NicPolicy::Named(v.iter().map(|s| s.to_string()).collect());
        let r = select_rails(&devs, &named(&["mlx5_2", "mlx5_0:1"]), &aff, Some(1), 0).unwrap();
        assert_eq!(
            (r[0].device.as_str(), r[1].device.as_str()),
            ("mlx5_2", "mlx5_0")
        );
        assert!(r.iter().all(|c| c.gid_index == 1));
        let e = select_rails(&devs, &named(&["mlx5_3"]), &aff, None, 0).unwrap_err();
        assert_eq!(e.status(), Status::NoRdmaDevice);
        assert!(e.detail().contains("DOWN"), "{e}");
        let e = select_rails(&devs, &named(&["mlx5_9"]), &aff, None, 0).unwrap_err();
        assert!(e.detail().contains("mlx5_0, mlx5_1"), "{e}");
        let e = select_rails(&devs, &named(&["mlx5_0:2"]), &aff, None, 0).unwrap_err();
        assert!(e.detail().contains("no port 2"), "{e}");
        // Forcing an unpopulated GID index names it and lists the populated ones.
        let e = select_rails(&devs, &named(&["mlx5_0"]), &aff, Some(7), 0).unwrap_err();
        assert!(
            e.detail().contains("gid_index 7") && e.detail().contains("all zero"),
            "{e}"
        );
        assert!(
            e.detail()
                .contains("3=0000:0000:0000:0000:0000:ffff:0a00:0001 RoCE v2"),
            "{e}"
        );
    }

    #[test]
    fn gpudirect_modules_are_detected() {
        let s = FakeSys::new("gdr");
        assert_eq!(
            gpudirect(&s.0),
            GpuDirect {
                peermem: false,
                nvidia: false
            }
        );
        fs::create_dir_all(s.0.join("module/nvidia")).unwrap();
        fs::create_dir_all(s.0.join("module/nvidia_peermem")).unwrap();
        assert_eq!(
            gpudirect(&s.0),
            GpuDirect {
                peermem: true,
                nvidia: true
            }
        );
    }

    #[test]
    fn no_active_port_is_named() {
        let s = FakeSys::new("down");
        s.nic(
            "mlx5_0",
            "pci0000:00/0000:00:01.0/0000:01:00.0",
            0,
            "InfiniBand\n",
            "1: DOWN\n",
            &[(0, LL, V1)],
        );
        let devs = scan(&s.0).unwrap();
        assert_eq!(
            devs[0].ports[0].active_mtu, None,
            "IB MTU is only known through verbs"
        );
        let e =
            select_rails(&devs, &NicPolicy::Nearest, &Affinity::default(), None, 0).unwrap_err();
        assert!(e.detail().contains("mlx5_0 port 1 DOWN"), "{e}");
    }
}
