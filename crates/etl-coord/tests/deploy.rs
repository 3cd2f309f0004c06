//! The files under `deploy/` checked against the code they configure, and run as far as a
//! machine without Docker or Kubernetes allows:
//!
//! - the compose file's commands run against a NATS server started from the compose NATS
//!   configuration (TLS with a certificate from `deploy/nats/dev-ca.sh`, authorization on): the
//!   set-up service creates the job's buckets as its user, then two replicas complete the job as
//!   the job's user; a client without credentials is refused;
//! - the NATS accounts in the compose and Kubernetes configurations are what
//!   `etl-coord nats-account` prints for the commands written above them;
//! - the Kubernetes NATS configuration forms a 3-node JetStream cluster on loopback (TLS and
//!   users as configured, passwords from the Secrets its env names), the bucket Job's pod
//!   creates the job's buckets, two "pods" built from the backfill Job's container spec
//!   complete the job on it with replicas 3 and exit 0, and two from the Deployment's come up,
//!   see it complete and stay up serving their admin endpoints; a server that dials a node's
//!   route port without the route password or without a certificate the CA signed is refused
//!   (and its anonymous client cannot read the job), one with both joins; monitoring listens
//!   on localhost only;
//! - the NetworkPolicy admits the route port from the NATS pods only and the client port from
//!   every shipped pod that talks to NATS, and nothing else;
//! - every worker flag any file uses exists in `etl-coord worker --help`; cross-file names
//!   (services, ports, probes, annotations, grace period vs drain timeout) agree;
//! - the alert rules pass `promtool check rules` and their `promtool test rules` unit tests; the
//!   dashboard's queries are valid PromQL; every metric and label value they use exists.
//!
//! Needs `NATS_SERVER_BIN` and `PROMTOOL` (`cargo xtask ci` provisions both).

mod common;

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use common::http_get;
use etl_coordination_metrics::{
    ACQUISITION_REASONS, JOB_STATES, REVOCATION_REASONS, SPLIT_STATES, STORE_OPS, WRITE_OUTCOMES, names,
};
use serde_norway::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy").canonicalize().unwrap()
}

fn read(rel: &str) -> String {
    let p = deploy().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn yaml_docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_norway::Deserializer::from_str(&text)
        .map(|d| {
            let mut v: Value =
                serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"));
            v.apply_merge().unwrap_or_else(|e| panic!("{rel}: merge keys: {e}"));
            v
        })
        .collect()
}

/// The development CA and a server certificate, from the script deploy/ ships.
fn dev_certs(dir: &Path) {
    let out = Command::new("sh").arg(deploy().join("nats/dev-ca.sh")).arg(dir).output().unwrap();
    assert!(out.status.success(), "dev-ca.sh: {}", String::from_utf8_lossy(&out.stderr));
}

/// Every `# etl-coord nats-account ...` line of a NATS configuration is followed by what that
/// command prints (whitespace aside): nobody edits an account or a permission block by hand.
/// A job's users live in its own account (the boundary between jobs), nowhere else.
fn assert_generated_accounts(what: &str, conf: &str) {
    let squash = |t: &str| {
        t.lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut n = 0;
    for line in conf.lines().filter_map(|l| l.trim().strip_prefix("# etl-coord nats-account ")) {
        let out = etl_coord().arg("nats-account").args(line.split_whitespace()).output().unwrap();
        assert!(out.status.success(), "{what}: `etl-coord nats-account {line}`");
        let entry = squash(&String::from_utf8_lossy(&out.stdout));
        assert!(
            squash(conf).contains(&entry),
            "{what}: the entry under `{line}` is not what it prints:\n{entry}"
        );
        n += 1;
    }
    assert!(n >= 1, "{what}: a job's account under its command");
    assert!(
        !conf.contains("authorization {\n  users") && !conf.contains("authorization {\n      users"),
        "{what}: users outside an account"
    );
}

/// `text` with every occurrence of the container path `from` (`count` of them) moved to `to`.
fn replace_n(text: &str, from: &str, to: &Path, count: usize) -> String {
    assert_eq!(text.matches(from).count(), count, "{from} {count} times in\n{text}");
    text.replace(from, &to.display().to_string())
}

/// The value of a compose environment entry: `${NAME:?message}` (compose refuses to start
/// without NAME) is `secrets[NAME]`; a container path of a mount is its path on this machine.
fn compose_value(v: &str, secrets: &[(&str, &str)], mounts: &[(String, PathBuf)]) -> String {
    if let Some(rest) = v.strip_prefix("${") {
        let name = rest.split(":?").next().unwrap();
        assert!(rest.contains(":?"), "{v}: required (`${{{name}:?...}}`), never a default password");
        return secrets
            .iter()
            .find(|(k, _)| *k == name)
            .unwrap_or_else(|| panic!("no secret {name}"))
            .1
            .to_owned();
    }
    mounts.iter().find(|(c, _)| c == v).map_or(v.to_owned(), |(_, h)| h.display().to_string())
}

/// A compose service's environment, resolved as [`compose_value`] does.
fn compose_env(
    service: &Value,
    secrets: &[(&str, &str)],
    mounts: &[(String, PathBuf)],
) -> Vec<(String, String)> {
    service["environment"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_owned(), compose_value(v.as_str().unwrap(), secrets, mounts)))
        .collect()
}

/// A compose service's file mounts: container path, path on this machine.
fn compose_mounts(service: &Value) -> Vec<(String, PathBuf)> {
    service["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| {
            let (src, rest) = v.as_str().unwrap().split_once(':').unwrap();
            (rest.split(':').next().unwrap().to_owned(), deploy().join(src))
        })
        .collect()
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

fn str_of<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    s(v, path).as_str().unwrap_or_else(|| panic!("{} is not a string in {v:?}", path.join(".")))
}

fn etl_coord() -> Command {
    Command::new(env!("CARGO_BIN_EXE_etl-coord"))
}

/// The long flags `etl-coord worker --help` lists.
fn worker_flags() -> BTreeSet<String> {
    let out = etl_coord().args(["worker", "--help"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            l.strip_prefix("--").map(|f| format!("--{}", f.split([' ', '=']).next().unwrap()))
        })
        .collect()
}

fn assert_known_flags(what: &str, args: &[String]) {
    let known = worker_flags();
    assert!(known.len() > 10, "could not read the flags from `etl-coord worker --help`: {known:?}");
    for a in args.iter().filter(|a| a.starts_with("--")) {
        assert!(known.contains(a.as_str()), "{what} uses {a}, which `etl-coord worker --help` does not list");
    }
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).map(|i| args[i + 1].as_str())
}

fn secs(v: &str) -> u64 {
    v.strip_suffix('s').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{v:?} is not N s"))
}

/// Processes killed when the test ends, pass or fail.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a `nats-server` (`NATS_SERVER_BIN`) with `config` (file path) and `args`, and waits
/// (bounded) until its client port accepts connections.
fn nats_server(config: &Path, port: u16, env: &[(&str, &str)], args: &[String]) -> Child {
    let bin = std::env::var("NATS_SERVER_BIN")
        .expect("NATS_SERVER_BIN is not set: run `cargo xtask ci`, which provisions nats-server");
    let log = config.with_extension("log");
    let mut child = Command::new(bin)
        .arg("-c")
        .arg(config)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if child.try_wait().unwrap().is_some() || t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("nats-server with {} did not start:\n{log}", config.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// `conf` with the one occurrence of the container path `from` moved to `to` on this machine.
fn replace_once(conf: &str, from: &str, to: &Path) -> String {
    assert_eq!(conf.matches(from).count(), 1, "{from} once in\n{conf}");
    conf.replace(from, &to.display().to_string())
}

/// Spawns `cmd` with stderr followed line by line on a thread.
fn spawn_following(cmd: &mut Command) -> (Child, Receiver<String>) {
    let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Waits (bounded) for a stderr line containing `text`; returns the lines seen.
fn wait_for_line(rx: &Receiver<String>, text: &str, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line.contains(text) => return seen,
            Ok(line) => seen.push(line),
            Err(e) => panic!("no line containing {text:?} ({e}); stderr so far:\n{}", seen.join("\n")),
        }
    }
}

fn status_json(job: &str, store: &str, env: &[(String, String)]) -> serde_json::Value {
    let out = etl_coord()
        .args(["status", "--json", "--job", job, "--store", store])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_all_done(job: &str, store: &str, env: &[(String, String)]) {
    let st = status_json(job, store, env);
    let splits = st["splits"].as_array().unwrap();
    assert!(!splits.is_empty(), "{st}");
    assert!(splits.iter().all(|s| s["state"] == "Done"), "every split Done: {st}");
}

fn assert_job_state_complete(admin: &str) {
    let metrics = http_get(admin, "/metrics").expect("the admin server answers");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("etl_coordination_job_state{") && l.ends_with(r#"state="complete"} 1"#)),
        "job_state complete on {admin}:\n{metrics}"
    );
}

fn sigterm(child: &Child) {
    let ok = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success();
    assert!(ok);
}

/// Waits (bounded) for `child` to exit; its exit code.
fn exit_within(child: &mut Child, within: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        assert!(t.elapsed() < within, "did not exit within {within:?} of SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_dockerfile_builds_the_worker_with_the_pinned_toolchain_and_its_features() {
    let docker = read("Dockerfile");
    let toolchain = std::fs::read_to_string(deploy().join("../rust-toolchain.toml")).unwrap();
    let channel = toolchain.lines().find_map(|l| l.strip_prefix("channel = ")).unwrap().trim_matches('"');
    let minor = channel.rsplit_once('.').unwrap().0; // 1.95.0 -> 1.95
    assert!(
        docker.lines().any(|l| l.starts_with(&format!("ARG RUST_IMAGE=rust:{minor}-"))),
        "the build stage's default base has the toolchain of rust-toolchain.toml ({channel})"
    );
    assert!(docker.lines().any(|l| l == "FROM ${RUST_IMAGE} AS build"), "the build base is a build argument");
    assert!(docker.lines().any(|l| l == "FROM ${RUNTIME_IMAGE}"), "the runtime base is a build argument");
    let build = docker.lines().find(|l| l.contains("cargo build")).expect("a cargo build step");
    assert!(build.contains("--locked") && build.contains("-p etl-coord"), "{build}");
    let cargo = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let features = build.split("--features ").nth(1).unwrap().split_whitespace().next().unwrap();
    for f in features.split(',') {
        assert!(cargo.contains(&format!("\n{f} = [")), "feature {f} exists in etl-coord's Cargo.toml");
    }
    assert!(docker.contains(r#"ENTRYPOINT ["etl-coord"]"#));
    assert!(docker.contains("COPY --from=build /src/target/release/etl-coord /usr/local/bin/etl-coord"));
    let ignore = std::fs::read_to_string(deploy().join("../.dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l.trim() == "target/"), "the build context leaves target/ out");
}

#[test]
fn the_compose_services_run_their_commands_against_the_compose_nats_config() {
    let compose = yaml_docs("docker-compose.yml").remove(0);
    let nats = &compose["services"]["nats"];
    // `${NATS_IMAGE:-nats:2.11-alpine}`: the public image unless a machine without a registry
    // names a local one (the compose test of `cargo xtask itest` does).
    let image = str_of(nats, &["image"]);
    let default = image.strip_prefix("${NATS_IMAGE:-").and_then(|i| i.strip_suffix('}')).unwrap_or(image);
    assert!(default.starts_with("nats:2.11"), "NATS >= 2.11: {nats:?}");
    let nats_mounts = compose_mounts(nats);
    let (conf_dst, dev_conf) = nats_mounts.iter().find(|(c, _)| c.ends_with(".conf")).unwrap().clone();
    let cmd: Vec<&str> = nats["command"].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(cmd, ["--config", conf_dst.as_str()], "the server runs the mounted configuration");
    let dev = std::fs::read_to_string(&dev_conf).unwrap();
    assert!(dev.contains("sync_interval: always"));
    assert_generated_accounts("nats/dev.conf", &dev);
    // The health check asks the monitoring port the configuration opens, inside the container:
    // monitoring listens on localhost only, and no port of the host leads to it.
    let check = nats["healthcheck"]["test"].as_sequence().unwrap();
    let url = check.iter().filter_map(|v| v.as_str()).find(|a| a.starts_with("http://")).unwrap();
    let monitor = url.strip_prefix("http://").unwrap().split('/').next().unwrap();
    assert!(monitor.starts_with("127.0.0.1:"), "{url}");
    assert!(dev.contains(&format!("\nhttp: {monitor}\n")), "{url} vs\n{dev}");
    let mport = monitor.split(':').nth(1).unwrap();
    let published = nats["ports"].as_sequence().unwrap();
    assert!(
        published.iter().all(|p| !p.as_str().unwrap().ends_with(&format!(":{mport}"))),
        "the monitoring port is not published: {published:?}"
    );

    let buckets = &compose["services"]["buckets"];
    assert_eq!(buckets["depends_on"]["nats"]["condition"].as_str(), Some("service_healthy"));
    let pipeline = &compose["services"]["pipeline"];
    let condition = pipeline["depends_on"]["buckets"]["condition"].as_str();
    assert_eq!(condition, Some("service_completed_successfully"), "replicas start once the buckets exist");
    let replicas = pipeline["deploy"]["replicas"].as_u64().unwrap();
    assert_eq!(replicas, 2);
    assert_eq!(
        str_of(pipeline, &["environment", "NATS_URL"]),
        "nats://nats:4222",
        "the nats service's client port"
    );
    let script_of = |service: &Value| {
        let entry: Vec<&str> =
            service["entrypoint"].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(&entry[..2], ["/bin/sh", "-c"]);
        // Compose turns `$$` into `$`; the container's shell expands the rest.
        entry[2].replace("$$", "$")
    };
    let mut script = script_of(pipeline);
    let words: Vec<String> = script.split_whitespace().map(|w| w.trim_matches('"').to_owned()).collect();
    assert_eq!(&words[..3], ["exec", "etl-coord", "worker"]);
    assert_known_flags("docker-compose.yml", &words);
    let grace = secs(str_of(pipeline, &["stop_grace_period"]));
    assert!(grace > secs(flag(&words, "--drain-timeout").unwrap()), "stop_grace_period > --drain-timeout");
    assert_eq!(flag(&words, "--instance-id"), Some("$HOSTNAME"), "instance ids from the container hostname");
    assert_eq!(
        flag(&words, "--on-complete"),
        Some("wait"),
        "a restart: on-failure replica stays up when done"
    );
    let job = flag(&words, "--job").unwrap().to_owned();
    let setup_script = script_of(buckets);
    assert!(setup_script.contains(&format!("etl-coord nats-buckets --job {job} ")), "{setup_script}");
    // Users: the job's for the replicas, the set-up user for the buckets; both from dev.conf.
    assert_eq!(str_of(pipeline, &["environment", "ETL_COORD_NATS_USER"]), format!("etl-{job}"));
    assert_eq!(str_of(buckets, &["environment", "ETL_COORD_NATS_USER"]), format!("setup-{job}"));

    // What Docker would do for us: the NATS server from the compose config (on a free port, a
    // temporary store instead of /data, certificates from dev-ca.sh where nats/certs is
    // mounted, the passwords compose requires), the mounts mapped to their directories on
    // this machine, and each replica in its own network namespace (here: its own admin port).
    let tmp = tempfile::tempdir().unwrap();
    let certs = tmp.path().join("certs");
    dev_certs(&certs);
    let (certs_dst, _) = nats_mounts.iter().find(|(c, _)| !c.ends_with(".conf")).unwrap();
    let secrets = [("ETL_JOB_NATS_PASSWORD", "job-secret"), ("ETL_SETUP_NATS_PASSWORD", "setup-secret")];
    let port = etl_coordination_testkit::free_port();
    let local_conf = tmp.path().join("dev.conf");
    let conf = replace_n(&replace_once(&dev, "/data", tmp.path()), certs_dst, &certs, 2);
    std::fs::write(&local_conf, conf).unwrap();
    let server_env = compose_env(nats, &secrets, &nats_mounts);
    let server_env: Vec<(&str, &str)> = server_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut procs = Procs(vec![nats_server(
        &local_conf,
        port,
        &server_env,
        &["-m".into(), etl_coordination_testkit::free_port().to_string()],
    )]);
    let store = format!("nats://127.0.0.1:{port}");
    // Client mounts: the CA file is the one dev-ca.sh made; the input is deploy/input.
    let client_env = |service: &Value| {
        let mounts: Vec<(String, PathBuf)> = compose_mounts(service)
            .into_iter()
            .map(|(c, h)| if h.ends_with("certs/ca.pem") { (c, certs.join("ca.pem")) } else { (c, h) })
            .collect();
        let mut env = compose_env(service, &secrets, &mounts);
        env.iter_mut().filter(|(k, _)| k == "NATS_URL").for_each(|(_, v)| *v = store.clone());
        (env, mounts)
    };
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_etl-coord")).parent().unwrap().to_owned();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    // Authorization is on: no credentials, no access.
    let anonymous = etl_coord()
        .args(["status", "--job", &job, "--store", &store, "--nats-tls-ca"])
        .arg(certs.join("ca.pem"))
        .output()
        .unwrap();
    assert_eq!(anonymous.status.code(), Some(1), "a client without credentials is refused");
    // The set-up service first, then the replicas.
    let (setup_env, _) = client_env(buckets);
    let out = Command::new("/bin/sh")
        .args(["-c", &setup_script])
        .env("PATH", &path)
        .envs(setup_env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    assert!(out.status.success(), "the buckets service: {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("created"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let (worker_env, mounts) = client_env(pipeline);
    let (input_dst, input) = mounts.iter().find(|(_, h)| h.ends_with("input")).unwrap();
    script = script.replace(&format!("files:{input_dst}"), &format!("files:{}", input.display()));
    let mut replicas_out = Vec::new();
    for i in 0..replicas {
        let admin = format!("127.0.0.1:{}", etl_coordination_testkit::free_port());
        let script = script.replace(flag(&words, "--admin-addr").unwrap(), &admin);
        let (child, rx) = spawn_following(
            Command::new("/bin/sh")
                .args(["-c", &script])
                .env("PATH", &path)
                .env("HOSTNAME", format!("pipeline-{i}"))
                .envs(worker_env.iter().map(|(k, v)| (k, v))),
        );
        procs.0.push(child);
        replicas_out.push((rx, admin));
    }
    for (i, (rx, admin)) in replicas_out.iter().enumerate() {
        let seen = wait_for_line(rx, "staying after the end", Duration::from_secs(60));
        assert!(seen.iter().all(|l| !l.contains("ERROR")), "{}", seen.join("\n"));
        assert_job_state_complete(admin);
        let metrics = http_get(admin, "/metrics").unwrap();
        assert!(
            metrics.contains(&format!(r#"coordination_instance="pipeline-{i}""#)),
            "id from $HOSTNAME:\n{metrics}"
        );
    }
    let status_env: Vec<(String, String)> = worker_env.into_iter().filter(|(k, _)| k != "NATS_URL").collect();
    assert_all_done(&job, &store, &status_env);
    for child in procs.0.iter_mut().skip(1) {
        sigterm(child);
        assert_eq!(exit_within(child, Duration::from_secs(grace)), Some(0));
    }
}

/// The env entry `name` of a container spec.
fn env_entry<'a>(container: &'a Value, name: &str) -> &'a Value {
    let env = container["env"].as_sequence().unwrap();
    env.iter().find(|e| e["name"] == name).unwrap_or_else(|| panic!("no env {name} in {container:?}"))
}

/// The literal value of the env entry `name` of a container spec.
fn env_value(container: &Value, name: &str) -> String {
    str_of(env_entry(container, name), &["value"]).to_owned()
}

/// A container's env as a pod would have it: values as written, with `$(NAME)` replaced by the
/// value of an entry above it (Kubernetes' dependent variables), the pod name from the downward
/// API, a Secret's key as `secret(name, key)`, and container paths of `mounts` moved to this
/// machine.
fn pod_env(container: &Value, pod_name: &str, mounts: &[(&str, &Path)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = Vec::new();
    for e in container["env"].as_sequence().unwrap() {
        let value = match (&e["value"], &e["valueFrom"]) {
            (Value::String(v), _) => {
                let v =
                    env.iter().fold(v.clone(), |v, (name, value)| v.replace(&format!("$({name})"), value));
                assert!(!v.contains("$("), "{v}: a $(NAME) that no entry above defines");
                mounts.iter().find(|(c, _)| *c == v).map_or(v, |(_, h)| h.display().to_string())
            }
            (_, from) if from["fieldRef"]["fieldPath"] == "metadata.name" => pod_name.to_owned(),
            (_, from) if !from["secretKeyRef"].is_null() => {
                secret(str_of(from, &["secretKeyRef", "name"]), str_of(from, &["secretKeyRef", "key"]))
            }
            other => panic!("unexpected env entry {other:?}"),
        };
        env.push((e["name"].as_str().unwrap().to_owned(), value));
    }
    env
}

/// The value this test gives the key `key` of the Secret `name`.
fn secret(name: &str, key: &str) -> String {
    format!("{name}-{key}-value")
}

/// The backfill Job of backfill.yaml, its container, and its args.
fn backfill_job() -> (Value, Value, Vec<String>) {
    let docs = yaml_docs("kubernetes/backfill.yaml");
    let job = docs
        .iter()
        .find(|d| d["kind"] == "Job" && d["metadata"]["name"] == "etl-backfill")
        .expect("the backfill Job")
        .clone();
    let container = job["spec"]["template"]["spec"]["containers"][0].clone();
    let args =
        container["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    (job, container, args)
}

#[test]
fn the_kubernetes_backfill_job_agrees_with_the_worker_and_the_deployment() {
    let (job, container, args) = backfill_job();
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(args[0], "worker");
    assert_known_flags("backfill.yaml", &args);
    // A Job's pods exit when the job is complete; a stall exits 3 and fails the Job at once.
    assert!(flag(&args, "--on-complete").is_none_or(|v| v == "exit"), "Job pods must exit when done");
    assert_eq!(flag(&args, "--on-stall"), Some("fatal"));
    assert_eq!(str_of(pod, &["restartPolicy"]), "Never", "podFailurePolicy needs restartPolicy Never");
    let rules = job["spec"]["podFailurePolicy"]["rules"].as_sequence().unwrap();
    let drained: u64 =
        flag(&args, "--exit-code-when-drained").expect("drained pods exit non-zero").parse().unwrap();
    assert!(drained != 0 && drained != 3, "a drained pod is neither a success nor a stall");
    assert!(
        rules
            .iter()
            .any(|r| r["action"] == "Ignore" && r["onPodConditions"][0]["type"] == "DisruptionTarget"),
        "evicted (drained) pods are replaced without counting: {rules:?}"
    );
    let rule = rules.iter().find(|r| r["action"] == "FailJob").expect("a FailJob rule");
    assert_eq!(rule["onExitCodes"]["containerName"], container["name"]);
    assert_eq!(rule["onExitCodes"]["values"][0].as_u64(), Some(3), "exit code 3 is a stall");
    assert!(job["spec"]["parallelism"].as_u64().unwrap() >= 2, "several pods share the job");
    assert!(job["spec"]["completions"].is_null(), "work-queue Job: done when the pods exit 0");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace > secs(flag(&args, "--drain-timeout").unwrap()), "grace period > drain timeout");
    assert!(args.iter().all(|a| a != "--instance-id"), "instance ids from the pod name");
    // The same job, store, NATS user, CA and source as the Deployment; only the ending differs.
    let (_, dep_container, dep_args) = deployment();
    for f in [
        "--job",
        "--store",
        "--nats-replicas",
        "--source",
        "--lease-duration",
        "--max-attempts",
        "--drain-timeout",
    ] {
        assert_eq!(flag(&args, f), flag(&dep_args, f), "{f} as in pipeline.yaml");
    }
    assert_eq!(container["env"], dep_container["env"], "the same environment as the Deployment's pods");
    assert_eq!(pod["volumes"], deployment().0["spec"]["template"]["spec"]["volumes"], "the CA volume");
    // Its bucket Job is pipeline.yaml's.
    let docs = yaml_docs("kubernetes/backfill.yaml");
    let setup = docs.iter().find(|d| d["metadata"]["name"] == "etl-pipeline-buckets").unwrap();
    let pipeline = yaml_docs("kubernetes/pipeline.yaml");
    assert_eq!(setup, pipeline.iter().find(|d| d["kind"] == "Job").unwrap(), "one bucket Job, two files");
}

/// The pipeline Deployment, its container, and its args.
fn deployment() -> (Value, Value, Vec<String>) {
    let docs = yaml_docs("kubernetes/pipeline.yaml");
    let dep = docs.iter().find(|d| d["kind"] == "Deployment").expect("a Deployment").clone();
    let container = dep["spec"]["template"]["spec"]["containers"][0].clone();
    let args =
        container["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    (dep, container, args)
}

#[test]
fn the_kubernetes_deployment_agrees_with_the_worker_and_the_services() {
    let docs = yaml_docs("kubernetes/pipeline.yaml");
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, BTreeSet::from(["Deployment", "Job", "Service"]), "a plain Deployment, no StatefulSet");
    let (dep, container, args) = deployment();
    let pod = &dep["spec"]["template"];
    assert_eq!(args[0], "worker");
    assert_known_flags("pipeline.yaml", &args);
    let job = flag(&args, "--job").unwrap();

    // NATS as the job's own user, over TLS; the only volume is the CA certificate, from the
    // ConfigMap nats-ca (not the Secret that holds the server's key).
    let ca_only = |pod_spec: &Value, container: &Value| {
        let volumes = pod_spec["volumes"].as_sequence().unwrap();
        assert_eq!(volumes.len(), 1, "one volume: {volumes:?}");
        assert_eq!(str_of(&volumes[0], &["configMap", "name"]), "nats-ca");
        let items = volumes[0]["configMap"]["items"].as_sequence().unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(str_of(&items[0], &["key"]), "ca.crt");
        let mount = &container["volumeMounts"][0];
        assert_eq!(mount["name"], volumes[0]["name"]);
        let ca = format!("{}/{}", str_of(mount, &["mountPath"]), str_of(&items[0], &["path"]));
        assert_eq!(
            env_value(container, "ETL_COORD_NATS_TLS_CA"),
            ca,
            "ETL_COORD_NATS_TLS_CA names the mounted CA"
        );
    };
    ca_only(&pod["spec"], &container);
    assert_eq!(env_value(&container, "ETL_COORD_NATS_USER"), format!("etl-{job}"));
    let password = env_entry(&container, "ETL_COORD_NATS_PASSWORD");
    assert_eq!(str_of(password, &["valueFrom", "secretKeyRef", "name"]), "etl-pipeline-nats");
    // The bucket Job: the same job, replicas and store, as the set-up user.
    let setup = docs.iter().find(|d| d["kind"] == "Job").unwrap();
    let setup_pod = &setup["spec"]["template"]["spec"];
    let setup_container = &setup_pod["containers"][0];
    let setup_args: Vec<String> = setup_container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(setup_args[0], "nats-buckets");
    for f in ["--job", "--store", "--nats-replicas"] {
        assert_eq!(flag(&setup_args, f), flag(&args, f), "the bucket Job's {f}");
    }
    assert_eq!(env_value(setup_container, "ETL_COORD_NATS_USER"), format!("setup-{job}"));
    ca_only(setup_pod, setup_container);

    // Drain on SIGTERM must finish before the kubelet's SIGKILL.
    let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    let drain = secs(flag(&args, "--drain-timeout").expect("--drain-timeout set explicitly"));
    assert!(grace > drain, "terminationGracePeriodSeconds {grace} > drain timeout {drain}");

    // Replicated buckets, with leases long enough for a NATS leader election.
    assert_eq!(flag(&args, "--nats-replicas"), Some("3"));
    assert!(secs(flag(&args, "--lease-duration").unwrap()) >= 15);
    assert_eq!(flag(&args, "--on-complete"), Some("wait"), "a finished pod must not crash-loop");

    // The instance id comes from the pod name through the downward API.
    let env = container["env"].as_sequence().unwrap();
    let pod_name = env.iter().find(|e| e["name"] == "POD_NAME").expect("POD_NAME in env");
    assert_eq!(str_of(pod_name, &["valueFrom", "fieldRef", "fieldPath"]), "metadata.name");
    assert!(args.iter().all(|a| a != "--instance-id"), "no fixed id: every replica would share it");

    // Admin server, probes, scrape annotations and the Service all name the same port.
    let admin_port: u64 = flag(&args, "--admin-addr").unwrap().rsplit_once(':').unwrap().1.parse().unwrap();
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"].as_u64(), Some(admin_port));
    let port_name = str_of(port, &["name"]);
    assert_eq!(str_of(&container, &["readinessProbe", "httpGet", "path"]), "/readyz");
    assert_eq!(str_of(&container, &["livenessProbe", "httpGet", "path"]), "/healthz");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(str_of(&container, &[probe, "httpGet", "port"]), port_name);
    }
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(ann["prometheus.io/port"].as_str(), Some(admin_port.to_string().as_str()));
    assert_eq!(ann["prometheus.io/path"].as_str(), Some("/metrics"));
    let svc = docs.iter().find(|d| d["kind"] == "Service").unwrap();
    let svc_selector = &svc["spec"]["selector"];
    assert!(
        svc_selector.as_mapping().is_some_and(|m| !m.is_empty()),
        "a Service without a selector selects nothing"
    );
    assert!(selects(svc_selector, &pod["metadata"]["labels"]), "the Service selects the pods");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"].as_str(), Some(port_name));
    let selector = &dep["spec"]["selector"]["matchLabels"];
    assert!(selector.as_mapping().is_some_and(|m| !m.is_empty()), "the Deployment's selector");
    assert!(selects(selector, &pod["metadata"]["labels"]), "the Deployment selects its own pods");

    // The store URL names the NATS client Service of nats.yaml on its port.
    let nats = yaml_docs("kubernetes/nats.yaml");
    let store = flag(&args, "--store").unwrap();
    let host = store.strip_prefix("nats://").unwrap().split(':').next().unwrap();
    let client = nats.iter().find(|d| d["kind"] == "Service" && d["metadata"]["name"] == host);
    let client = client.unwrap_or_else(|| panic!("nats.yaml has no Service {host:?} for {store}"));
    assert_eq!(client["spec"]["ports"][0]["port"].as_u64(), Some(4222));
}

/// Whether a label selector (`matchLabels`, or a Service's `selector`: absent or empty selects
/// every pod) selects a pod labelled `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector.as_mapping().is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Whether the NetworkPolicy `policy` admits a connection from a pod labelled `labels` (same
/// namespace) to the port `name`/`number` of a pod it selects: Kubernetes' ingress rules for
/// the subset the shipped file uses (pod selectors by `matchLabels`, ports by name or number);
/// anything else in a rule fails the test rather than being misjudged.
fn admits(policy: &Value, labels: &Value, name: &str, number: u64) -> bool {
    let matches = |selector: &Value| {
        assert!(selector["matchExpressions"].is_null(), "matchExpressions are not judged here: {selector:?}");
        selects(&selector["matchLabels"], labels)
    };
    policy["spec"]["ingress"].as_sequence().unwrap().iter().any(|rule| {
        let port_ok = rule["ports"].as_sequence().is_none_or(|ports| {
            ports.iter().any(|p| {
                assert!(p["endPort"].is_null() && p["protocol"].as_str().is_none_or(|t| t == "TCP"), "{p:?}");
                p["port"].as_str() == Some(name) || p["port"].as_u64() == Some(number)
            })
        });
        let from_ok = rule["from"].as_sequence().is_none_or(|peers| {
            peers.is_empty()
                || peers.iter().any(|peer| {
                    assert!(peer["ipBlock"].is_null() && peer["namespaceSelector"].is_null(), "{peer:?}");
                    matches(&peer["podSelector"])
                })
        });
        port_ok && from_ok
    })
}

#[test]
fn the_kubernetes_network_policy_admits_routes_from_nats_pods_and_clients_from_the_pipeline_pods_only() {
    let docs = yaml_docs("kubernetes/nats.yaml");
    let sts = docs.iter().find(|d| d["kind"] == "StatefulSet").unwrap();
    let nats_labels = &sts["spec"]["template"]["metadata"]["labels"];
    let policy = docs.iter().find(|d| d["kind"] == "NetworkPolicy").expect("nats.yaml has a NetworkPolicy");
    let selected = &policy["spec"]["podSelector"]["matchLabels"];
    assert!(!selected.is_null() && selects(selected, nats_labels), "the policy selects the NATS pods only");
    let types = policy["spec"]["policyTypes"].as_sequence().unwrap();
    assert!(types.iter().any(|t| t == "Ingress"), "{types:?}");
    // The NATS container's ports by name; monitoring is not one (it listens inside the pod).
    let container = &sts["spec"]["template"]["spec"]["containers"][0];
    let port = |name: &str| {
        let ports = container["ports"].as_sequence().unwrap();
        let p = ports.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("no port {name}"));
        p["containerPort"].as_u64().unwrap()
    };
    let (client, cluster) = (port("client"), port("cluster"));
    assert_eq!((client, cluster), (4222, 6222));
    assert!(container["ports"].as_sequence().unwrap().len() == 2, "only the client and route ports");

    // Routes from the NATS pods only.
    assert!(admits(policy, nats_labels, "cluster", cluster));
    // Every shipped pod that talks to NATS (a --store nats://... argument) reaches the client
    // port, and none reaches the route port or the monitoring port.
    let mut clients = 0;
    for rel in ["kubernetes/pipeline.yaml", "kubernetes/backfill.yaml"] {
        for doc in yaml_docs(rel).iter().filter(|d| !d["spec"]["template"].is_null()) {
            let template = &doc["spec"]["template"];
            let args = template["spec"]["containers"][0]["args"].as_sequence().unwrap();
            let args: Vec<String> = args.iter().map(|a| a.as_str().unwrap().to_owned()).collect();
            if !flag(&args, "--store").is_some_and(|s| s.starts_with("nats://")) {
                continue;
            }
            clients += 1;
            let what = format!("{rel}: {}", str_of(doc, &["metadata", "name"]));
            let labels = &template["metadata"]["labels"];
            assert!(admits(policy, labels, "client", client), "{what} cannot reach the NATS client port");
            assert!(!admits(policy, labels, "cluster", cluster), "{what} reaches the route port");
            assert!(!admits(policy, labels, "monitor", 8222), "{what} reaches the monitoring port");
        }
    }
    assert_eq!(clients, 4, "the bucket Jobs, the backfill Job and the Deployment");
    // Any other pod: nothing.
    let stranger: Value = serde_norway::from_str("app.kubernetes.io/name: curious").unwrap();
    for (name, number) in [("client", client), ("cluster", cluster), ("monitor", 8222)] {
        assert!(!admits(policy, &stranger, name, number), "an unlabelled pod reaches {name}");
    }
}

#[test]
fn the_kubernetes_nats_config_forms_a_cluster_that_pipeline_pods_complete_a_job_on() {
    let docs = yaml_docs("kubernetes/nats.yaml");
    let sts = docs.iter().find(|d| d["kind"] == "StatefulSet").expect("a StatefulSet");
    let name = str_of(sts, &["metadata", "name"]);
    let headless = str_of(sts, &["spec", "serviceName"]);
    let replicas = sts["spec"]["replicas"].as_u64().unwrap();
    assert_eq!(replicas, 3);
    let svc = docs.iter().find(|d| d["kind"] == "Service" && d["metadata"]["name"] == headless).unwrap();
    assert!(svc["spec"]["clusterIP"] == "None", "{headless} is headless (stable pod DNS names)");
    let conf = str_of(docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap(), &["data", "nats.conf"]);
    assert!(conf.contains("sync_interval: always"));
    assert_generated_accounts("kubernetes/nats.yaml", conf);
    let (_, pipeline_container, pipeline_args) = deployment();
    let job = flag(&pipeline_args, "--job").unwrap().to_owned();
    assert!(conf.contains(&format!("--job {job} ")), "nats.yaml has users for the pipeline's job {job}");
    // The server's certificate and key from the Secret nats-tls, mounted where the config reads.
    let nats_container = &sts["spec"]["template"]["spec"]["containers"][0];
    let nats_args = nats_container["args"].as_sequence().unwrap();
    assert_eq!(
        nats_args.len(),
        2,
        "the configuration file alone (a --cluster flag would clear the routes' authorization)"
    );
    let tls_mount =
        nats_container["volumeMounts"].as_sequence().unwrap().iter().find(|m| m["name"] == "tls").unwrap();
    let tls_dir = str_of(tls_mount, &["mountPath"]);
    let tls_volume = sts["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tls")
        .unwrap();
    assert_eq!(str_of(tls_volume, &["secret", "secretName"]), "nats-tls");
    let tmp = tempfile::tempdir().unwrap();
    // What the Secret nats-tls holds (cert-manager's key names), made by the development CA.
    let certs = tmp.path().join("certs");
    dev_certs(&certs);
    for (from, to) in [("server-cert.pem", "tls.crt"), ("server-key.pem", "tls.key"), ("ca.pem", "ca.crt")] {
        std::fs::copy(certs.join(from), certs.join(to)).unwrap();
    }
    // The client port's certificate and key, and the cluster port's (mutual TLS: the same
    // certificate, the CA to check a peer's).
    let conf = replace_n(conf, tls_dir, &certs, 5);
    // The monitoring port listens inside the pod only; the probes ask it there.
    assert!(conf.contains("\nhttp: 127.0.0.1:8222\n"), "monitoring on localhost only:\n{conf}");
    for probe in ["readinessProbe", "livenessProbe"] {
        let cmd = nats_container[probe]["exec"]["command"].as_sequence().unwrap();
        let url = cmd.iter().filter_map(|v| v.as_str()).find(|a| a.starts_with("http://")).unwrap();
        assert!(url.starts_with("http://127.0.0.1:8222/healthz"), "{probe}: {url}");
    }

    // Three nodes from the ConfigMap's configuration on loopback: the routes' pod DNS names
    // (nats-N.nats-cluster, in the route URLs the StatefulSet's env builds) become this
    // machine's ports, the Secrets' files and values this test's; everything else is the file
    // as is.
    let ports: Vec<(u16, u16, u16)> = (0..replicas)
        .map(|_| {
            (
                etl_coordination_testkit::free_port(),
                etl_coordination_testkit::free_port(),
                etl_coordination_testkit::free_port(),
            )
        })
        .collect();
    let node_env = |pod: &str| {
        let mut env = pod_env(nats_container, pod, &[]);
        for (i, (_, cport, _)) in ports.iter().enumerate() {
            let route = format!("{name}-{i}.{headless}:6222");
            let (var, url) = env
                .iter_mut()
                .find(|(_, v)| v.contains(&route))
                .unwrap_or_else(|| panic!("no env entry of the StatefulSet routes to the pod {route}"));
            assert!(conf.contains(&format!("${var}\n")), "the cluster's routes use ${var}:\n{conf}");
            *url = url.replace(&route, &format!("127.0.0.1:{cport}"));
        }
        env
    };
    let mut procs = Procs(Vec::new());
    for (i, (port, cport, mport)) in ports.iter().enumerate() {
        // Each node its own store directory and pid file (a pod each has its own).
        let dir = tmp.path().join(format!("n{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let node = replace_once(&replace_once(&conf, "/data", &dir), "/var/run/nats", &dir);
        // The route port moves in the file, not by `--cluster` (that flag, without a user in
        // its URL, clears the cluster's authorization).
        assert_eq!(node.matches("\n  port: 6222\n").count(), 1, "the cluster block's port:\n{node}");
        let node = node.replace("\n  port: 6222\n", &format!("\n  listen: 127.0.0.1:{cport}\n"));
        let conf_path = tmp.path().join(format!("n{i}.conf"));
        std::fs::write(&conf_path, node).unwrap();
        let pod = format!("{name}-{i}");
        let env = node_env(&pod);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        procs.0.push(nats_server(&conf_path, *port, &env, &["-m".into(), mport.to_string()]));
    }
    // The cluster is ready when every node's health endpoint reports JetStream healthy
    // (meta leader elected).
    let t = Instant::now();
    for (_, _, mport) in &ports {
        while !http_get(&format!("127.0.0.1:{mport}"), "/healthz")
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
        {
            assert!(t.elapsed() < Duration::from_secs(60), "the 3-node cluster did not become healthy");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    // The bucket Job's pod, then two pods from the Deployment's container spec: args as
    // written, except the store (the three loopback nodes instead of the Service), the source
    // (the sample input instead of the bucket) and the admin address (one port per pod); env as
    // written, with the downward-API pod name (dots included, as pod names may have them),
    // this test's Secret values, and the CA file where the pod mounts it.
    let store = ports.iter().map(|(p, _, _)| format!("nats://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let ca = certs.join("ca.crt");
    let pipeline = yaml_docs("kubernetes/pipeline.yaml");
    let setup =
        &pipeline.iter().find(|d| d["kind"] == "Job").unwrap()["spec"]["template"]["spec"]["containers"][0];
    let mut setup_args: Vec<String> =
        setup["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let at = setup_args.iter().position(|x| x == "--store").unwrap() + 1;
    setup_args[at] = store.clone();
    let ca_mount = |c: &Value| format!("{}/ca.crt", str_of(&c["volumeMounts"][0], &["mountPath"]));
    let setup_env = pod_env(setup, "etl-pipeline-buckets-x1", &[(&ca_mount(setup), &ca)]);
    let out = etl_coord().args(&setup_args).envs(setup_env.iter().map(|(k, v)| (k, v))).output().unwrap();
    assert!(out.status.success(), "the bucket Job: {}", String::from_utf8_lossy(&out.stderr));
    // Both buckets bounded as the Job says (one job cannot fill the cluster's store).
    let made = String::from_utf8_lossy(&out.stdout);
    for (bucket, flag_name) in [("state", "--nats-max-bytes"), ("lease", "--nats-lease-max-bytes")] {
        let bound = etl_coordination_runner::parse_bytes(flag(&setup_args, flag_name).unwrap()).unwrap();
        assert!(
            made.contains(&format!(
                "_{bucket}: created, configuration valid, replicas 3, at most {bound} bytes"
            )),
            "{made}"
        );
    }
    // The pod command of a container spec: args as written but the store, the source and the
    // admin address; env as a pod would have it.
    let pod = |container: &Value, args: &[String], pod_name: &str, admin: &str| {
        let mut a = args.to_vec();
        let mut set = |f: &str, v: &str| {
            let at = a.iter().position(|x| x == f).unwrap() + 1;
            a[at] = v.to_owned();
        };
        set("--store", &store);
        set("--source", &format!("files:{}", deploy().join("input").display()));
        set("--admin-addr", admin);
        let mut cmd = etl_coord();
        cmd.args(&a).envs(pod_env(container, pod_name, &[(&ca_mount(container), &ca)]));
        cmd
    };
    // The backfill Job's pods process the job and exit 0, as a Job needs them to.
    let (_, backfill_container, backfill_args) = backfill_job();
    let mut backfill = Vec::new();
    for i in 0..2 {
        let admin = format!("127.0.0.1:{}", etl_coordination_testkit::free_port());
        backfill.push(spawn_following(&mut pod(
            &backfill_container,
            &backfill_args,
            &format!("etl-backfill-x{i}"),
            &admin,
        )));
    }
    for (child, rx) in &mut backfill {
        let seen = wait_for_line(rx, "job complete", Duration::from_secs(90));
        assert!(seen.iter().all(|l| !l.contains("ERROR")), "{}", seen.join("\n"));
        assert_eq!(exit_within(child, Duration::from_secs(30)), Some(0), "a finished Job pod exits 0");
    }
    // Then the Deployment's pods on the same (complete) job: they connect as configured, see
    // it complete, and stay up serving their admin endpoints.
    let (dep, container, args) = (deployment().0, pipeline_container, pipeline_args);
    let grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    let worker_ca = ca_mount(&container);
    let mut pods = Vec::new();
    for i in 0..2 {
        let admin = format!("127.0.0.1:{}", etl_coordination_testkit::free_port());
        let pod_name = format!("etl-pipeline.7f9c-{i}");
        let (child, rx) = spawn_following(&mut pod(&container, &args, &pod_name, &admin));
        procs.0.push(child);
        pods.push((rx, admin, pod_name));
    }
    for (rx, admin, pod_name) in &pods {
        let seen = wait_for_line(rx, "staying after the end", Duration::from_secs(90));
        assert!(seen.iter().all(|l| !l.contains("ERROR")), "{}", seen.join("\n"));
        assert_job_state_complete(admin);
        let metrics = http_get(admin, "/metrics").unwrap();
        let id = pod_name.replace('.', "-");
        assert!(
            metrics.contains(&format!(r#"coordination_instance="{id}""#)),
            "instance id {id} from POD_NAME:\n{metrics}"
        );
    }
    let status_env: Vec<(String, String)> = pod_env(&container, "status", &[(&worker_ca, &ca)])
        .into_iter()
        .filter(|(k, _)| k.starts_with("ETL_COORD_NATS_"))
        .collect();
    assert_all_done(&job, &store, &status_env);
    let n = procs.0.len();
    for child in &mut procs.0[n - 2..] {
        sigterm(child);
        assert_eq!(exit_within(child, Duration::from_secs(grace)), Some(0));
    }

    // A server nobody set up dials a node's route port (any pod could, and its clients would
    // then reach every stream of the cluster): refused without the route password, refused
    // with a certificate another CA signed, refused with neither; its anonymous client then
    // cannot read the job. The control: with both it joins (the check can see a join).
    let cluster_name = conf
        .split_once("cluster {")
        .and_then(|(_, c)| c.lines().find_map(|l| l.trim().strip_prefix("name: ")))
        .expect("the cluster block names the cluster")
        .to_owned();
    let password = secret("nats-route", "password");
    let other_ca = tmp.path().join("other-ca");
    dev_certs(&other_ca);
    let (route, node) = (ports[0].1, ports[0].2);
    let signed = (certs.join("tls.crt"), certs.join("tls.key"), certs.join("ca.crt"));
    let foreign = (other_ca.join("server-cert.pem"), other_ca.join("server-key.pem"), certs.join("ca.crt"));
    for (what, user, tls) in [
        ("no TLS and no password", None, None),
        ("the CA's certificate but no password", None, Some(&signed)),
        ("the password but another CA's certificate", Some(&password), Some(&foreign)),
    ] {
        let mut rogue = RogueRoute::dial(tmp.path(), what, &cluster_name, route, user, tls);
        assert!(!rogue.joined(node, false), "a server with {what} joined the cluster:\n{}", rogue.log());
        let out = etl_coord()
            .args(["status", "--json", "--job", &job, "--store", &format!("nats://127.0.0.1:{}", rogue.port)])
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "an anonymous client of a server with {what} read the job: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        rogue.stop();
    }
    let mut peer = RogueRoute::dial(tmp.path(), "both", &cluster_name, route, Some(&password), Some(&signed));
    assert!(
        peer.joined(node, true),
        "a server with the route password and the CA's certificate joins:\n{}",
        peer.log()
    );
    peer.stop();
}

/// A `nats-server` (no JetStream, no authorization: anyone may use it) that dials a cluster's
/// route port as a peer would, with the route user's password and a TLS certificate if given.
struct RogueRoute {
    child: Child,
    port: u16,
    name: String,
    log: PathBuf,
}

impl RogueRoute {
    fn dial(
        dir: &Path,
        what: &str,
        cluster: &str,
        route: u16,
        password: Option<&String>,
        tls: Option<&(PathBuf, PathBuf, PathBuf)>,
    ) -> Self {
        let tag = what.replace(|c: char| !c.is_ascii_alphanumeric(), "-");
        let user = password.map_or(String::new(), |p| format!("route:{p}@"));
        let tls = tls.map_or(String::new(), |(cert, key, ca)| {
            format!(
                "  tls {{\n    cert_file: {}\n    key_file: {}\n    ca_file: {}\n  }}\n",
                cert.display(),
                key.display(),
                ca.display()
            )
        });
        let conf = format!(
            "server_name: rogue-{tag}\ncluster {{\n  name: {cluster}\n  routes: [\"nats://{user}127.0.0.1:{route}\"]\n{tls}}}\n"
        );
        let path = dir.join(format!("rogue-{tag}.conf"));
        std::fs::write(&path, conf).unwrap();
        let (port, monitor) = (etl_coordination_testkit::free_port(), etl_coordination_testkit::free_port());
        let listen = format!("nats://127.0.0.1:{}", etl_coordination_testkit::free_port());
        let child =
            nats_server(&path, port, &[], &["-m".into(), monitor.to_string(), "--cluster".into(), listen]);
        RogueRoute { child, port, name: format!("rogue-{tag}"), log: path.with_extension("log") }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the cluster node whose monitoring port is `node` accepted its route, judged by
    /// the node (the dialling side may count a route for a moment before the node's refusal
    /// arrives): the node lists a route to it (joined). Not `expected`: the rogue's log shows
    /// three route connections closed while the node lists none (refused: it keeps dialling,
    /// and each attempt ends the same way). Expected: only a listing (or 30 s) decides (a
    /// joining server may close duplicate routes first).
    fn joined(&self, node: u16, expected: bool) -> bool {
        let monitor = std::net::SocketAddr::from(([127, 0, 0, 1], node));
        let t = Instant::now();
        loop {
            let closed = self.log().matches("Router connection closed").count();
            let routez =
                etl_coordination_testkit::monitor_at(monitor, "/routez").expect("the node's /routez");
            let routes = routez["routes"].as_array().cloned().unwrap_or_default();
            if routes.iter().any(|r| r["remote_name"] == self.name.as_str()) {
                return true;
            }
            if closed >= 3 && !expected {
                return false;
            }
            if t.elapsed() > Duration::from_secs(30) {
                assert!(!expected, "no route verdict in 30 s:\n{}", self.log());
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RogueRoute {
    fn drop(&mut self) {
        self.stop();
    }
}

fn promtool() -> Command {
    let bin = std::env::var("PROMTOOL")
        .expect("PROMTOOL is not set: run `cargo xtask ci`, which provisions promtool (or set PROMTOOL)");
    let mut cmd = Command::new(bin);
    cmd.current_dir(deploy().join("prometheus"));
    cmd
}

fn assert_success(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    assert_success(promtool().args(["check", "rules", "alerts.yml"]));
    assert_success(promtool().args(["test", "rules", "alerts.test.yml"]));
    // The issue's alerts are all there.
    let rules = read("prometheus/alerts.yml");
    for alert in [
        "EtlCoordinationSplitsQuarantined",
        "EtlCoordinationJobStalled",
        "EtlCoordinationNoLeader",
        "EtlCoordinationConflictWritesInBulk",
        "EtlCoordinationWorkerSelfFencing",
        "EtlCoordinationLaneStalled",
        "EtlCoordinationUndecodableRecords",
        "EtlCoordinationBreakerOpen",
    ] {
        assert!(rules.contains(&format!("alert: {alert}")), "{alert} missing");
        let tests = read("prometheus/alerts.test.yml");
        assert!(tests.contains(&format!("alertname: {alert}")), "{alert} has no unit test");
    }
}

/// The dashboard's queries, with Grafana's variables replaced by concrete values.
fn dashboard_queries() -> Vec<String> {
    let d: serde_json::Value = serde_json::from_str(&read("prometheus/grafana-dashboard.json")).unwrap();
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert!(vars.contains(&"job") && vars.contains(&"datasource"), "{vars:?}");
    d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| {
            let e = t["expr"].as_str().unwrap();
            assert!(e.contains(r#"coordination_job="$job""#), "every query filters on the job: {e}");
            e.replace("$job", "backfill").replace("$__rate_interval", "5m")
        })
        .collect()
}

#[test]
fn the_dashboard_queries_are_valid_promql() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 9);
    let tmp = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        rules += &format!(
            "      - record: dashboard_query_{i}\n        expr: {}\n",
            serde_json::to_string(q).unwrap()
        );
    }
    let path = tmp.path().join("dashboard-rules.yml");
    std::fs::write(&path, rules).unwrap();
    assert_success(promtool().arg("check").arg("rules").arg(&path));
}

/// Metric names (`etl_coordination_*`) and `label="value"` pairs in `text`.
fn metric_refs(text: &str) -> (BTreeSet<String>, BTreeSet<(String, String)>) {
    let mut metrics = BTreeSet::new();
    let mut labels = BTreeSet::new();
    for (i, _) in text.match_indices("etl_coordination_") {
        let name: String = text[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        // `etl_coordination_*` in prose names the families, not a metric.
        if !name.ends_with('_') {
            metrics.insert(name);
        }
    }
    for label in ["state", "outcome", "reason", "op"] {
        for (i, _) in
            text.match_indices(&format!("{label}=\\\"")).chain(text.match_indices(&format!("{label}=\"")))
        {
            let rest = &text[i + label.len() + 1..];
            let rest = rest.trim_start_matches('\\').trim_start_matches('"');
            let value: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            labels.insert((label.to_owned(), value));
        }
    }
    (metrics, labels)
}

#[test]
fn every_metric_and_label_value_the_alerts_and_dashboard_use_exists() {
    let histogram = names::STORE_OP_DURATION_SECONDS;
    let known = |m: &str| {
        names::ALL.contains(&m)
            || ["_bucket", "_sum", "_count"].iter().any(|s| m.strip_suffix(s) == Some(histogram))
    };
    let dashboard = read("prometheus/grafana-dashboard.json");
    for (file, text) in [
        ("alerts.yml", read("prometheus/alerts.yml")),
        ("alerts.test.yml", read("prometheus/alerts.test.yml")),
        ("grafana-dashboard.json", dashboard.clone()),
    ] {
        let (metrics, labels) = metric_refs(&text);
        assert!(!metrics.is_empty(), "{file} uses no metric");
        for m in &metrics {
            assert!(known(m), "{file} uses {m}, which the metrics crate does not define");
        }
        for (label, value) in &labels {
            let values: Vec<&str> = match label.as_str() {
                // `state` labels two families: the job's state and the splits' states.
                "state" => [&JOB_STATES[..], &SPLIT_STATES[..]].concat(),
                "outcome" => WRITE_OUTCOMES.to_vec(),
                "reason" => [&REVOCATION_REASONS[..], &ACQUISITION_REASONS[..]].concat(),
                _ => STORE_OPS.to_vec(),
            };
            assert!(
                values.contains(&value.as_str()),
                "{file} uses {label}=\"{value}\", not a value the workers emit"
            );
        }
    }
    // The dashboard shows every family.
    let (used, _) = metric_refs(&dashboard);
    for family in names::ALL {
        assert!(used.iter().any(|m| m.starts_with(family)), "the dashboard does not show {family}");
    }
}
