//! Workspace tidy checks (rust-analyzer style), run under `cargo test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Architecture Invariant: no crate has an import cycle between its modules. A module may use
/// its parent (a `mod.rs` that orchestrates its children, as `worker/mod.rs` does); siblings
/// may use each other only one way, so helpers live below the modules that share them.
#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    crates.push(root.join("xtask/src"));
    assert!(crates.len() >= 8, "{crates:?}");
    for src in crates {
        let modules = modules(&src);
        let graph = imports(&modules);
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{}: import cycle {}", src.display(), cycle.join(" -> "));
        }
    }
}

/// The same check, shown to fire on a crafted cycle.
#[test]
fn the_cycle_check_finds_a_cycle_between_siblings() {
    let modules: BTreeMap<String, String> = [
        ("".into(), "mod a; mod b;".into()),
        ("a".into(), "use crate::b::Thing;".into()),
        ("b".into(), "use super::a::Other;".into()),
    ]
    .into();
    let cycle = find_cycle(&imports(&modules)).expect("a cycle");
    assert_eq!(cycle, ["a", "b", "a"]);
}

/// A cycle made by paths written inline (no `use` line) and by grouped imports is found too.
#[test]
fn the_cycle_check_sees_inline_paths_and_groups() {
    let modules: BTreeMap<String, String> = [
        ("".into(), "mod a; mod b; mod c;".into()),
        ("a".into(), "fn f() { let x = crate::b::make(); }".into()),
        ("b".into(), "use crate::{c::{self, Thing as T}, io};\n// crate::a::not_a_use\n".into()),
        ("c".into(), "fn g() -> super::a::Out { todo!() }".into()),
    ]
    .into();
    let graph = imports(&modules);
    assert_eq!(graph["b"], BTreeSet::from(["c".to_owned()]), "comments are not dependencies");
    let cycle = find_cycle(&graph).expect("a cycle");
    assert_eq!(cycle, ["a", "b", "c", "a"]);
}

#[test]
fn paths_are_read_whole_from_groups_and_nested_modules() {
    let paths = crate_paths("use crate::records::{self, keys, ManifestRef};\nlet k = super::super::x::y(1);");
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        joined,
        ["crate::records", "crate::records::keys", "crate::records::ManifestRef", "super::super::x::y"]
    );
}

/// Module path (`worker::claim`, `` for the crate root) -> source text, without test modules.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|l| l == "mod" || l == "lib" || l == "main") {
                parts.pop();
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let text = text.split("#[cfg(test)]").next().unwrap_or_default().to_owned();
            out.insert(parts.join("::"), text);
        }
    }
    out
}

/// Edges module -> module it uses (any `crate::..` or `super::..` path in non-test code: `use`
/// lines, grouped imports and paths written inline in expressions or types), parents excluded.
fn imports(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for (m, text) in modules {
        let mut to = BTreeSet::new();
        let here: Vec<&str> = if m.is_empty() { vec![] } else { m.split("::").collect() };
        let parent = here[..here.len().saturating_sub(1)].join("::");
        for path in crate_paths(&without_comments(text)) {
            let mut segments: Vec<&str> = path.iter().map(String::as_str).collect();
            let mut base: Vec<&str> = Vec::new();
            match segments.first() {
                Some(&"crate") => {
                    segments.remove(0);
                }
                Some(&"super") => {
                    base = here.clone();
                    while segments.first() == Some(&"super") {
                        segments.remove(0);
                        base.pop();
                    }
                }
                _ => continue,
            }
            let target: Vec<&str> = base.into_iter().chain(segments).collect();
            let found =
                (1..=target.len()).rev().map(|n| target[..n].join("::")).find(|c| modules.contains_key(c));
            if let Some(t) = found
                && t != *m
                && t != parent
            {
                to.insert(t);
            }
        }
        graph.insert(m.clone(), to);
    }
    graph
}

/// The text with `//` comments (doc comments included) removed: a link in a doc comment is not
/// a dependency.
fn without_comments(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

/// Every path starting with `crate::` or `super::` in `text`, as segments; a group
/// (`crate::a::{b, c::d}`) gives one path per member (`crate::a::b`, `crate::a::c::d`).
fn crate_paths(text: &str) -> Vec<Vec<String>> {
    let bytes = text.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = (bytes[i..].starts_with(b"crate::") || bytes[i..].starts_with(b"super::"))
            && (i == 0 || !is_ident(bytes[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let (paths, end) = path_at(text, i);
        out.extend(paths);
        i = end.max(i + 1);
    }
    out
}

/// The path (or group of paths) starting at byte `i`, and where it ends.
fn path_at(text: &str, mut i: usize) -> (Vec<Vec<String>>, usize) {
    let bytes = text.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut prefix = Vec::new();
    loop {
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        if i > start {
            prefix.push(text[start..i].to_owned());
        }
        if bytes[i..].starts_with(b"::{") {
            // A group: split its members at top-level commas.
            let open = i + 2;
            let mut depth = 0;
            let mut close = open;
            for (k, c) in text[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            close = open + k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let inner = &text[open + 1..close];
            let mut members = Vec::new();
            let (mut depth, mut from) = (0, 0);
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        members.push(&inner[from..k]);
                        from = k + 1;
                    }
                    _ => {}
                }
            }
            members.push(&inner[from..]);
            let mut out = Vec::new();
            for member in members.into_iter().map(str::trim).filter(|m| !m.is_empty()) {
                let (subs, _) = path_at(member, 0);
                for sub in subs {
                    let sub: Vec<String> = sub.into_iter().filter(|s| s != "self").collect();
                    out.push(prefix.iter().cloned().chain(sub).collect());
                }
            }
            return (out, close + 1);
        }
        if bytes[i..].starts_with(b"::") && i + 2 < bytes.len() && is_ident(bytes[i + 2]) {
            i += 2;
            continue;
        }
        return (vec![prefix], i);
    }
}

fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        u: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(u.to_owned(), 1);
        path.push(u.to_owned());
        for v in graph.get(u).into_iter().flatten() {
            match state.get(v) {
                Some(1) => {
                    let start = path.iter().position(|p| p == v).unwrap();
                    let mut cycle = path[start..].to_vec();
                    cycle.push(v.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(v, graph, state, path) {
                        return Some(c);
                    }
                }
            }
        }
        state.insert(u.to_owned(), 2);
        path.pop();
        None
    }
    let mut state = BTreeMap::new();
    for u in graph.keys() {
        if !state.contains_key(u)
            && let Some(c) = visit(u, graph, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}
