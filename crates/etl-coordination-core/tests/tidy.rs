//! Architecture invariants of the core, checked under `cargo test` (rust-analyzer's "tidy"
//! style): the core is sans-IO and users can depend on it alone.

use std::path::Path;
use std::process::Command;

#[test]
fn the_core_depends_on_nothing_async() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "-p", "etl-coordination-core", "-e", "normal", "--prefix", "none", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8_lossy(&out.stdout);
    for banned in ["tokio", "futures", "async-nats", "mio"] {
        assert!(
            !tree.lines().any(|l| l.starts_with(banned)),
            "Architecture Invariant: the core must not depend on {banned}:\n{tree}"
        );
    }
}

#[test]
fn the_core_reads_no_clock_does_no_io_and_owns_no_randomness() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let banned = [
        "Instant::now",
        "SystemTime",
        "std::fs",
        "std::net",
        "std::thread",
        "std::env",
        "thread_rng",
        "rand::",
        "HashMap",
        "HashSet",
    ];
    let files = rust_files(&src);
    assert!(files.len() > 10 && files.iter().any(|f| f.ends_with("worker/mod.rs")), "{files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for word in banned {
            assert!(
                !text.contains(word),
                "Architecture Invariant: {} uses {word}; the core is a pure state machine (BTreeMap, not HashMap, so iteration order cannot leak into behaviour)",
                path.display()
            );
        }
    }
}

/// Every `.rs` file under `dir`, recursively (the worker's rules live in `src/worker/`).
fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The layers of `worker/`, lowest first: each file adds an `impl Worker` block for one
/// concern, and a file may call the methods of the files below it, never of one above (no two
/// rule files call each other; a change to a rule reads downward only). ARCHITECTURE.md,
/// "Inside the core", lists them in this order.
const WORKER_LAYERS: [&str; 20] = [
    "outbox",
    "resolve",
    "lease",
    "tenancy",
    "end",
    "drain",
    "commit",
    "presence",
    "plan",
    "leader",
    "heartbeat",
    "claim",
    "steal",
    "acquire",
    "watches",
    "manifest",
    "startup",
    "retries",
    "timers",
    "mod",
];

#[test]
fn no_worker_file_calls_a_method_of_a_higher_layer() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/worker");
    let mut files = std::collections::BTreeMap::new();
    for path in rust_files(&dir) {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        files.insert(name, text);
    }
    let listed: std::collections::BTreeSet<&str> = WORKER_LAYERS.into_iter().collect();
    let present: std::collections::BTreeSet<&str> = files.keys().map(String::as_str).collect();
    assert_eq!(listed, present, "every file of worker/ has a layer in WORKER_LAYERS (and only those)");
    let violations = layer_violations(&files, &WORKER_LAYERS);
    assert!(violations.is_empty(), "lower layers call higher ones:\n{}", violations.join("\n"));
}

/// The layer check fires on a crafted upward call (and on an associated function called with
/// `Self::`), and not on a call downward.
#[test]
fn the_layer_check_finds_an_upward_call() {
    let files: std::collections::BTreeMap<String, String> = [
        ("low".to_owned(), "impl Worker {\n    fn a(&self) { self.b(); }\n    fn c() {}\n}\n".to_owned()),
        (
            "high".to_owned(),
            "impl Worker {\n    pub(super) fn b(&self) { Self::c(); }\n    fn d() {}\n}\n".to_owned(),
        ),
    ]
    .into();
    assert_eq!(layer_violations(&files, &["low", "high"]), ["low.rs calls b of high.rs"]);
    assert!(layer_violations(&files, &["high", "low"]).len() == 1, "high.rs -> low.rs c is upward there");
}

/// Calls (`self.m(` or `Self::m(`) from a file's `impl Worker` blocks to a method an `impl
/// Worker` block of a higher layer defines. Test modules are not read.
fn layer_violations(files: &std::collections::BTreeMap<String, String>, layers: &[&str]) -> Vec<String> {
    let rank = |f: &str| layers.iter().position(|l| *l == f).unwrap_or(usize::MAX);
    let impls = |text: &str| -> Vec<String> {
        let text = format!("\n{}", text.split("#[cfg(test)]").next().unwrap_or(""));
        let mut out = Vec::new();
        for part in text.split("\nimpl Worker {").skip(1) {
            out.push(part.split("\n}\n").next().unwrap_or("").to_owned());
        }
        out
    };
    let mut defined = std::collections::BTreeMap::new();
    for (file, text) in files {
        for body in impls(text) {
            for line in body.lines() {
                let t = line.trim_start();
                let t = t.strip_prefix("pub(super) ").or_else(|| t.strip_prefix("pub(crate) ")).unwrap_or(t);
                if line.starts_with("    ")
                    && !line.starts_with("     ")
                    && let Some(name) = t.strip_prefix("fn ").and_then(|r| r.split(['(', '<']).next())
                {
                    defined.insert(name.to_owned(), file.clone());
                }
            }
        }
    }
    let mut out = Vec::new();
    for (file, text) in files {
        for body in impls(text) {
            for line in body.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for prefix in ["self.", "Self::"] {
                    for piece in line.split(prefix).skip(1) {
                        let name: String =
                            piece.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                        if !piece[name.len()..].starts_with('(') {
                            continue;
                        }
                        if let Some(home) = defined.get(&name)
                            && home != file
                            && rank(home) > rank(file)
                        {
                            let v = format!("{file}.rs calls {name} of {home}.rs");
                            if !out.contains(&v) {
                                out.push(v);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}
