//! The embedded server in-process: scenario 5 (malformed, oversized and
//! unauthenticated requests get a clear 4xx and change nothing), the client
//! API and the keep-alive thread.

use pdxfer::bootstrap::{
    BootstrapServer, HttpStore, InstanceId, LeaseState, Registrar, Registration, Role,
    ServerConfig, Store,
};
use pdxfer::layout::Topology;
use pdxfer::Status;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "s3cret-token";

fn server(token: Option<&str>) -> BootstrapServer {
    BootstrapServer::start(ServerConfig {
        token: token.map(str::to_string),
        max_body_bytes: 64 * 1024,
        ..ServerConfig::default()
    })
    .unwrap()
}

fn reg(cluster: &str, role: Role, tp: u32, tp_size: u32) -> Registration {
    let mut t = Topology::single_mla(64, 2, 1152);
    t.attn_tp_size = tp_size;
    t.attn_tp_rank = tp;
    let mut r = Registration::new(cluster, role, InstanceId::random().unwrap(), t);
    r.endpoints.insert("tcp".into(), "127.0.0.1:7000".into());
    r
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into()
}

/// Sends a request; returns (status, body).
fn call(method: &str, url: &str, token: Option<&str>, body: Option<&[u8]>) -> (u16, String) {
    let a = agent();
    let auth = token.map(|t| format!("Bearer {t}"));
    let r = match (method, body) {
        ("GET", _) => {
            let mut rb = a.get(url);
            if let Some(h) = &auth {
                rb = rb.header("Authorization", h);
            }
            rb.call()
        }
        ("DELETE", _) => {
            let mut rb = a.delete(url);
            if let Some(h) = &auth {
                rb = rb.header("Authorization", h);
            }
            rb.call()
        }
        (_, b) => {
            let mut rb = a.post(url);
            if let Some(h) = &auth {
                rb = rb.header("Authorization", h);
            }
            rb.send(b.unwrap_or(b""))
        }
    };
    let mut r = r.expect("request");
    let code = r.status().as_u16();
    (code, r.body_mut().read_to_string().unwrap_or_default())
}

fn kind(body: &str) -> (String, String) {
    let v: Value = serde_json::from_str(body).expect("JSON error body");
    (
        v["error"].as_str().unwrap_or("").to_string(),
        v["detail"].as_str().unwrap_or("").to_string(),
    )
}

#[test]
fn scenario5_bad_requests_get_a_clear_4xx_and_change_nothing() {
    let srv = server(Some(TOKEN));
    let base = srv.url();
    let reg_url = format!("{base}/v1/register");
    let good = serde_json::to_vec(&json!({
        "registration": reg("c5", Role::Prefill, 0, 1),
        "ttl_ms": 5000,
    }))
    .unwrap();

    // Unauthenticated and wrongly authenticated writes.
    let (c, b) = call("POST", &reg_url, None, Some(&good));
    assert_eq!(c, 401, "{b}");
    assert_eq!(kind(&b).0, "unauthorized");
    assert!(kind(&b).1.contains("Authorization: Bearer"));
    let (c, _) = call("POST", &reg_url, Some("s3cret-tokem"), Some(&good));
    assert_eq!(c, 401);
    let (c, _) = call("POST", &reg_url, Some(""), Some(&good));
    assert_eq!(c, 401);
    // Reads of endpoint data need the token too; the summary does not.
    let ranks = format!("{base}/v1/clusters/c5/prefill/ranks");
    assert_eq!(call("GET", &ranks, None, None).0, 401);
    assert_eq!(
        call("GET", &format!("{ranks}/dp0-tp0-cp0-pp0"), None, None).0,
        401
    );
    assert_eq!(
        call("POST", &format!("{base}/v1/leases/1/keepalive"), None, None).0,
        401
    );
    assert_eq!(
        call("DELETE", &format!("{base}/v1/leases/1"), None, None).0,
        401
    );

    // Malformed JSON: the answer names the field.
    let (c, b) = call("POST", &reg_url, Some(TOKEN), Some(b"{not json"));
    assert_eq!(c, 400, "{b}");
    assert_eq!(kind(&b).0, "invalid_argument");
    let mut bad = serde_json::from_slice::<Value>(&good).unwrap();
    bad["registration"]["topology"]["dcp_size"] = json!("four");
    let (c, b) = call(
        "POST",
        &reg_url,
        Some(TOKEN),
        Some(bad.to_string().as_bytes()),
    );
    assert_eq!(c, 400);
    assert!(kind(&b).1.contains("registration.topology.dcp_size"), "{b}");
    let mut bad = serde_json::from_slice::<Value>(&good).unwrap();
    bad["registration"]
        .as_object_mut()
        .unwrap()
        .remove("cluster");
    let (c, b) = call(
        "POST",
        &reg_url,
        Some(TOKEN),
        Some(bad.to_string().as_bytes()),
    );
    assert_eq!(c, 400);
    assert!(kind(&b).1.contains("missing field `cluster`"), "{b}");
    // Well-formed but invalid: rank >= size, bad cluster name, TTL out of range, other schema.
    for (path, val, needle) in [
        ("/registration/topology/dcp_rank", json!(3), "dcp_rank=3"),
        ("/registration/cluster", json!("a b"), "cluster:"),
        ("/ttl_ms", json!(1), "ttl_ms"),
        ("/registration/schema_version", json!(99), "schema_version"),
    ] {
        let mut bad = serde_json::from_slice::<Value>(&good).unwrap();
        *bad.pointer_mut(path).unwrap() = val;
        let (c, b) = call(
            "POST",
            &reg_url,
            Some(TOKEN),
            Some(bad.to_string().as_bytes()),
        );
        assert_eq!(c, 400, "{path}: {b}");
        assert!(kind(&b).1.contains(needle), "{path}: {b}");
    }
    // Oversized body.
    let huge = vec![b' '; 100 * 1024];
    let (c, b) = call("POST", &reg_url, Some(TOKEN), Some(&huge));
    assert_eq!(c, 413, "{b}");
    assert_eq!(kind(&b).0, "payload_too_large");
    // Bad paths and parameters.
    assert_eq!(call("GET", &format!("{base}/v1/nope"), None, None).0, 404);
    assert_eq!(
        call(
            "GET",
            &format!("{base}/v1/clusters/c5/router/summary"),
            None,
            None
        )
        .0,
        400
    );
    assert_eq!(
        call("GET", &format!("{ranks}/tp0"), Some(TOKEN), None).0,
        400
    );
    assert_eq!(
        call(
            "POST",
            &format!("{base}/v1/leases/x/keepalive"),
            Some(TOKEN),
            None
        )
        .0,
        400
    );
    // Not HTTP at all.
    let mut s = std::net::TcpStream::connect(srv.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GARBAGE\r\n\r\n").unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    assert!(
        head.starts_with(b"HTTP/1.1 4"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );

    // Nothing changed.
    let st = srv.store().stats();
    assert_eq!((st.registrations, st.entries, st.leases), (0, 0, 0));
    let (c, b) = call(
        "GET",
        &format!("{base}/v1/clusters/c5/prefill/summary"),
        None,
        None,
    );
    assert_eq!(c, 200);
    let s: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(s["registered_ranks"], 0);
    let (c, m) = call("GET", &format!("{base}/metrics"), None, None);
    assert_eq!(c, 200);
    assert!(
        m.contains("pdxfer_bootstrap_rejected_requests_total{reason=\"unauthorized\"} 7"),
        "{m}"
    );
    assert!(
        m.contains("pdxfer_bootstrap_rejected_requests_total{reason=\"too_large\"} 1"),
        "{m}"
    );
    assert!(m.contains("pdxfer_bootstrap_registrations_total 0"), "{m}");
    assert!(m.contains("# TYPE pdxfer_bootstrap_entries gauge"), "{m}");

    // The good request with the token works, and the lookup carries the endpoints.
    let (c, b) = call("POST", &reg_url, Some(TOKEN), Some(&good));
    assert_eq!(c, 200, "{b}");
    let (c, b) = call(
        "GET",
        &format!("{ranks}/dp0-tp0-cp0-pp0"),
        Some(TOKEN),
        None,
    );
    assert_eq!(c, 200);
    assert!(b.contains("127.0.0.1:7000"));
    assert_eq!(call("GET", &format!("{base}/health"), None, None).0, 200);
    srv.stop();
}

#[test]
fn client_api_and_keepalive_thread() {
    let srv = server(Some(TOKEN));
    let store: Arc<dyn Store> = Arc::new(HttpStore::new(&srv.url(), Some(TOKEN)).unwrap());
    let r0 = Registrar::start(
        store.clone(),
        reg("c", Role::Prefill, 0, 2),
        Duration::from_millis(300),
    )
    .unwrap();
    let r1 = Registrar::start(
        store.clone(),
        reg("c", Role::Prefill, 1, 2),
        Duration::from_millis(300),
    )
    .unwrap();
    // Kept alive across several TTLs.
    std::thread::sleep(Duration::from_millis(1000));
    let s = store.summary("c", Role::Prefill).unwrap();
    assert!(s.ready, "{s:?}");
    assert_eq!(r0.lease_state(), LeaseState::Live);
    let got = store
        .lookup("c", Role::Prefill, &r1.registration().key())
        .unwrap();
    assert_eq!(got, r1.registration());
    assert_eq!(got.endpoints["tcp"], "127.0.0.1:7000");
    assert_eq!(r1.hello().epoch, got.epoch);

    // Another process takes rank 1: the old registrar learns it was replaced.
    let usurper = reg("c", Role::Prefill, 1, 2);
    let ack = store.register(&usurper, Duration::from_secs(5)).unwrap();
    assert!(ack.replaced && ack.epoch > got.epoch);
    let replaced = common_poll(|| matches!(r1.lease_state(), LeaseState::Replaced(_)));
    assert!(replaced, "{:?}", r1.lease_state());
    if let LeaseState::Replaced(why) = r1.lease_state() {
        assert!(why.contains(&usurper.instance_id.to_string()), "{why}");
    }
    // Deregistration removes only this registrar's entry.
    r0.deregister().unwrap();
    r1.deregister().unwrap();
    let left = store.entries("c", Role::Prefill).unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].instance_id, usurper.instance_id);
    assert_eq!(
        store.keepalive(ack.lease_id + 1).unwrap_err().status(),
        Status::NotRegistered
    );
    // Without a token the client gets the typed error back.
    let anon = HttpStore::new(&srv.url(), None).unwrap();
    assert_eq!(
        anon.entries("c", Role::Prefill).unwrap_err().status(),
        Status::Unauthorized
    );
    anon.health().unwrap();
}

#[test]
fn registrar_reregisters_with_a_new_epoch_after_its_lease_expired() {
    let srv = server(None);
    let store: Arc<dyn Store> = Arc::new(HttpStore::new(&srv.url(), None).unwrap());
    let r = Registrar::start(
        store.clone(),
        reg("c", Role::Decode, 0, 1),
        Duration::from_millis(300),
    )
    .unwrap();
    let first = r.ack();
    // Simulate a lease lost while the store was unreachable.
    store.deregister(first.lease_id).unwrap();
    assert!(store.entries("c", Role::Decode).unwrap().is_empty());
    let back = common_poll(|| r.ack().epoch > first.epoch);
    assert!(back, "registrar did not register again");
    let e = store.entries("c", Role::Decode).unwrap();
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].epoch, r.registration().epoch);
    assert_eq!(e[0].instance_id, first_instance(&r));
}

fn first_instance(r: &Registrar) -> InstanceId {
    r.registration().instance_id
}

fn common_poll(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..100 {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    false
}

#[test]
fn server_refuses_an_empty_token_and_a_busy_port() {
    assert!(BootstrapServer::start(ServerConfig {
        token: Some(String::new()),
        ..ServerConfig::default()
    })
    .is_err());
    let a = server(None);
    let e = BootstrapServer::start(ServerConfig {
        listen: a.addr().to_string(),
        ..ServerConfig::default()
    })
    .err()
    .expect("second bind on the same port must fail");
    assert_eq!(e.status(), Status::Bootstrap);
}

#[test]
fn prefill_leader_registers_in_process_and_remote_ranks_see_it() {
    let srv = server(Some(TOKEN));
    // The leader writes straight into the server's store (no HTTP, no token).
    let local: Arc<dyn Store> = srv.store();
    let leader = Registrar::start(
        local,
        reg("lead", Role::Prefill, 0, 2),
        Duration::from_secs(5),
    )
    .unwrap();
    // Another rank registers over HTTP.
    let remote: Arc<dyn Store> = Arc::new(HttpStore::new(&srv.url(), Some(TOKEN)).unwrap());
    let other = Registrar::start(
        remote.clone(),
        reg("lead", Role::Prefill, 1, 2),
        Duration::from_secs(5),
    )
    .unwrap();
    let s = remote.summary("lead", Role::Prefill).unwrap();
    assert!(s.ready, "{s:?}");
    assert!(other.registration().epoch > leader.registration().epoch);
    assert_eq!(
        remote
            .lookup("lead", Role::Prefill, &leader.registration().key())
            .unwrap(),
        leader.registration()
    );
}
