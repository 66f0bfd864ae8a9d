//! Engine metrics and per-room telemetry end to end: a bootstrap server,
//! one prefill rank and two decode DCP ranks in one process; the counters
//! follow the rooms the test runs, the histogram counts the rooms that
//! succeeded, failures are counted by kind, the telemetry's times are
//! ordered and its bytes are the room's, and `/metrics` answers over HTTP.

use crate::support::cluster::{self, Cluster, P, ROW};
use pdxfer::bootstrap::schema::Role;
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::transport::TransportKind;
use pdxfer::Status;
use std::io::{Read, Write};
use std::time::Duration;

const LAYERS: u32 = 4;
const DCP: u64 = 2;

fn cluster(name: &str, transport: TransportKind, metrics_listen: Option<&str>) -> Cluster {
    Cluster::build(name, (1, DCP as u32), transport)
        .layers(LAYERS)
        .staging(1 << 20)
        .room_timeout(Duration::from_secs(20))
        .receiver_timeout(Duration::from_secs(20))
        .metrics_listen(metrics_listen)
        .start()
}

/// The value of the sample `series` (name and labels exactly as printed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The sum of every sample of metric `name` (any labels).
fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn val(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..4000 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("never happened: {what}");
}

struct Request {
    req: cluster::Request,
    /// Batches the prefill had completed before the room started.
    batches_before: f64,
}

/// Opens `room` on every rank and queues its chunks; checks the state
/// gauges on the way.
fn start(c: &mut Cluster, room: u64, total: u64, prefix: u64, chunk_pages: usize) -> Request {
    let req = c.plan(room, total, prefix);
    c.fill(&req);
    let batches_before = sum(&c.prefill().metrics(), "pdxfer_engine_sent_batches_total");
    c.senders(room);
    let m = c.prefill().metrics();
    assert_eq!(val(&m, "pdxfer_engine_rooms{state=\"bootstrapping\"}"), 1.0);
    c.post_metadata(&req);
    wait_until("the prefill saw the metadata", || {
        c.prefill().poll(room) != KvPoll::Bootstrapping
    });
    let m = c.prefill().metrics();
    assert_eq!(val(&m, "pdxfer_engine_rooms{state=\"bootstrapping\"}"), 0.0);
    assert_eq!(
        val(&m, "pdxfer_engine_rooms{state=\"waiting_for_input\"}"),
        1.0
    );
    c.send_all(&req, chunk_pages);
    Request {
        req,
        batches_before,
    }
}

/// Waits for the request on every rank, verifies it, checks its telemetry
/// and clears it; returns the (KV + aux) bytes verified.
fn finish(c: &mut Cluster, r: &Request) -> u64 {
    let (batches_before, r) = (r.batches_before, &r.req);
    let room = r.room;
    c.wait_prefill_success(room);
    let mut verified = 0;
    let mut kv = 0;
    for i in 0..c.decode.len() {
        c.wait_decode_success(room, i);
        verified += c.verify_rank(r, i);
        let e = &c.decode[i].0;
        let t = e.telemetry(room).unwrap();
        assert_eq!((t.room, t.attempt, t.state), (room, 1, KvPoll::Success));
        assert_eq!(t.bytes, e.room_bytes(room));
        assert!(t.bytes > 0);
        kv += t.bytes;
        let (q, a) = (t.queued.unwrap(), t.last_ack.unwrap());
        assert!(q <= a, "decode: queued {q:?} after last ack {a:?}");
        assert_eq!(
            (t.planned, t.first_byte, t.batches, t.retries),
            (None, None, None, None)
        );
        assert_eq!(t.transport.as_deref(), Some("cma"));
    }
    let t = c.prefill().telemetry(room).unwrap();
    assert_eq!((t.room, t.state), (room, KvPoll::Success));
    let (q, p, f, a) = (
        t.queued.unwrap(),
        t.planned.unwrap(),
        t.first_byte.unwrap(),
        t.last_ack.unwrap(),
    );
    assert!(
        q <= p && p <= f && f <= a,
        "prefill times out of order: {t:?}"
    );
    assert_eq!(
        t.bytes, kv,
        "prefill KV bytes are the decode ranks' together"
    );
    assert_eq!(t.bytes, (r.total - r.prefix) * ROW * u64::from(LAYERS));
    // every batch the room posted completed, and is counted on one peer
    let batches = sum(&c.prefill().metrics(), "pdxfer_engine_sent_batches_total") - batches_before;
    assert_eq!(t.batches.unwrap() as f64, batches);
    assert!(batches >= 2.0, "at least KV and aux");
    assert_eq!(t.retries, Some(0));
    assert_eq!(t.transport.as_deref(), Some("cma"));
    assert!(t.created_unix_ns > 1_700_000_000_000_000_000);
    for (e, _) in &c.decode {
        e.clear(room).unwrap();
        assert_eq!(e.telemetry(room).unwrap_err().status(), Status::UnknownRoom);
    }
    c.prefill().clear(room).unwrap();
    verified
}

#[test]
fn metrics_follow_the_rooms_and_telemetry_is_ordered() {
    let mut c = cluster("metrics-rooms", TransportKind::Cma, None);
    let m = c.prefill().metrics();
    assert_eq!(val(&m, "pdxfer_engine_rooms_created_total"), 0.0);
    assert_eq!(sum(&m, "pdxfer_engine_transfer_seconds_count"), 0.0);
    assert_eq!(
        val(
            &m,
            "pdxfer_engine_info{role=\"prefill\",cluster=\"metrics-rooms\"}"
        ),
        1.0
    );
    let kv_pool = 64 * P * ROW * u64::from(LAYERS);
    assert_eq!(
        val(&m, "pdxfer_engine_registered_bytes{kind=\"kv\"}"),
        kv_pool as f64
    );
    assert_eq!(val(&m, "pdxfer_engine_staging_bytes"), (2u64 << 20) as f64);
    let rooms = [
        (1u64, 150u64, 32u64, 3usize),
        (2, 97, 0, 100),
        (3, 64, 0, 2),
    ];
    let mut verified = 0;
    for (i, &(room, total, prefix, chunk)) in rooms.iter().enumerate() {
        let r = start(&mut c, room, total, prefix, chunk);
        verified += finish(&mut c, &r);
        let done = (i + 1) as f64;
        let m = c.prefill().metrics();
        assert_eq!(val(&m, "pdxfer_engine_rooms_created_total"), done);
        assert_eq!(
            val(&m, "pdxfer_engine_rooms_finished_total{state=\"success\"}"),
            done
        );
        assert_eq!(
            val(
                &m,
                "pdxfer_engine_transfer_seconds_count{transport=\"cma\"}"
            ),
            done
        );
        assert_eq!(
            val(
                &m,
                "pdxfer_engine_transfer_seconds_bucket{transport=\"cma\",le=\"+Inf\"}"
            ),
            done
        );
        assert_eq!(sum(&m, "pdxfer_engine_rooms"), 0.0, "every room cleared");
    }
    let m = c.prefill().metrics();
    let s = c.prefill().metrics_snapshot();
    assert_eq!(
        val(&m, "pdxfer_engine_rooms_finished_total{state=\"failed\"}"),
        0.0
    );
    assert_eq!(sum(&m, "pdxfer_engine_room_failures_total"), 0.0);
    // every verified byte went over a completed batch to one of the two peers
    assert_eq!(sum(&m, "pdxfer_engine_sent_bytes_total"), verified as f64);
    assert_eq!(s.peers.len(), 2);
    for (p, want) in s.peers.iter().zip(["dp0-tp0-cp0-pp0", "dp0-tp1-cp0-pp0"]) {
        assert_eq!((p.transport.as_str(), p.peer.as_str()), ("cma", want));
        assert!(p.batches > 0 && p.bytes > 0 && p.failed_batches == 0);
        assert_eq!(
            p.staged_bytes, 0,
            "nothing in flight once the rooms finished"
        );
    }
    assert_eq!(val(&m, "pdxfer_engine_staging_in_flight_bytes"), 0.0);
    // heap pools over cma: the rows go straight from the pools (the
    // sender's process_vm_writev gathers them), none through the staging
    assert_eq!(s.gathers, 0, "no DCP 2 row is packed through the staging");
    assert!(s.wire_seconds()["cma"] > 0.0);
    let h = &s.totals.latency["cma"];
    assert_eq!(h.count, 3);
    let (p50, p99) = (h.quantile(0.5).unwrap(), h.quantile(0.99).unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{p50} {p99}");
    // the decode ranks: their own rooms and the bytes each prefill rank reported
    let mut received = 0.0;
    for (e, _) in &c.decode {
        let d = e.metrics();
        assert_eq!(val(&d, "pdxfer_engine_rooms_created_total"), 3.0);
        assert_eq!(
            val(&d, "pdxfer_engine_rooms_finished_total{state=\"success\"}"),
            3.0
        );
        assert_eq!(
            val(
                &d,
                "pdxfer_engine_transfer_seconds_count{transport=\"cma\"}"
            ),
            3.0
        );
        received += val(
            &d,
            "pdxfer_engine_received_bytes_total{transport=\"cma\",peer=\"dp0-tp0-cp0-pp0\"}",
        );
        wait_until("the decode agent's records were drained", || {
            sample(&e.metrics(), "pdxfer_engine_received_batches_total").unwrap_or(0.0) > 0.0
        });
    }
    let kv: u64 = rooms
        .iter()
        .map(|&(_, total, prefix, _)| (total - prefix) * ROW * u64::from(LAYERS))
        .sum();
    assert_eq!(received, kv as f64);
}

#[test]
fn failures_are_counted_by_kind() {
    let c = cluster("metrics-fail", TransportKind::Cma, None);
    // an abort from the decode side: every rank counts an aborted room
    let room = 9;
    c.prefill().sender(room).unwrap();
    for (e, _) in &c.decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &[1, 2], 0, 0).unwrap();
    }
    wait_until("waiting for input", || {
        c.prefill().poll(room) == KvPoll::WaitingForInput
    });
    c.decode[0].0.abort(room).unwrap();
    wait_until("the prefill heard the abort", || {
        c.prefill().poll(room) == KvPoll::Failed
    });
    let m = c.prefill().metrics();
    assert_eq!(
        val(&m, "pdxfer_engine_room_failures_total{kind=\"aborted\"}"),
        1.0
    );
    assert_eq!(
        val(&m, "pdxfer_engine_rooms_finished_total{state=\"failed\"}"),
        1.0
    );
    assert_eq!(val(&m, "pdxfer_engine_rooms{state=\"failed\"}"), 1.0);
    assert_eq!(sum(&m, "pdxfer_engine_transfer_seconds_count"), 0.0);
    let d = c.decode[0].0.metrics();
    assert_eq!(
        val(&d, "pdxfer_engine_room_failures_total{kind=\"aborted\"}"),
        1.0
    );
    // cleared, the failure still counts, once
    c.prefill().clear(room).unwrap();
    let m = c.prefill().metrics();
    assert_eq!(
        val(&m, "pdxfer_engine_room_failures_total{kind=\"aborted\"}"),
        1.0
    );
    assert_eq!(val(&m, "pdxfer_engine_rooms{state=\"failed\"}"), 0.0);
    // a chunk the decode pages cannot hold fails on the worker, typed
    let room = 10;
    c.prefill().sender(room).unwrap();
    for (e, _) in &c.decode {
        e.receiver(room, 0, None).unwrap();
        e.send_metadata(room, &[4], 0, 0).unwrap();
    }
    wait_until("waiting for input", || {
        c.prefill().poll(room) == KvPoll::WaitingForInput
    });
    c.prefill().send(room, &[5, 6, 7], 40, true, 0).unwrap();
    assert_eq!(
        c.prefill().wait(room, Duration::from_secs(10)),
        KvPoll::Failed
    );
    let m = c.prefill().metrics();
    assert_eq!(
        val(
            &m,
            "pdxfer_engine_room_failures_total{kind=\"insufficient_destination\"}"
        ),
        1.0
    );
    assert_eq!(
        val(&m, "pdxfer_engine_rooms_finished_total{state=\"failed\"}"),
        2.0
    );
    let t = c.prefill().telemetry(room).unwrap();
    assert_eq!(t.state, KvPoll::Failed);
    assert_eq!((t.last_ack, t.first_byte, t.bytes), (None, None, 0));
    assert!(t.queued.is_some());
}

#[test]
fn a_miswired_pair_counts_as_a_dcp_rank_mismatch() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let pp = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    let mut pt = pp.topology(4, 0);
    pt.attn_tp_size = 1;
    pt.attn_tp_rank = 0;
    let cfg = EngineConfig::new(Role::Prefill, "metrics-miswired", &url, pt, pp.kv_pools());
    // SAFETY: the pools outlive the engines in this test.
    let _prefill = unsafe { Engine::new(cfg) }.unwrap();
    let dp = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    let mut dt = dp.topology(4, 1);
    dt.attn_tp_size = 1;
    dt.attn_tp_rank = 0;
    dt.engine_rank = 0;
    let cfg = EngineConfig::new(Role::Decode, "metrics-miswired", &url, dt, dp.kv_pools());
    // SAFETY: as above.
    let decode = unsafe { Engine::new(cfg) }.unwrap();
    for room in [1, 2] {
        let e = decode.receiver(room, 0, None).unwrap_err();
        assert_eq!(e.status(), Status::DcpRankMismatch);
    }
    let m = decode.metrics();
    assert_eq!(
        val(
            &m,
            "pdxfer_engine_room_failures_total{kind=\"dcp_rank_mismatch\"}"
        ),
        2.0
    );
    assert_eq!(val(&m, "pdxfer_engine_rooms_created_total"), 2.0);
    assert_eq!(val(&m, "pdxfer_engine_rooms{state=\"failed\"}"), 2.0);
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn metrics_are_served_over_http_on_metrics_listen() {
    let mut c = cluster("metrics-http", TransportKind::Cma, Some("127.0.0.1:0"));
    assert!(c.decode[0].0.metrics_addr().is_none());
    let addr = c.prefill().metrics_addr().unwrap();
    assert!(addr.ip().is_loopback() && addr.port() != 0);
    assert_eq!(
        c.prefill().registration().unwrap().endpoints["metrics"],
        addr.to_string()
    );
    let r = start(&mut c, 4, 40, 0, 100);
    finish(&mut c, &r);
    let got = http_get(addr, "/metrics");
    let (head, body) = got.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(len, body.len());
    assert_eq!(
        val(
            body,
            "pdxfer_engine_rooms_finished_total{state=\"success\"}"
        ),
        1.0
    );
    assert_eq!(
        val(
            body,
            "pdxfer_engine_transfer_seconds_count{transport=\"cma\"}"
        ),
        1.0
    );
    assert!(http_get(addr, "/other").starts_with("HTTP/1.1 404"));
    // a closed engine stops answering
    c.prefill().close();
    std::thread::sleep(Duration::from_millis(300));
    let refused = std::net::TcpStream::connect(addr).map(|mut s| {
        let _ = write!(s, "GET /metrics HTTP/1.1\r\n\r\n");
        let mut b = String::new();
        let _ = s.read_to_string(&mut b);
        b
    });
    assert!(
        refused.as_deref().map_or(true, |b| b.is_empty()),
        "{refused:?}"
    );
}

#[test]
fn a_trickling_client_and_idle_connections_do_not_delay_a_scrape() {
    let c = cluster("metrics-slow", TransportKind::Cma, Some("127.0.0.1:0"));
    let addr = c.prefill().metrics_addr().unwrap();
    // ten idle connections, and one that sends a header byte every 300 ms
    let idle: Vec<std::net::TcpStream> = (0..10)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            for b in b"GET /metrics HTTP/1.1\r\nX-Slow: 1".iter().cycle() {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    // six scrapes, each answered promptly while both hold their connections
    for _ in 0..6 {
        let t = std::time::Instant::now();
        let got = http_get(addr, "/metrics");
        assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "a scrape took {:?} behind a trickling client and 10 idle connections",
            t.elapsed()
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
    drop(idle);
}

#[test]
fn a_metrics_listen_that_cannot_bind_is_refused_at_creation() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let pools = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(
        Role::Prefill,
        "metrics-bad",
        &server.url(),
        pools.topology(1, 0),
        pools.kv_pools(),
    );
    cfg.metrics_listen = Some("not-an-address".into());
    // SAFETY: the pools outlive the (refused) engine.
    let e = unsafe { Engine::new(cfg) }.unwrap_err();
    assert_eq!(e.status(), Status::Io);
    assert!(e.detail().contains("metrics_listen"), "{e}");
}
