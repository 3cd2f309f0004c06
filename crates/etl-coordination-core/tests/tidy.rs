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
