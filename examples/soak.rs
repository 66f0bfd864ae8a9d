//! Soak driver for `scripts/soak.sh`: a `pdxfer bootstrap` server process,
//! one prefill and three decode `pdxfer-fault-peer` processes, small requests
//! in rounds (one room per decode rank at a time, every byte verified) for a
//! given time, with faults at fixed fractions of the run: kill -9 of a decode
//! mid-transfer, a bootstrap server restart, kill -9 of the prefill
//! mid-transfer, kill -9 of a decode again. Resident memory and open file
//! descriptors of every process are sampled; a summary table ends the run.
//!
//! `soak --peer PATH [--secs 120] [--seed N] [--transport auto|cma|tcp]`

#[path = "../tests/support/proc.rs"]
mod support;

use pdxfer::bootstrap::schema::Role;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{Proc as Peer, DEADLINE, SLACK};

const PAGE: u64 = 16;
const ROW_TOTAL: u64 = 4 * 64;
const AUX_ITEM: u64 = 32;
const DECODES: usize = 3;

#[derive(Default)]
struct Tally {
    requests: u64,
    ok: u64,
    failed_expected: u64,
    failed_unexpected: u64,
    corrupt: u64,
    bytes: u64,
    faults: BTreeMap<&'static str, u64>,
    canary_damage: u64,
    reregister_ms: Vec<u64>,
    unexpected: Vec<String>,
}

/// (elapsed s, rss KiB, fds) samples of one process.
struct Track {
    label: String,
    pid: u32,
    born: Instant,
    samples: Vec<(f64, u64, u64)>,
    died: Option<f64>,
}

fn proc_sample(pid: u32) -> Option<(u64, u64)> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = st
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

struct Soak {
    peer_bin: String,
    url: String,
    cluster: String,
    transport: String,
    t0: Instant,
    tracks: Vec<Track>,
    tally: Tally,
    next_room: u64,
}

impl Soak {
    fn spawn(&mut self, name: &str, args: &[(&str, String)]) -> Peer {
        let mut a = vec![
            ("transport", self.transport.clone()),
            ("lease-ms", "600".to_string()),
        ];
        a.extend(args.iter().cloned());
        let p = Peer::spawn_bin(&self.peer_bin, name, &self.url, &self.cluster, &a);
        self.tracks.push(Track {
            label: name.to_string(),
            pid: p.child.id(),
            born: Instant::now(),
            samples: Vec::new(),
            died: None,
        });
        p
    }

    fn prefill(&mut self) -> Peer {
        self.spawn("prefill", &[("role", "prefill".into())])
    }

    fn decode(&mut self, i: usize) -> Peer {
        self.spawn(
            &format!("decode{i}"),
            &[
                ("role", "decode".into()),
                ("dp-size", DECODES.to_string()),
                ("dp-rank", i.to_string()),
            ],
        )
    }

    fn killed(&mut self, p: &mut Peer) {
        let pid = p.child.id();
        p.kill9();
        let t = self.t0.elapsed().as_secs_f64();
        if let Some(tr) = self.tracks.iter_mut().find(|t| t.pid == pid) {
            tr.died = Some(t);
        }
    }

    fn sample(&mut self) {
        let t = self.t0.elapsed().as_secs_f64();
        for tr in self.tracks.iter_mut().filter(|t| t.died.is_none()) {
            if let Some((rss, fds)) = proc_sample(tr.pid) {
                tr.samples.push((t, rss, fds));
            }
        }
    }

    /// One round: a room per decode; `slow` rooms go one page per chunk with a pause.
    /// Returns the room ids (slot order) after sending the metadata and the chunks.
    fn start_round(&mut self, p: &mut Peer, d: &mut [Peer], pages: u64, delay_ms: u64) -> Vec<u64> {
        let mut rooms = Vec::new();
        for (i, dp) in d.iter_mut().enumerate() {
            let room = self.next_room;
            self.next_room += 1;
            let dst: Vec<u64> = (0..pages).map(|k| (room * 2 + k) % 32).collect();
            dp.cmd(
                json!({"cmd": "recv", "room": room, "total": pages * PAGE, "dst_pages": dst,
                "aux": i as u64, "timeout_ms": DEADLINE.as_millis() as u64}),
            );
            rooms.push(room);
        }
        for (i, dp) in d.iter_mut().enumerate() {
            let room = rooms[i];
            dp.expect_match(|v| v["event"] == "meta" && v["room"] == room, SLACK);
            p.cmd(json!({"cmd": "send", "room": room, "total": pages * PAGE,
                "src_pages": (0..pages).map(|k| i as u64 * 16 + k).collect::<Vec<_>>(),
                "chunk_pages": 1, "aux": i as u64, "delay_ms": delay_ms,
                "timeout_ms": DEADLINE.as_millis() as u64}));
        }
        self.tally.requests += rooms.len() as u64;
        rooms
    }

    fn decode_outcome(&mut self, d: &mut Peer, room: u64, pages: u64, expect_fail: bool) {
        let v = d.done(room, DEADLINE + SLACK);
        self.account(&v, pages, expect_fail, &d.name);
    }

    fn account(&mut self, v: &Value, pages: u64, expect_fail: bool, who: &str) {
        match (v["poll"].as_str().unwrap_or(""), expect_fail) {
            ("Success", false) => {
                if who.starts_with("decode") {
                    let want = pages * PAGE * ROW_TOTAL + AUX_ITEM;
                    if v["verified"].as_u64() != Some(want) {
                        self.tally.corrupt += 1;
                        self.tally.unexpected.push(format!("{who}: {v}"));
                        return;
                    }
                    self.tally.bytes += want;
                }
                self.tally.ok += 1;
            }
            ("Failed", true) if v["reason"].as_str().is_some_and(|r| !r.is_empty()) => {
                self.tally.failed_expected += 1
            }
            ("Corrupt", _) => {
                self.tally.corrupt += 1;
                self.tally.unexpected.push(format!("{who}: {v}"));
            }
            _ => {
                self.tally.failed_unexpected += 1;
                self.tally
                    .unexpected
                    .push(format!("{who} (expected failure: {expect_fail}): {v}"));
            }
        }
    }
}

/// `pdxfer bootstrap --listen ADDR` as a child process; returns it and its URL.
fn bootstrap(bin: &str, listen: &str) -> (Child, String) {
    let end = Instant::now() + DEADLINE;
    loop {
        let mut c = Command::new(bin)
            .args(["bootstrap", "--listen", listen])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pdxfer bootstrap");
        let mut line = String::new();
        let _ = std::io::BufReader::new(c.stdout.take().unwrap()).read_line(&mut line);
        if let Some(url) = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["url"].as_str().map(str::to_string))
        {
            return (c, url);
        }
        let _ = c.kill();
        let _ = c.wait();
        assert!(
            Instant::now() < end,
            "pdxfer bootstrap did not start on {listen}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let secs: u64 = opt("--secs").map_or(120, |s| s.parse().expect("--secs"));
    let seed: u64 = opt("--seed").map_or(1, |s| s.parse().expect("--seed"));
    let peer_bin = opt("--peer").unwrap_or_else(|| {
        let me = std::env::current_exe().unwrap();
        me.parent()
            .and_then(|p| p.parent())
            .unwrap()
            .join("pdxfer-fault-peer")
            .to_string_lossy()
            .into_owned()
    });
    let pdxfer_bin = std::path::Path::new(&peer_bin)
        .with_file_name("pdxfer")
        .to_string_lossy()
        .into_owned();
    let (mut server, url) = bootstrap(&pdxfer_bin, "127.0.0.1:0");
    let addr = url.trim_start_matches("http://").to_string();
    let store = pdxfer::bootstrap::open_store(&url, None).expect("bootstrap client");
    let mut s = Soak {
        peer_bin,
        url: url.clone(),
        cluster: "soak".into(),
        transport: opt("--transport").unwrap_or_else(|| "auto".into()),
        t0: Instant::now(),
        tracks: vec![Track {
            label: "driver".into(),
            pid: std::process::id(),
            born: Instant::now(),
            samples: Vec::new(),
            died: None,
        }],
        tally: Tally::default(),
        next_room: 1 + seed * 1_000_000,
    };
    s.tracks.push(Track {
        label: "bootstrap".into(),
        pid: server.id(),
        born: Instant::now(),
        samples: Vec::new(),
        died: None,
    });
    let mut p = s.prefill();
    let mut d: Vec<Peer> = (0..DECODES).map(|i| s.decode(i)).collect();
    let total = Duration::from_secs(secs);
    let fault_arg = opt("--faults")
        .unwrap_or_else(|| "kill decode,restart bootstrap,kill prefill,kill decode".into());
    let faults: Vec<&str> = fault_arg.split(',').filter(|f| !f.is_empty()).collect();
    for f in &faults {
        assert!(
            ["kill decode", "restart bootstrap", "kill prefill"].contains(f),
            "unknown fault {f:?}"
        );
    }
    let mut next_fault = 0usize;
    let mut last_sample = Instant::now() - Duration::from_secs(10);
    let mut rounds = 0u64;
    while s.t0.elapsed() < total {
        if last_sample.elapsed() >= Duration::from_secs(2) {
            s.sample();
            last_sample = Instant::now();
        }
        let frac = s.t0.elapsed().as_secs_f64() / total.as_secs_f64();
        if next_fault < faults.len()
            && frac >= (next_fault as f64 + 1.0) / (faults.len() as f64 + 1.0)
        {
            let f: &'static str = match faults[next_fault] {
                "kill decode" => "kill decode",
                "kill prefill" => "kill prefill",
                _ => "restart bootstrap",
            };
            next_fault += 1;
            *s.tally.faults.entry(f).or_default() += 1;
            eprintln!("[{:6.1}s] fault: {f}", s.t0.elapsed().as_secs_f64());
            let pages = 12;
            let rooms = s.start_round(&mut p, &mut d, pages, 20);
            match f {
                "kill decode" => {
                    let v = DECODES - 1;
                    let vroom = rooms[v];
                    p.expect_match(
                        |e| e["event"] == "chunk" && e["room"] == vroom && e["i"] == 3,
                        DEADLINE,
                    );
                    d[v].check_canaries();
                    // kill first, then start the replacement (a restart, not a takeover)
                    let mut victim = d.remove(v);
                    s.killed(&mut victim);
                    drop(victim);
                    let fresh = s.decode(v);
                    d.insert(v, fresh);
                    for (i, &room) in rooms.iter().enumerate() {
                        let pv = p.done(room, DEADLINE + SLACK);
                        if i == v {
                            s.account(&pv, pages, true, "prefill");
                        } else {
                            s.decode_outcome(&mut d[i], room, pages, false);
                            let _ = pv;
                        }
                    }
                }
                "kill prefill" => {
                    let r0 = rooms[0];
                    p.expect_match(
                        |e| e["event"] == "chunk" && e["room"] == r0 && e["i"] == 3,
                        DEADLINE,
                    );
                    p.check_canaries();
                    s.killed(&mut p);
                    p = s.prefill();
                    for (i, &room) in rooms.iter().enumerate() {
                        s.decode_outcome(&mut d[i], room, pages, true);
                    }
                }
                _ => {
                    let r0 = rooms[0];
                    p.expect_match(
                        |e| e["event"] == "chunk" && e["room"] == r0 && e["i"] == 3,
                        DEADLINE,
                    );
                    // SAFETY: kill(2) on our own child's pid.
                    unsafe { libc::kill(server.id() as i32, libc::SIGKILL) };
                    let _ = server.wait();
                    let t = s.t0.elapsed().as_secs_f64();
                    if let Some(tr) = s.tracks.iter_mut().find(|t| t.pid == server.id()) {
                        tr.died = Some(t);
                    }
                    server = bootstrap(&pdxfer_bin, &addr).0;
                    s.tracks.push(Track {
                        label: "bootstrap".into(),
                        pid: server.id(),
                        born: Instant::now(),
                        samples: Vec::new(),
                        died: None,
                    });
                    for &room in &rooms {
                        let _ = p.done(room, DEADLINE + SLACK);
                    }
                    for (i, &room) in rooms.iter().enumerate() {
                        s.decode_outcome(&mut d[i], room, pages, false);
                    }
                    // a keep-alive caught in the outage can take its HTTP timeout (5 s) to notice
                    let restarted = Instant::now();
                    let end = restarted + Duration::from_secs(20);
                    while store
                        .entries(&s.cluster, Role::Prefill)
                        .map_or(0, |e| e.len())
                        < 1
                        || store
                            .entries(&s.cluster, Role::Decode)
                            .map_or(0, |e| e.len())
                            < DECODES
                    {
                        assert!(
                            Instant::now() < end,
                            "ranks did not re-register: {:?} {:?}",
                            store.entries(&s.cluster, Role::Prefill).map(|e| e.len()),
                            store
                                .entries(&s.cluster, Role::Decode)
                                .map(|e| e.iter().map(|r| r.describe()).collect::<Vec<_>>())
                        );
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    s.tally
                        .reregister_ms
                        .push(restarted.elapsed().as_millis() as u64);
                }
            }
            continue;
        }
        let pages = 2;
        let rooms = s.start_round(&mut p, &mut d, pages, 0);
        for &room in &rooms {
            // the request is counted on the decode side; a prefill failure is still unexpected
            let v = p.done(room, DEADLINE + SLACK);
            if v["poll"] != "Success" {
                s.tally.unexpected.push(format!("prefill: {v}"));
            }
        }
        for (i, &room) in rooms.iter().enumerate() {
            s.decode_outcome(&mut d[i], room, pages, false);
        }
        rounds += 1;
    }
    s.sample();
    // what the descriptors of every live process are, before they exit
    let mut kinds_report = Vec::new();
    for tr in s.tracks.iter().filter(|t| t.died.is_none()) {
        let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{}/fd", tr.pid)) {
            for e in rd.flatten() {
                let t = std::fs::read_link(e.path())
                    .map_or("?".into(), |l| l.to_string_lossy().into_owned());
                let k = t.split(':').next().unwrap_or("?").to_string();
                *kinds
                    .entry(if k.starts_with('/') { "file".into() } else { k })
                    .or_default() += 1;
            }
        }
        kinds_report.push(format!("{} ({}): {:?}", tr.label, tr.pid, kinds));
    }
    // final canary check on every live process, then a clean exit
    for mut x in d.into_iter().chain(std::iter::once(p)) {
        x.cmd(json!({"cmd": "check"}));
        let c = x.expect_match(|v| v["event"] == "canaries", SLACK);
        s.tally.canary_damage += c["damaged"].as_u64().unwrap_or(u64::MAX);
        x.exit();
    }
    let _ = server.kill();
    let _ = server.wait();
    let t = s.t0.elapsed().as_secs_f64();
    let tl = &s.tally;
    println!();
    println!(
        "== soak summary: {t:.0} s, {rounds} normal rounds, transport {}, seed {seed}",
        s.transport
    );
    println!("{:<34} {:>14}", "requests", tl.requests);
    println!("{:<34} {:>14}", "succeeded (byte-exact)", tl.ok);
    println!(
        "{:<34} {:>14}",
        "failed as expected (with reason)", tl.failed_expected
    );
    println!("{:<34} {:>14}", "failed unexpectedly", tl.failed_unexpected);
    println!("{:<34} {:>14}", "corrupt (bytes lost)", tl.corrupt);
    println!("{:<34} {:>14}", "bytes verified", tl.bytes);
    let nf: u64 = tl.faults.values().sum();
    let fl: Vec<String> = tl.faults.iter().map(|(k, v)| format!("{k} x{v}")).collect();
    println!("{:<34} {:>14}  ({})", "faults injected", nf, fl.join(", "));
    println!(
        "{:<34} {:>14}",
        "out-of-bounds writes (canary bytes)", tl.canary_damage
    );
    println!(
        "{:<34} {:>14}",
        "re-registration after restart (ms)",
        format!("{:?}", tl.reregister_ms)
    );
    println!();
    println!(
        "{:<18} {:>7} {:>9} {:>12} {:>12} {:>12} {:>12} {:>6} {:>6} {:>6}",
        "process",
        "pid",
        "lived s",
        "rss KiB @10%",
        "rss KiB @50%",
        "rss KiB end",
        "rss KiB max",
        "fd@10%",
        "fd end",
        "fd max"
    );
    for tr in &s.tracks {
        if tr.samples.is_empty() {
            continue;
        }
        // the first sample after a tenth of the process's life: past the warm-up
        let life = tr.samples.last().unwrap().0 - tr.samples[0].0;
        let warm = tr
            .samples
            .iter()
            .find(|x| x.0 - tr.samples[0].0 >= life / 10.0)
            .unwrap_or(&tr.samples[0]);
        let mid = tr
            .samples
            .iter()
            .find(|x| x.0 - tr.samples[0].0 >= life / 2.0)
            .unwrap_or(&tr.samples[0]);
        let last = tr.samples.last().unwrap();
        let rmax = tr.samples.iter().map(|x| x.1).max().unwrap();
        let fmax = tr.samples.iter().map(|x| x.2).max().unwrap();
        let lived = tr.died.map_or(t, |d| d) - (tr.born - s.t0).as_secs_f64().max(0.0);
        println!(
            "{:<18} {:>7} {:>9.0} {:>12} {:>12} {:>12} {:>12} {:>6} {:>6} {:>6}{}",
            tr.label,
            tr.pid,
            lived,
            warm.1,
            mid.1,
            last.1,
            rmax,
            warm.2,
            last.2,
            fmax,
            if tr.died.is_some() { "  (killed)" } else { "" }
        );
    }
    println!();
    println!("open descriptors by kind at the end:");
    for k in &kinds_report {
        println!("  {k}");
    }
    for u in &tl.unexpected {
        println!("unexpected: {u}");
    }
    let bad = tl.failed_unexpected + tl.corrupt + tl.canary_damage + tl.unexpected.len() as u64;
    std::process::exit(if bad == 0 { 0 } else { 1 });
}
