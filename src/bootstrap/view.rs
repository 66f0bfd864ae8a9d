//! Which live entries of a (cluster, role) are current, shared by every store.
//!
//! The newest entry (highest epoch) defines the current [`Layout`]. Entries
//! with another layout, and entries with the current layout that are older
//! than the newest entry of another layout (a flip A -> B -> A), are stale:
//! they are listed as such, never counted toward readiness, and a lookup that
//! lands on one fails with `stale_metadata` naming it. This replaces
//! SGLang's first-PUT-wins topology: a restart with a new layout takes over
//! at once, and what is left of the old one can no longer be paired with.

use super::schema::{Layout, RankBrief, RankKey, Registration, Role, Summary, SCHEMA_VERSION};
use crate::error::{Error, Result, Status};
use std::collections::BTreeMap;

/// The live entries of one (cluster, role), split into current and stale.
#[derive(Debug, Clone)]
pub struct View {
    /// Cluster name.
    pub cluster: String,
    /// Role.
    pub role: Role,
    /// The current layout.
    pub layout: Option<Layout>,
    /// First epoch of the current layout.
    pub current_epoch: u64,
    /// Current entries by key (one per key: the newest).
    pub current: BTreeMap<RankKey, Registration>,
    /// Stale entries, oldest first.
    pub stale: Vec<Registration>,
}

impl View {
    /// Classifies the live entries of `cluster`/`role` (entries of other
    /// clusters or roles in `entries` are ignored).
    pub fn new(cluster: &str, role: Role, entries: Vec<Registration>) -> View {
        let mut entries: Vec<Registration> = entries
            .into_iter()
            .filter(|e| e.cluster == cluster && e.role == role)
            .collect();
        entries.sort_by_key(|e| e.epoch);
        let layout = entries.last().map(|e| e.layout());
        let mut current = BTreeMap::new();
        let mut stale = Vec::new();
        let mut current_epoch = 0;
        if let Some(l) = &layout {
            let cutoff = entries
                .iter()
                .filter(|e| &e.layout() != l)
                .map(|e| e.epoch)
                .max()
                .unwrap_or(0);
            for e in entries {
                if &e.layout() == l && e.epoch > cutoff {
                    if current_epoch == 0 {
                        current_epoch = e.epoch;
                    }
                    // Sorted by epoch: a later entry at the same key replaces.
                    if let Some(old) = current.insert(e.key(), e) {
                        stale.push(old);
                    }
                } else {
                    stale.push(e);
                }
            }
        }
        View {
            cluster: cluster.to_string(),
            role,
            layout,
            current_epoch,
            current,
            stale,
        }
    }

    /// Topology and readiness.
    pub fn summary(&self) -> Summary {
        let expected = self.layout.as_ref().map_or(0, |l| l.expected_ranks());
        let registered = self.current.len() as u64;
        Summary {
            schema_version: SCHEMA_VERSION,
            cluster: self.cluster.clone(),
            role: self.role,
            layout: self.layout.clone(),
            current_epoch: self.current_epoch,
            expected_ranks: expected,
            registered_ranks: registered,
            ready: registered > 0 && registered == expected,
            ranks: self.current.values().map(RankBrief::from).collect(),
            stale: self.stale.iter().map(RankBrief::from).collect(),
        }
    }

    /// The current entry at `key`; a stale one there is `stale_metadata`, none is `not_registered`.
    pub fn lookup(&self, key: &RankKey) -> Result<Registration> {
        if let Some(r) = self.current.get(key) {
            return Ok(r.clone());
        }
        let layout = self
            .layout
            .as_ref()
            .map_or_else(|| "none".to_string(), |l| l.to_string());
        if let Some(s) = self.stale.iter().rev().find(|s| &s.key() == key) {
            return Err(Error::new(
                Status::StaleMetadata,
                format!(
                    "the only entry for {} {}/{key} is stale: {} with layout [{}], but the current layout since epoch {} is [{layout}]. Likely cause: the {} instance was restarted with another layout and this entry belongs to a process of the earlier layout (it expires with its lease); it is never handed out as a peer",
                    self.role, self.cluster, s.describe(), s.layout(), self.current_epoch, self.role
                ),
            ));
        }
        let keys: Vec<String> = self.current.keys().map(|k| k.to_string()).collect();
        Err(Error::new(
            Status::NotRegistered,
            format!(
                "no {} rank {key} is registered in cluster {:?} (current layout [{layout}], registered keys {keys:?}); the rank has not registered yet, its lease expired, or the cluster name differs",
                self.role, self.cluster
            ),
        ))
    }

    /// Current entries, by key.
    pub fn current_entries(&self) -> Vec<Registration> {
        self.current.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::schema::InstanceId;
    use crate::layout::Topology;

    fn reg(tp: u32, tp_size: u32, dcp: u32, dcp_size: u32, epoch: u64) -> Registration {
        let mut t = Topology::single_mla(64, 2, 1152);
        t.attn_tp_size = tp_size;
        t.attn_tp_rank = tp;
        t.engine_rank = tp;
        t.dcp_size = dcp_size;
        t.dcp_rank = dcp;
        let mut r = Registration::new("c", Role::Decode, InstanceId(epoch as u128), t);
        r.epoch = epoch;
        r
    }

    #[test]
    fn newest_layout_wins_and_old_entries_are_stale() {
        // Layout A: tp4 dcp4 at epochs 1..4; layout B: tp2 dcp2 at epochs 5, 6.
        let mut all: Vec<Registration> = (0..4).map(|i| reg(i, 4, i, 4, 1 + i as u64)).collect();
        all.push(reg(0, 2, 0, 2, 5));
        let v = View::new("c", Role::Decode, all.clone());
        let s = v.summary();
        assert_eq!(s.layout.as_ref().unwrap().dcp_size, 2);
        assert_eq!(
            (s.registered_ranks, s.expected_ranks, s.ready),
            (1, 2, false)
        );
        assert_eq!(s.current_epoch, 5);
        assert_eq!(s.stale.len(), 4);
        let k1 = all[1].key();
        let e = v.lookup(&k1).unwrap_err();
        assert_eq!(e.status(), Status::StaleMetadata);
        assert!(
            e.detail().contains(&InstanceId(2).to_string()),
            "{}",
            e.detail()
        );
        all.push(reg(1, 2, 1, 2, 6));
        let v = View::new("c", Role::Decode, all);
        let s = v.summary();
        assert!(s.ready);
        assert_eq!(v.lookup(&k1).unwrap().epoch, 6);
        let e = v
            .lookup(&RankKey {
                dp: 0,
                tp: 3,
                cp: 0,
                pp: 0,
            })
            .unwrap_err();
        assert_eq!(e.status(), Status::StaleMetadata);
    }

    #[test]
    fn a_rank_registering_twice_counts_once() {
        let all = vec![reg(0, 2, 0, 1, 1), reg(0, 2, 0, 1, 2), reg(0, 2, 0, 1, 3)];
        let v = View::new("c", Role::Decode, all);
        let s = v.summary();
        assert_eq!((s.registered_ranks, s.ready), (1, false));
        assert_eq!(s.ranks[0].epoch, 3);
    }

    #[test]
    fn a_layout_flip_back_leaves_the_first_generation_stale() {
        // Layout X (tp1) at epoch 1, layout Y (tp2) at 2, X again at 3: the
        // epoch-1 entry shares X but predates the Y entry, so it is stale.
        let all = vec![reg(0, 1, 0, 1, 1), reg(0, 2, 0, 1, 2), reg(0, 1, 0, 1, 3)];
        let v = View::new("c", Role::Decode, all);
        assert_eq!(v.current_epoch, 3);
        assert_eq!(v.current.len(), 1);
        assert_eq!(v.stale.len(), 2);
    }

    #[test]
    fn unknown_key_is_not_registered() {
        let v = View::new("c", Role::Decode, vec![]);
        let e = v
            .lookup(&RankKey {
                dp: 0,
                tp: 0,
                cp: 0,
                pp: 0,
            })
            .unwrap_err();
        assert_eq!(e.status(), Status::NotRegistered);
        assert!(!v.summary().ready);
    }
}
