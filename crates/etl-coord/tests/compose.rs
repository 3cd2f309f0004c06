//! `docker compose -f deploy/docker-compose.yml up` for real, checking what deploy/README.md
//! promises: NATS healthy, the two replicas join the sample job and finish it, `etl-coord
//! status` from the host shows every split Done, `docker compose down` leaves nothing running.
//!
//! Ignored by `cargo test`: it needs a Docker engine with the compose tool and the images, which
//! the container path of `cargo xtask itest` provides (`HOSTS_NATS_IMAGE` for `NATS_IMAGE`,
//! `HOSTS_WORKER_IMAGE` for `ETL_COORD_IMAGE`) before it runs this suite with `--ignored`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::free_addr;
use etl_coordination_testkit::docker::{docker, image, port_taken, unique};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// `docker compose` (the plugin) where the CLI has it, else `docker-compose` (the standalone
/// tool, as Debian packages it).
fn compose_tool() -> Vec<&'static str> {
    let plugin =
        Command::new("docker").args(["compose", "version"]).output().is_ok_and(|o| o.status.success());
    if plugin { vec!["docker", "compose"] } else { vec!["docker-compose"] }
}

/// The project: its name, and the environment every compose command of it needs.
struct Project {
    name: String,
    env: Vec<(&'static str, String)>,
    nats_port: u16,
}

impl Project {
    fn compose(&self, args: &[&str]) -> std::process::Output {
        let tool = compose_tool();
        let mut c = Command::new(tool[0]);
        c.args(&tool[1..])
            .args(["-p", &self.name, "-f", "deploy/docker-compose.yml"])
            .args(args)
            .current_dir(repo());
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c.output().expect("the compose tool runs")
    }

    fn compose_ok(&self, args: &[&str]) -> String {
        let out = self.compose(args);
        assert!(
            out.status.success(),
            "compose {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The project's containers (running or not), by the label compose puts on them.
    fn containers(&self) -> Vec<String> {
        let label = format!("label=com.docker.compose.project={}", self.name);
        docker(&["ps", "-a", "-q", "--filter", &label]).lines().map(str::to_owned).collect()
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        let _ = self.compose(&["down", "-v", "--remove-orphans"]);
    }
}

/// `etl-coord status --json` of the compose job from the host, as the README says: the job's
/// user, its password and the development CA, through the published port.
fn status(p: &Project) -> Option<serde_json::Value> {
    let password = p.env.iter().find(|(k, _)| *k == "ETL_JOB_NATS_PASSWORD").unwrap().1.clone();
    let out = Command::new(env!("CARGO_BIN_EXE_etl-coord"))
        .args(["status", "--json", "--job", "compose-demo"])
        .args(["--store", &format!("nats://localhost:{}", p.nats_port)])
        .env("ETL_COORD_NATS_USER", "etl-compose-demo")
        .env("ETL_COORD_NATS_PASSWORD", password)
        .env("ETL_COORD_NATS_TLS_CA", repo().join("deploy/nats/certs/ca.pem"))
        .output()
        .unwrap();
    out.status.success().then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// `up -d --no-build` (the images exist, built by xtask: `up` must not build or pull) of a
/// project of its own on host ports chosen free. A port can be taken by another program between
/// its choice and the engine's bind: then the project is taken down and started again on other
/// ports (up to five times).
fn up_on_free_ports() -> Project {
    let port = |a: String| a.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    for attempt in 1.. {
        let nats_port = port(free_addr());
        let p = Project {
            name: unique("etlcompose").replace('-', ""),
            env: vec![
                ("ETL_JOB_NATS_PASSWORD", "job-pass-1".into()),
                ("ETL_SETUP_NATS_PASSWORD", "setup-pass-2".into()),
                ("NATS_IMAGE", image("HOSTS_NATS_IMAGE")),
                ("ETL_COORD_IMAGE", image("HOSTS_WORKER_IMAGE")),
                ("NATS_PORT", nats_port.to_string()),
            ],
            nats_port,
        };
        let out = p.compose(&["up", "-d", "--no-build"]);
        if out.status.success() {
            return p;
        }
        let err = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(port_taken(&err) && attempt < 5, "compose up -d --no-build failed: {err}");
        // Dropping the project takes it down.
    }
    unreachable!()
}

#[test]
#[ignore = "needs a Docker engine, the compose tool and images: run by the container path of `cargo xtask itest`"]
fn compose_up_runs_nats_and_two_replicas_to_completion_and_down_leaves_nothing() {
    // The development CA, as the README's first step (an existing CA is kept).
    let ca = Command::new("sh").arg("deploy/nats/dev-ca.sh").current_dir(repo()).status().unwrap();
    assert!(ca.success(), "deploy/nats/dev-ca.sh failed");
    let p = up_on_free_ports();

    let nats = p.compose_ok(&["ps", "-q", "nats"]).trim().to_owned();
    let t = Instant::now();
    loop {
        let health = docker(&["inspect", "--format", "{{.State.Health.Status}}", &nats]);
        if health == "healthy" {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "NATS is {health} after 60 s: {}",
            docker(&["logs", &nats])
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    let t = Instant::now();
    let done = loop {
        if let Some(st) = status(&p) {
            let splits = st["splits"].as_array().cloned().unwrap_or_default();
            let workers = st["workers"].as_array().map_or(0, Vec::len);
            if !splits.is_empty() && splits.iter().all(|s| s["state"] == "Done") && workers == 2 {
                break st;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the job is not complete with two replicas after 120 s: {:?}\n{}",
            status(&p),
            String::from_utf8_lossy(&p.compose(&["logs", "--no-color"]).stdout)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(done["summary"]["done"].as_u64(), done["summary"]["total"].as_u64(), "{done}");
    let replicas = p.compose_ok(&["ps", "-q", "pipeline"]);
    assert_eq!(replicas.lines().count(), 2, "two replicas: {replicas}");
    // Each replica is its own worker (instance id from its hostname) and still serves.
    for id in replicas.lines() {
        let host = docker(&["inspect", "--format", "{{.Config.Hostname}}", id]);
        assert!(
            done["workers"].as_array().unwrap().iter().any(|w| w["instance"] == host.as_str()),
            "{host}: {done}"
        );
        assert_eq!(docker(&["inspect", "--format", "{{.State.Status}}", id]), "running");
    }

    p.compose_ok(&["down", "-v"]);
    let left = p.containers();
    assert!(left.is_empty(), "compose down left containers: {left:?}");
}

#[test]
#[ignore = "needs a Docker engine and the image: run by the container path of `cargo xtask itest`"]
fn the_worker_image_runs_as_non_root_answers_help_and_serves_healthz() {
    let img = image("HOSTS_WORKER_IMAGE");
    assert_eq!(docker(&["image", "inspect", "--format", "{{.Config.User}}", &img]), "10001");
    assert_eq!(docker(&["run", "--rm", "--entrypoint", "id", &img, "-u"]), "10001", "runs as non-root");
    let help = docker(&["run", "--rm", &img, "--help"]);
    assert!(help.contains("worker") && help.contains("status"), "{help}");
    // One replica on the in-memory store over the sample input, its admin server published.
    let input = format!("{}:/input:ro", repo().join("deploy/input").display());
    let c = etl_coordination_testkit::docker::Container::run(
        &unique("healthz"),
        &[
            "-p",
            "127.0.0.1::9090",
            "-v",
            &input,
            &img,
            "worker",
            "--job",
            "healthz",
            "--store",
            "memory",
            "--source",
            "files:/input",
            "--on-complete",
            "wait",
            "--admin-addr",
            "0.0.0.0:9090",
        ],
    );
    let addr = c.published("9090/tcp").to_string();
    let t = Instant::now();
    loop {
        if let Some(reply) = common::http_get(&addr, "/healthz")
            && reply.starts_with("HTTP/1.1 200")
        {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "/healthz did not answer 200: {}", c.logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    let metrics = common::http_get(&addr, "/metrics").unwrap_or_default();
    assert!(metrics.contains("etl_coordination_"), "{metrics}");
}
