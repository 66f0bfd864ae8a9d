//! `pdxfer rank`: a small stand-in for one engine rank, for end-to-end tests
//! and demos of the bootstrap. It registers (keeping its lease alive), serves
//! a TCP hello endpoint that answers with its [`PeerHello`], and obeys
//! commands read from stdin, one per line:
//!
//! - `pair` (decode): resolve the prefill targets (cached after the first
//!   time, as an engine would), handshake each one, verify it with
//!   [`verify_peer`] and send a payload only if it passes;
//! - `refresh`: forget the cached targets;
//! - `peers` (prefill): list the decode entries that pair with this rank;
//! - `summary prefill|decode`: print the bootstrap's summary;
//! - `quit`: deregister and exit.
//!
//! Every outcome is one JSON line on stdout (`{"event": ...}`).

use clap::Args;
use pdxfer::bootstrap::{
    decode_peers, open_store, prefill_targets, verify_peer, InstanceId, PeerHello, Registrar,
    Registration, Role, Store, Target,
};
use pdxfer::error::{Error, Result, Status};
use pdxfer::layout::Topology;
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Arguments of `pdxfer rank`.
#[derive(Args, Debug)]
pub struct RankArgs {
    /// Bootstrap store: http://HOST:PORT or etcd://HOST:PORT/NAMESPACE.
    #[arg(long)]
    store: String,
    /// Shared bootstrap token.
    #[arg(long, env = "PDXFER_BOOTSTRAP_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Cluster name.
    #[arg(long)]
    cluster: String,
    /// prefill or decode.
    #[arg(long)]
    role: String,
    /// Attention TP size.
    #[arg(long, default_value_t = 1)]
    tp_size: u32,
    /// Attention TP rank (also the engine rank).
    #[arg(long, default_value_t = 0)]
    tp_rank: u32,
    /// Attention CP size.
    #[arg(long, default_value_t = 1)]
    cp_size: u32,
    /// Attention CP rank.
    #[arg(long, default_value_t = 0)]
    cp_rank: u32,
    /// Pipeline size.
    #[arg(long, default_value_t = 1)]
    pp_size: u32,
    /// Pipeline rank.
    #[arg(long, default_value_t = 0)]
    pp_rank: u32,
    /// DCP size.
    #[arg(long, default_value_t = 1)]
    dcp_size: u32,
    /// DCP rank.
    #[arg(long, default_value_t = 0)]
    dcp_rank: u32,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    page_size: u32,
    /// KV entries (MLA layers).
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// Bytes of one token row per layer.
    #[arg(long, default_value_t = 1152)]
    row_bytes: u64,
    /// Lease time-to-live in milliseconds.
    #[arg(long, default_value_t = 3000)]
    ttl_ms: u64,
    /// Serve the hello endpoint on this address (published as endpoint "hello").
    #[arg(long)]
    hello: Option<String>,
    /// Do not register (serve the hello endpoint only).
    #[arg(long)]
    no_register: bool,
    /// Bytes sent to each verified prefill target by `pair`.
    #[arg(long, default_value_t = 4096)]
    payload_bytes: usize,
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    // A closed stdout only loses the report; the rank keeps its behaviour.
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn err_json(e: &Error) -> serde_json::Value {
    json!({"kind": e.kind(), "code": e.status() as i32, "detail": e.detail()})
}

fn topology(a: &RankArgs) -> Topology {
    let mut t = Topology::single_mla(a.page_size, a.layers, a.row_bytes);
    t.engine_rank = a.tp_rank;
    t.attn_tp_size = a.tp_size;
    t.attn_tp_rank = a.tp_rank;
    t.attn_cp_size = a.cp_size;
    t.attn_cp_rank = a.cp_rank;
    t.pp_size = a.pp_size;
    t.pp_rank = a.pp_rank;
    t.dcp_size = a.dcp_size;
    t.dcp_rank = a.dcp_rank;
    t
}

/// What the hello endpoint answers with: the registrar's current entry.
type HelloSource = Arc<Mutex<Option<Registrar>>>;

fn serve_hello(listener: TcpListener, me: HelloSource, fallback: Registration) {
    for conn in listener.incoming() {
        let Ok(mut s) = conn else { continue };
        let hello = me
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(Registrar::hello))
            .unwrap_or_else(|| PeerHello::from(&fallback));
        std::thread::spawn(move || {
            if let Err(e) = answer(&mut s, &hello) {
                emit(json!({"event": "hello_error", "error": err_json(&e)}));
            }
        });
    }
}

fn answer(s: &mut TcpStream, hello: &PeerHello) -> Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let line = serde_json::to_string(hello).map_err(|e| Error::invalid(e.to_string()))?;
    s.write_all(format!("{line}\n").as_bytes())?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut cmd = String::new();
    r.read_line(&mut cmd)?;
    let v: serde_json::Value = serde_json::from_str(cmd.trim())
        .map_err(|e| Error::new(Status::Protocol, format!("bad command line: {e}")))?;
    match v["cmd"].as_str() {
        Some("send") => {
            let n = v["bytes"].as_u64().unwrap_or(0) as usize;
            let mut buf = vec![0u8; n];
            r.read_exact(&mut buf)?;
            s.write_all(format!("{}\n", json!({"ok": true, "received": n})).as_bytes())?;
            emit(json!({"event": "received", "bytes": n, "from_instance": v["from"]}));
        }
        _ => emit(json!({"event": "aborted", "kind": v["kind"], "from_instance": v["from"]})),
    }
    Ok(())
}

/// Connects to a target's hello endpoint, verifies it and sends the payload
/// only when it passes.
fn handshake(target: &Registration, local: &Registration, payload: &[u8]) -> Result<()> {
    let addr = target.endpoints.get("hello").ok_or_else(|| {
        Error::new(
            Status::PeerUnreachable,
            format!("entry [{}] has no hello endpoint", target.describe()),
        )
    })?;
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| Error::invalid(format!("cannot resolve {addr}")))?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let hello: PeerHello = pdxfer::bootstrap::schema::from_json(line.as_bytes(), "peer hello")
        .map_err(|e| Error::new(Status::Protocol, e.detail().to_string()))?;
    match verify_peer(target, &hello, local) {
        Ok(_) => {
            let cmd = json!({"cmd": "send", "bytes": payload.len(), "from": local.instance_id});
            s.write_all(format!("{cmd}\n").as_bytes())?;
            s.write_all(payload)?;
            let mut ack = String::new();
            r.read_line(&mut ack)?;
            if !ack.contains("\"ok\":true") {
                return Err(Error::new(
                    Status::Protocol,
                    format!("peer did not acknowledge: {ack:?}"),
                ));
            }
            Ok(())
        }
        Err(e) => {
            let cmd = json!({"cmd": "abort", "kind": e.kind(), "from": local.instance_id});
            // The refusal is the result; failing to tell the peer changes nothing.
            let _ = s.write_all(format!("{cmd}\n").as_bytes());
            Err(e)
        }
    }
}

/// Runs the rank until `quit` or the end of stdin.
pub fn run(a: &RankArgs) -> Result<()> {
    let role = Role::parse(&a.role)?;
    let store: Arc<dyn Store> = open_store(&a.store, a.token.as_deref())?;
    let mut reg = Registration::new(&a.cluster, role, InstanceId::random()?, topology(a));
    let source: HelloSource = Arc::new(Mutex::new(None));
    if let Some(h) = &a.hello {
        let l = TcpListener::bind(h)?;
        reg.endpoints
            .insert("hello".into(), l.local_addr()?.to_string());
        let (src, fallback) = (source.clone(), reg.clone());
        std::thread::spawn(move || serve_hello(l, src, fallback));
    }
    if !a.no_register {
        let r = Registrar::start(store.clone(), reg, Duration::from_millis(a.ttl_ms))?;
        reg = r.registration();
        let ack = r.ack();
        *source
            .lock()
            .map_err(|_| Error::invalid("hello lock poisoned"))? = Some(r);
        emit(
            json!({"event": "registered", "instance_id": reg.instance_id, "epoch": ack.epoch,
            "lease_id": ack.lease_id, "replaced": ack.replaced, "key": reg.key().to_string(),
            "endpoints": reg.endpoints}),
        );
    } else {
        emit(
            json!({"event": "serving", "instance_id": reg.instance_id, "endpoints": reg.endpoints}),
        );
    }
    let payload: Vec<u8> = (0..a.payload_bytes).map(|i| (i % 251) as u8).collect();
    let mut cache: Option<Vec<Target>> = None;
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["pair"] => {
                if cache.is_none() {
                    match prefill_targets(store.as_ref(), &reg, 0) {
                        Ok(t) => cache = Some(t),
                        Err(e) => {
                            emit(json!({"event": "pair_failed", "error": err_json(&e)}));
                            continue;
                        }
                    }
                }
                let mut paired = Vec::new();
                let mut refused = Vec::new();
                for t in cache.iter().flatten().filter(|t| !t.dummy) {
                    let p = &t.registration;
                    match handshake(p, &reg, &payload) {
                        Ok(()) => paired.push(json!({"key": p.key().to_string(),
                            "instance_id": p.instance_id, "epoch": p.epoch})),
                        Err(e) => {
                            refused.push(json!({"key": p.key().to_string(),
                            "instance_id": p.instance_id, "epoch": p.epoch, "error": err_json(&e)}))
                        }
                    }
                }
                emit(json!({"event": "pair", "paired": paired, "refused": refused}));
            }
            ["refresh"] => cache = None,
            ["peers"] => match decode_peers(store.as_ref(), &reg) {
                Ok(ps) => {
                    let list: Vec<_> = ps
                        .iter()
                        .map(|p| {
                            json!({"key": p.key().to_string(), "instance_id": p.instance_id,
                            "epoch": p.epoch, "dcp_rank": p.topology.dcp_rank})
                        })
                        .collect();
                    emit(json!({"event": "peers", "decode": list}));
                }
                Err(e) => emit(json!({"event": "peers_failed", "error": err_json(&e)})),
            },
            ["summary", r] => match Role::parse(r).and_then(|r| store.summary(&a.cluster, r)) {
                Ok(s) => emit(json!({"event": "summary", "summary": s})),
                Err(e) => emit(json!({"event": "summary_failed", "error": err_json(&e)})),
            },
            ["quit"] => {
                let r = source
                    .lock()
                    .map_err(|_| Error::invalid("hello lock poisoned"))?
                    .take();
                if let Some(r) = r {
                    r.deregister()?;
                }
                emit(json!({"event": "bye"}));
                return Ok(());
            }
            [] => {}
            _ => emit(json!({"event": "unknown_command", "line": line})),
        }
    }
    Ok(())
}
