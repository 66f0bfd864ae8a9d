//! The CLI's logger: stderr, filtered by `PDXFER_LOG`.
//!
//! `PDXFER_LOG` takes env_logger's directives with the crate prefix
//! optional: `info,transport=debug` is `info,pdxfer::transport=debug`.
//! Unset, warnings and errors are shown.

/// The environment variable holding the filter.
pub const ENV: &str = "PDXFER_LOG";

/// `spec` with each `module=level` directive naming a pdxfer module made
/// absolute (`transport=debug` -> `pdxfer::transport=debug`). Bare levels,
/// `pdxfer...` and other crates' paths (`ureq::...`, `tiny_http`) are kept.
pub fn qualify(spec: &str) -> String {
    let (directives, regex) = match spec.split_once('/') {
        Some((d, r)) => (d, Some(r)),
        None => (spec, None),
    };
    let mut out: Vec<String> = Vec::new();
    for d in directives
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let (name, level) = match d.split_once('=') {
            Some((n, l)) => (n.trim(), Some(l.trim())),
            None => (d, None),
        };
        let is_level = level.is_none() && name.parse::<log::LevelFilter>().is_ok();
        let name = if is_level || !is_pdxfer_module(name) {
            name.to_string()
        } else {
            format!("pdxfer::{name}")
        };
        out.push(match level {
            Some(l) => format!("{name}={l}"),
            None => name,
        });
    }
    let mut s = out.join(",");
    if let Some(r) = regex {
        s.push('/');
        s.push_str(r);
    }
    s
}

/// The crate's top-level modules (`src/lib.rs`).
const MODULES: &[&str] = &[
    "admission",
    "auth",
    "bootstrap",
    "cuda",
    "engine",
    "error",
    "ffi",
    "layout",
    "memory",
    "relayout",
    "rng",
    "threads",
    "transport",
    "version",
];

/// Whether `path`'s first segment is a top-level module of this crate.
fn is_pdxfer_module(path: &str) -> bool {
    MODULES.contains(&path.split("::").next().unwrap_or(""))
}

/// The stderr logger for the filter `spec` (`PDXFER_LOG` syntax).
fn logger(spec: &str) -> env_logger::Logger {
    env_logger::Builder::new()
        .parse_filters(&qualify(spec))
        .format_timestamp(None)
        .target(env_logger::Target::Stderr)
        .build()
}

/// Installs the stderr logger filtered by `PDXFER_LOG` (default `warn`); a
/// second call, or another logger already installed, changes nothing.
pub fn init() {
    let l = logger(&std::env::var(ENV).unwrap_or_else(|_| "warn".into()));
    let max = l.filter();
    if log::set_boxed_logger(Box::new(l)).is_ok() {
        log::set_max_level(max);
    }
}

#[cfg(test)]
mod tests {
    use super::{logger, qualify, MODULES};
    use log::{Level, Log, Metadata};

    fn on(spec: &str, target: &str, level: Level) -> bool {
        logger(spec).enabled(&Metadata::builder().target(target).level(level).build())
    }

    #[test]
    fn the_filter_applies_per_module() {
        let spec = "info,transport=debug";
        assert!(on(spec, "pdxfer::transport::agent", Level::Debug));
        assert!(!on(spec, "pdxfer::transport::agent", Level::Trace));
        assert!(on(spec, "pdxfer::bootstrap::peer", Level::Info));
        assert!(!on(spec, "pdxfer::bootstrap::peer", Level::Debug));
        assert!(on("warn", "pdxfer::bootstrap::peer", Level::Warn));
        assert!(!on("warn", "pdxfer::engine::core", Level::Info));
        assert!(!on(
            "bootstrap=off",
            "pdxfer::bootstrap::peer",
            Level::Error
        ));
    }

    #[test]
    fn the_module_list_is_lib_rs() {
        let lib = include_str!("../../lib.rs");
        let mods: Vec<&str> = lib
            .lines()
            .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
            .collect();
        assert_eq!(mods, MODULES);
    }

    #[test]
    fn module_names_gain_the_crate_prefix() {
        assert_eq!(
            qualify("info,transport=debug"),
            "info,pdxfer::transport=debug"
        );
        assert_eq!(
            qualify("engine::worker=trace, pdxfer::layout=off,ureq=warn"),
            "pdxfer::engine::worker=trace,pdxfer::layout=off,ureq=warn"
        );
        assert_eq!(qualify("bootstrap/refused"), "pdxfer::bootstrap/refused");
        assert_eq!(qualify("debug"), "debug");
        assert_eq!(qualify(""), "");
    }
}
