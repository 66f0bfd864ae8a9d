//! Generates `include/pdxfer.h` from the Rust sources with cbindgen.
//!
//! The header is committed; the test command regenerates it and fails when the
//! committed copy differs (`git diff --exit-code include/pdxfer.h`).
use std::path::PathBuf;

fn main() {
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=src/error.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    std::fs::create_dir_all(crate_dir.join("include")).expect("create include/");
    match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(bindings) => {
            bindings.write_to_file(crate_dir.join("include/pdxfer.h"));
        }
        Err(e) => {
            // A parse failure here is a bug in our sources; rustc reports it better.
            println!("cargo:warning=cbindgen could not generate include/pdxfer.h: {e}");
        }
    }
}
