//! The fuzz targets of `fuzz/` (cargo-fuzz needs a nightly compiler) run here
//! on the stable toolchain as bounded, seeded property tests: every target gets
//! its seed inputs, then mutations of them and random bytes. Deterministic for
//! a given seed (`PDXFER_FUZZ_SEED`, default fixed); `PDXFER_FUZZ_ITERS`
//! scales the iteration count (default 2000 per target, a few seconds in all).
//! The budget is a number of inputs, not a time: every input of it must run,
//! and no assertion depends on how fast the machine is.
//! A failing input is printed in hex and saved under `target/fuzz-failures/`;
//! inputs under `fuzz/regressions/<target>/` (crashes found before) always run.

#[path = "../../fuzz/common/targets.rs"]
mod targets;

use pdxfer::rng::SplitMix64;
use std::time::Instant;

fn mutate(rng: &mut SplitMix64, seeds: &[Vec<u8>], out: &mut Vec<u8>) {
    out.clear();
    if seeds.is_empty() || rng.index(8) == 0 {
        let n = rng.index(256);
        out.extend((0..n).map(|_| rng.next_u64() as u8));
        return;
    }
    out.extend_from_slice(&seeds[rng.index(seeds.len())]);
    for _ in 0..1 + rng.index(4) {
        let len = out.len();
        match rng.index(7) {
            0 if len > 0 => out[rng.index(len)] ^= 1 << rng.index(8),
            1 if len > 0 => out[rng.index(len)] = rng.next_u64() as u8,
            2 => out.insert(rng.index(len + 1), rng.next_u64() as u8),
            3 if len > 0 => {
                out.remove(rng.index(len));
            }
            4 if len > 0 => out.truncate(rng.index(len)),
            5 if len > 0 => {
                // an interesting integer at a random place
                let v: [u8; 8] = [0u64, 1, u64::MAX, u32::MAX as u64, 1 << 31, 64 << 20]
                    [rng.index(6)]
                .to_le_bytes();
                let at = rng.index(len);
                for (i, b) in v.iter().enumerate().take(len - at) {
                    out[at + i] = *b;
                }
            }
            _ => {
                let other = &seeds[rng.index(seeds.len())];
                if !other.is_empty() {
                    let at = rng.index(other.len());
                    out.extend_from_slice(&other[at..]);
                }
            }
        }
    }
}

fn fuzz(name: &str, iters_scale: u64) {
    let seed = std::env::var("PDXFER_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f00d_u64);
    let iters = std::env::var("PDXFER_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000u64)
        * iters_scale
        / 4;
    let mut rng = SplitMix64::new(seed ^ name.len() as u64 ^ (name.as_bytes()[0] as u64) << 32);
    let mut seeds = targets::seeds(name);
    // inputs that once failed (fuzz/regressions/<target>/) always run first
    let reg = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(name);
    if let Ok(rd) = std::fs::read_dir(&reg) {
        let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            seeds.insert(0, std::fs::read(&f).expect("regression input"));
        }
    }
    let t0 = Instant::now();
    let mut input = Vec::new();
    let mut ran = 0u64;
    for i in 0..iters + seeds.len() as u64 {
        if let Some(s) = seeds.get(i as usize) {
            input.clone_from(s);
        } else {
            mutate(&mut rng, &seeds, &mut input);
        }
        let r = std::panic::catch_unwind(|| targets::run(name, &input));
        ran += 1;
        if r.is_err() {
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../fuzz-failures");
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("{name}-{seed}-{i}"));
            let _ = std::fs::write(&path, &input);
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            panic!(
                "fuzz target {name} failed on input {i} (saved to {}): {hex}",
                path.display()
            );
        }
    }
    let budget = iters + seeds.len() as u64;
    assert_eq!(
        ran, budget,
        "fuzz target {name}: ran {ran} of {budget} inputs"
    );
    assert!(
        iters == 0 || ran > seeds.len() as u64,
        "fuzz target {name}: no mutated input ran"
    );
    eprintln!("fuzz {name}: {ran} inputs in {:?}", t0.elapsed());
}

#[test]
fn fuzz_wire_records() {
    fuzz("wire", 4);
}

#[test]
fn fuzz_transport_handshake() {
    fuzz("transport_handshake", 4);
}

#[test]
fn fuzz_rdma_handshake() {
    fuzz("rdma_handshake", 4);
}

#[test]
fn fuzz_control_messages() {
    fuzz("control", 4);
}

#[test]
fn fuzz_control_stream_reader() {
    // one loopback connection per input: fewer of them
    fuzz("control_stream", 1);
}

#[test]
fn fuzz_bootstrap_json() {
    fuzz("bootstrap_json", 4);
}

#[test]
fn fuzz_c_abi() {
    fuzz("c_abi", 4);
}

#[test]
fn every_target_has_a_test_and_seeds() {
    for t in targets::TARGETS {
        assert!(!targets::seeds(t).is_empty(), "{t} has no seeds");
    }
}
