//! One engine rank (prefill or decode) for the fault-injection tests
//! (`tests/engine/faults.rs`) and the soak run (`scripts/soak.sh`).
//!
//! Every KV pool and the aux buffer live in their own anonymous mapping laid
//! out as `[guard page][canary page][pool ...][canary tail][guard page]`: the
//! guard pages are `PROT_NONE` (a stray local write faults, a stray CMA write
//! gets `EFAULT`), the canaries hold a known pattern that `check` and `exit`
//! compare, so any byte written outside a registered region is reported.
//!
//! Commands are JSON lines on stdin, events JSON lines on stdout:
//! - prefill `{"cmd":"send","room":R,"total":T,"src_pages":[..],"chunk_pages":C,"aux":A,"delay_ms":D,"timeout_ms":M}`
//!   fills the pattern, sends the room chunk by chunk (`{"event":"chunk",..}` after each),
//!   then reports `{"event":"done","room":R,"poll":"Success"|"Failed",..}`;
//! - decode `{"cmd":"recv","room":R,"total":T,"dst_pages":[..],"aux":A,"timeout_ms":M}`
//!   opens the room, sends the metadata, waits, verifies every byte it owns and reports `done`;
//! - `{"cmd":"check"}` reports `{"event":"canaries","ok":..}`; `{"cmd":"stats"}` reports RSS
//!   and open descriptors; `{"cmd":"poke"}` flips one canary byte (the detector's self-test);
//!   `{"cmd":"exit"}` checks the canaries, closes the engine and exits.
//!
//! Arguments: `--role prefill|decode --bootstrap URL --cluster NAME [--dcp N --rank R
//! --dp-size N --dp-rank R --transport auto|cma|tcp|local --lease-ms MS --timeout-ms MS
//! --host ADDR]` (`--host`: the address the rank listens on, default 127.0.0.1).

use pdxfer::bootstrap::schema::Role;
use pdxfer::engine::{AuxBuffer, Engine, EngineConfig, KvPoll, KvPool};
use pdxfer::layout::{DcpLayout, KvDtype, KvEntry, PoolKind, Side, Topology};
use pdxfer::transport::TransportKind;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LAYERS: u32 = 4;
const ROW: u64 = 64;
const PAGE: u64 = 16;
const AUX_ROWS: u64 = 8;
const AUX_ITEM: u64 = 32;
const OS_PAGE: usize = 4096;

fn canary_byte(i: usize) -> u8 {
    0xA5 ^ (i as u8) ^ ((i >> 8) as u8)
}

/// One pool in its own mapping with guard pages and canaries around it.
struct Guarded {
    map: *mut u8,
    map_len: usize,
    data: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this struct; threads only touch disjoint rows through raw pointers.
unsafe impl Send for Guarded {}
// SAFETY: as above.
unsafe impl Sync for Guarded {}

impl Guarded {
    fn new(len: usize) -> Guarded {
        let body = len.div_ceil(OS_PAGE) * OS_PAGE;
        // guard + canary + body (+ the rest of its last page as canary) + canary + guard
        let map_len = body + 4 * OS_PAGE;
        // SAFETY: an anonymous private mapping with no address hint.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(map != libc::MAP_FAILED, "mmap of {map_len} bytes failed");
        let map = map as *mut u8;
        // SAFETY: both ranges are whole pages inside the mapping just created.
        unsafe {
            assert_eq!(libc::mprotect(map.cast(), OS_PAGE, libc::PROT_NONE), 0);
            assert_eq!(
                libc::mprotect(map.add(map_len - OS_PAGE).cast(), OS_PAGE, libc::PROT_NONE),
                0
            );
        }
        // SAFETY: 2 pages in, inside the mapping.
        let data = unsafe { map.add(2 * OS_PAGE) };
        let g = Guarded {
            map,
            map_len,
            data,
            len,
        };
        for (i, p) in g.canary_ranges().into_iter().flatten().enumerate() {
            // SAFETY: canary bytes are inside the writable part of the mapping.
            unsafe { *p = canary_byte(i) };
        }
        g
    }

    /// Pointers to every canary byte (head range, then tail range).
    fn canary_ranges(&self) -> [Vec<*mut u8>; 2] {
        // SAFETY: all offsets stay inside the mapping (see new()).
        unsafe {
            let head = (OS_PAGE..2 * OS_PAGE).map(|o| self.map.add(o)).collect();
            let tail = (2 * OS_PAGE + self.len..self.map_len - OS_PAGE)
                .map(|o| self.map.add(o))
                .collect();
            [head, tail]
        }
    }

    /// Number of canary bytes that changed.
    fn damaged(&self) -> usize {
        self.canary_ranges()
            .into_iter()
            .flatten()
            .enumerate()
            // SAFETY: canary bytes are inside the readable part of the mapping.
            .filter(|(i, p)| unsafe { std::ptr::read_volatile(*p) } != canary_byte(*i))
            .count()
    }

    fn word(&self, idx: usize) -> *mut u64 {
        assert!((idx + 1) * 8 <= self.len, "word {idx} outside the pool");
        // SAFETY: checked just above; data is page aligned so u64 access is aligned.
        unsafe { self.data.add(idx * 8).cast() }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by new() with this length.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed(room: u64, layer: u64, pos: u64) -> u64 {
    mix(room.wrapping_mul(0x1000_0000_01b3) ^ (layer << 48) ^ pos)
}

struct Pools {
    kv: Vec<Guarded>,
    aux: Guarded,
    num_pages: u64,
}

impl Pools {
    fn new(num_pages: u64) -> Pools {
        Pools {
            kv: (0..LAYERS)
                .map(|_| Guarded::new((num_pages * PAGE * ROW) as usize))
                .collect(),
            aux: Guarded::new((AUX_ROWS * AUX_ITEM) as usize),
            num_pages,
        }
    }

    fn damaged(&self) -> usize {
        self.kv.iter().map(Guarded::damaged).sum::<usize>() + self.aux.damaged()
    }

    fn rows<'a>(&self, side: &'a Side<'a>, end: u64) -> impl Iterator<Item = (u64, usize)> + 'a {
        let base = side.layout.local(side.origin);
        (side.origin..end)
            .filter(|t| side.layout.owner(*t) == side.rank)
            .map(move |t| {
                let li = side.layout.local(t) - base;
                (
                    t,
                    (side.pages[(li / PAGE) as usize] * PAGE + li % PAGE) as usize,
                )
            })
    }

    fn fill(&self, room: u64, side: &Side<'_>, end: u64, aux: u64) {
        let w = (ROW / 8) as usize;
        for (l, buf) in self.kv.iter().enumerate() {
            for (t, row) in self.rows(side, end) {
                let s = seed(room, l as u64, t);
                for j in 0..w {
                    // SAFETY: word() bounds-checks; rooms use disjoint pages.
                    unsafe {
                        buf.word(row * w + j)
                            .write_volatile(s.wrapping_add(j as u64))
                    };
                }
            }
        }
        let aw = (AUX_ITEM / 8) as usize;
        let s = seed(room, u64::MAX >> 16, 0);
        for j in 0..aw {
            // SAFETY: as above.
            unsafe {
                self.aux
                    .word(aux as usize * aw + j)
                    .write_volatile(s ^ j as u64)
            };
        }
    }

    fn verify(&self, room: u64, side: &Side<'_>, end: u64, aux: u64) -> Result<u64, String> {
        let w = (ROW / 8) as usize;
        let mut bytes = 0;
        for (l, buf) in self.kv.iter().enumerate() {
            for (t, row) in self.rows(side, end) {
                let s = seed(room, l as u64, t);
                for j in 0..w {
                    // SAFETY: word() bounds-checks.
                    let got = unsafe { buf.word(row * w + j).read_volatile() };
                    if got != s.wrapping_add(j as u64) {
                        return Err(format!(
                            "room {room}: layer {l} position {t} row {row} word {j}: {got:#x}"
                        ));
                    }
                }
                bytes += ROW;
            }
        }
        let aw = (AUX_ITEM / 8) as usize;
        let s = seed(room, u64::MAX >> 16, 0);
        for j in 0..aw {
            // SAFETY: as above.
            let got = unsafe { self.aux.word(aux as usize * aw + j).read_volatile() };
            if got != s ^ j as u64 {
                return Err(format!("room {room}: aux row {aux} word {j}: {got:#x}"));
            }
        }
        Ok(bytes + AUX_ITEM)
    }

    fn kv_pools(&self) -> Vec<KvPool> {
        self.kv
            .iter()
            .enumerate()
            .map(|(l, g)| KvPool {
                layer_id: l as u32,
                base: g.data as u64,
                page_bytes: PAGE * ROW,
                num_pages: self.num_pages,
                page_stride: PAGE * ROW,
            })
            .collect()
    }
}

fn topology(dcp: u32, rank: u32) -> Topology {
    Topology {
        engine_rank: rank,
        attn_tp_size: dcp,
        attn_tp_rank: rank,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        dcp_size: dcp,
        dcp_rank: rank,
        dcp_interleave: 1,
        page_size: PAGE as u32,
        kv_dtype: KvDtype::Bf16,
        pool: PoolKind::Mla,
        entries: (0..LAYERS)
            .map(|l| KvEntry {
                layer_id: l,
                row_bytes: ROW,
            })
            .collect(),
        cp: Default::default(),
    }
}

struct Out(Mutex<std::io::Stdout>);

impl Out {
    fn emit(&self, v: Value) {
        let mut o = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    }
}

fn outcome(e: &Engine, room: u64) -> (String, Option<String>, Option<i32>) {
    let p = e.poll(room);
    let f = (p == KvPoll::Failed).then(|| e.failure(room)).flatten();
    (
        format!("{p:?}"),
        f.as_ref().map(|f| f.to_string()),
        f.map(|f| f.status() as i32),
    )
}

fn u(v: &Value, k: &str, d: u64) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(d)
}

fn pages(v: &Value, k: &str) -> Vec<u64> {
    v.get(k)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn prefill_room(e: &Engine, pools: &Pools, out: &Out, c: &Value) {
    let room = u(c, "room", 0);
    let total = u(c, "total", PAGE);
    let chunk = u(c, "chunk_pages", 1).max(1) as usize;
    let aux = u(c, "aux", 0);
    let delay = Duration::from_millis(u(c, "delay_ms", 0));
    let timeout = Duration::from_millis(u(c, "timeout_ms", 10_000));
    let src = pages(c, "src_pages");
    let t0 = Instant::now();
    let side = Side {
        layout: DcpLayout::sglang(PAGE, 1).expect("page size"),
        rank: 0,
        pages: &src,
        origin: 0,
    };
    pools.fill(room, &side, total, aux);
    let run = || -> pdxfer::Result<()> {
        e.sender(room)?;
        while e.poll(room) == KvPoll::Bootstrapping {
            if t0.elapsed() > timeout {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut sent = 0;
        for (i, ch) in src.chunks(chunk).enumerate() {
            let last = (i + 1) * chunk >= src.len();
            let n = if last {
                total - sent
            } else {
                ch.len() as u64 * PAGE
            };
            e.send(room, ch, n, last, aux)?;
            sent += n;
            out.emit(json!({"event": "chunk", "room": room, "i": i}));
            if !last {
                std::thread::sleep(delay);
            }
        }
        Ok(())
    };
    let r = run();
    e.wait(room, timeout + Duration::from_secs(1));
    let (poll, reason, code) = outcome(e, room);
    out.emit(
        json!({"event": "done", "room": room, "poll": poll, "reason": reason, "code": code,
        "send_error": r.err().map(|x| x.to_string()), "bytes": e.room_bytes(room),
        "elapsed_ms": t0.elapsed().as_millis() as u64}),
    );
    let _ = e.clear(room);
}

fn decode_room(e: &Engine, pools: &Pools, out: &Out, c: &Value, dcp: u64, rank: u64) {
    let room = u(c, "room", 0);
    let total = u(c, "total", PAGE);
    let aux = u(c, "aux", 0);
    let timeout = Duration::from_millis(u(c, "timeout_ms", 10_000));
    let dst = pages(c, "dst_pages");
    let t0 = Instant::now();
    let r = e
        .receiver(room, 0, Some(timeout))
        .and_then(|()| e.send_metadata(room, &dst, 0, aux));
    out.emit(json!({"event": "meta", "room": room, "ok": r.is_ok()}));
    e.wait(room, timeout + Duration::from_secs(1));
    let (poll, mut reason, code) = outcome(e, room);
    let mut verified = 0;
    let mut poll = poll;
    if poll == "Success" {
        let side = Side {
            layout: DcpLayout::sglang(PAGE, dcp).expect("layout"),
            rank,
            pages: &dst,
            origin: 0,
        };
        match pools.verify(room, &side, total, aux) {
            Ok(b) => verified = b,
            Err(m) => {
                poll = "Corrupt".into();
                reason = Some(m);
            }
        }
    }
    out.emit(
        json!({"event": "done", "room": room, "poll": poll, "reason": reason, "code": code,
        "verified": verified, "elapsed_ms": t0.elapsed().as_millis() as u64}),
    );
    let _ = e.clear(room);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opt: HashMap<String, String> = HashMap::new();
    for kv in args.chunks(2) {
        if let [k, v] = kv {
            opt.insert(k.trim_start_matches("--").to_string(), v.clone());
        }
    }
    let get = |k: &str, d: &str| opt.get(k).cloned().unwrap_or_else(|| d.to_string());
    let num = |k: &str, d: u64| get(k, &d.to_string()).parse::<u64>().expect(k);
    let role = match get("role", "decode").as_str() {
        "prefill" => Role::Prefill,
        _ => Role::Decode,
    };
    let (dcp, rank) = (num("dcp", 1), num("rank", 0));
    let transport = match get("transport", "auto").as_str() {
        "cma" => TransportKind::Cma,
        "tcp" => TransportKind::Tcp,
        "local" => TransportKind::Local,
        _ => TransportKind::Auto,
    };
    let pools = Arc::new(Pools::new(if role == Role::Prefill { 64 } else { 32 }));
    let mut cfg = EngineConfig::new(
        role,
        &get("cluster", "fault"),
        &get("bootstrap", "http://127.0.0.1:1"),
        topology(dcp as u32, rank as u32),
        pools.kv_pools(),
    );
    cfg.aux = vec![AuxBuffer {
        base: pools.aux.data as u64,
        item_bytes: AUX_ITEM,
        count: AUX_ROWS,
    }];
    cfg.transport = transport;
    cfg.host = get("host", "127.0.0.1");
    cfg.staging_bytes = 1 << 20;
    cfg.dp_size = num("dp-size", 1) as u32;
    cfg.dp_rank = num("dp-rank", 0) as u32;
    cfg.lease_ttl = Duration::from_millis(num("lease-ms", 3000));
    cfg.room_timeout = Duration::from_millis(num("timeout-ms", 10_000));
    cfg.workers = num("workers", cfg.workers as u64) as usize;
    cfg.idle_timeout = Duration::from_millis(num("idle-timeout-ms", 120_000));
    cfg.keepalive = Duration::from_millis(num("keepalive-ms", 15_000));
    cfg.pin_timeout = Duration::from_millis(num("pin-timeout-ms", 60_000));
    let out = Arc::new(Out(Mutex::new(std::io::stdout())));
    // SAFETY: the pools are kept alive (Arc) until after the engine is closed at exit.
    let engine = match unsafe { Engine::new(cfg) } {
        Ok(e) => e,
        Err(e) => {
            out.emit(json!({"event": "error", "reason": e.to_string()}));
            std::process::exit(2);
        }
    };
    out.emit(json!({"event": "ready", "pid": std::process::id()}));
    let mut threads = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let Ok(c) = serde_json::from_str::<Value>(&line) else {
            out.emit(json!({"event": "error", "reason": format!("bad command {line:?}")}));
            continue;
        };
        match c.get("cmd").and_then(Value::as_str).unwrap_or("") {
            "send" | "recv" => {
                let (e, p, o) = (engine.clone(), pools.clone(), out.clone());
                threads.push(std::thread::spawn(move || {
                    if role == Role::Prefill {
                        prefill_room(&e, &p, &o, &c)
                    } else {
                        decode_room(&e, &p, &o, &c, dcp, rank)
                    }
                }));
            }
            // self-test of the detector: one stray byte just past the first pool
            "poke" => {
                // SAFETY: the byte after the pool is a canary byte inside the writable mapping.
                unsafe { *pools.kv[0].data.add(pools.kv[0].len) ^= 0xff };
                out.emit(json!({"event": "poked"}));
            }
            "check" => out.emit(json!({"event": "canaries", "damaged": pools.damaged()})),
            "stats" => out.emit(json!({"event": "stats", "rss_kib": rss_kib(), "fds": fd_count()})),
            "exit" => break,
            other => {
                out.emit(json!({"event": "error", "reason": format!("unknown command {other:?}")}))
            }
        }
        threads.retain(|t| !t.is_finished());
    }
    for t in threads {
        let _ = t.join();
    }
    engine.close();
    out.emit(json!({"event": "canaries", "damaged": pools.damaged(), "final": true}));
    drop(engine);
}
