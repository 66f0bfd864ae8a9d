//! The package's surfaces: the C header's names (`header`), the `pdxfer` CLI
//! (`cli`, `bench_request`), the fuzz targets on stable (`fuzz_smoke`), the
//! planner's properties (`layout_props`), `scripts/gpu-check.sh`'s dry run
//! (`gpu_check_script`). `cargo test --test abi [filter]`.

mod bench_request;
mod cli;
mod fuzz_smoke;
mod gpu_check_script;
mod header;
mod layout_props;
