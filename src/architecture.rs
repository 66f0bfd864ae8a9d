//! The layering of the crate, checked from its sources: every file under
//! `src/` is read, its comments and string literals dropped, and each path it
//! names (`use` trees, `crate::a::b` and `super::a` anywhere in the code,
//! `pdxfer::a` in the binaries) resolved to the module and file it lands in.
//! Two rules hold:
//!
//! 1. a layer uses only layers below it, in the order of [`LAYERS`] (the order
//!    the comment at the top of `lib.rs` states); the modules of [`BESIDE`]
//!    may be used by every layer and use nothing but each other; the crate
//!    root re-exports only from [`BESIDE`]; the binaries sit on top;
//! 2. inside one folder the files import each other in no circle. A
//!    folder's `mod.rs` (a binary's `main.rs`) is its facade and is left out;
//!    a subfolder is checked as a folder of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, top to bottom: each may use the ones after it.
const LAYERS: &[&str] = &[
    "ffi",
    "engine",
    "transport",
    "relayout",
    "cuda",
    "bootstrap",
    "memory",
    "layout",
];

/// Modules beside the layers: usable from anywhere, using only each other.
const BESIDE: &[&str] = &[
    "admission",
    "auth",
    "error",
    "version",
    "rng",
    "threads",
    "test_skip",
    "architecture",
];

/// Folders whose files are known to import each other in circles, exempted
/// from rule 2 until a restructure removes those circles (none now).
/// Subfolders are exempt too. Remove an entry once its folder is circle-free.
const CIRCLE_CHECK_PENDING: &[&str] = &[];

/// One source file: which crate it belongs to and its module path there.
struct Source {
    /// `src/transport/conn.rs`, relative to the package root.
    rel: String,
    /// `lib`, or `bin:<name>` for a binary.
    krate: String,
    /// Module path inside the crate (`["transport", "conn"]`).
    module: Vec<String>,
    /// The code without comments and string or char literals.
    code: String,
}

fn package_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The crate and module path of `rel` (`src/...`).
fn module_of(rel: &str) -> (String, Vec<String>) {
    let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').skip(1).collect();
    let (krate, rest): (String, &[&str]) = if parts[0] == "bin" {
        if parts.len() == 2 {
            (format!("bin:{}", parts[1]), &[])
        } else {
            (format!("bin:{}", parts[1]), &parts[2..])
        }
    } else {
        ("lib".to_string(), &parts[..])
    };
    let mut m: Vec<String> = rest.iter().map(|s| s.to_string()).collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        m.pop();
    }
    (krate, m)
}

/// `src` without comments, string literals and char literals (each replaced
/// by a space), so that paths named in docs or messages are not counted.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r'
            && (i == 0 || !ident(c[i - 1]) || c[i - 1] == 'b')
            && matches!(next, Some('"' | '#'))
        {
            // raw string r"..." / r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
            out.push(' ');
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push(' ');
        } else if c[i] == '\'' {
            if next == Some('\\') {
                // escaped char literal: up to the closing quote
                let mut j = i + 2;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push(' ');
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push(' ');
            } else {
                // a lifetime
                out.push(c[i]);
                i += 1;
            }
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Expands a `use` tree (whitespace removed, renames dropped) into paths.
fn expand_use(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        let head = &tree[..open];
        let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let mut depth = 0;
        let mut start = 0;
        let b: Vec<char> = body.chars().collect();
        let mut parts = Vec::new();
        for (k, ch) in b.iter().enumerate() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(b[start..k].iter().collect::<String>());
                    start = k + 1;
                }
                _ => {}
            }
        }
        parts.push(b[start..].iter().collect::<String>());
        let p = format!("{prefix}{head}");
        for part in parts.iter().filter(|s| !s.is_empty()) {
            if part == "self" {
                out.push(p.trim_end_matches("::").to_string());
            } else {
                expand_use(&p, part, out);
            }
        }
    } else {
        out.push(format!("{prefix}{tree}"));
    }
}

/// Every path the code names that starts at `crate`, `super`, `self` or (in a
/// binary) `pdxfer`, each with the inline module it was written in, as
/// `(path, enclosing inline modules)`.
fn paths(code: &str) -> Vec<(String, Vec<String>)> {
    let c: Vec<char> = code.chars().collect();
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let word_at = |i: usize, w: &str| {
        let wc: Vec<char> = w.chars().collect();
        c.len() >= i + wc.len()
            && c[i..i + wc.len()] == wc[..]
            && (i == 0 || !(ident(c[i - 1]) || c[i - 1] == ':'))
            && c.get(i + wc.len()).is_none_or(|&n| !ident(n))
    };
    let mut out = Vec::new();
    let mut mods: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut pending_mod: Option<String> = None;
    let mut i = 0;
    while i < c.len() {
        let here = || mods.iter().map(|(m, _)| m.clone()).collect::<Vec<_>>();
        match c[i] {
            '{' => {
                depth += 1;
                if let Some(m) = pending_mod.take() {
                    mods.push((m, depth));
                }
                i += 1;
                continue;
            }
            '}' => {
                if mods.last().is_some_and(|(_, d)| *d == depth) {
                    mods.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            ';' => {
                pending_mod = None;
            }
            _ => {}
        }
        if word_at(i, "mod") {
            let mut j = i + 3;
            while j < c.len() && c[j].is_whitespace() {
                j += 1;
            }
            let start = j;
            while j < c.len() && ident(c[j]) {
                j += 1;
            }
            pending_mod = Some(c[start..j].iter().collect());
            i = j;
            continue;
        }
        if word_at(i, "use") {
            let end = (i..c.len()).find(|&k| c[k] == ';').unwrap_or(c.len());
            let text: String = c[i + 3..end].iter().collect();
            // drop renames (`X as Y`: the `as` and the new name)
            let mut joined = String::new();
            let mut words = text.split_whitespace();
            while let Some(w) = words.next() {
                if w == "as" {
                    let next = words.next().unwrap_or("");
                    joined.push_str(next.trim_start_matches(|ch: char| ident(ch)));
                } else {
                    joined.push_str(w);
                }
            }
            let mut trees = Vec::new();
            expand_use("", &joined, &mut trees);
            for t in trees {
                out.push((t, here()));
            }
            i = end;
            continue;
        }
        let root = ["crate", "super", "self", "pdxfer"]
            .into_iter()
            .find(|r| word_at(i, r) && c.get(i + r.len()) == Some(&':'));
        if root.is_some() {
            let mut j = i;
            while j < c.len() && (ident(c[j]) || c[j] == ':') {
                j += 1;
            }
            out.push((c[i..j].iter().collect(), here()));
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// The absolute module path (crate, segments) that `path`, written in the
/// module of `src` (inside its inline modules `inline`), names; a path with
/// no `crate`/`super`/`self` root is relative to that module (a `use` of a
/// child, or of a dependency, which `Tree::references` tells apart).
fn resolve(src: &Source, path: &str, inline: &[String]) -> Option<(String, Vec<String>)> {
    let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut here: Vec<String> = src.module.iter().chain(inline).cloned().collect();
    let first = *segs.first()?;
    match first {
        "crate" => Some((
            src.krate.clone(),
            segs[1..].iter().map(|s| s.to_string()).collect(),
        )),
        "pdxfer" if src.krate != "lib" => Some((
            "lib".into(),
            segs[1..].iter().map(|s| s.to_string()).collect(),
        )),
        "super" | "self" => {
            let mut k = 0;
            while k < segs.len() && matches!(segs[k], "super" | "self") {
                if segs[k] == "super" {
                    here.pop()?;
                }
                k += 1;
            }
            here.extend(segs[k..].iter().map(|s| s.to_string()));
            Some((src.krate.clone(), here))
        }
        _ => {
            here.extend(segs.iter().map(|s| s.to_string()));
            Some((src.krate.clone(), here))
        }
    }
}

#[derive(Default)]
struct Tree {
    sources: Vec<Source>,
    /// (crate, module path) -> index into `sources`.
    by_module: BTreeMap<(String, Vec<String>), usize>,
}

impl Tree {
    fn read() -> Tree {
        let root = package_root();
        let mut files = Vec::new();
        rust_files(&root.join("src"), &mut files);
        let mut t = Tree::default();
        for f in files {
            let rel = f
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let (krate, module) = module_of(&rel);
            let text = std::fs::read_to_string(&f).unwrap();
            t.by_module
                .insert((krate.clone(), module.clone()), t.sources.len());
            t.sources.push(Source {
                rel,
                krate,
                module,
                code: strip(&text),
            });
        }
        t
    }

    /// The file holding `module` of `krate`: the longest prefix that is a file.
    fn file_of(&self, krate: &str, module: &[String]) -> Option<usize> {
        (0..=module.len())
            .rev()
            .find_map(|n| {
                self.by_module
                    .get(&(krate.to_string(), module[..n].to_vec()))
            })
            .copied()
    }

    /// Every reference of every file: (from file, to file, the path as written).
    fn references(&self) -> Vec<(usize, usize, String)> {
        let mut out = Vec::new();
        for (i, s) in self.sources.iter().enumerate() {
            for (p, inline) in paths(&s.code) {
                let Some((krate, m)) = resolve(s, &p, &inline) else {
                    continue;
                };
                let rooted = ["crate", "super", "self", "pdxfer"]
                    .iter()
                    .any(|r| p.starts_with(&format!("{r}::")) || p == *r);
                // a relative path names a child file of this module, or else
                // a dependency (std, serde, ...)
                let base = s.module.len() + inline.len();
                let child = m.get(..base + 1).map(<[String]>::to_vec);
                if !rooted
                    && child.is_none_or(|c| !self.by_module.contains_key(&(krate.clone(), c)))
                {
                    continue;
                }
                if let Some(to) = self.file_of(&krate, &m) {
                    out.push((i, to, p));
                }
            }
        }
        out
    }
}

/// The layer of a library module path: its first segment (`""` for the root).
fn layer_of(s: &Source) -> &str {
    s.module.first().map_or("", String::as_str)
}

fn rank(layer: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == layer)
}

/// Rule 1 for the edge `from -> to` (library files): `Err(why)` when broken.
fn layer_rule(from: &str, to: &str) -> Result<(), String> {
    if from == to {
        return Ok(());
    }
    let beside = |l: &str| BESIDE.contains(&l);
    match (from, rank(from), rank(to)) {
        // the root's re-exports (`crate::Result`) come from beside modules
        (_, _, _) if to.is_empty() => Ok(()),
        ("", _, _) if beside(to) => Ok(()),
        ("", _, _) => Err("the crate root re-exports only modules beside the layers".into()),
        (_, _, None) if beside(to) => Ok(()),
        (f, None, _) if beside(f) => Err(format!("`{f}` is beside the layers and uses none")),
        (_, Some(a), Some(b)) if a < b => Ok(()),
        (_, Some(_), Some(_)) => Err(format!(
            "`{to}` is above `{from}` in the layer order {}",
            LAYERS.join(" -> ")
        )),
        _ => Err(format!(
            "`{from}` or `{to}` is in neither LAYERS nor BESIDE: place it there"
        )),
    }
}

/// The folder of `rel` and whether `rel` is that folder's facade: its
/// `mod.rs`, or a binary's `main.rs`. (`src/a/b.rs` beside `src/a/b/` is a
/// file of `src/a`; the files of `src/a/b/` that use it cross folders.)
fn folder_of(rel: &str) -> (String, bool) {
    let (dir, name) = rel.rsplit_once('/').unwrap();
    let facade = name == "mod.rs" || name == "main.rs" && dir.starts_with("src/bin/");
    (dir.to_string(), facade)
}

/// A circle in `edges` (within one folder), as the list of its files.
fn find_circle(edges: &BTreeMap<usize, BTreeSet<usize>>) -> Option<Vec<usize>> {
    fn visit(
        n: usize,
        edges: &BTreeMap<usize, BTreeSet<usize>>,
        state: &mut BTreeMap<usize, u8>,
        stack: &mut Vec<usize>,
    ) -> Option<Vec<usize>> {
        state.insert(n, 1);
        stack.push(n);
        for &m in edges.get(&n).into_iter().flatten() {
            match state.get(&m).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|&x| x == m).unwrap();
                    return Some(stack[at..].to_vec());
                }
                0 => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n, 2);
        None
    }
    let mut state = BTreeMap::new();
    for &n in edges.keys() {
        if state.get(&n).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The breaches of rule 1, one line each.
fn layer_breaches(t: &Tree, refs: &[(usize, usize, String)]) -> Vec<String> {
    let mut bad = BTreeSet::new();
    for (from, to, p) in refs {
        let (f, g) = (&t.sources[*from], &t.sources[*to]);
        if f.krate != "lib" || g.krate != "lib" {
            continue;
        }
        if let Err(why) = layer_rule(layer_of(f), layer_of(g)) {
            bad.insert(format!("{} uses {} (`{p}`): {why}", f.rel, g.rel));
        }
    }
    bad.into_iter().collect()
}

/// The circles of rule 2, one line each naming every edge of the circle.
fn folder_circles(t: &Tree, refs: &[(usize, usize, String)]) -> Vec<String> {
    let mut by_folder: BTreeMap<String, BTreeMap<usize, BTreeSet<usize>>> = BTreeMap::new();
    let mut why: BTreeMap<(usize, usize), String> = BTreeMap::new();
    for (from, to, p) in refs {
        if from == to {
            continue;
        }
        let (fd, ff) = folder_of(&t.sources[*from].rel);
        let (td, tf) = folder_of(&t.sources[*to].rel);
        if fd != td || ff || tf {
            continue;
        }
        let pending = CIRCLE_CHECK_PENDING
            .iter()
            .any(|p| fd == *p || fd.starts_with(&format!("{p}/")));
        if pending {
            continue;
        }
        by_folder
            .entry(fd)
            .or_default()
            .entry(*from)
            .or_default()
            .insert(*to);
        why.entry((*from, *to)).or_insert_with(|| p.clone());
    }
    let mut out = Vec::new();
    for (folder, edges) in &by_folder {
        if let Some(c) = find_circle(edges) {
            let hops: Vec<String> = (0..c.len())
                .map(|k| {
                    let (a, b) = (c[k], c[(k + 1) % c.len()]);
                    format!(
                        "{} -> {} (`{}`)",
                        t.sources[a].rel,
                        t.sources[b].rel,
                        why[&(a, b)]
                    )
                })
                .collect();
            out.push(format!("circle in {folder}: {}", hops.join(", ")));
        }
    }
    out
}

#[test]
fn every_layer_uses_only_the_layers_below_it() {
    let t = Tree::read();
    let refs = t.references();
    assert!(refs.len() > 500, "too few references found: {}", refs.len());
    let bad = layer_breaches(&t, &refs);
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn no_folder_has_an_import_circle() {
    let t = Tree::read();
    let bad = folder_circles(&t, &t.references());
    assert!(bad.is_empty(), "import circles:\n{}", bad.join("\n"));
}

#[test]
fn the_lib_comment_states_the_layer_order() {
    let lib = std::fs::read_to_string(package_root().join("src/lib.rs")).unwrap();
    let order: Vec<String> = LAYERS
        .iter()
        .enumerate()
        .map(|(k, l)| {
            if k == 0 {
                format!("[`{l}`]")
            } else {
                format!("`{l}`")
            }
        })
        .collect();
    let flat: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join(" ");
    let flat = flat.split_whitespace().collect::<Vec<_>>().join(" ");
    let want = order.join(" -> ");
    assert!(flat.contains(&want), "lib.rs should state `{want}`: {flat}");
}

/// The checks see what they must: a path written in a comment or string is
/// not a use, `use` trees and inline modules resolve, and a made-up upward
/// edge and a made-up circle are reported with the files and the path.
#[test]
fn the_checks_catch_a_bad_import() {
    let code = strip(
        "// crate::engine::x\nlet s = \"crate::ffi::y\"; let c = '{';\n\
         use crate::{memory::Registry, layout::{plan::{self, X as Y}, Run}};\n\
         mod tests { use super::super::room::Z; fn f<'a>(x: &'a u8) {} }\n\
         let r = r#\"crate::ffi\"#; let v = crate::bootstrap::Store::new();",
    );
    let got: Vec<(String, Vec<String>)> = paths(&code);
    let names: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        names,
        [
            "crate::memory::Registry",
            "crate::layout::plan",
            "crate::layout::plan::X",
            "crate::layout::Run",
            "super::super::room::Z",
            "crate::bootstrap::Store::new"
        ],
        "{code}"
    );
    assert_eq!(got[4].1, ["tests"]);
    let src = Source {
        rel: "src/transport/conn.rs".into(),
        krate: "lib".into(),
        module: vec!["transport".into(), "conn".into()],
        code: String::new(),
    };
    assert_eq!(
        resolve(&src, "super::super::room::Z", &["tests".into()]),
        Some((
            "lib".into(),
            vec!["transport".into(), "room".into(), "Z".into()]
        ))
    );
    // rule 1
    assert!(layer_rule("transport", "cuda").is_ok());
    assert!(layer_rule("cuda", "memory").is_ok());
    assert!(layer_rule("relayout", "error").is_ok());
    assert!(layer_rule("transport", "relayout").is_ok());
    assert!(layer_rule("cuda", "relayout")
        .unwrap_err()
        .contains("above"));
    assert!(layer_rule("cuda", "transport").is_err());
    assert!(layer_rule("", "ffi").is_err());
    assert!(layer_rule("error", "layout").is_err());
    // the real tree plus one made-up upward edge and one made-up circle
    let t = Tree::read();
    let mut refs = t.references();
    let file = |rel: &str| t.sources.iter().position(|s| s.rel == rel).unwrap();
    let (cuda, relayout) = (file("src/cuda/stream.rs"), file("src/relayout/cpu.rs"));
    refs.push((cuda, relayout, "crate::relayout::cpu".into()));
    let (runs, plan) = (file("src/layout/runs.rs"), file("src/layout/plan.rs"));
    refs.push((runs, plan, "super::plan::push_run".into()));
    let bad = layer_breaches(&t, &refs);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].starts_with("src/cuda/stream.rs uses src/relayout/cpu.rs (`crate::relayout::cpu`)"),
        "{bad:?}"
    );
    let circles = folder_circles(&t, &refs);
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert!(
        circles[0].starts_with("circle in src/layout: "),
        "{circles:?}"
    );
    assert!(
        circles[0].contains("src/layout/runs.rs -> src/layout/plan.rs (`super::plan::push_run`)"),
        "{circles:?}"
    );
}
