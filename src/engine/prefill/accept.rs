//! The prefill's control listener and one connection per decode rank: the
//! handshake (authentication, hello, pair checks, the data connection and
//! its write path), then the decode's metadata, aborts and NCCL answers
//! until it disconnects.

use super::{MetaInfo, Prefill};
use crate::auth::{Channel, PeerInstance, SessionKeys};
use crate::bootstrap::peer::check_pair;
use crate::bootstrap::schema::{PeerHello, Role};
use crate::engine::control::{
    install, is_older_peer, refusal, CtlAuth, CtlMsg, CtlReader, CtlWriter, CONTROL_VERSION,
};
use crate::engine::gpu_identity::{local_gpu, refuse_same_gpu};
use crate::engine::link::DecodeLink;
use crate::engine::path::Conn;
use crate::engine::room_grants::room_ranges;
use crate::engine::state::{catch, lock};
use crate::error::{Error, Result, Status};
use crate::transport::auth_exchange::{AuthCodec, AuthExchange};
use crate::transport::listen::{self, Framing, ListenStats, Slot};
use crate::transport::{ConnectOptions, TransportKind};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

pub(in crate::engine) fn accept_loop(w: Weak<Prefill>, l: TcpListener) {
    let Some((limits, mode, instance)) = w.upgrade().map(|i| {
        (
            i.cfg.listen_limits,
            i.agent.auth().clone(),
            i.agent.instance().0,
        )
    }) else {
        return;
    };
    let stop = {
        let w = w.clone();
        move || w.upgrade().is_none_or(|i| i.closed.load(Ordering::Acquire))
    };
    let stats = ListenStats::default();
    let refuse = |why: &str| CtlAuth.refusal(&Error::new(Status::Protocol, why));
    // Authentication first, in the listener's poll loop (no thread): nothing
    // else is read, allocated or said before the exchange succeeds, and a
    // decode that stalls in the middle holds only an evictable place.
    listen::serve_exchange(
        l,
        limits,
        Framing::Line,
        stats,
        stop,
        refuse,
        || AuthExchange::new(mode.clone(), Channel::Control, instance, CtlAuth),
        |s, rest, peer, slot| {
            let w2 = w.clone();
            let _ = crate::threads::spawn("pdxfer-ctl-p".into(), move || {
                prefill_conn(w2, s, rest, peer, slot)
            });
        },
    );
}

/// A peer's label in the metrics: its rank key (`dp0-tp1-cp0-pp0`), which
/// names one rank of a cluster and role.
pub(super) fn peer_label(h: &PeerHello) -> String {
    crate::bootstrap::schema::RankKey {
        dp: h.dp_rank,
        tp: h.topology.attn_tp_rank,
        cp: h.topology.attn_cp_rank,
        pp: h.topology.pp_rank,
    }
    .to_string()
}

/// Prefill: one decode rank's control connection, authenticated by the
/// listener as `peer` with the connection's keys; `rest` is what the
/// listener read after the proof (the start of the Hello, perhaps).
fn prefill_conn(
    w: Weak<Prefill>,
    s: TcpStream,
    rest: Vec<u8>,
    peer: (PeerInstance, SessionKeys),
    mut slot: Slot,
) {
    let _ = s.set_nodelay(true);
    let (Ok(ws), Ok(rs)) = (s.try_clone(), s.try_clone()) else {
        return;
    };
    let handshake = w.upgrade().map(|i| i.cfg.handshake_timeout);
    let _ = s.set_write_timeout(handshake);
    let writer = CtlWriter::new(ws);
    let mut reader = CtlReader::with_prefix(rs, rest);
    let addr = s
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    let (peer, keys) = peer;
    install(
        &writer,
        &mut reader,
        keys,
        &format!("decode instance {peer} at {addr}"),
    );
    let _ = s.set_read_timeout(handshake);
    let hello_msg = reader.recv_first();
    let _ = s.set_read_timeout(None);
    let (version, hello, data_addr, regions, peer_gpu) = match hello_msg {
        Ok(Some(CtlMsg::Hello {
            version,
            hello,
            data_addr,
            regions,
            gpu,
        })) => (version, hello, data_addr, regions, gpu),
        Ok(other) => {
            let _ = writer.send(&refusal(&Error::new(
                Status::Protocol,
                format!("expected hello first, got {other:?}"),
            )));
            return;
        }
        Err(e) => {
            log::warn!("prefill control channel: refused decode {peer} at {addr}: {e}");
            if is_older_peer(&e) {
                // an older decode reads only bare lines: the refusal goes bare
                let mut line = serde_json::to_vec(&refusal(&e)).unwrap_or_default();
                line.push(b'\n');
                let _ = std::io::Write::write_all(&mut &s, &line);
            } else {
                let _ = writer.send(&refusal(&e));
            }
            return;
        }
    };
    let Some(inner) = w.upgrade() else { return };
    let local_gpu = local_gpu(&inner.cfg);
    let setup = catch("control handshake", || {
        if u128::from_be_bytes(peer.0) != hello.instance_id.0 {
            return Err(Error::new(
                Status::PeerIdentity,
                format!(
                    "the decode authenticated as instance {peer} but its hello names instance {}",
                    hello.instance_id
                ),
            ));
        }
        if version != CONTROL_VERSION {
            let why = if version < 3 {
                " (before 3 a decode cannot say its KV pools' page strides)"
            } else {
                ""
            };
            return Err(Error::new(
                Status::Protocol,
                format!(
                    "decode instance {peer} speaks control protocol {version}, this build speaks control protocol {CONTROL_VERSION}{why}; run the same pdxfer version on every rank"
                ),
            ));
        }
        let local = lock(&inner.registrar)
            .as_ref()
            .map(|r| r.registration())
            .ok_or_else(|| Error::new(Status::EngineClosed, "closing"))?;
        let mut peer = local.clone();
        peer.role = Role::Decode;
        peer.topology = hello.topology.clone();
        peer.instance_id = hello.instance_id;
        peer.epoch = hello.epoch;
        peer.registered_at_ms = hello.registered_at_ms;
        check_pair(&local, &peer)?;
        check_advertised(&*inner.store, &local.cluster, &hello, &data_addr)?;
        refuse_same_gpu(
            inner.cfg.transport,
            local_gpu.as_ref(),
            peer_gpu.as_ref(),
            &format!("decode instance {}", hello.instance_id),
        )?;
        // the decode's page strides: whole pages, one step for all its pools
        regions.page_step(&hello.topology)?;
        Ok(local)
    });
    let local = match setup {
        Ok(l) => l,
        Err(e) => {
            let _ = writer.send(&refusal(&e));
            return;
        }
    };
    let data = match inner.agent.connect(
        &data_addr,
        &ConnectOptions {
            transport: inner.cfg.data_transport(),
            keepalive: inner.cfg.keepalive,
            // the decode's data plane must be the instance this channel authenticated
            expect_instance: Some(peer),
            // a worker writes a chunk to every decode rank, then waits for them all
            fan_out: true,
            ..Default::default()
        },
    ) {
        Ok(d) => d,
        Err(e) => {
            let _ = writer.send(&refusal(&e));
            return;
        }
    };
    if data.kind() == TransportKind::Cma
        && data
            .remote_regions()
            .iter()
            .any(|r| matches!(r.kind, crate::memory::RegionKind::Device { .. }))
    {
        data.close();
        let _ = writer.send(&refusal(&Error::new(
            Status::Unsupported,
            format!(
                "decode {} has KV pools in CUDA device memory, which cma (process_vm_writev) cannot write; use tcp, rdma or auto on the prefill",
                hello.instance_id
            ),
        )));
        return;
    }
    let counters = inner.metrics.peer(data.kind().name(), peer_label(&hello));
    let conn = Conn::new(&inner, Arc::from(data), &regions, hello.instance_id, true);
    let link = Arc::new(DecodeLink {
        hello,
        regions,
        writer,
        conn: Mutex::new(conn),
        data_addr,
        alive: AtomicBool::new(true),
        counters,
    });
    if link
        .writer
        .send(&CtlMsg::HelloAck {
            version: CONTROL_VERSION,
            hello: PeerHello::from(&local),
            gpu: local_gpu,
        })
        .is_err()
    {
        return;
    }
    slot.established();
    let _ = s.set_write_timeout(None);
    lock(&inner.decode_links).push(link.clone());
    if inner.cfg.transport == TransportKind::Nccl {
        // the link's communicator opens now, not inside its first room
        crate::engine::path::nccl::send::keep_open(&inner, &link);
    }
    drop(inner);
    loop {
        let msg = reader.recv();
        let Some(inner) = w.upgrade() else { return };
        match msg {
            Ok(Some(CtlMsg::Meta {
                room,
                attempt,
                dst_pages,
                decode_prefix_len,
                aux_index,
                state_indices,
                required_dst_info_num,
                grant,
                ..
            })) => {
                // a data link broken by the last room is made again for this one
                inner.redial_if_broken(&link);
                // the grant covers the rows this Meta names, computed as the decode did
                let grant = grant.and_then(|g| {
                    match room_ranges(
                        &link.regions,
                        &link.hello.topology,
                        &dst_pages,
                        aux_index,
                        &state_indices,
                    ) {
                        Ok(r) => Some(g.with_ranges(room, r)),
                        Err(e) => {
                            log::warn!("room {room}: cannot open the decode's grant ({e}); writing with per-batch grants");
                            None
                        }
                    }
                });
                inner.add_meta(
                    room,
                    MetaInfo {
                        link: link.clone(),
                        attempt,
                        dst_pages,
                        prefix: decode_prefix_len,
                        aux_index,
                        state_indices,
                        required: required_dst_info_num,
                        bytes: 0,
                        arrived: Instant::now(),
                        grant,
                        dummy: false,
                    },
                );
            }
            Ok(Some(CtlMsg::DummyMeta {
                room,
                attempt,
                decode_prefix_len,
            })) => {
                inner.add_meta(
                    room,
                    MetaInfo {
                        link: link.clone(),
                        attempt,
                        dst_pages: Vec::new(),
                        prefix: decode_prefix_len,
                        aux_index: 0,
                        state_indices: Vec::new(),
                        required: 0,
                        bytes: 0,
                        arrived: Instant::now(),
                        grant: None,
                        dummy: true,
                    },
                );
            }
            Ok(Some(CtlMsg::Abort { room, attempt })) if lock(&inner.rooms).get(room).is_ok() => {
                let local_attempt = lock(&inner.rooms).get(room).map(|r| r.attempt).unwrap_or(0);
                let fenced = lock(&inner.rooms)
                    .abort(room, local_attempt)
                    .unwrap_or(true);
                inner.cv.notify_all();
                if fenced {
                    let _ = link.writer.send(&CtlMsg::AbortAck { room, attempt });
                } else if let Some(r) = lock(&inner.prefill_rooms).get_mut(&room) {
                    r.abort_pending.push((link.clone(), attempt));
                }
            }
            Ok(Some(CtlMsg::Abort { room, attempt })) => {
                let _ = link.writer.send(&CtlMsg::AbortAck { room, attempt });
            }
            Ok(Some(m @ (CtlMsg::NcclAccepted { .. } | CtlMsg::NcclReady { .. }))) => {
                let key = (link.hello.instance_id, link.hello.epoch);
                inner.nccl.answer(key, m);
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                link.alive.store(false, Ordering::Release);
                link.data().close();
                // a line that failed its MAC: the decode is told why (sealed,
                // so it knows the reason is this prefill's), then dropped
                let integrity = match msg {
                    Err(e) if e.status() == Status::ChannelIntegrity => {
                        log::warn!("prefill control channel: {e}");
                        // bounded: a relay that stops reading cannot hold this thread
                        let _ = s.set_write_timeout(handshake);
                        let _ = link.writer.send(&refusal(&e));
                        link.writer.shutdown();
                        Some(e)
                    }
                    _ => None,
                };
                // rooms waiting on this decode rank fail; others go on
                let pr = lock(&inner.prefill_rooms);
                let hit: Vec<(u64, u64)> = pr
                    .iter()
                    .filter(|(_, r)| r.infos.iter().any(|m| Arc::ptr_eq(&m.link, &link)))
                    .map(|(id, r)| (*id, r.attempt))
                    .collect();
                drop(pr);
                for (room, a) in hit {
                    let e = integrity.clone().unwrap_or_else(|| {
                        Error::new(
                            Status::PeerUnreachable,
                            format!(
                                "decode rank instance {} (dcp_rank {}) disconnected",
                                link.hello.instance_id, link.hello.topology.dcp_rank
                            ),
                        )
                    });
                    inner.fail_room(room, a, e);
                }
                lock(&inner.decode_links).retain(|l| !Arc::ptr_eq(l, &link));
                return;
            }
        }
    }
}

/// The decode's bootstrap entry for the instance the control channel
/// authenticated (current or stale) must advertise the data address it gave:
/// the prefill dials only the data plane the bootstrap names for that
/// instance. It fails closed: an instance with no entry in the cluster
/// (never registered, or its entry expired), or a bootstrap that cannot be
/// read, is refused, since the data address then cannot be checked.
fn check_advertised(
    store: &dyn crate::bootstrap::Store,
    cluster: &str,
    hello: &PeerHello,
    data_addr: &str,
) -> Result<()> {
    let view = store.view(cluster, Role::Decode).map_err(|e| {
        Error::new(
            e.status(),
            format!(
                "cannot read the decode entries of cluster {cluster:?} ({}) to check decode instance {}'s data address: {}",
                store.describe(),
                hello.instance_id,
                e.detail()
            ),
        )
    })?;
    let Some(entry) = view
        .current
        .values()
        .chain(view.stale.iter())
        .find(|r| r.instance_id == hello.instance_id)
    else {
        return Err(Error::new(
            Status::PeerIdentity,
            format!(
                "decode instance {} has no bootstrap entry in cluster {cluster:?}: its data address cannot be checked",
                hello.instance_id
            ),
        ));
    };
    match entry.endpoints.get("data") {
        Some(a) if a == data_addr => Ok(()),
        other => Err(Error::new(
            Status::PeerIdentity,
            format!(
                "decode instance {} gave data address {data_addr:?}, but its bootstrap entry [{}] advertises {:?}",
                hello.instance_id,
                entry.describe(),
                other
            ),
        )),
    }
}
