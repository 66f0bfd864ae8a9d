//! The decode's control link to each prefill rank: dialled, authenticated
//! and checked against the bootstrap entry ([`Decode::prefill_link`]), and
//! its reader thread (statuses, abort acknowledgements, NCCL messages,
//! disconnects).

use super::Decode;
use crate::auth::PeerInstance;
use crate::bootstrap::peer::verify_peer;
use crate::bootstrap::schema::{PeerHello, Registration};
use crate::engine::control::{
    authenticate_to_prefill, CtlMsg, CtlReader, CtlWriter, CONTROL_VERSION,
};
use crate::engine::gpu_identity::{local_gpu, refuse_same_gpu};
use crate::engine::link::PrefillLink;
use crate::engine::room::KvPoll;
use crate::engine::state::lock;
use crate::error::{Error, Result, Status};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

impl Decode {
    /// Decode: the control link to a prefill rank, reused while its instance and epoch hold.
    pub(super) fn prefill_link(
        self: &Arc<Self>,
        reg: &Registration,
        local: &Registration,
    ) -> Result<Arc<PrefillLink>> {
        let key = (reg.instance_id, reg.epoch);
        if let Some(l) = lock(&self.prefill_links).get(&key) {
            if l.alive.load(Ordering::Acquire) {
                return Ok(l.clone());
            }
        }
        let addr = reg.endpoints.get("ctl").ok_or_else(|| {
            Error::new(
                Status::Bootstrap,
                format!("prefill entry [{}] has no ctl endpoint", reg.describe()),
            )
        })?;
        #[cfg(any(test, feature = "testing"))]
        let addr = self.cfg.testing.ctl_via.as_ref().unwrap_or(addr);
        let s = TcpStream::connect_timeout(
            &addr
                .parse()
                .map_err(|_| Error::invalid(format!("bad ctl address {addr}")))?,
            Duration::from_secs(5),
        )
        .map_err(|e| {
            Error::new(
                Status::PeerUnreachable,
                format!("connecting to prefill {} at {addr}: {e}", reg.describe()),
            )
        })?;
        s.set_nodelay(true)?;
        let writer = CtlWriter::new(s.try_clone()?);
        let mut reader = CtlReader::new(s.try_clone()?);
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        // Authentication first, as the instance the bootstrap entry names.
        authenticate_to_prefill(
            &writer,
            &mut reader,
            self.agent.auth(),
            self.agent.instance().0,
            PeerInstance(reg.instance_id.0.to_be_bytes()),
            &format!("{} at {addr}", reg.describe()),
        )?;
        let data_addr = self
            .agent
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let gpu = local_gpu(&self.cfg);
        writer.send(&CtlMsg::Hello {
            version: CONTROL_VERSION,
            hello: PeerHello::from(local),
            data_addr,
            regions: self.region_map(),
            gpu: gpu.clone(),
        })?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        let ack = reader.recv_first()?.ok_or_else(|| {
            Error::new(
                Status::PeerUnreachable,
                format!(
                    "prefill {} closed the control connection during the handshake",
                    reg.describe()
                ),
            )
        })?;
        s.set_read_timeout(None)?;
        let (hello, peer_gpu) = match ack {
            CtlMsg::HelloAck {
                version,
                hello,
                gpu,
            } if version == CONTROL_VERSION => (hello, gpu),
            CtlMsg::Status {
                ok: false,
                reason,
                code,
                ..
            } => {
                return Err(Error::new(
                    code.and_then(Status::from_code).unwrap_or(Status::Protocol),
                    format!(
                        "prefill {} refused this decode rank: {}",
                        reg.describe(),
                        reason.unwrap_or_default()
                    ),
                ))
            }
            CtlMsg::HelloAck { version, .. } => {
                return Err(Error::new(
                    Status::Protocol,
                    format!(
                        "prefill {} speaks control protocol {version}, this build speaks control protocol {CONTROL_VERSION}; run the same pdxfer version on every rank",
                        reg.describe()
                    ),
                ))
            }
            other => {
                return Err(Error::new(
                    Status::Protocol,
                    format!("expected hello_ack from prefill, got {other:?}"),
                ))
            }
        };
        // the peer must still be the process the bootstrap advertised, with a compatible layout
        verify_peer(reg, &hello, local)?;
        refuse_same_gpu(
            self.cfg.transport,
            gpu.as_ref(),
            peer_gpu.as_ref(),
            &format!("prefill {}", reg.describe()),
        )?;
        let counters = self
            .metrics
            .peer(self.cfg.transport.name(), reg.key().to_string());
        let link = Arc::new(PrefillLink {
            registration: reg.clone(),
            writer,
            alive: AtomicBool::new(true),
            counters,
        });
        {
            let mut links = lock(&self.prefill_links);
            // links to an older epoch of this instance, or dead ones, that no room
            // uses any more (the map and the link's reader hold the only two
            // references) are closed, so their sockets on both sides go away
            links.retain(|(inst, ep), l| {
                let stale = (*inst == key.0 && *ep < key.1) || !l.alive.load(Ordering::Acquire);
                if stale && Arc::strong_count(l) <= 2 {
                    l.writer.shutdown();
                    return false;
                }
                true
            });
            links.insert(key, link.clone());
        }
        let w = Arc::downgrade(self);
        let l2 = link.clone();
        crate::threads::spawn("pdxfer-ctl-d".into(), move || decode_reader(w, l2, reader))?;
        Ok(link)
    }
}

/// Decode: status messages from one prefill rank.
pub(super) fn decode_reader(w: Weak<Decode>, link: Arc<PrefillLink>, mut reader: CtlReader) {
    loop {
        let msg = match reader.recv() {
            // attempts start at 1: attempt 0 refuses the whole connection
            // (the prefill found a line of this link failing its MAC)
            Ok(Some(CtlMsg::Status {
                attempt: 0,
                ok: false,
                reason,
                code,
                ..
            })) => Err(Error::new(
                code.and_then(Status::from_code)
                    .unwrap_or(Status::PeerUnreachable),
                format!(
                    "prefill {} dropped the control connection: {}",
                    link.registration.describe(),
                    reason.unwrap_or_default()
                ),
            )),
            m => m,
        };
        let Some(inner) = w.upgrade() else { return };
        match msg {
            Ok(Some(CtlMsg::Status {
                room,
                attempt,
                ok,
                prefill_rank,
                bytes,
                reason,
                code,
            })) => {
                let mut d = lock(&inner.decode_rooms);
                let Some(r) = d.get_mut(&room).filter(|r| r.attempt == attempt) else {
                    continue;
                };
                if ok {
                    if r.responded.insert(prefill_rank) {
                        link.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
                    }
                    r.bytes += bytes;
                    let done = r.responded.len() >= r.targets.len();
                    drop(d);
                    if done {
                        inner.revoke_room_grants(room, None);
                        lock(&inner.rooms).update(room, attempt, KvPoll::Success);
                    } else {
                        lock(&inner.rooms).update(room, attempt, KvPoll::Transferring);
                    }
                } else {
                    drop(d);
                    let st = code
                        .and_then(Status::from_code)
                        .unwrap_or(Status::RoomFailed);
                    inner.fail_room(
                        room,
                        attempt,
                        Error::new(
                            st,
                            format!(
                                "prefill {} reported: {}",
                                link.registration.describe(),
                                reason.unwrap_or_default()
                            ),
                        ),
                    );
                }
                inner.cv.notify_all();
            }
            Ok(Some(CtlMsg::AbortAck { room, attempt })) => {
                let mut d = lock(&inner.decode_rooms);
                // a dummy target's acknowledgement fences nothing: it never writes
                let acked = d
                    .get_mut(&room)
                    .filter(|r| r.attempt == attempt)
                    .filter(|r| r.targets.iter().any(|t| Arc::ptr_eq(t, &link)))
                    .map(|r| {
                        r.abort_acks += 1;
                    });
                drop(d);
                if acked.is_some() {
                    // fenced on that prefill rank: its grant goes
                    inner.revoke_room_grants(room, Some(link.registration.instance_id.0));
                }
                inner.cv.notify_all();
            }
            Ok(Some(m @ (CtlMsg::NcclOpen { .. } | CtlMsg::NcclChunk { .. }))) => {
                super::nccl::on_prefill_message(&inner, &link, m);
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                link.alive.store(false, Ordering::Release);
                // a MAC failure (this side's or the prefill's) fails the rooms
                // as that; any other end as a lost connection
                let integrity = match msg {
                    Err(e) if e.status() == Status::ChannelIntegrity => {
                        log::warn!("decode control channel: {e}");
                        link.writer.shutdown();
                        Some(e)
                    }
                    _ => None,
                };
                let d = lock(&inner.decode_rooms);
                let hit: Vec<(u64, u64)> = d
                    .iter()
                    .filter(|(_, r)| r.targets.iter().any(|t| Arc::ptr_eq(t, &link)))
                    .map(|(id, r)| (*id, r.attempt))
                    .collect();
                drop(d);
                for (room, a) in hit {
                    if !lock(&inner.rooms)
                        .get(room)
                        .is_ok_and(|r| r.poll.is_terminal())
                    {
                        let e = integrity.clone().unwrap_or_else(|| {
                            Error::new(
                                Status::PeerUnreachable,
                                format!(
                                    "lost the control connection to prefill {}; it may have died",
                                    link.registration.describe()
                                ),
                            )
                        });
                        inner.fail_room(room, a, e);
                    }
                }
                return;
            }
        }
    }
}
