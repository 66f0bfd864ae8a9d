//! Bootstrap: the seed scenarios with `pdxfer bootstrap`/`pdxfer rank`
//! processes (`e2e`), the etcd backend (`etcd`), hostile clients of the
//! server (`hostile`), the embedded server in-process (`http`).
//! `cargo test --test bootstrap [filter]`.

#[allow(dead_code, unused_imports)] // each binary uses part of it
#[path = "../support/mod.rs"]
mod support;

mod e2e;
mod etcd;
mod hostile;
mod http;
