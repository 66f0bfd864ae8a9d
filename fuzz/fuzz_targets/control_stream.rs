//! cargo-fuzz target `control_stream` (see fuzz/common/targets.rs).
#![no_main]

#[path = "../common/targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::run("control_stream", data));
