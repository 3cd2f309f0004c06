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

/// Edges module -> module it imports from (`use crate::..` / `use super::..`), parents excluded.
fn imports(modules: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for (m, text) in modules {
        let mut to = BTreeSet::new();
        let here: Vec<&str> = if m.is_empty() { vec![] } else { m.split("::").collect() };
        let parent = here[..here.len().saturating_sub(1)].join("::");
        for line in text.lines().map(str::trim) {
            let Some(path) = line.strip_prefix("use ").or_else(|| line.strip_prefix("pub use ")) else {
                continue;
            };
            let segments: Vec<&str> =
                path.split("::").map(|s| s.trim_matches(|c| c == ';' || c == ' ')).collect();
            let target: Vec<&str> = match segments.first() {
                Some(&"crate") => segments[1..].to_vec(),
                Some(&"super") => here[..here.len().saturating_sub(1)]
                    .iter()
                    .copied()
                    .chain(segments[1..].iter().copied())
                    .collect(),
                _ => continue,
            };
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
