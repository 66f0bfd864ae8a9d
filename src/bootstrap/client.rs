//! Clients: [`HttpStore`] (a [`Store`] backed by a bootstrap server) and
//! [`Registrar`] (registers one rank and keeps its lease alive on a thread),
//! used the same way with every backend.

use super::schema::{
    from_json, PeerHello, RankKey, RegisterAck, RegisterRequest, Registration, Role, Summary,
};
use super::store::Store;
use crate::error::{Error, Result, Status};
use crossbeam::channel::{bounded, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A [`Store`] that talks to a bootstrap server over HTTP.
pub struct HttpStore {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl HttpStore {
    /// A client for the server at `url` (`http://host:port`), with an optional token.
    pub fn new(url: &str, token: Option<&str>) -> Result<HttpStore> {
        let base = url.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            return Err(Error::invalid(format!(
                "bootstrap url must start with http://, got {url:?}"
            )));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            // no idle keep-alive connections: tiny_http serves a connection on
            // one pool thread until it closes and can queue a new connection
            // behind busy ones, so ranks holding idle connections starved
            // others' registrations (seen with 5 processes registering at once)
            .max_idle_connections(0)
            .build()
            .into();
        Ok(HttpStore {
            base,
            token: token.map(str::to_string),
            agent,
        })
    }

    /// The server's base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn finish<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        r: std::result::Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<T> {
        let mut resp = r.map_err(|e| {
            Error::new(
                Status::Bootstrap,
                format!("bootstrap server {} unreachable ({what}): {e}", self.base),
            )
        })?;
        let code = resp.status().as_u16();
        let body = resp.body_mut().read_to_vec().map_err(|e| {
            Error::new(
                Status::Bootstrap,
                format!("reading the answer of {} ({what}): {e}", self.base),
            )
        })?;
        if (200..300).contains(&code) {
            return from_json(&body, what);
        }
        #[derive(serde::Deserialize)]
        struct ErrBody {
            code: i32,
            detail: String,
        }
        match serde_json::from_slice::<ErrBody>(&body) {
            Ok(e) => Err(Error::new(
                Status::from_code(e.code).unwrap_or(Status::Bootstrap),
                e.detail,
            )),
            Err(_) => Err(Error::new(
                Status::Bootstrap,
                format!(
                    "bootstrap server {} answered HTTP {code} to {what}: {}",
                    self.base,
                    String::from_utf8_lossy(&body)
                ),
            )),
        }
    }

    fn auth<B>(&self, rb: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(t) => rb.header("Authorization", format!("Bearer {t}")),
            None => rb,
        }
    }

    fn cluster_url(&self, cluster: &str, role: Role) -> String {
        format!("{}/v1/clusters/{cluster}/{role}", self.base)
    }

    /// Whether `/health` answers.
    pub fn health(&self) -> Result<()> {
        let _: serde_json::Value = self.finish(
            "health",
            self.agent.get(format!("{}/health", self.base)).call(),
        )?;
        Ok(())
    }
}

impl Store for HttpStore {
    fn register(&self, reg: &Registration, ttl: Duration) -> Result<RegisterAck> {
        let body = serde_json::to_vec(&RegisterRequest {
            registration: reg.clone(),
            ttl_ms: ttl.as_millis() as u64,
        })
        .map_err(|e| Error::invalid(format!("cannot encode registration: {e}")))?;
        let rb = self.auth(self.agent.post(format!("{}/v1/register", self.base)));
        self.finish(
            "register",
            rb.header("Content-Type", "application/json")
                .send(&body[..]),
        )
    }

    fn keepalive(&self, lease_id: u64) -> Result<()> {
        let rb = self.auth(
            self.agent
                .post(format!("{}/v1/leases/{lease_id}/keepalive", self.base)),
        );
        let _: serde_json::Value = self.finish("keepalive", rb.send_empty())?;
        Ok(())
    }

    fn deregister(&self, lease_id: u64) -> Result<()> {
        let rb = self.auth(
            self.agent
                .delete(format!("{}/v1/leases/{lease_id}", self.base)),
        );
        let _: serde_json::Value = self.finish("deregister", rb.call())?;
        Ok(())
    }

    fn entries(&self, cluster: &str, role: Role) -> Result<Vec<Registration>> {
        let rb = self.auth(
            self.agent
                .get(format!("{}/ranks", self.cluster_url(cluster, role))),
        );
        self.finish("list ranks", rb.call())
    }

    fn describe(&self) -> String {
        format!("bootstrap server {}", self.base)
    }

    fn summary(&self, cluster: &str, role: Role) -> Result<Summary> {
        let rb = self
            .agent
            .get(format!("{}/summary", self.cluster_url(cluster, role)));
        self.finish("summary", rb.call())
    }

    fn lookup(&self, cluster: &str, role: Role, key: &RankKey) -> Result<Registration> {
        let rb = self.auth(
            self.agent
                .get(format!("{}/ranks/{key}", self.cluster_url(cluster, role))),
        );
        self.finish("lookup", rb.call())
    }
}

/// State of a [`Registrar`]'s lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Registered and kept alive.
    Live,
    /// Another registration took the same rank key; keep-alives stopped.
    Replaced(String),
    /// The last keep-alive failed (the store was unreachable); retrying.
    Failing(String),
}

struct RegState {
    reg: Registration,
    ack: RegisterAck,
    state: LeaseState,
}

/// One registered rank whose lease is kept alive by a background thread.
///
/// If the lease expires (the store was unreachable for longer than the TTL),
/// the thread registers again, which bumps the epoch. If another process took
/// the rank key, it stops and reports [`LeaseState::Replaced`]. Dropping the
/// registrar stops the thread without deregistering (the entry then expires);
/// [`deregister`](Self::deregister) removes it at once.
pub struct Registrar {
    store: Arc<dyn Store>,
    state: Arc<Mutex<RegState>>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Registrar {
    /// Registers `reg` with a lease of `ttl` and starts the keep-alive thread
    /// (one keep-alive every `ttl / 3`).
    pub fn start(store: Arc<dyn Store>, reg: Registration, ttl: Duration) -> Result<Registrar> {
        let ack = store.register(&reg, ttl)?;
        let mut reg = reg;
        reg.epoch = ack.epoch;
        reg.registered_at_ms = ack.registered_at_ms;
        let state = Arc::new(Mutex::new(RegState {
            reg,
            ack,
            state: LeaseState::Live,
        }));
        let (tx, rx) = bounded::<()>(1);
        let (st, store2) = (state.clone(), store.clone());
        let period = (ttl / 3).max(Duration::from_millis(20));
        let thread = crate::threads::spawn("pdxfer-bootstrap-keepalive".into(), move || loop {
            match rx.recv_timeout(period) {
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let lease = lock(&st).ack.lease_id;
            match store2.keepalive(lease) {
                Ok(()) => lock(&st).state = LeaseState::Live,
                Err(e) if e.status() == Status::StaleMetadata => {
                    lock(&st).state = LeaseState::Replaced(e.detail().to_string());
                    return;
                }
                Err(e) if e.status() == Status::NotRegistered => {
                    let reg = lock(&st).reg.clone();
                    match store2.register(&reg, ttl) {
                        Ok(ack) => {
                            let mut g = lock(&st);
                            g.reg.epoch = ack.epoch;
                            g.reg.registered_at_ms = ack.registered_at_ms;
                            g.ack = ack;
                            g.state = LeaseState::Live;
                        }
                        Err(e) => lock(&st).state = LeaseState::Failing(e.to_string()),
                    }
                }
                Err(e) => lock(&st).state = LeaseState::Failing(e.to_string()),
            }
        })
        .map_err(|e| Error::new(Status::Io, format!("cannot start keep-alive thread: {e}")))?;
        Ok(Registrar {
            store,
            state,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// The registration as the store holds it now (epoch and time filled in).
    pub fn registration(&self) -> Registration {
        lock(&self.state).reg.clone()
    }

    /// The last registration's acknowledgement (lease, epoch).
    pub fn ack(&self) -> RegisterAck {
        lock(&self.state).ack
    }

    /// The lease state.
    pub fn lease_state(&self) -> LeaseState {
        lock(&self.state).state.clone()
    }

    /// What this rank says about itself on a direct connection.
    pub fn hello(&self) -> PeerHello {
        PeerHello::from(&lock(&self.state).reg)
    }

    /// Stops the keep-alive thread and removes the entry from the store.
    pub fn deregister(mut self) -> Result<()> {
        self.halt();
        let lease = self.ack().lease_id;
        self.store.deregister(lease)
    }

    fn halt(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            // The thread only loops and returns; a panic there has no state to recover.
            let _ = t.join();
        }
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        self.halt();
    }
}

fn lock(m: &Mutex<RegState>) -> std::sync::MutexGuard<'_, RegState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
