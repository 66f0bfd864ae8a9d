//! Pairing: which peer entries a rank may use ([`prefill_targets`],
//! [`decode_peers`]) and the re-check of the direct handshake ([`verify_peer`]).
//!
//! Only current entries are ever returned (see [`View`](super::view::View)),
//! and the handshake compares what the peer says about itself now with what
//! the bootstrap advertised, so an entry left by a dead or restarted process
//! is detected and named, never silently used.

use super::schema::{InstanceId, PeerHello, RankKey, Registration, Role, SCHEMA_VERSION};
use super::store::Store;
use crate::error::{Error, Result, Status};
use crate::layout::{check_peer, resolve_rank_mapping, MappingOptions, PeerCompat};

/// A prefill entry a decode rank must connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The prefill rank's current entry.
    pub registration: Registration,
    /// True for MLA replicas that only acknowledge (no KV is sent by them).
    pub dummy: bool,
}

fn hello_desc(h: &PeerHello) -> String {
    format!(
        "{} {}/dp{}-tp{}-cp{}-pp{} (dcp_rank={}/{}) instance {} epoch {} registered at {} ms",
        h.role,
        h.cluster,
        h.dp_rank,
        h.topology.attn_tp_rank,
        h.topology.attn_cp_rank,
        h.topology.pp_rank,
        h.topology.dcp_rank,
        h.topology.dcp_size,
        h.instance_id,
        h.epoch,
        h.registered_at_ms
    )
}

/// Logs a refused pairing as a warning naming the peer instance and the
/// status kind, and passes the error on. Only refusals log: the filtering of
/// candidates in [`decode_peers`] stays silent.
fn refused(what: &str, peer_instance: &InstanceId, e: Error) -> Error {
    log::warn!(
        "{what} refused, peer instance {peer_instance}: {} ({}): {}",
        e.kind(),
        e.status() as i32,
        e.detail()
    );
    e
}

/// Runs the layout core's compatibility check for a (local, peer) pair in
/// prefill/decode order, adding both entries' identities to any error.
pub fn check_pair(local: &Registration, peer: &Registration) -> Result<PeerCompat> {
    let (p, d) = match local.role {
        Role::Prefill => (local, peer),
        Role::Decode => (peer, local),
    };
    check_peer(&p.topology, &d.topology).map_err(|e| {
        Error::new(
            e.status(),
            format!(
                "{}; prefill entry [{}], decode entry [{}]",
                e.detail(),
                p.describe(),
                d.describe()
            ),
        )
    })
}

/// Re-checks, on a direct connection, the peer entry the bootstrap
/// advertised against what the peer says about itself (`hello`), then the
/// layout compatibility with the local rank.
///
/// Errors (each names both entries, their instance ids, epochs and
/// registration times, and the likely cause):
/// - `protocol`: another schema version;
/// - `peer_identity`: another cluster, or the same role on both ends;
/// - `stale_metadata`: another instance id (the peer restarted at a reused
///   address), another epoch (it re-registered since), or another topology;
/// - the layout core's errors (`dcp_rank_mismatch`, ...) from
///   [`check_peer`](crate::layout::check_peer).
pub fn verify_peer(
    advertised: &Registration,
    hello: &PeerHello,
    local: &Registration,
) -> Result<PeerCompat> {
    verify_hello(advertised, hello, local)
        .map_err(|e| refused("peer handshake", &hello.instance_id, e))
}

fn verify_hello(
    advertised: &Registration,
    hello: &PeerHello,
    local: &Registration,
) -> Result<PeerCompat> {
    if hello.schema_version != SCHEMA_VERSION {
        return Err(Error::new(
            Status::Protocol,
            format!(
                "peer speaks bootstrap schema version {}, this build {SCHEMA_VERSION}; upgrade the older side (peer: {})",
                hello.schema_version,
                hello_desc(hello)
            ),
        ));
    }
    if hello.cluster != local.cluster || advertised.cluster != local.cluster {
        return Err(Error::new(
            Status::PeerIdentity,
            format!(
                "cluster mismatch: local rank is in cluster {:?}, the bootstrap entry in {:?}, the process that answered in {:?}. Likely cause: two clusters share one bootstrap namespace or an endpoint address; give each deployment its own cluster name. Local [{}], advertised [{}], answered [{}]",
                local.cluster,
                advertised.cluster,
                hello.cluster,
                local.describe(),
                advertised.describe(),
                hello_desc(hello)
            ),
        ));
    }
    if hello.role == local.role || advertised.role == local.role {
        return Err(Error::new(
            Status::PeerIdentity,
            format!(
                "both ends are {} ranks: local [{}], answered [{}]; a {} rank pairs only with {} ranks",
                local.role,
                local.describe(),
                hello_desc(hello),
                local.role,
                local.role.peer()
            ),
        ));
    }
    if hello.instance_id != advertised.instance_id {
        return Err(Error::new(
            Status::StaleMetadata,
            format!(
                "stale bootstrap entry: the bootstrap advertised [{}], but the process at its endpoint is [{}]. Likely cause: the {} rank restarted at the same address (new instance id) and this entry predates the restart, or a cached entry outlived it; look the rank up again. Nothing was sent. Local rank [{}]",
                advertised.describe(),
                hello_desc(hello),
                advertised.role,
                local.describe()
            ),
        ));
    }
    if hello.epoch != advertised.epoch {
        return Err(Error::new(
            Status::StaleMetadata,
            format!(
                "stale bootstrap entry: instance {} registered again since the entry was read (advertised epoch {} at {} ms, now epoch {} at {} ms); look the rank up again. Nothing was sent. Local rank [{}]",
                hello.instance_id,
                advertised.epoch,
                advertised.registered_at_ms,
                hello.epoch,
                hello.registered_at_ms,
                local.describe()
            ),
        ));
    }
    if hello.topology != advertised.topology || hello.dp_rank != advertised.dp_rank {
        return Err(Error::new(
            Status::StaleMetadata,
            format!(
                "the peer's topology differs from its bootstrap entry at the same instance and epoch: advertised [{}] with layout [{}], answered [{}] with layout dcp={}/{} tp={}/{}; the peer changed its layout without registering again. Nothing was sent",
                advertised.describe(),
                advertised.layout(),
                hello_desc(hello),
                hello.topology.dcp_rank,
                hello.topology.dcp_size,
                hello.topology.attn_tp_rank,
                hello.topology.attn_tp_size
            ),
        ));
    }
    check_pair(local, advertised)
}

/// The prefill entries the decode rank `decode` connects to, in prefill
/// data-parallel group `prefill_dp`: resolved with the layout core's rank
/// mapping from the prefill instance's *current* entries only.
///
/// `not_ready` if the prefill instance has not registered every rank of its
/// current layout; the layout core's errors if the layouts cannot pair.
pub fn prefill_targets(
    store: &dyn Store,
    decode: &Registration,
    prefill_dp: u32,
) -> Result<Vec<Target>> {
    let view = store.view(&decode.cluster, Role::Prefill)?;
    let s = view.summary();
    if !s.ready {
        return Err(Error::new(
            Status::NotReady,
            format!(
                "prefill instance of cluster {:?} is not ready in {}: {} of {} ranks of the current layout registered (epoch {}, {} stale entries ignored)",
                decode.cluster,
                store.describe(),
                s.registered_ranks,
                s.expected_ranks,
                s.current_epoch,
                s.stale.len()
            ),
        ));
    }
    let any = view
        .current
        .values()
        .next()
        .ok_or_else(|| Error::new(Status::NotReady, "no current prefill entry"))?;
    let m = resolve_rank_mapping(&decode.topology, &any.topology, MappingOptions::default())
        .map_err(|e| refused("rank mapping to the prefill instance", &any.instance_id, e))?;
    let mut out = Vec::new();
    for &cp in &m.target_cp_ranks {
        for (i, &tp) in m.target_tp_ranks.iter().enumerate() {
            for &pp in &m.target_pp_ranks {
                let key = RankKey {
                    dp: prefill_dp,
                    tp,
                    cp,
                    pp,
                };
                let reg = view.lookup(&key)?;
                let dummy = m.dummy_tp.get(i).copied().unwrap_or(false);
                if !dummy {
                    check_pair(decode, &reg).map_err(|e| {
                        refused("pairing with a prefill entry", &reg.instance_id, e)
                    })?;
                }
                out.push(Target {
                    registration: reg,
                    dummy,
                });
            }
        }
    }
    Ok(out)
}

/// The current decode entries that pair with the prefill rank `prefill`
/// (those whose rank mapping targets it as a non-dummy rank and whose layout
/// is compatible). Stale decode entries are never returned.
pub fn decode_peers(store: &dyn Store, prefill: &Registration) -> Result<Vec<Registration>> {
    let view = store.view(&prefill.cluster, Role::Decode)?;
    let mut out = Vec::new();
    let t = &prefill.topology;
    for d in view.current.values() {
        let Ok(m) = resolve_rank_mapping(&d.topology, t, MappingOptions::default()) else {
            continue;
        };
        let real_tp = m
            .target_tp_ranks
            .iter()
            .zip(&m.dummy_tp)
            .any(|(&r, &dummy)| r == t.attn_tp_rank && !dummy);
        if real_tp
            && m.target_cp_ranks.contains(&t.attn_cp_rank)
            && m.target_pp_ranks.contains(&t.pp_rank)
            && check_pair(prefill, d).is_ok()
        {
            out.push(d.clone());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::schema::InstanceId;
    use crate::bootstrap::store::MemStore;
    use crate::layout::Topology;
    use std::time::Duration;

    fn reg(role: Role, tp: u32, tp_size: u32, dcp: u32, dcp_size: u32) -> Registration {
        let mut t = Topology::single_mla(64, 2, 1152);
        t.attn_tp_size = tp_size;
        t.attn_tp_rank = tp;
        t.engine_rank = tp;
        t.dcp_size = dcp_size;
        t.dcp_rank = dcp;
        Registration::new("c", role, InstanceId::random().unwrap(), t)
    }

    fn registered(s: &MemStore, r: Registration) -> Registration {
        let ack = s.register(&r, Duration::from_secs(30)).unwrap();
        Registration {
            epoch: ack.epoch,
            registered_at_ms: ack.registered_at_ms,
            ..r
        }
    }

    #[test]
    fn verify_accepts_the_advertised_process() {
        let s = MemStore::new();
        let p = registered(&s, reg(Role::Prefill, 0, 1, 0, 1));
        let d = registered(&s, reg(Role::Decode, 1, 2, 1, 2));
        let targets = prefill_targets(&s, &d, 0).unwrap();
        assert_eq!(targets.len(), 1);
        assert_eq!(targets[0].registration, p);
        let c = verify_peer(&p, &PeerHello::from(&p), &d).unwrap();
        assert!(c.decode_ranks_served.contains(&1));
        assert_eq!(decode_peers(&s, &p).unwrap(), vec![d]);
    }

    #[test]
    fn a_restart_at_the_same_address_is_stale_and_named() {
        let s = MemStore::new();
        let old = registered(&s, reg(Role::Prefill, 0, 1, 0, 1));
        let d = registered(&s, reg(Role::Decode, 0, 1, 0, 2));
        // The prefill process restarted with DCP 2 rank 1: new instance, new topology.
        let new = registered(&s, reg(Role::Prefill, 0, 1, 1, 2));
        let e = verify_peer(&old, &PeerHello::from(&new), &d).unwrap_err();
        assert_eq!(e.status(), Status::StaleMetadata);
        for id in [old.instance_id, new.instance_id, d.instance_id] {
            assert!(e.detail().contains(&id.to_string()), "{}", e.detail());
        }
        assert!(e.detail().contains("restarted at the same address"));
        // Looked up again, the new entry is the seed's miswire, with both entries named.
        let e = prefill_targets(&s, &d, 0).unwrap_err();
        assert_eq!(e.status(), Status::DcpRankMismatch);
        assert!(e
            .detail()
            .contains("PD peers must connect matching DCP ranks, got prefill=1, decode=0"));
        assert!(e.detail().contains(&new.instance_id.to_string()));
        assert!(e.detail().contains(&format!("epoch {}", new.epoch)));
        let e = verify_peer(&new, &PeerHello::from(&new), &d).unwrap_err();
        assert_eq!(e.status(), Status::DcpRankMismatch);
    }

    #[test]
    fn epoch_cluster_and_role_mismatches_are_refused() {
        let s = MemStore::new();
        let p = registered(&s, reg(Role::Prefill, 0, 1, 0, 1));
        let d = registered(&s, reg(Role::Decode, 0, 1, 0, 1));
        let mut h = PeerHello::from(&p);
        h.epoch += 1;
        assert_eq!(
            verify_peer(&p, &h, &d).unwrap_err().status(),
            Status::StaleMetadata
        );
        let mut h = PeerHello::from(&p);
        h.cluster = "other".into();
        let e = verify_peer(&p, &h, &d).unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity);
        assert!(e.detail().contains("two clusters share"));
        let e = verify_peer(&d, &PeerHello::from(&d), &d).unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity);
        let mut h = PeerHello::from(&p);
        h.topology.page_size = 32;
        assert_eq!(
            verify_peer(&p, &h, &d).unwrap_err().status(),
            Status::StaleMetadata
        );
    }

    #[test]
    fn targets_wait_for_readiness() {
        let s = MemStore::new();
        registered(&s, reg(Role::Prefill, 0, 2, 0, 1));
        let d = registered(&s, reg(Role::Decode, 0, 1, 0, 1));
        let e = prefill_targets(&s, &d, 0).unwrap_err();
        assert_eq!(e.status(), Status::NotReady);
        assert!(e.detail().contains("1 of 2"), "{}", e.detail());
    }
}
