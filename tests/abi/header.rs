//! `include/pdxfer.h` exports only pdxfer's own names: functions `pdxfer_*`,
//! macros `PDXFER_*` (the include guard included), types and struct/enum tags
//! `Pdx*`, enum constants `PDX_<ENUM>_*`. A C or C++ engine includes the
//! header next to its own and autoconf's macros, so a bare `VERSION` or
//! `MAX_LINE` would collide there.
//!
//! The check is a small C declaration scanner: comments and strings dropped,
//! preprocessor lines read for `#define`, then every top-level declaration's
//! declared names (typedef names, tags, functions, enumerators) collected.

use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Macro,
    Function,
    Type,
    Enumerator,
    Global,
}

/// One exported name and what it is; `owner` is the enum of an enumerator.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Export {
    kind: Kind,
    name: String,
    owner: Option<String>,
}

/// The header without comments, and its preprocessor lines apart.
fn split_preprocessor(src: &str) -> (String, Vec<String>) {
    let mut code = String::new();
    let mut pp = Vec::new();
    let b = src.as_bytes();
    let mut i = 0;
    let mut no_comments = String::new();
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            // strings carry no declarations (`extern "C"`); keep a placeholder
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            no_comments.push_str("\"\"");
        } else {
            no_comments.push(b[i] as char);
            i += 1;
        }
    }
    let mut cont = false;
    for line in no_comments.lines() {
        let t = line.trim_start();
        if cont || t.starts_with('#') {
            if cont {
                if let Some(last) = pp.last_mut() {
                    let last: &mut String = last;
                    last.push(' ');
                    last.push_str(t.trim_end_matches('\\'));
                }
            } else {
                pp.push(t.trim_end_matches('\\').to_string());
            }
            cont = t.ends_with('\\');
        } else {
            code.push_str(line);
            code.push('\n');
        }
    }
    (code, pp)
}

fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in code.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            cur.push(c);
        } else {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// Every name the header declares at file scope.
fn exports(src: &str) -> BTreeSet<Export> {
    let (code, pp) = split_preprocessor(src);
    let mut out = BTreeSet::new();
    for d in &pp {
        let mut w = d.trim_start_matches('#').split_whitespace();
        if w.next() == Some("define") {
            if let Some(n) = w.next() {
                let n = n.split('(').next().unwrap_or(n);
                out.insert(Export {
                    kind: Kind::Macro,
                    name: n.to_string(),
                    owner: None,
                });
            }
        }
    }
    let toks = tokens(&code);
    let mut i = 0;
    let mut decl: Vec<String> = Vec::new();
    let mut depth = 0usize;
    while i < toks.len() {
        let t = toks[i].as_str();
        // `extern "C" {` ... `}` (C++ linkage) holds declarations, not a body
        if depth == 0
            && decl.is_empty()
            && t == "extern"
            && toks.get(i + 1).map(String::as_str) == Some("\"")
        {
            let mut j = i + 1;
            while j < toks.len() && toks[j] != "{" && toks[j] != ";" {
                j += 1;
            }
            if toks.get(j).map(String::as_str) == Some("{") {
                i = j + 1;
                continue;
            }
        }
        if depth == 0 && decl.is_empty() && t == "}" {
            i += 1; // the end of `extern "C" {`
            continue;
        }
        match t {
            "{" | "(" | "[" => depth += 1,
            "}" | ")" | "]" => depth = depth.saturating_sub(1),
            _ => {}
        }
        decl.push(t.to_string());
        if depth == 0 && t == ";" {
            declared(&decl, &mut out);
            decl.clear();
        }
        i += 1;
    }
    assert!(
        decl.is_empty(),
        "unterminated declaration at the end: {decl:?}"
    );
    out
}

/// The names one declaration (tokens up to and including `;`) declares.
fn declared(decl: &[String], out: &mut BTreeSet<Export>) {
    let push = |out: &mut BTreeSet<Export>, kind, name: &str, owner: Option<&str>| {
        out.insert(Export {
            kind,
            name: name.to_string(),
            owner: owner.map(str::to_string),
        });
    };
    let mut depth = 0usize;
    let mut idx = 0;
    while idx < decl.len() {
        let t = decl[idx].as_str();
        // tags: `struct X`, `enum X`, `union X` anywhere at file scope
        if depth == 0 && matches!(t, "struct" | "enum" | "union") {
            let tag = decl
                .get(idx + 1)
                .filter(|n| is_ident(n))
                .map(String::as_str);
            if let Some(tag) = tag {
                push(out, Kind::Type, tag, None);
            }
            if t == "enum" {
                // enumerators: the first identifier after `{` or `,` in its body
                let mut j = idx + 1;
                while j < decl.len() && decl[j] != "{" && decl[j] != ";" {
                    j += 1;
                }
                if decl.get(j).map(String::as_str) == Some("{") {
                    let mut d = 0usize;
                    let mut expect_name = true;
                    for tok in &decl[j + 1..] {
                        match tok.as_str() {
                            "(" | "{" | "[" => d += 1,
                            ")" | "]" => d -= 1,
                            "}" if d == 0 => break,
                            "}" => d -= 1,
                            "," if d == 0 => expect_name = true,
                            n if expect_name && d == 0 && is_ident(n) => {
                                push(out, Kind::Enumerator, n, tag);
                                expect_name = false;
                            }
                            _ => expect_name = false,
                        }
                    }
                }
            }
        }
        match t {
            "{" | "[" | "(" => depth += 1,
            "}" | "]" | ")" => depth = depth.saturating_sub(1),
            _ => {}
        }
        idx += 1;
    }
    // the declarator: outside every brace group, before `;`
    let top: Vec<&str> = {
        let mut d = 0usize;
        let mut v = Vec::new();
        for t in decl {
            match t.as_str() {
                "{" => d += 1,
                "}" => {
                    d -= 1;
                    continue;
                }
                _ => {}
            }
            if d == 0 {
                v.push(t.as_str());
            }
        }
        v
    };
    let typedef = top.first() == Some(&"typedef");
    let paren = top.iter().position(|t| *t == "(");
    let name = match paren {
        // `typedef void (*pdx_cb)(int);`: the name inside the first parentheses
        Some(p) if typedef && top.get(p + 1) == Some(&"*") => {
            top.get(p + 2).copied().filter(|n| is_ident(n))
        }
        // a function: the identifier before its parameter list
        Some(p) => top[..p].last().copied().filter(|n| is_ident(n)),
        // `typedef ... Name;` or `int32_t pdxfer_x;` (a global)
        None => top[..top.len() - 1]
            .last()
            .copied()
            .filter(|n| is_ident(n) && !matches!(*n, "struct" | "enum" | "union")),
    };
    let Some(name) = name else { return };
    let tag_only = !typedef
        && paren.is_none()
        && matches!(top[0], "struct" | "enum" | "union")
        && matches!(top.get(2), Some(&";") | Some(&":"));
    if tag_only {
        return; // `struct X;`, `enum X : int32_t {..};`: the tag was recorded above
    }
    let kind = if typedef {
        Kind::Type
    } else if paren.is_some() {
        Kind::Function
    } else {
        Kind::Global
    };
    push(out, kind, name, None);
}

/// `PdxStatus` -> `PDX_STATUS_`.
fn enumerator_prefix(owner: &str) -> String {
    let mut s = String::new();
    for (i, c) in owner.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_uppercase());
    }
    s.push('_');
    s
}

/// The names that break the prefix rule, one line each.
fn violations(header: &str) -> Vec<String> {
    exports(header)
        .into_iter()
        .filter(|e| {
            let n = e.name.as_str();
            !match e.kind {
                Kind::Macro => n.starts_with("PDXFER_"),
                Kind::Function | Kind::Global => n.starts_with("pdxfer_"),
                Kind::Type => n.starts_with("Pdx"),
                Kind::Enumerator => e
                    .owner
                    .as_deref()
                    .is_some_and(|o| o.starts_with("Pdx") && n.starts_with(&enumerator_prefix(o))),
            }
        })
        .map(|e| format!("{:?} {}", e.kind, e.name))
        .collect()
}

fn committed_header() -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("include/pdxfer.h");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

#[test]
fn the_header_exports_only_pdxfer_names() {
    let v = violations(&committed_header());
    assert!(
        v.is_empty(),
        "include/pdxfer.h exports names without the pdxfer prefix:\n  {}",
        v.join("\n  ")
    );
}

/// The scanner sees the header's real declarations (so an empty scan cannot
/// pass the check above).
#[test]
fn the_scanner_finds_every_kind_in_the_header() {
    let e = exports(&committed_header());
    let has = |kind, name: &str| e.iter().any(|x| x.kind == kind && x.name == name);
    assert!(has(Kind::Macro, "PDXFER_H"), "include guard");
    assert!(has(Kind::Macro, "PDXFER_ABI_VERSION_MAJOR"));
    assert!(has(Kind::Function, "pdxfer_engine_create"));
    assert!(has(Kind::Function, "pdxfer_abi_version"));
    assert!(has(Kind::Type, "PdxStatus"));
    assert!(has(Kind::Type, "PdxEngineConfig"));
    assert!(has(Kind::Type, "PdxEngine"));
    assert!(has(Kind::Enumerator, "PDX_STATUS_OK"));
    assert!(has(Kind::Enumerator, "PDX_STATUS_ENGINE_CLOSED"));
    let functions = e.iter().filter(|x| x.kind == Kind::Function).count();
    // every `pdxfer_name(` outside comments is one function declaration
    let toks = tokens(&split_preprocessor(&committed_header()).0);
    let listed = toks
        .windows(2)
        .filter(|w| w[0].starts_with("pdxfer_") && w[1] == "(")
        .count();
    assert!(
        functions > 0 && functions == listed,
        "{functions} functions of {listed}"
    );
}

/// Every kind of unprefixed export is caught, and prefixed ones pass.
#[test]
fn the_check_catches_each_kind_of_leak() {
    let header = r#"
#ifndef PDXFER_H
#define PDXFER_H
#define VERSION 1
#define MAX_LINE (64 << 20)
#define PDXFER_OK_MACRO 2
#define helper(x) ((x) + 1)
enum PdxColour
#if defined(__cplusplus)
  : int32_t
#endif
 {
  PDX_COLOUR_RED = 0,
  GREEN = 1,
  PDX_STATUS_WRONG_ENUM = (1 << 2),
};
enum Loose { LOOSE_A, LOOSE_B };
typedef struct PdxThing PdxThing;
typedef struct Inner { int a; } PdxOuter;
typedef uint64_t handle_t;
typedef void (*callback_fn)(int x, const char *why);
struct Plain { int32_t (*f)(void); };
#ifdef __cplusplus
extern "C" {
#endif
PdxThing *pdxfer_thing_new(const struct PdxThing *x, size_t n);
int helper_fn(int a,
              int b);
extern int32_t global_counter;
#ifdef __cplusplus
}  // extern "C"
#endif
#endif
"#;
    let mut got = violations(header);
    got.sort();
    let mut want = vec![
        "Macro VERSION",
        "Macro MAX_LINE",
        "Macro helper",
        "Enumerator GREEN",
        "Enumerator PDX_STATUS_WRONG_ENUM",
        "Type Loose",
        "Enumerator LOOSE_A",
        "Enumerator LOOSE_B",
        "Type Inner",
        "Type handle_t",
        "Type callback_fn",
        "Type Plain",
        "Function helper_fn",
        "Global global_counter",
    ];
    want.sort();
    assert_eq!(got, want);
}
