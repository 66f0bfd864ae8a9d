//! `pdxfer target`: a receiving peer for tests and `pdxfer bench`.
//!
//! Registers `--regions` zero-filled host regions of `--size` bytes each,
//! listens, prints one JSON line `{"ready":true,"addr":..,"pid":..,"regions":[..]}`,
//! then one JSON line per completion record received. Commands on stdin:
//! `dump PATH` (write every region, in id order, to PATH), `unregister ID
//! [TIMEOUT_MS]` (answers `{"unregistered":ID,"ok":..}`), `stats` (sessions
//! and connections), `grant INSTANCE ROOM EPOCH MS` (grants the instance,
//! 32 hex digits, every region for the room; answers `{"grant":..}`), `quit`;
//! end of stdin also quits.

use clap::Args;
use pdxfer::transport::listen::ListenLimits;
use pdxfer::transport::{Agent, AgentOptions};
use std::io::{BufRead, Write};
use std::time::Duration;

/// Arguments of `pdxfer target`.
#[derive(Args, Debug)]
pub struct TargetArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Bytes per region.
    #[arg(long, default_value_t = 64 << 20)]
    pub size: usize,
    /// Number of regions.
    #[arg(long, default_value_t = 1)]
    pub regions: usize,
    /// Test knob (testing builds only): sleep this many ms before validating
    /// each new batch (a stalled peer).
    #[cfg(feature = "testing")]
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Do not print a line per completion (benchmarks).
    #[arg(long)]
    pub quiet: bool,
    /// Connections waiting for their first frame (when full, the oldest of
    /// the source holding the most is closed).
    #[arg(long, default_value_t = ListenLimits::default().max_pending)]
    pub max_pending: usize,
    /// Connections in their handshake at once (when full, the oldest of the
    /// source holding the most is shut down for the newcomer).
    #[arg(long, default_value_t = ListenLimits::default().max_handshakes)]
    pub max_handshakes: usize,
    /// Connections one source (all of loopback per uid) holds in the poll set
    /// or in handshakes before its oldest (past 1 s) is closed for its newcomer.
    #[arg(long, default_value_t = ListenLimits::default().max_per_source)]
    pub max_per_source: usize,
    /// Live connections (the excess is refused).
    #[arg(long, default_value_t = ListenLimits::default().max_connections)]
    pub max_connections: usize,
    /// Milliseconds a connection may take to send its first frame.
    #[arg(long, default_value_t = 10_000)]
    pub first_frame_timeout_ms: u64,
    /// Milliseconds each handshake frame may take.
    #[arg(long, default_value_t = 10_000)]
    pub handshake_timeout_ms: u64,
    /// Milliseconds of silence after which a sender's session is closed.
    #[arg(long, default_value_t = 120_000)]
    pub idle_timeout_ms: u64,
    /// Milliseconds a batch may pin a region (a piece in progress, a grant).
    #[arg(long, default_value_t = 60_000)]
    pub pin_timeout_ms: u64,
    /// Register plain heap buffers instead of shared (memfd) regions: cma
    /// peers then write with process_vm_writev instead of memcpy.
    #[arg(long)]
    pub heap: bool,
}

/// Touches every page so the first transfer does not pay the page faults.
pub fn prefault(b: &mut [u8]) {
    for i in (0..b.len()).step_by(4096) {
        // SAFETY: i < b.len(); a volatile write of the value already there (zero) only faults the page in.
        unsafe { std::ptr::write_volatile(b.as_mut_ptr().add(i), 0) };
    }
}

/// Runs the target until `quit` or end of stdin.
pub fn run(a: &TargetArgs) -> pdxfer::Result<()> {
    let agent = Agent::new(&AgentOptions {
        listen: Some(a.listen.clone()),
        #[cfg(feature = "testing")]
        testing: pdxfer::transport::TestKnobs {
            stall: Duration::from_millis(a.stall_ms),
            ..Default::default()
        },
        limits: ListenLimits {
            max_pending: a.max_pending,
            max_handshakes: a.max_handshakes,
            max_per_source: a.max_per_source,
            max_connections: a.max_connections,
            first_message_timeout: Duration::from_millis(a.first_frame_timeout_ms),
            ..ListenLimits::default()
        },
        handshake_timeout: Duration::from_millis(a.handshake_timeout_ms),
        idle_timeout: Duration::from_millis(a.idle_timeout_ms),
        pin_timeout: Duration::from_millis(a.pin_timeout_ms),
        ..Default::default()
    })?;
    let n = a.regions.max(1);
    let mut bufs: Vec<Vec<u8>> = if a.heap {
        (0..n).map(|_| vec![0u8; a.size]).collect()
    } else {
        Vec::new()
    };
    let mut descs = Vec::new();
    for b in &mut bufs {
        prefault(b);
        // SAFETY: the buffers live until this function returns, after the agent is shut down.
        descs.push(unsafe { agent.register_host(b.as_mut_ptr(), b.len()) }?);
    }
    if !a.heap {
        for _ in 0..n {
            descs.push(agent.registry().alloc_shared(a.size)?);
        }
    }
    let ready = serde_json::json!({
        "ready": true,
        "addr": agent.local_addr().map(|s| s.to_string()),
        "pid": std::process::id(),
        "regions": descs,
    });
    println!("{ready}");
    std::io::stdout().flush()?;
    let quiet = a.quiet;
    let agent = std::sync::Arc::new(agent);
    let ag = agent.clone();
    std::thread::spawn(move || loop {
        if let Some(inc) = ag.next_completion(Duration::from_millis(200)) {
            if !quiet {
                let line = serde_json::json!({
                    "completion": inc.completion,
                    "peer_pid": inc.peer.pid,
                    "session": inc.session,
                });
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "{line}");
                let _ = o.flush();
            }
        } else if std::sync::Arc::strong_count(&ag) == 1 {
            return;
        }
    });
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        let mut it = line.split_whitespace();
        match (it.next(), it.next()) {
            (Some("dump"), Some(path)) => {
                let mut f = std::fs::File::create(path)?;
                for d in &descs {
                    let g = agent.registry().acquire(d.id, 0, d.len)?;
                    // SAFETY: the guard pins the registered region [addr, addr+len) while we read it.
                    let b = unsafe {
                        std::slice::from_raw_parts(g.addr() as *const u8, d.len as usize)
                    };
                    f.write_all(b)?;
                }
                f.sync_all()?;
                println!("{}", serde_json::json!({"dumped": path}));
            }
            (Some("unregister"), Some(id)) => {
                let ms = it.next().and_then(|t| t.parse().ok()).unwrap_or(1000);
                let r = id
                    .parse::<u64>()
                    .map_err(|e| pdxfer::Error::invalid(format!("region id {id:?}: {e}")))
                    .and_then(|id| agent.registry().unregister(id, Duration::from_millis(ms)));
                println!(
                    "{}",
                    serde_json::json!({"unregistered": id, "ok": r.is_ok(),
                        "error": r.err().map(|e| e.to_string())})
                );
            }
            (Some("grant"), Some(instance)) => {
                let r = grant(&agent, &descs, instance, &mut it);
                println!(
                    "{}",
                    serde_json::json!({"grant": r.as_ref().ok(),
                        "error": r.err().map(|e| e.to_string())})
                );
            }
            (Some("stats"), _) => println!(
                "{}",
                serde_json::json!({"sessions": agent.sessions(), "connections": agent.connections()})
            ),
            (Some("quit"), _) => break,
            (None, _) => {}
            _ => println!(
                "{}",
                serde_json::json!({"error": format!("unknown command {line:?}")})
            ),
        }
        std::io::stdout().flush()?;
    }
    agent.shutdown();
    for d in descs {
        let _ = agent.registry().unregister(d.id, Duration::from_secs(5));
    }
    drop(bufs);
    Ok(())
}

/// `grant INSTANCE ROOM EPOCH MS`: a room grant of every region to `instance`.
fn grant<'a>(
    agent: &Agent,
    descs: &[pdxfer::memory::RegionDesc],
    instance: &str,
    rest: &mut impl Iterator<Item = &'a str>,
) -> pdxfer::Result<pdxfer::transport::room::RoomGrant> {
    let bad = || pdxfer::Error::invalid("usage: grant INSTANCE(32 hex) ROOM EPOCH MS");
    let id = u128::from_str_radix(instance, 16).map_err(|_| bad())?;
    let mut num =
        || -> pdxfer::Result<u64> { rest.next().and_then(|v| v.parse().ok()).ok_or_else(bad) };
    let (room, epoch, ms) = (num()?, num()?, num()?);
    let ranges: Vec<_> = descs
        .iter()
        .map(|d| pdxfer::transport::room::GrantRange {
            region: d.id,
            offset: 0,
            len: d.len,
        })
        .collect();
    agent.grant_room(
        pdxfer::auth::PeerInstance(id.to_be_bytes()),
        room,
        epoch,
        &ranges,
        Duration::from_millis(ms),
    )
}
