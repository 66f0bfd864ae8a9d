//! The Prometheus text exposition (format 0.0.4) of a [`MetricsSnapshot`].

use super::{MetricsSnapshot, PeerSnapshot, LATENCY_BUCKETS, STATE_NAMES};
use crate::bootstrap::schema::Role;
use std::fmt::Write;

impl MetricsSnapshot {
    /// The Prometheus text exposition (format 0.0.4) of the snapshot.
    pub fn to_prometheus(&self) -> String {
        let mut o = String::new();
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {kind}");
        };
        head(
            &mut o,
            "pdxfer_engine_info",
            "gauge",
            "The engine's role and cluster (always 1).",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_info{{role=\"{}\",cluster=\"{}\"}} 1",
            self.role.as_str(),
            escape(&self.cluster)
        );
        head(
            &mut o,
            "pdxfer_engine_rooms",
            "gauge",
            "Live rooms by KVPoll state.",
        );
        for (name, n) in STATE_NAMES.iter().zip(self.rooms) {
            let _ = writeln!(o, "pdxfer_engine_rooms{{state=\"{name}\"}} {n}");
        }
        head(
            &mut o,
            "pdxfer_engine_rooms_created_total",
            "counter",
            "Rooms created (each attempt of a reused room id counts).",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_rooms_created_total {}",
            self.totals.created
        );
        head(
            &mut o,
            "pdxfer_engine_rooms_finished_total",
            "counter",
            "Rooms that reached a terminal state, by that state.",
        );
        let failed: u64 = self.totals.failed.values().sum();
        let _ = writeln!(
            o,
            "pdxfer_engine_rooms_finished_total{{state=\"success\"}} {}",
            self.totals.succeeded
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_rooms_finished_total{{state=\"failed\"}} {failed}"
        );
        head(
            &mut o,
            "pdxfer_engine_room_failures_total",
            "counter",
            "Failed rooms by the status kind of their failure.",
        );
        for (kind, n) in &self.totals.failed {
            let _ = writeln!(
                o,
                "pdxfer_engine_room_failures_total{{kind=\"{kind}\"}} {n}"
            );
        }
        head(
            &mut o,
            "pdxfer_engine_transfer_seconds",
            "histogram",
            "Transfer latency of successful rooms by transport: first chunk queued (prefill) or metadata sent (decode) to Success.",
        );
        for (t, h) in &self.totals.latency {
            let mut cum = 0u64;
            for (i, n) in h.buckets.iter().enumerate() {
                cum += n;
                let le = LATENCY_BUCKETS
                    .get(i)
                    .map_or("+Inf".to_string(), |b| b.to_string());
                let _ = writeln!(
                    o,
                    "pdxfer_engine_transfer_seconds_bucket{{transport=\"{t}\",le=\"{le}\"}} {cum}"
                );
            }
            let _ = writeln!(
                o,
                "pdxfer_engine_transfer_seconds_sum{{transport=\"{t}\"}} {}",
                h.sum
            );
            let _ = writeln!(
                o,
                "pdxfer_engine_transfer_seconds_count{{transport=\"{t}\"}} {}",
                h.count
            );
        }
        let per_peer =
            |o: &mut String, name: &str, help: &str, value: &dyn Fn(&PeerSnapshot) -> String| {
                head(o, name, "counter", help);
                for p in &self.peers {
                    let _ = writeln!(
                        o,
                        "{name}{{transport=\"{}\",peer=\"{}\"}} {}",
                        p.transport,
                        escape(&p.peer),
                        value(p)
                    );
                }
            };
        if self.role == Role::Decode {
            per_peer(
                &mut o,
                "pdxfer_engine_received_bytes_total",
                "KV bytes each prefill rank reported for its finished rooms.",
                &|p| p.bytes.to_string(),
            );
        } else {
            per_peer(
                &mut o,
                "pdxfer_engine_sent_bytes_total",
                "Bytes of completed batches (KV, aux, state) by transport and peer.",
                &|p| p.bytes.to_string(),
            );
            per_peer(
                &mut o,
                "pdxfer_engine_sent_batches_total",
                "Completed batches by transport and peer.",
                &|p| p.batches.to_string(),
            );
            per_peer(
                &mut o,
                "pdxfer_engine_failed_batches_total",
                "Batches refused at submit or failed at completion, by transport and peer.",
                &|p| p.failed_batches.to_string(),
            );
            per_peer(
                &mut o,
                "pdxfer_engine_wire_seconds_total",
                "Seconds workers spent submitting batches and waiting for their completion, by transport and peer.",
                &|p| p.wire_seconds.to_string(),
            );
        }
        if self.role == Role::Decode {
            head(
                &mut o,
                "pdxfer_engine_received_batches_total",
                "counter",
                "Batches that landed in this engine's memory (the receiving agent's completion records).",
            );
            let _ = writeln!(
                o,
                "pdxfer_engine_received_batches_total {}",
                self.received_batches
            );
        }
        if self.role == Role::Decode {
            head(
                &mut o,
                "pdxfer_engine_room_grants_held",
                "gauge",
                "Room grants this decode engine holds for its prefill ranks (pinned until the room ends, is revoked or expires).",
            );
            let _ = writeln!(
                o,
                "pdxfer_engine_room_grants_held {}",
                self.room_grants_held
            );
        }
        if self.nccl_comm_inits + self.nccl_comm_init_failures > 0 {
            head(
                &mut o,
                "pdxfer_engine_nccl_comm_inits_total",
                "counter",
                "NCCL communicators opened (transport nccl: one per link and generation, opened after the hello and again after a failure), by outcome.",
            );
            for (outcome, v) in [
                ("ok", self.nccl_comm_inits),
                ("failed", self.nccl_comm_init_failures),
            ] {
                let _ = writeln!(
                    o,
                    "pdxfer_engine_nccl_comm_inits_total{{outcome=\"{outcome}\"}} {v}"
                );
            }
            head(
                &mut o,
                "pdxfer_engine_nccl_comm_init_seconds_total",
                "counter",
                "Seconds spent in NCCL communicator inits (ncclCommInitRankConfig until ready, or failed).",
            );
            let _ = writeln!(
                o,
                "pdxfer_engine_nccl_comm_init_seconds_total {}",
                self.nccl_comm_init_seconds
            );
        }
        head(
            &mut o,
            "pdxfer_engine_control_messages_total",
            "counter",
            "Control messages this process sent and received, by channel (engine: the rank-to-rank control channel; data_plane: handshake, intent, grant, commit, ack and room frames) and direction.",
        );
        for (channel, dir, v) in [
            ("engine", "sent", self.control.engine_sent),
            ("engine", "received", self.control.engine_received),
            ("data_plane", "sent", self.control.data_plane_sent),
            ("data_plane", "received", self.control.data_plane_received),
        ] {
            let _ = writeln!(
                o,
                "pdxfer_engine_control_messages_total{{channel=\"{channel}\",direction=\"{dir}\"}} {v}"
            );
        }
        head(
            &mut o,
            "pdxfer_engine_gather_seconds_total",
            "counter",
            "Seconds prefill workers spent gathering rows into host staging or straight into mapped decode pools (compare with pdxfer_engine_wire_seconds_total).",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_gather_seconds_total {}",
            self.gather_seconds
        );
        head(
            &mut o,
            "pdxfer_engine_gathers_total",
            "counter",
            "Gathers into host staging.",
        );
        let _ = writeln!(o, "pdxfer_engine_gathers_total {}", self.gathers);
        head(
            &mut o,
            "pdxfer_engine_one_copy_bytes_total",
            "counter",
            "KV bytes gathered straight into same-host decode ranks' mapped pools (one copy, no staging).",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_one_copy_bytes_total {}",
            self.one_copy_bytes
        );
        head(
            &mut o,
            "pdxfer_engine_tcp_room_resumes_total",
            "counter",
            "Rooms resumed on a new tcp connection after theirs broke in their middle.",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_tcp_room_resumes_total {}",
            self.tcp_resumes
        );
        head(
            &mut o,
            "pdxfer_engine_tcp_resent_bytes_total",
            "counter",
            "Bytes resumed rooms sent again on their new tcp connection (what had not landed).",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_tcp_resent_bytes_total {}",
            self.tcp_resent_bytes
        );
        head(
            &mut o,
            "pdxfer_engine_staging_bytes",
            "gauge",
            "Bytes of the prefill workers' host staging buffers.",
        );
        let _ = writeln!(o, "pdxfer_engine_staging_bytes {}", self.staging_bytes);
        head(
            &mut o,
            "pdxfer_engine_staging_in_flight_bytes",
            "gauge",
            "Bytes of host staging read by batches not yet completed.",
        );
        let _ = writeln!(
            o,
            "pdxfer_engine_staging_in_flight_bytes {}",
            self.staging_in_flight_bytes()
        );
        head(
            &mut o,
            "pdxfer_engine_registered_bytes",
            "gauge",
            "Memory registered with the engine's agent, by kind.",
        );
        for (kind, n) in &self.registered_bytes {
            let _ = writeln!(o, "pdxfer_engine_registered_bytes{{kind=\"{kind}\"}} {n}");
        }
        o
    }
}

/// A label value with `\`, `"` and newlines escaped (the text format's rules).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
