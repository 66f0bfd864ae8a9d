//! Peer authentication against real processes: an unprivileged attacker
//! (uid/gid 65534, this test binary re-run with a filter for an `#[ignore]`d
//! child test) tries the engine's control port and an agent's data port
//! without the cluster secret; a canary process (the kind a confused deputy
//! would write into) keeps its bytes; the live room is unaffected; a decode
//! with another secret is refused by name; `auto` uses tcp for a peer of
//! another uid.

use crate::support as common;
use crate::support::child::{self, is_root, next_report, report, Talker, NOBODY};

use pdxfer::bootstrap::schema::{PeerHello, Role};
use pdxfer::bootstrap::server::{BootstrapServer, ServerConfig};
use pdxfer::engine::synthetic::SyntheticPools;
use pdxfer::engine::{Engine, EngineConfig, KvPoll};
use pdxfer::layout::{DcpLayout, Side};
use pdxfer::transport::wire::{self, FrameType};
use pdxfer::transport::{Agent, AgentOptions, ConnectOptions, ProcIdentity, TransportKind};
use pdxfer::Status;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: &str = "auth-test-cluster-secret-0123456789";
const LAYERS: u32 = 4;
const ROW: u64 = 64;
const P: u64 = 16;
const CANARY: u8 = 0xC3;
const CHILD_ENV: &str = "PDXFER_AUTH_CHILD";

// ---------------------------------------------------------------- children

/// Re-runs this test binary for the ignored child test `name`, as uid/gid
/// 65534 when `nobody` (as root, how the test command runs, the attacker
/// drops to nobody; an unprivileged test user is already an unprivileged
/// attacker).
fn child(name: &str, envs: &[(&str, String)], nobody: bool) -> Child {
    let mut c = child::command(module_path!(), name, CHILD_ENV, nobody);
    c.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in envs {
        c.env(k, v);
    }
    c.spawn().expect("spawn child test")
}

fn is_child(name: &str) -> bool {
    child::is_child(CHILD_ENV, name)
}

/// A process holding 64 KiB of canary bytes ([`child::run_canary`]).
#[test]
#[ignore = "child process of the auth tests"]
fn child_canary() {
    if is_child("child_canary") {
        child::run_canary(CANARY);
    }
}

/// The canary child, started and reporting.
fn spawn_canary() -> Talker {
    Talker::spawn(child::command(
        module_path!(),
        "child_canary",
        CHILD_ENV,
        false,
    ))
}

/// Everything a peer sends until it closes or is quiet for `quiet`.
fn drain(s: &mut TcpStream, quiet: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(quiet)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 || out.len() > 1 << 20 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

fn hex(n: usize) -> String {
    (0..n).map(|i| format!("{:x}", (i * 7 + 3) % 16)).collect()
}

fn line(v: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap();
    b.push(b'\n');
    b
}

/// A fake data-plane agent (the old protocol, unauthenticated): answers a
/// Hello with the canary's public `/proc` identity and "regions" inside it,
/// as a confused deputy's accomplice would. Counts the connections it got.
fn fake_agent(canary: Value, accepted: Arc<AtomicUsize>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            accepted.fetch_add(1, Ordering::SeqCst);
            let canary = canary.clone();
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let Ok((FrameType::Hello, _)) = wire::read_frame(&mut s) else {
                    return;
                };
                let region =
                    json!({"id": 1, "addr": canary["addr"], "len": canary["len"], "kind": "host"});
                let ack = json!({
                    "version": wire::VERSION, "identity": canary["identity"],
                    "regions": [region], "session": 1, "token": 1, "nonce_addr": canary["addr"],
                });
                let _ = wire::write_json(&mut s, FrameType::HelloAck, &ack);
                if wire::read_frame(&mut s).is_ok() {
                    let _ = wire::write_json(&mut s, FrameType::SelectOk, &json!({}));
                }
                let _ = drain(&mut s, Duration::from_secs(5));
            });
        }
    });
    addr
}

/// The attacker of the control port: decode Hellos with its own data address
/// (the fake agent) and with the real decode's, Meta messages with another
/// prefix length, forged auth proofs, an oversized line. Reports every byte
/// the prefill answered and how many connections the fake agent got.
#[test]
#[ignore = "child process of the auth tests"]
fn child_ctl_attacker() {
    if !is_child("child_ctl_attacker") {
        return;
    }
    let env = |k: &str| std::env::var(k).unwrap();
    let ctl = env("ATTACK_CTL");
    let hello: Value = serde_json::from_str(&env("ATTACK_HELLO")).unwrap();
    let canary: Value = serde_json::from_str(&env("ATTACK_CANARY")).unwrap();
    let room: u64 = env("ATTACK_ROOM").parse().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let fake = fake_agent(canary, accepted.clone());
    let decode_hello = |data_addr: &str| {
        json!({"type": "hello", "version": 1, "hello": hello, "data_addr": data_addr,
               "regions": {"kv": (0..LAYERS).map(|l| (l, 1)).collect::<Vec<_>>(), "aux": [[1, 32]]}})
    };
    let meta = |prefix: u64| {
        json!({"type": "meta", "room": room, "attempt": 0, "dst_pages": [0, 1],
               "decode_prefix_len": prefix, "aux_index": 0, "required_dst_info_num": 1, "timeout_ms": 0})
    };
    let auth_hello = |secret: bool| json!({"type": "auth_hello", "auth": {"version": 1, "instance": hex(32), "nonce": hex(64), "secret": secret}});
    let proof = |p: String| json!({"type": "auth_proof", "auth": {"proof": p}});
    let conversations: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "hello_fake_data_addr",
            vec![line(&decode_hello(&fake)), line(&meta(0))],
        ),
        (
            "hello_real_data_addr",
            vec![line(&decode_hello(&env("ATTACK_DATA"))), line(&meta(5))],
        ),
        ("meta_first", vec![line(&meta(5))]),
        (
            "forged_proof",
            vec![
                line(&auth_hello(true)),
                line(&proof(hex(64))),
                line(&decode_hello(&fake)),
                line(&meta(5)),
            ],
        ),
        (
            "open_mode",
            vec![
                line(&auth_hello(false)),
                line(&proof(String::new())),
                line(&decode_hello(&fake)),
                line(&meta(5)),
            ],
        ),
        // over the 4 KiB limit, small enough to be read whole (no reset)
        ("oversized_line", vec![vec![b'{'; 6000]]),
    ];
    let mut replies = serde_json::Map::new();
    for (name, msgs) in conversations {
        let mut s = TcpStream::connect(&ctl).unwrap();
        for m in msgs {
            // the first auth message gets its challenge before the proof goes out
            if s.write_all(&m).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let got = drain(&mut s, Duration::from_secs(2));
        replies.insert(name.into(), String::from_utf8_lossy(&got).into());
    }
    std::thread::sleep(Duration::from_millis(500));
    report(json!({"accepted": accepted.load(Ordering::SeqCst), "replies": replies}));
}

/// The attacker of a decode agent's data port: the unauthenticated protocol
/// (Hello, then tcp data into the region and a 0-byte commit that would
/// forge a completion), an Attach and a data frame as first frames, forged
/// proofs, an oversized first frame. Reports every frame it got back.
#[test]
#[ignore = "child process of the auth tests"]
fn child_data_attacker() {
    if !is_child("child_data_attacker") {
        return;
    }
    let addr = std::env::var("ATTACK_DATA").unwrap();
    let region: u64 = std::env::var("ATTACK_REGION").unwrap().parse().unwrap();
    let me = ProcIdentity::current().unwrap();
    let frame = |ty: FrameType, v: &Value| {
        let mut b = Vec::new();
        wire::write_json(&mut b, ty, v).unwrap();
        b
    };
    let data = |batch: u64| {
        let h = wire::DataHeader {
            flags: 0,
            batch,
            region,
            offset: 0,
            len: 64,
        };
        [h.encode().to_vec(), vec![0xEE; 64]].concat()
    };
    let commit = |batch: u64, bytes: u64| {
        let mut b = Vec::new();
        let c = wire::Commit {
            batch,
            bytes,
            checksum: None,
            room: 7,
            epoch: 0,
        };
        wire::write_frame(&mut b, FrameType::Commit, &wire::encode_commit(&c)).unwrap();
        b
    };
    let auth_hello = |secret: bool| json!({"version": 1, "instance": hex(32), "nonce": hex(64), "secret": secret});
    let hello = frame(
        FrameType::Hello,
        &json!({"version": wire::VERSION, "identity": me}),
    );
    let mut replies = serde_json::Map::new();
    let mut record = |name: &str, got: Vec<u8>| {
        let mut frames = Vec::new();
        let mut r = got.as_slice();
        while let Ok((ty, p)) = wire::read_frame(&mut r) {
            frames.push(json!({"type": format!("{ty:?}"), "payload": String::from_utf8_lossy(&p)}));
        }
        replies.insert(name.into(), json!({"frames": frames, "bytes": got.len()}));
    };
    // 1. the unauthenticated protocol, followed as far as the receiver lets it
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&hello).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut got = Vec::new();
    let first = wire::read_frame(&mut s);
    if let Ok((ty, p)) = &first {
        wire::write_frame(&mut got, *ty, p).unwrap();
    }
    if let Ok((FrameType::HelloAck, p)) = first {
        let ack: Value = serde_json::from_slice(&p).unwrap();
        let sel = json!({"transport": "tcp", "streams": 1, "proof": 0});
        s.write_all(&frame(FrameType::Select, &sel)).unwrap();
        let _ = wire::read_frame(&mut s);
        let mut d = TcpStream::connect(&addr).unwrap();
        let att = json!({"session": ack["session"], "token": ack["token"], "index": 0});
        d.write_all(&frame(FrameType::Attach, &att)).unwrap();
        let _ = wire::read_frame(&mut d);
        d.write_all(&data(1)).unwrap();
        s.write_all(&commit(1, 64)).unwrap();
        s.write_all(&commit(2, 0)).unwrap();
    }
    got.extend(drain(&mut s, Duration::from_secs(2)));
    record("unauthenticated_protocol", got);
    // 2. an Attach, a data frame with a 0-byte commit, forged and open-mode
    // proofs, an oversized first frame
    // the header of a 1 MiB AuthHello (refused from the header)
    let mut oversized = Vec::new();
    wire::write_frame(&mut oversized, FrameType::AuthHello, &vec![b' '; 1 << 20]).unwrap();
    oversized.truncate(12);
    let tries: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "attach_first",
            vec![frame(
                FrameType::Attach,
                &json!({"session": 1, "token": hex(32), "index": 0}),
            )],
        ),
        ("data_first", vec![[data(3), commit(3, 0)].concat()]),
        (
            "forged_proof",
            vec![
                frame(FrameType::AuthHello, &auth_hello(true)),
                frame(FrameType::AuthProof, &json!({"proof": hex(64)})),
                hello.clone(),
            ],
        ),
        (
            "open_mode",
            vec![
                frame(FrameType::AuthHello, &auth_hello(false)),
                frame(FrameType::AuthProof, &json!({"proof": ""})),
                hello.clone(),
            ],
        ),
        ("oversized_first_frame", vec![oversized]),
    ];
    for (name, msgs) in tries {
        let mut s = TcpStream::connect(&addr).unwrap();
        for m in msgs {
            if s.write_all(&m).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        record(name, drain(&mut s, Duration::from_secs(2)));
    }
    report(json!({ "replies": replies }));
}

fn run_attacker(name: &str, envs: &[(&str, String)]) -> Value {
    let mut c = child(name, envs, true);
    let mut out = BufReader::new(c.stdout.take().unwrap());
    let v = next_report(&c, &mut out);
    assert!(c.wait().unwrap().success());
    v
}

// ------------------------------------------------------------------ engines

struct Pair {
    _server: BootstrapServer,
    prefill: Engine,
    p_pools: SyntheticPools,
    decode: Engine,
    d_pools: SyntheticPools,
}

fn engine(
    role: Role,
    url: &str,
    pages: u64,
    token: Option<&str>,
) -> (Result<Engine, pdxfer::Error>, SyntheticPools) {
    let pools = SyntheticPools::new(LAYERS, ROW, P, pages, 8, 32).unwrap();
    let mut cfg = EngineConfig::new(role, "auth", url, pools.topology(1, 0), pools.kv_pools());
    cfg.aux = pools.aux_buffers();
    cfg.token = token.map(str::to_string);
    cfg.room_timeout = Duration::from_secs(20);
    // SAFETY: the pools are returned with the engine and outlive it in every caller.
    (unsafe { Engine::new(cfg) }, pools)
}

fn pair() -> Pair {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let (prefill, p_pools) = engine(Role::Prefill, &url, 64, Some(SECRET));
    let (decode, d_pools) = engine(Role::Decode, &url, 32, Some(SECRET));
    Pair {
        _server: server,
        prefill: prefill.unwrap(),
        p_pools,
        decode: decode.unwrap(),
        d_pools,
    }
}

const TOTAL: u64 = 40;

/// Opens `room` on both sides, up to the prefill's WaitingForInput.
fn open_room(p: &mut Pair, room: u64) -> (Vec<u64>, Vec<u64>) {
    let src: Vec<u64> = (0..TOTAL.div_ceil(P)).map(|i| i * 7 % 64).collect();
    let dst: Vec<u64> = (0..TOTAL.div_ceil(P)).map(|i| i * 3 % 32 + 1).collect();
    let side = Side {
        layout: DcpLayout::sglang(P, 1).unwrap(),
        rank: 0,
        pages: &src,
        origin: 0,
    };
    p.p_pools.fill(room, &side, TOTAL);
    p.p_pools.fill_aux(room, 3);
    p.decode
        .receiver(room, 0, Some(Duration::from_secs(20)))
        .unwrap();
    p.decode.send_metadata(room, &dst, 0, 5).unwrap();
    p.prefill.sender(room).unwrap();
    let t = Instant::now();
    while p.prefill.poll(room) == KvPoll::Bootstrapping {
        assert!(t.elapsed() < Duration::from_secs(10), "no metadata");
        std::thread::sleep(Duration::from_millis(5));
    }
    (src, dst)
}

/// Sends the room and checks every byte on the decode.
fn finish_room(p: &mut Pair, room: u64, src: &[u64], dst: &[u64]) {
    p.prefill.send(room, src, TOTAL, true, 3).unwrap();
    assert_eq!(
        p.prefill.wait(room, Duration::from_secs(20)),
        KvPoll::Success,
        "{:?}",
        p.prefill.failure(room)
    );
    assert_eq!(
        p.decode.wait(room, Duration::from_secs(20)),
        KvPoll::Success,
        "{:?}",
        p.decode.failure(room)
    );
    let side = Side {
        layout: DcpLayout::sglang(P, 1).unwrap(),
        rank: 0,
        pages: dst,
        origin: 0,
    };
    assert!(p.d_pools.verify(room, &side, TOTAL, Some(5)).unwrap() > 0);
}

/// No reply names a process, an address or a region: the keys an answer may
/// carry are the challenge's and a refusal's.
fn assert_no_leak(text: &str, pids: &[u32]) {
    for word in [
        "pid",
        "identity",
        "regions",
        "nonce_addr",
        "data_addr",
        "127.0.0.1",
        "endpoints",
        "addr",
    ] {
        assert!(!text.contains(word), "a reply leaks {word:?}: {text}");
    }
    for pid in pids {
        // reasons are prose; nonces are hex of fixed length, checked separately
        assert!(
            !text.contains(&format!(" {pid}")),
            "a reply names pid {pid}: {text}"
        );
    }
}

fn ctl_replies(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn refusal_code(v: &Value) -> i64 {
    assert_eq!(v["type"], "status", "{v}");
    assert_eq!(v["ok"], false, "{v}");
    v["code"].as_i64().unwrap()
}

/// (a) a decode Hello with the attacker's data address is refused after the
/// challenge and the prefill never dials it (so it reads and writes no byte
/// of the canary the fake agent names); (c) unauthenticated Meta messages
/// with another prefix length leave the live room alone; (d) the only reply
/// besides a refusal is the challenge, which names no process or address.
#[test]
fn an_unprivileged_attacker_cannot_steer_the_prefill() {
    let mut p = pair();
    let mut canary = spawn_canary();
    let room = 41;
    let (src, dst) = open_room(&mut p, room);
    let reg = p.prefill.registration().unwrap();
    let d_reg = p.decode.registration().unwrap();
    let v = run_attacker(
        "child_ctl_attacker",
        &[
            ("ATTACK_CTL", reg.endpoints["ctl"].clone()),
            ("ATTACK_DATA", d_reg.endpoints["data"].clone()),
            (
                "ATTACK_HELLO",
                serde_json::to_string(&PeerHello::from(&d_reg)).unwrap(),
            ),
            ("ATTACK_CANARY", canary.info.to_string()),
            ("ATTACK_ROOM", room.to_string()),
        ],
    );
    assert_eq!(
        v["accepted"], 0,
        "the prefill dialed the attacker's data address: {v}"
    );
    let pids = [std::process::id(), canary.child.id()];
    let r = &v["replies"];
    for name in ["hello_fake_data_addr", "hello_real_data_addr", "meta_first"] {
        let text = r[name].as_str().unwrap();
        assert_no_leak(text, &pids);
        let msgs = ctl_replies(text);
        assert_eq!(msgs.len(), 1, "{name}: {text}");
        assert_eq!(
            refusal_code(&msgs[0]),
            Status::AuthRequired as i64,
            "{name}"
        );
    }
    for name in ["forged_proof", "open_mode"] {
        let text = r[name].as_str().unwrap();
        assert_no_leak(text, &pids);
        let msgs = ctl_replies(text);
        assert_eq!(
            msgs.len(),
            2,
            "{name}: the challenge and the refusal: {text}"
        );
        assert_eq!(msgs[0]["type"], "auth_challenge", "{name}");
        let mut keys: Vec<&String> = msgs[0]["auth"].as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["instance", "nonce", "proof", "version"], "{name}");
        assert_eq!(refusal_code(&msgs[1]), Status::AuthFailed as i64, "{name}");
    }
    let text = r["oversized_line"].as_str().unwrap();
    assert_eq!(refusal_code(&ctl_replies(text)[0]), Status::Protocol as i64);
    assert!(text.contains("4096"), "{text}");
    // the live room goes on as if nobody had tried, byte-exact
    assert_eq!(p.prefill.poll(room), KvPoll::WaitingForInput);
    finish_room(&mut p, room, &src, &dst);
    assert_eq!(canary.changed(), 0, "bytes of the canary process changed");
}

/// (b) the decode agent's data port: no write into a registered region, no
/// forged completion, no session, and nothing but the challenge or a refusal.
#[test]
fn an_unprivileged_attacker_cannot_write_a_decode_agent() {
    let mut p = pair();
    let room = 42;
    let (src, dst) = open_room(&mut p, room);
    let d_reg = p.decode.registration().unwrap();
    let kv = d_reg.regions.iter().find(|r| r.kind == "kv").unwrap();
    // page 0 of the first pool: where the attacker writes, never a room's page here
    assert!(!dst.contains(&0));
    let page0 = |p: &Pair| {
        let pool = p.d_pools.kv_pools()[0];
        // SAFETY: the pool is live host memory of at least one page, owned by `p`.
        unsafe { std::slice::from_raw_parts(pool.base as *const u8, pool.page_bytes as usize) }
            .to_vec()
    };
    assert_eq!(p.d_pools.kv_pools()[0].base, kv.addr);
    let before = page0(&p);
    let v = run_attacker(
        "child_data_attacker",
        &[
            ("ATTACK_DATA", d_reg.endpoints["data"].clone()),
            ("ATTACK_REGION", kv.id.to_string()),
        ],
    );
    let pids = [std::process::id()];
    let r = v["replies"].as_object().unwrap();
    assert_eq!(r.len(), 6, "{v}");
    for (name, got) in r {
        let text = got.to_string();
        assert_no_leak(&text, &pids);
        let frames = got["frames"].as_array().unwrap();
        let types: Vec<&str> = frames.iter().map(|f| f["type"].as_str().unwrap()).collect();
        let want: &[&str] = match name.as_str() {
            "forged_proof" | "open_mode" => &["AuthChallenge", "Error"],
            _ => &["Error"],
        };
        assert_eq!(types, want, "{name}: {text}");
        let e = wire::decode_error(
            frames.last().unwrap()["payload"]
                .as_str()
                .unwrap()
                .as_bytes(),
        );
        let code = match name.as_str() {
            "forged_proof" | "open_mode" => Status::AuthFailed,
            "oversized_first_frame" => Status::Protocol,
            _ => Status::AuthRequired,
        };
        assert_eq!(e.status(), code, "{name}: {e}");
    }
    // the decode's pools hold nothing of the attacker's, and the room lands
    assert_eq!(
        page0(&p),
        before,
        "the attacker wrote into the decode's KV pool"
    );
    finish_room(&mut p, room, &src, &dst);
    assert_eq!(page0(&p), before);
    // a second room still works: nothing was forged or failed meanwhile
    let (src, dst) = open_room(&mut p, room + 1);
    finish_room(&mut p, room + 1, &src, &dst);
}

/// The agent alone: refused attackers leave no session and no completion,
/// and the registered region keeps its bytes.
#[test]
fn an_unprivileged_attacker_forges_no_completion_on_an_agent() {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        secret: Some(SECRET.into()),
        ..Default::default()
    })
    .unwrap();
    let mut mem = vec![CANARY; 1 << 16];
    // SAFETY: `mem` outlives the agent (dropped after it at the end of the test).
    let d = unsafe { rx.register_host(mem.as_mut_ptr(), mem.len()) }.unwrap();
    let v = run_attacker(
        "child_data_attacker",
        &[
            ("ATTACK_DATA", rx.local_addr().unwrap().to_string()),
            ("ATTACK_REGION", d.id.to_string()),
        ],
    );
    assert_eq!(v["replies"].as_object().unwrap().len(), 6, "{v}");
    assert!(
        rx.next_completion(Duration::from_millis(300)).is_none(),
        "a completion was delivered for a refused peer"
    );
    assert_eq!(rx.sessions(), 0);
    assert!(mem.iter().all(|&b| b == CANARY), "the region was written");
    // a peer with the secret still gets in
    let tx = Agent::new(&AgentOptions {
        secret: Some(SECRET.into()),
        ..Default::default()
    })
    .unwrap();
    let t = tx
        .connect(
            &rx.local_addr().unwrap().to_string(),
            &ConnectOptions {
                transport: TransportKind::Tcp,
                expect_instance: Some(rx.instance()),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(t.kind(), TransportKind::Tcp);
    drop(t);
    drop(rx);
    drop(mem);
}

/// A decode with another secret (or none) is refused by name at its first
/// metadata, and the prefill's rooms are unaffected.
#[test]
fn a_decode_with_another_secret_is_refused_by_name() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let (prefill, _pp) = engine(Role::Prefill, &url, 64, Some(SECRET));
    let prefill = prefill.unwrap();
    let instance = prefill.registration().unwrap().instance_id.to_string();
    for token in [Some("another-cluster-secret-0123456789"), None] {
        let (decode, _dp) = engine(Role::Decode, &url, 32, token);
        let decode = decode.unwrap();
        // the control link is opened (and refused) when the room is
        let e = decode
            .receiver(9, 0, Some(Duration::from_secs(5)))
            .unwrap_err();
        assert_eq!(e.status(), Status::AuthFailed, "{e}");
        assert!(e.detail().contains(&instance), "names the prefill: {e}");
        assert!(e.detail().contains("prefill"), "{e}");
    }
    // a secret shorter than 16 bytes is refused at creation, naming the token
    let (e, _) = engine(Role::Decode, &url, 32, Some("short"));
    let e = e.unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.detail().contains("token"), "{e}");
}

/// Without a secret: loopback works (with the warning), a listener other
/// hosts can reach is refused with `auth_required` naming the address.
#[test]
fn without_a_secret_only_loopback_listeners() {
    let server = BootstrapServer::start(ServerConfig::default()).unwrap();
    let url = server.url();
    let pools = SyntheticPools::new(LAYERS, ROW, P, 8, 8, 32).unwrap();
    for role in [Role::Prefill, Role::Decode] {
        let mut cfg = EngineConfig::new(role, "open", &url, pools.topology(1, 0), pools.kv_pools());
        cfg.aux = pools.aux_buffers();
        cfg.host = "0.0.0.0".into();
        // SAFETY: `pools` outlives the (refused) engine.
        let e = unsafe { Engine::new(cfg) }.unwrap_err();
        assert_eq!(e.status(), Status::AuthRequired, "{role:?}: {e}");
        assert!(e.detail().contains("0.0.0.0"), "{e}");
        assert!(e.detail().contains("secret"), "{e}");
    }
    let e = Agent::new(&AgentOptions {
        listen: Some("0.0.0.0:0".into()),
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(e.status(), Status::AuthRequired, "{e}");
    // loopback in open mode: a room end to end
    let (prefill, p_pools) = engine(Role::Prefill, &url, 64, None);
    let (decode, d_pools) = engine(Role::Decode, &url, 32, None);
    let mut p = Pair {
        _server: server,
        prefill: prefill.unwrap(),
        p_pools,
        decode: decode.unwrap(),
        d_pools,
    };
    let (src, dst) = open_room(&mut p, 5);
    finish_room(&mut p, 5, &src, &dst);
}

/// `auto` does not pick cma for a same-host peer of another uid: tcp.
#[test]
fn auto_uses_tcp_for_a_peer_of_another_uid() {
    if !is_root() {
        common::skip("root", "starting a process of another uid needs root");
        return;
    }
    let mut target = Command::new(env!("CARGO_BIN_EXE_pdxfer"));
    target
        .args(["target", "--listen", "127.0.0.1:0", "--size", "65536"])
        .env_remove(pdxfer::transport::CLUSTER_SECRET_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        target.pre_exec(|| {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(NOBODY) != 0
                || libc::setuid(NOBODY) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut target = target.spawn().unwrap();
    let mut out = BufReader::new(target.stdout.take().unwrap());
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    let ready: Value = serde_json::from_str(&l).unwrap();
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let t = tx
        .connect(ready["addr"].as_str().unwrap(), &ConnectOptions::default())
        .unwrap();
    assert_eq!(
        t.kind(),
        TransportKind::Tcp,
        "auto chose cma into another uid"
    );
    drop(t);
    let _ = target.kill();
    let _ = target.wait();
}

/// Even a peer holding the secret cannot point the prefill at a data address
/// the bootstrap does not advertise for the instance it claims (refused with
/// `peer_identity` before anything is dialed), nor, claiming an instance the
/// bootstrap does not know, at another instance's data plane (that agent
/// authenticates as itself: `peer_identity` naming both ids).
#[test]
fn a_cluster_member_cannot_redirect_the_prefill() {
    use pdxfer::auth::{Mode, PeerInstance};
    use pdxfer::engine::control::{
        authenticate_to_prefill, CtlMsg, CtlReader, CtlWriter, CONTROL_VERSION,
    };
    let mut p = pair();
    let reg = p.prefill.registration().unwrap();
    let d_reg = p.decode.registration().unwrap();
    let decoy = TcpListener::bind("127.0.0.1:0").unwrap();
    decoy.set_nonblocking(true).unwrap();
    let mode = Mode::from_option(Some(SECRET)).unwrap();
    let mut unknown = PeerHello::from(&d_reg);
    unknown.instance_id = pdxfer::bootstrap::schema::InstanceId(7);
    for (hello, data_addr, want) in [
        (
            PeerHello::from(&d_reg),
            decoy.local_addr().unwrap().to_string(),
            "advertises",
        ),
        (
            unknown,
            d_reg.endpoints["data"].clone(),
            "has no bootstrap entry in cluster",
        ),
    ] {
        let s = TcpStream::connect(&reg.endpoints["ctl"]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let w = CtlWriter::new(s.try_clone().unwrap());
        let mut r = CtlReader::new(s);
        authenticate_to_prefill(
            &w,
            &mut r,
            &mode,
            hello.instance_id.0.to_be_bytes(),
            PeerInstance(reg.instance_id.0.to_be_bytes()),
            "test",
        )
        .unwrap();
        w.send(&CtlMsg::Hello {
            version: CONTROL_VERSION,
            hello,
            data_addr,
            regions: Default::default(),
            gpu: None,
        })
        .unwrap();
        match r.recv().unwrap() {
            Some(CtlMsg::Status {
                ok: false,
                code,
                reason,
                ..
            }) => {
                assert_eq!(code, Some(Status::PeerIdentity as i32), "{reason:?}");
                let reason = reason.unwrap();
                assert!(reason.contains(want), "{reason}");
                if want == "has no bootstrap entry in cluster" {
                    // refused before its data address is dialled: the claimed id named
                    assert!(reason.contains(&format!("{:032x}", 7)), "{reason}");
                    assert!(reason.contains("cannot be checked"), "{reason}");
                }
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    assert!(decoy.accept().is_err(), "the prefill dialed the decoy");
    // the real decode is unaffected
    let (src, dst) = open_room(&mut p, 77);
    finish_room(&mut p, 77, &src, &dst);
}
