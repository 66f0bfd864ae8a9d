//! The etcd backend: etcd's v3 JSON gateway over the same HTTP client as the
//! bootstrap server (no gRPC stack, no async runtime).
//!
//! Keys are `/<namespace>/<cluster>/<role>/<dpN-tpN-cpN-ppN>`, values the
//! registration JSON. Every entry is bound to its own lease, kept alive by
//! the [`Registrar`](super::Registrar) thread, so a dead process's entries
//! vanish when the lease runs out. A registration is one transaction that
//! compares the key's revision with the one just read and puts the new
//! entry, so it replaces the old entry atomically (or retries when another
//! registration raced it). The entry's epoch is the key's `mod_revision`,
//! which etcd increases on every write.

use super::schema::{now_ms, validate_cluster, RegisterAck, Registration, Role};
use super::store::{check_ttl, Store};
use crate::error::{Error, Result, Status};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::Duration;

/// etcd's shortest lease (its minimum TTL with default heartbeat settings is 2 s).
pub const ETCD_MIN_TTL: Duration = Duration::from_secs(2);

/// A [`Store`] on etcd.
pub struct EtcdStore {
    base: String,
    namespace: String,
    agent: ureq::Agent,
}

fn num(v: &Value) -> u64 {
    // The gateway writes 64-bit integers as strings and omits zeros.
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_u64().unwrap_or(0),
        _ => 0,
    }
}

fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1; // '/' -> '0': every key under the prefix sorts below it
    }
    end
}

impl EtcdStore {
    /// A store on the etcd at `url` (`http://host:port`), keys under `/namespace/`.
    pub fn new(url: &str, namespace: &str) -> Result<EtcdStore> {
        validate_cluster(namespace)
            .map_err(|e| Error::invalid(format!("etcd namespace: {}", e.detail())))?;
        let base = url.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            return Err(Error::invalid(format!(
                "etcd url must start with http://, got {url:?}"
            )));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        Ok(EtcdStore {
            base,
            namespace: namespace.to_string(),
            agent,
        })
    }

    fn post(&self, path: &str, body: Value) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut resp = self
            .agent
            .post(&url)
            .header("Content-Type", "application/json")
            .send(body.to_string().as_bytes())
            .map_err(|e| Error::new(Status::Bootstrap, format!("etcd {url} unreachable: {e}")))?;
        let code = resp.status().as_u16();
        let text = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| Error::new(Status::Bootstrap, format!("reading etcd {url}: {e}")))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            Error::new(
                Status::Bootstrap,
                format!("etcd {url} answered HTTP {code} with non-JSON ({e}): {text}"),
            )
        })?;
        if !(200..300).contains(&code) || v.get("error").is_some() {
            let msg = v["message"].as_str().or(v["error"].as_str()).unwrap_or("");
            // gRPC code 5 = NotFound (e.g. an unknown lease).
            let status = if v["code"].as_u64() == Some(5) {
                Status::NotRegistered
            } else {
                Status::Bootstrap
            };
            return Err(Error::new(
                status,
                format!("etcd {url} answered HTTP {code}: {msg}"),
            ));
        }
        Ok(v)
    }

    fn prefix(&self, cluster: &str, role: Role) -> String {
        format!("/{}/{cluster}/{role}/", self.namespace)
    }

    fn revoke(&self, lease_id: u64) -> Result<()> {
        self.post("/v3/lease/revoke", json!({"ID": lease_id.to_string()}))
            .map(|_| ())
    }

    fn try_put(&self, key: &str, value: &[u8], lease: u64) -> Result<Option<(u64, bool)>> {
        let k = B64.encode(key);
        let cur = self.post("/v3/kv/range", json!({"key": k}))?;
        let rev = cur["kvs"].get(0).map_or(0, |kv| num(&kv["mod_revision"]));
        let txn = json!({
            "compare": [{"key": k, "target": "MOD", "mod_revision": rev.to_string(), "result": "EQUAL"}],
            "success": [{"request_put": {"key": k, "value": B64.encode(value), "lease": lease.to_string()}}],
        });
        let r = self.post("/v3/kv/txn", txn)?;
        if r["succeeded"].as_bool() == Some(true) {
            Ok(Some((num(&r["header"]["revision"]), rev != 0)))
        } else {
            Ok(None)
        }
    }
}

impl Store for EtcdStore {
    fn register(&self, reg: &Registration, ttl: Duration) -> Result<RegisterAck> {
        reg.validate()?;
        check_ttl(ttl, ETCD_MIN_TTL, super::store::MAX_TTL)?;
        let secs = ttl.as_millis().div_ceil(1000) as u64;
        let mut r = reg.clone();
        r.registered_at_ms = now_ms();
        r.epoch = 0; // the key's mod_revision is the epoch
        let value = serde_json::to_vec(&r)
            .map_err(|e| Error::invalid(format!("cannot encode registration: {e}")))?;
        let grant = self.post("/v3/lease/grant", json!({"TTL": secs.to_string()}))?;
        let lease = num(&grant["ID"]);
        if lease == 0 {
            return Err(Error::new(
                Status::Bootstrap,
                format!("etcd granted no lease: {grant}"),
            ));
        }
        let key = format!("{}{}", self.prefix(&r.cluster, r.role), r.key());
        for _ in 0..8 {
            match self.try_put(&key, &value, lease) {
                Ok(Some((epoch, replaced))) => {
                    return Ok(RegisterAck {
                        epoch,
                        registered_at_ms: r.registered_at_ms,
                        lease_id: lease,
                        ttl_ms: secs * 1000,
                        replaced,
                    })
                }
                Ok(None) => continue, // another registration raced this one: read again
                Err(e) => {
                    // Best effort: the lease would expire by itself anyway.
                    let _ = self.revoke(lease);
                    return Err(e);
                }
            }
        }
        let _ = self.revoke(lease);
        Err(Error::new(
            Status::Bootstrap,
            format!("etcd key {key} kept changing under 8 registration attempts; two processes register the same rank"),
        ))
    }

    fn keepalive(&self, lease_id: u64) -> Result<()> {
        let r = self.post("/v3/lease/keepalive", json!({"ID": lease_id.to_string()}))?;
        if num(&r["result"]["TTL"]) == 0 {
            return Err(Error::new(
                Status::NotRegistered,
                format!("etcd lease {lease_id} expired; register again"),
            ));
        }
        let t = self.post(
            "/v3/lease/timetolive",
            json!({"ID": lease_id.to_string(), "keys": true}),
        )?;
        if t["keys"].as_array().is_none_or(|k| k.is_empty()) {
            return Err(Error::new(
                Status::StaleMetadata,
                format!("the entry of etcd lease {lease_id} was replaced by another registration of the same rank"),
            ));
        }
        Ok(())
    }

    fn deregister(&self, lease_id: u64) -> Result<()> {
        self.revoke(lease_id)
    }

    fn entries(&self, cluster: &str, role: Role) -> Result<Vec<Registration>> {
        validate_cluster(cluster)?;
        let p = self.prefix(cluster, role);
        let r = self.post(
            "/v3/kv/range",
            json!({"key": B64.encode(&p), "range_end": B64.encode(prefix_end(&p))}),
        )?;
        let mut out = Vec::new();
        for kv in r["kvs"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let Some(bytes) = kv["value"].as_str().and_then(|v| B64.decode(v).ok()) else {
                continue;
            };
            // An entry of another schema version cannot be paired with; skip it.
            if let Ok(mut reg) = serde_json::from_slice::<Registration>(&bytes) {
                reg.epoch = num(&kv["mod_revision"]);
                out.push(reg);
            }
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        format!("etcd {} namespace /{}/", self.base, self.namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_covers_the_prefix() {
        assert_eq!(prefix_end("/ns/c/decode/"), b"/ns/c/decode0".to_vec());
        assert!(
            b"/ns/c/decode/dp0-tp9-cp0-pp0".as_slice() < prefix_end("/ns/c/decode/").as_slice()
        );
        assert_eq!(num(&json!("42")), 42);
        assert_eq!(num(&Value::Null), 0);
    }

    #[test]
    fn bad_urls_and_namespaces_are_refused() {
        assert!(EtcdStore::new("127.0.0.1:2379", "ns").is_err());
        assert!(EtcdStore::new("http://127.0.0.1:2379", "a/b").is_err());
        let s = EtcdStore::new("http://127.0.0.1:1", "ns").unwrap();
        assert_eq!(s.keepalive(1).unwrap_err().status(), Status::Bootstrap);
    }
}
