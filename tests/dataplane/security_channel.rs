//! The data plane's trust boundary after the authentication exchange, against
//! real processes on loopback: (a) a fake agent run by another uid (65534
//! when the test runs as root, else the same uid) answers the data auth in
//! open mode and names a canary process in its HelloAck: cma is refused by
//! name (the kernel says who listens on the binding socket), `auto` never
//! picks it, and every byte of the canary is unchanged; (b) an on-path relay
//! process that passes the three auth messages through and rewrites the
//! HelloAck to name the canary is caught by the session MAC
//! (`channel_integrity`), with the secret configured; nothing reaches the
//! canary.

use crate::support::child::{self, report, Talker};
use pdxfer::auth::Mode;
use pdxfer::transport::peer_auth::authenticate_server;
use pdxfer::transport::wire::{self, FrameType};
use pdxfer::transport::{Agent, AgentOptions, ConnectOptions, TransportKind};
use pdxfer::Status;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::time::{Duration, Instant};

const SECRET: &str = "security-channel-secret-0123456789";
const CANARY: u8 = 0x5C;
const CHILD_ENV: &str = "PDXFER_SECURITY_CHANNEL_CHILD";

/// Re-runs this test binary for the ignored child test `name` (as uid/gid
/// 65534 when `nobody` and root), with `envs`; waits for its first report.
fn spawn(name: &str, envs: &[(&str, String)], nobody: bool) -> Talker {
    let mut c = child::command(module_path!(), name, CHILD_ENV, nobody);
    for (k, v) in envs {
        c.env(k, v);
    }
    Talker::spawn(c)
}

fn is_child(name: &str) -> bool {
    child::is_child(CHILD_ENV, name)
}

/// A process holding 64 KiB of canary bytes ([`child::run_canary`]).
#[test]
#[ignore = "child process of the security_channel tests"]
fn child_canary() {
    if is_child("child_canary") {
        child::run_canary(CANARY);
    }
}

fn canary_region(canary: &Value) -> Value {
    serde_json::to_value(pdxfer::memory::RegionDesc {
        id: 1,
        addr: canary["addr"].as_u64().unwrap(),
        len: canary["len"].as_u64().unwrap(),
        kind: pdxfer::memory::RegionKind::Host,
        keys: Default::default(),
    })
    .unwrap()
}

/// A fake data-plane agent (open mode) that authenticates properly, then
/// answers each Hello with the canary's identity and a region inside it,
/// advertising as its cma binding socket one it listens on itself
/// (`FAKE_SOCKET=own`) or none. Grants nothing. Ends by itself after 60 s.
#[test]
#[ignore = "child process of the security_channel tests"]
fn child_fake_agent() {
    if !is_child("child_fake_agent") {
        return;
    }
    let canary: Value = serde_json::from_str(&std::env::var("FAKE_CANARY").unwrap()).unwrap();
    let own = std::env::var("FAKE_SOCKET").as_deref() == Ok("own");
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = format!("pdxfer-test-fake-{}", std::process::id());
    let unix = std::os::unix::net::UnixListener::bind_addr(
        &std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap(),
    )
    .unwrap();
    report(json!({"addr": l.local_addr().unwrap().to_string(), "pid": std::process::id()}));
    l.set_nonblocking(true).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        let Ok((mut s, _)) = l.accept() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let Ok((_, mut keys)) = authenticate_server(&mut s, &Mode::Open, [0x66; 16]) else {
            continue;
        };
        let Ok((FrameType::Hello, _)) =
            wire::read_frame_sealed(&mut s, wire::MAX_CONTROL_PAYLOAD, &mut keys.recv)
        else {
            continue;
        };
        let ack = json!({
            "version": wire::VERSION, "identity": canary["identity"],
            "regions": [canary_region(&canary)], "session": 1, "token": "00",
            "cma_socket": if own { Value::from(name.clone()) } else { Value::Null },
        });
        let _ = wire::write_json_sealed(&mut s, FrameType::HelloAck, &ack, &mut keys.send);
        // whatever follows (a Select), answered as accepted
        if wire::read_frame_sealed(&mut s, wire::MAX_CONTROL_PAYLOAD, &mut keys.recv).is_ok() {
            let _ =
                wire::write_json_sealed(&mut s, FrameType::SelectOk, &json!({}), &mut keys.send);
        }
        let _ = unix.set_nonblocking(true);
        let _ = unix.accept();
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The sender, open mode, with one registered 4 KiB buffer.
fn sender(secret: Option<&str>) -> (Agent, Vec<u8>, u64) {
    let a = Agent::new(&AgentOptions {
        secret: secret.map(str::to_string),
        ..AgentOptions::default()
    })
    .unwrap();
    let mut buf = vec![0xAB; 4096];
    // SAFETY: buf lives as long as the agent in every test below (returned with it).
    let d = unsafe { a.registry().register_host(buf.as_mut_ptr(), buf.len()) }.unwrap();
    (a, buf, d.id)
}

fn connect(a: &Agent, addr: &str, transport: TransportKind) -> pdxfer::Result<TransportKind> {
    let t = a.connect(
        addr,
        &ConnectOptions {
            transport,
            timeout: Duration::from_secs(5),
            ..ConnectOptions::default()
        },
    )?;
    Ok(t.kind())
}

/// (a) A fake agent of another uid naming a canary: cma refused with
/// `peer_identity` naming the canary's pid and the fake's; without a
/// binding socket refused too; `auto` never picks cma; the canary unchanged.
#[test]
fn a_fake_agent_cannot_aim_cma_at_another_process() {
    let mut canary = spawn("child_canary", &[], false);
    let canary_pid = canary.info["identity"]["pid"].as_u64().unwrap();
    let (tx, _buf, _) = sender(None);
    for socket in ["own", "none"] {
        let fake = spawn(
            "child_fake_agent",
            &[
                ("FAKE_CANARY", canary.info.to_string()),
                ("FAKE_SOCKET", socket.to_string()),
            ],
            true,
        );
        let addr = fake.info["addr"].as_str().unwrap().to_string();
        let fake_pid = fake.info["pid"].as_u64().unwrap();
        let e = connect(&tx, &addr, TransportKind::Cma).unwrap_err();
        assert_eq!(e.status(), Status::PeerIdentity, "{socket}: {e}");
        if socket == "own" {
            assert!(
                e.detail().contains(&format!("pid {canary_pid}"))
                    && e.detail().contains(&format!("pid {fake_pid}")),
                "the refusal names both processes: {e}"
            );
        } else {
            assert!(e.detail().contains("binding socket"), "{e}");
        }
        // auto: never cma (tcp, whose setup the fake does not serve, or an error)
        if let Ok(kind) = connect(&tx, &addr, TransportKind::Auto) {
            assert_ne!(kind, TransportKind::Cma, "{socket}: auto picked cma");
        }
        assert_eq!(canary.changed(), 0, "{socket}: canary bytes changed");
    }
    assert_eq!(canary.changed(), 0, "canary bytes changed");
}

/// A relay (no secret) between a sender and a real agent: passes the auth
/// exchange and the Hello through, rewrites the HelloAck to name the canary
/// (identity and region; it cannot re-tag it), then pipes both ways. Ends by
/// itself after 60 s.
#[test]
#[ignore = "child process of the security_channel tests"]
fn child_relay() {
    if !is_child("child_relay") {
        return;
    }
    let canary: Value = serde_json::from_str(&std::env::var("RELAY_CANARY").unwrap()).unwrap();
    let upstream = std::env::var("RELAY_UPSTREAM").unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    report(json!({"addr": l.local_addr().unwrap().to_string()}));
    l.set_nonblocking(true).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        let Ok((mut c, _)) = l.accept() else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let canary = canary.clone();
        let upstream = upstream.clone();
        std::thread::spawn(move || {
            c.set_nonblocking(false).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut u = TcpStream::connect(&upstream).unwrap();
            u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let pass = |from: &mut TcpStream, to: &mut TcpStream| -> Option<Vec<u8>> {
                let mut h = [0u8; 12];
                from.read_exact(&mut h).ok()?;
                let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
                let mut p = vec![0u8; len];
                from.read_exact(&mut p).ok()?;
                to.write_all(&h).ok()?;
                to.write_all(&p).ok()?;
                Some(p)
            };
            // AuthHello, AuthChallenge, AuthProof, Hello: verbatim
            let (mut c2, mut u2) = (c.try_clone().unwrap(), u.try_clone().unwrap());
            if pass(&mut c, &mut u).is_none()
                || pass(&mut u2, &mut c2).is_none()
                || pass(&mut c, &mut u).is_none()
                || pass(&mut c, &mut u).is_none()
            {
                return;
            }
            // the HelloAck: payload rewritten, the tag kept
            let mut h = [0u8; 12];
            if u.read_exact(&mut h).is_err() {
                return;
            }
            let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
            let mut body = vec![0u8; len];
            if u.read_exact(&mut body).is_err() {
                return;
            }
            let tag = body.split_off(len - 16);
            let mut ack: Value = serde_json::from_slice(&body).unwrap();
            ack["identity"] = canary["identity"].clone();
            ack["regions"] = json!([canary_region(&canary)]);
            let mut p = serde_json::to_vec(&ack).unwrap();
            p.extend_from_slice(&tag);
            h[8..12].copy_from_slice(&(p.len() as u32).to_le_bytes());
            let _ = c.write_all(&h);
            let _ = c.write_all(&p);
            // then pipe both ways until either side closes
            let up = std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut u2);
            });
            let _ = std::io::copy(&mut u, &mut c);
            let _ = up.join();
        });
    }
}

/// (b) An on-path relay that rewrites the HelloAck after passing the auth
/// exchange: `channel_integrity` for cma, tcp and auto alike; nothing written
/// into the canary; a direct connection still works.
#[test]
fn a_relay_that_rewrites_the_hello_ack_is_caught() {
    let mut canary = spawn("child_canary", &[], false);
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        secret: Some(SECRET.into()),
        ..AgentOptions::default()
    })
    .unwrap();
    let mut rbuf = vec![0u8; 4096];
    // SAFETY: rbuf outlives the receiving agent (dropped after it below).
    unsafe { rx.registry().register_host(rbuf.as_mut_ptr(), rbuf.len()) }.unwrap();
    let upstream = rx.local_addr().unwrap().to_string();
    let relay = spawn(
        "child_relay",
        &[
            ("RELAY_CANARY", canary.info.to_string()),
            ("RELAY_UPSTREAM", upstream.clone()),
        ],
        true,
    );
    let addr = relay.info["addr"].as_str().unwrap().to_string();
    let (tx, _buf, _) = sender(Some(SECRET));
    for kind in [TransportKind::Cma, TransportKind::Tcp, TransportKind::Auto] {
        let e = connect(&tx, &addr, kind).unwrap_err();
        assert_eq!(e.status(), Status::ChannelIntegrity, "{kind:?}: {e}");
        assert_eq!(canary.changed(), 0, "{kind:?}: canary bytes changed");
    }
    // the same sender, directly: fine
    assert!(connect(&tx, &upstream, TransportKind::Tcp).is_ok());
    assert_eq!(canary.changed(), 0, "canary bytes changed");
    drop(rx);
    drop(rbuf);
}
