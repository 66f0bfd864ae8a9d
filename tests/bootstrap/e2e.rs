//! The seed's scenarios end to end, with real `pdxfer bootstrap` / `pdxfer
//! rank` processes, on the embedded server and on a private etcd.

use crate::support as common;

use common::{bootstrap_server, poll, rank, Etcd};
use pdxfer::bootstrap::{open_store, RankKey, Role, Store};
use pdxfer::Status;
use serde_json::Value;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Keeps the backend (server process or etcd) alive for the test.
type Backend = Box<dyn std::any::Any>;

fn embedded() -> (Backend, String) {
    let (p, url) = bootstrap_server(&[]);
    (Box::new(p), url)
}

fn etcd(ns: &str) -> Option<(Backend, String)> {
    let e = Etcd::start()?;
    let url = e.store_url(ns);
    Some((Box::new(e), url))
}

fn ids(list: &Value) -> BTreeSet<String> {
    list.as_array()
        .expect("array")
        .iter()
        .map(|v| v["instance_id"].as_str().expect("instance_id").to_string())
        .collect()
}

fn key(tp: u32) -> RankKey {
    RankKey {
        dp: 0,
        tp,
        cp: 0,
        pp: 0,
    }
}

/// Scenario 1: decode registered with layout A (TP4 x DCP4) is restarted
/// with layout B (TP2 x DCP2) while A's entries are still in the store.
fn stale_layout(url: &str, ttl_long: &str) {
    let store: Arc<dyn Store> = open_store(url, None).unwrap();
    let (mut p, pev) = rank(
        "prefill",
        url,
        "c1",
        "prefill",
        &["--hello", "127.0.0.1:0", "--ttl-ms", ttl_long],
    );
    let prefill_id = pev["instance_id"].as_str().unwrap().to_string();

    let mut a_ranks = Vec::new();
    let mut a_ids = BTreeSet::new();
    for i in 0..4 {
        let r = i.to_string();
        let (proc_, ev) = rank(
            &format!("decode-A{i}"),
            url,
            "c1",
            "decode",
            &[
                "--tp-size",
                "4",
                "--tp-rank",
                &r,
                "--dcp-size",
                "4",
                "--dcp-rank",
                &r,
                "--ttl-ms",
                ttl_long,
            ],
        );
        a_ids.insert(ev["instance_id"].as_str().unwrap().to_string());
        a_ranks.push(proc_);
    }
    let s = store.summary("c1", Role::Decode).unwrap();
    assert!(s.ready, "{s:?}");
    assert_eq!(s.layout.as_ref().unwrap().dcp_size, 4);
    p.send("peers");
    assert_eq!(ids(&p.expect("peers")["decode"]), a_ids);

    // Layout A dies without deregistering: its entries stay until their leases run out.
    for r in &mut a_ranks {
        r.kill();
    }
    assert_eq!(store.entries("c1", Role::Decode).unwrap().len(), 4);

    let mut b_ids = BTreeSet::new();
    let mut b_ranks = Vec::new();
    for i in 0..2 {
        let r = i.to_string();
        let (proc_, ev) = rank(
            &format!("decode-B{i}"),
            url,
            "c1",
            "decode",
            &[
                "--tp-size",
                "2",
                "--tp-rank",
                &r,
                "--dcp-size",
                "2",
                "--dcp-rank",
                &r,
                "--ttl-ms",
                ttl_long,
            ],
        );
        assert_eq!(ev["replaced"], true, "B{i} replaces A's entry at tp{i}");
        b_ids.insert(ev["instance_id"].as_str().unwrap().to_string());
        b_ranks.push(proc_);
        let s = store.summary("c1", Role::Decode).unwrap();
        // Only B's ranks count toward readiness, although A's are still live.
        assert_eq!(s.layout.as_ref().unwrap().dcp_size, 2);
        assert_eq!(s.registered_ranks, i as u64 + 1);
        assert_eq!(s.expected_ranks, 2);
        assert_eq!(s.ready, i == 1);
        assert_eq!(s.stale.len(), 3 - i, "{s:?}");
        assert!(s
            .stale
            .iter()
            .all(|b| a_ids.contains(&b.instance_id.to_string())));
        // The prefill rank pairs only with current decode entries.
        p.send("peers");
        let got = ids(&p.expect("peers")["decode"]);
        assert!(got.is_subset(&b_ids) && got.len() == i + 1, "{got:?}");
    }
    // A's leftovers at tp2/tp3 are refused by name, never handed out.
    let e = store.lookup("c1", Role::Decode, &key(3)).unwrap_err();
    assert_eq!(e.status(), Status::StaleMetadata);
    assert!(
        a_ids.iter().any(|id| e.detail().contains(id)),
        "{}",
        e.detail()
    );
    assert!(
        e.detail().contains("restarted with another layout"),
        "{}",
        e.detail()
    );

    // The new decode ranks pair with the live prefill rank and move bytes.
    for (i, b) in b_ranks.iter_mut().enumerate() {
        b.send("pair");
        let ev = b.expect("pair");
        assert_eq!(ev["refused"].as_array().unwrap().len(), 0, "B{i}: {ev}");
        assert_eq!(ids(&ev["paired"]), BTreeSet::from([prefill_id.clone()]));
        let got = p.expect("received");
        assert!(b_ids.contains(got["from_instance"].as_str().unwrap()));
    }
}

#[test]
fn scenario1_restart_with_new_layout_never_pairs_stale_entries_embedded() {
    let (_b, url) = embedded();
    stale_layout(&url, "30000");
}

#[test]
fn scenario1_restart_with_new_layout_never_pairs_stale_entries_etcd() {
    let Some((_b, url)) = etcd("s1") else { return };
    stale_layout(&url, "30000");
}

/// Scenario 2: a prefill rank restarts at the same address with another
/// topology; decode, holding the earlier entry, notices at the next handshake.
#[test]
fn scenario2_prefill_restart_at_same_address_is_detected() {
    let (_b, url) = embedded();
    let hello = format!("127.0.0.1:{}", common::free_port());
    let (mut p1, ev1) = rank("prefill-1", &url, "c2", "prefill", &["--hello", &hello]);
    let old_id = ev1["instance_id"].as_str().unwrap().to_string();
    let (mut d, dev) = rank(
        "decode",
        &url,
        "c2",
        "decode",
        &["--dcp-size", "2", "--dcp-rank", "0"],
    );
    let decode_id = dev["instance_id"].as_str().unwrap().to_string();
    d.send("pair");
    let ev = d.expect("pair");
    assert_eq!(ids(&ev["paired"]), BTreeSet::from([old_id.clone()]), "{ev}");
    assert_eq!(p1.expect("received")["bytes"], 4096);

    // Restart at the same address: now DCP 2, rank 1 (a layout decode rank 0 must not use).
    p1.kill();
    let (p2, ev2) = rank(
        "prefill-2",
        &url,
        "c2",
        "prefill",
        &["--hello", &hello, "--dcp-size", "2", "--dcp-rank", "1"],
    );
    let new_id = ev2["instance_id"].as_str().unwrap().to_string();
    assert_ne!(new_id, old_id);

    // Decode still holds the old entry: the handshake names both instances.
    d.send("pair");
    let ev = d.expect("pair");
    assert_eq!(ev["paired"].as_array().unwrap().len(), 0, "{ev}");
    let err = &ev["refused"][0]["error"];
    assert_eq!(err["kind"], "stale_metadata", "{ev}");
    let detail = err["detail"].as_str().unwrap();
    for id in [&old_id, &new_id, &decode_id] {
        assert!(detail.contains(id.as_str()), "{detail}");
    }
    assert!(detail.contains("restarted at the same address"), "{detail}");
    assert!(detail.contains("registered at"), "{detail}");
    assert_eq!(p2.expect("aborted")["kind"], "stale_metadata");

    // Looked up again, the new entry is the seed's miswire, refused before any byte moves.
    d.send("refresh");
    d.send("pair");
    let ev = d.expect("pair_failed");
    assert_eq!(ev["error"]["kind"], "dcp_rank_mismatch", "{ev}");
    let detail = ev["error"]["detail"].as_str().unwrap();
    assert!(detail.contains("PD peers must connect matching DCP ranks, got prefill=1, decode=0"));
    assert!(
        detail.contains(&new_id) && detail.contains(&decode_id),
        "{detail}"
    );
    assert!(detail.contains("epoch"), "{detail}");
    std::thread::sleep(Duration::from_millis(200));
    let after: Vec<Value> = p2.drain();
    assert!(
        after.iter().all(|v| v["event"] != "received"),
        "nothing may reach the restarted rank: {after:?}"
    );
}

/// Scenario 3: two clusters in one bootstrap namespace stay isolated.
fn two_clusters(url: &str) {
    let url = url.to_string();
    let store = open_store(&url, None).unwrap();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for c in ["blue", "green"] {
        let (p, pev) = rank(
            &format!("{c}-prefill"),
            &url,
            c,
            "prefill",
            &["--hello", "127.0.0.1:0"],
        );
        let (d, dev) = rank(
            &format!("{c}-decode"),
            &url,
            c,
            "decode",
            &["--dcp-size", "2"],
        );
        prefill.push((p, pev["instance_id"].as_str().unwrap().to_string()));
        decode.push((d, dev["instance_id"].as_str().unwrap().to_string()));
    }
    for (i, c) in ["blue", "green"].iter().enumerate() {
        let s = store.summary(c, Role::Prefill).unwrap();
        assert_eq!((s.registered_ranks, s.ready), (1, true));
        assert_eq!(s.ranks[0].instance_id.to_string(), prefill[i].1);
        let (d, _) = &mut decode[i];
        d.send("pair");
        let ev = d.expect("pair");
        assert_eq!(
            ids(&ev["paired"]),
            BTreeSet::from([prefill[i].1.clone()]),
            "{c}: {ev}"
        );
        let got = prefill[i].0.expect("received");
        assert_eq!(got["from_instance"].as_str().unwrap(), decode[i].1);
        let (p, _) = &mut prefill[i];
        p.send("peers");
        assert_eq!(
            ids(&p.expect("peers")["decode"]),
            BTreeSet::from([decode[i].1.clone()])
        );
    }
    assert!(store
        .summary("red", Role::Prefill)
        .unwrap()
        .layout
        .is_none());
}

#[test]
fn scenario3_two_clusters_share_a_namespace_embedded() {
    let (_b, url) = embedded();
    two_clusters(&url);
}

#[test]
fn scenario3_two_clusters_share_a_namespace_etcd() {
    let Some((_b, url)) = etcd("s3") else { return };
    two_clusters(&url);
}

/// Scenario 4: a rank that dies stops being listed within its lease.
fn dies_within_ttl(url: &str, ttl_ms: u64, slack: Duration) {
    let store = open_store(url, None).unwrap();
    let ttl = ttl_ms.to_string();
    let (mut p, ev) = rank("doomed", url, "c4", "prefill", &["--ttl-ms", &ttl]);
    let id = ev["instance_id"].as_str().unwrap().to_string();
    // Kept alive past several TTLs while the process lives.
    std::thread::sleep(Duration::from_millis(ttl_ms * 2));
    let s = store.summary("c4", Role::Prefill).unwrap();
    assert_eq!(s.ranks.len(), 1, "live rank must stay listed: {s:?}");
    assert_eq!(s.ranks[0].instance_id.to_string(), id);
    p.kill();
    let died = Instant::now();
    let limit = Duration::from_millis(ttl_ms) + slack;
    let gone = poll(limit + Duration::from_secs(2), || {
        store
            .entries("c4", Role::Prefill)
            .ok()
            .filter(|e| e.is_empty())
            .map(|_| died.elapsed())
    })
    .expect("entry of a dead rank never expired");
    assert!(gone <= limit, "gone after {gone:?}, lease {ttl_ms} ms");
    let s = store.summary("c4", Role::Prefill).unwrap();
    assert!(!s.ready && s.ranks.is_empty());
}

#[test]
fn scenario4_dead_rank_expires_embedded() {
    let (_b, url) = embedded();
    dies_within_ttl(&url, 1000, Duration::from_millis(500));
}

#[test]
fn scenario4_dead_rank_expires_etcd() {
    let Some((_b, url)) = etcd("s4") else { return };
    // etcd's lease granularity: expiry is checked about every 500 ms.
    dies_within_ttl(&url, 2000, Duration::from_millis(1500));
}
