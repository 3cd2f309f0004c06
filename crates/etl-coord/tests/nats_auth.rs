//! Least privilege on a shared NATS: the real-process failure suite (kill -9 takeover, drain,
//! stopped zombie, poison split, NATS outage, leader kill) with a job's generated permissions
//! over TLS, and what a client with another job's, missing, wrong or too narrow credentials,
//! or without the CA, is told.
//!
//! Each test starts its own server the way deploy/ sets one up: TLS with a certificate from the
//! development CA (`deploy/nats/dev-ca.sh`, needs openssl), and users whose entries are exactly
//! what `etl-coord nats-permissions` prints: per job, the workers' user and a set-up user that
//! creates the buckets (`etl-coord nats-buckets`). Needs `NATS_SERVER_BIN` (`cargo xtask ci`).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cases;
use common::{Nats, dataset};
use etl_coordination_testkit::NatsServer;

fn etl_coord() -> Command {
    Command::new(env!("CARGO_BIN_EXE_etl-coord"))
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("etl-coord runs")
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The development CA and a server certificate, made by the script deploy/ ships.
fn dev_certs(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nats/dev-ca.sh");
    let out = Command::new("sh").arg(script).arg(dir).output().expect("sh runs");
    assert!(out.status.success(), "dev-ca.sh: {}", String::from_utf8_lossy(&out.stderr));
}

/// A TLS server whose users are, for each job, `etl-JOB` (the workers) and `setup-JOB` (creates
/// the buckets), with the entries `etl-coord nats-permissions` prints and passwords from config
/// variables (the server reads `$VAR` from its environment when the file does not define it).
struct Secured {
    server: NatsServer,
    certs: tempfile::TempDir,
}

impl Secured {
    fn start(jobs: &[&str]) -> Secured {
        Self::start_with(jobs, "")
    }

    /// Also with `extra` user entries.
    fn start_with(jobs: &[&str], extra: &str) -> Secured {
        let certs = tempfile::tempdir().unwrap();
        dev_certs(certs.path());
        let mut vars = String::new();
        let mut users = String::new();
        for job in jobs {
            for (user, create) in [(format!("etl-{job}"), false), (format!("setup-{job}"), true)] {
                let var = format!("PW_{}", user.replace('-', "_").to_uppercase());
                vars.push_str(&format!("{var}: {:?}\n", password(&user)));
                let mut cmd = etl_coord();
                cmd.args(["nats-permissions", "--job", job, "--user", &user, "--password-var", &var]);
                if create {
                    cmd.arg("--create");
                }
                users.push_str(&stdout(&run(&mut cmd)));
            }
        }
        let cert = |f: &str| certs.path().join(f).display().to_string();
        let server = NatsServer::start_with(&format!(
            "{vars}tls {{ cert_file: {:?}, key_file: {:?} }}\nauthorization {{\n  users: [\n{users}{extra}\n  ]\n}}\n",
            cert("server-cert.pem"),
            cert("server-key.pem")
        ));
        Secured { server, certs }
    }

    fn ca(&self) -> PathBuf {
        self.certs.path().join("ca.pem")
    }

    /// The server as `user` reaches it: credentials and the CA in the environment, as a pod has them.
    fn as_user(&self, user: &str) -> Nats {
        Nats {
            url: self.server.url(),
            env: vec![
                ("ETL_COORD_NATS_USER".into(), user.into()),
                ("ETL_COORD_NATS_PASSWORD".into(), password(user)),
                ("ETL_COORD_NATS_TLS_CA".into(), self.ca().display().to_string()),
            ],
        }
    }

    /// Creates `job`'s buckets as its set-up user.
    fn create_buckets(&self, job: &str) {
        let setup = self.as_user(&format!("setup-{job}"));
        let out = stdout(&run(setup.command().args(["nats-buckets", "--job", job, "--store", &setup.url])));
        assert!(out.contains(&format!("etl_coordination_{job}_lease: created")), "{out}");
        // Created refusing rollups: nothing to close, and the check finds no hole.
        assert!(!out.contains("now refuses"), "{out}");
        let checked =
            run(setup.command().args(["nats-buckets", "--job", job, "--store", &setup.url, "--check"]));
        assert!(checked.status.success(), "{}", String::from_utf8_lossy(&checked.stderr));
    }

    /// `job`'s workers, on buckets created by its set-up user.
    fn workers_of(&self, job: &str) -> Nats {
        self.create_buckets(job);
        self.as_user(&format!("etl-{job}"))
    }
}

fn password(user: &str) -> String {
    format!("pw-of-{user}")
}

/// A long op timeout for commands that must be refused: a refusal ends a request at once, a
/// timeout would take this long, and the bound the tests assert lies well between the two.
const SLOW: [&str; 2] = ["--nats-op-timeout", "30s"];

/// Runs `cmd` (given [`SLOW`]); its exit code and standard error, which must come at once, not
/// after a timeout or retries.
fn refused(cmd: &mut Command) -> (Option<i32>, String) {
    refused_child(
        cmd.args(SLOW).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("etl-coord starts"),
    )
}

fn refused_child(child: std::process::Child) -> (Option<i32>, String) {
    let t = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(t.elapsed() < Duration::from_secs(15), "refused at once, not after a timeout: {:?}", t.elapsed());
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn with_the_generated_permissions_over_tls_a_killed_worker_is_taken_over() {
    let s = Secured::start(&["lpkill"]);
    cases::kill9_takeover(&s.workers_of("lpkill"), "lpkill");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_a_drained_worker_hands_over() {
    let s = Secured::start(&["lpdrain"]);
    cases::drain_handover(&s.workers_of("lpdrain"), "lpdrain");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_a_killed_leader_is_replaced() {
    let s = Secured::start(&["lpleader"]);
    cases::leader_kill(&s.workers_of("lpleader"), "lpleader");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_a_stopped_zombie_is_fenced() {
    let s = Secured::start(&["lpzombie"]);
    cases::zombie_fenced(&s.workers_of("lpzombie"), "lpzombie");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_a_poison_split_is_quarantined() {
    let s = Secured::start(&["lppoison"]);
    cases::poison_quarantined(&s.workers_of("lppoison"), "lppoison");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_an_undecodable_record_is_reset() {
    let s = Secured::start(&["lpundec"]);
    cases::undecodable_record_reset(&s.workers_of("lpundec"), "lpundec");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_waiting_workers_take_up_a_requeued_split() {
    let s = Secured::start(&["lprequeue"]);
    cases::requeue_resumes_waiting_workers(&s.workers_of("lprequeue"), "lprequeue");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn with_the_generated_permissions_over_tls_workers_ride_out_a_nats_outage() {
    let mut s = Secured::start(&["lpoutage"]);
    let nats = s.workers_of("lpoutage");
    cases::outage_self_fence(&nats, &mut s.server, "lpoutage");
    assert!(!s.server.log().contains("Violation"), "nothing refused:\n{}", s.server.log());
}

#[test]
fn one_job_s_credentials_cannot_read_or_change_another_job() {
    let s = Secured::start(&["ja", "jb"]);
    let (tmp, data) = dataset(2, 50);
    let b = s.workers_of("jb");
    let out = b.worker("jb", "b1", &data, &tmp.path().join("b.jsonl"), &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let before = b.status_json("jb");
    let split = before["splits"][0]["id"].as_str().expect("a split").to_owned();
    s.create_buckets("ja");
    let a = s.as_user("etl-ja");
    let source = format!("files:{}", data.display());
    for args in [
        vec!["status", "--job", "jb"],
        vec!["requeue", "--job", "jb", "--split", &split],
        vec!["worker", "--job", "jb", "--source", &source],
    ] {
        let (code, err) = refused(a.command().args(&args).args(["--store", &a.url]));
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("denied user \"etl-ja\"") && err.contains("jb"), "{args:?}: {err}");
    }
    // Nor list the jobs: that reads every stream of the account.
    let (code, err) = refused(a.command().args(["jobs", "--store", &a.url]));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("denied user \"etl-ja\"") && err.contains("listing jobs"), "{err}");
    // The set-up user of one job cannot create or read another's buckets either.
    let setup = s.as_user("setup-ja");
    let (code, err) = refused(setup.command().args(["nats-buckets", "--job", "jb", "--store", &setup.url]));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("denied user \"setup-ja\""), "{err}");
    assert_eq!(b.status_json("jb"), before, "job jb untouched");
}

#[test]
fn missing_or_wrong_credentials_and_a_missing_ca_are_refused_saying_what_to_give() {
    let s = Secured::start(&["jc"]);
    s.create_buckets("jc");
    let ok = s.as_user("etl-jc");
    let status = |nats: &Nats| {
        let mut c = nats.command();
        c.args(["status", "--job", "jc", "--store", &nats.url]);
        c
    };
    // With its credentials it gets as far as the job's buckets: no worker has started it.
    let out = run(&mut status(&ok));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no job jc") && err.contains("no worker has started it yet"), "{err}");
    let strip = |names: &[&str]| Nats {
        url: ok.url.clone(),
        env: ok.env.iter().filter(|(k, _)| !names.contains(&k.as_str())).cloned().collect(),
    };
    let (code, err) = refused(&mut status(&strip(&["ETL_COORD_NATS_USER", "ETL_COORD_NATS_PASSWORD"])));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("refused the connection's credentials (no credentials given)"), "{err}");
    let mut wrong = ok.clone();
    wrong.env[1].1 = "not-the-password".into();
    let (code, err) = refused(&mut status(&wrong));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("credentials (user \"etl-jc\")"), "{err}");
    let (code, err) = refused(&mut status(&strip(&["ETL_COORD_NATS_TLS_CA"])));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("TLS with NATS") && err.contains("--nats-tls-ca"), "{err}");
}

#[test]
fn a_worker_with_too_narrow_permissions_or_no_buckets_exits_1_naming_what_is_missing() {
    // A user granted all of jn's permissions but writes to its lease bucket.
    let perms = stdout(&run(etl_coord().args(["nats-permissions", "--job", "jn", "--format", "json"])));
    let mut perms: serde_json::Value = serde_json::from_str(&perms).unwrap();
    let missing = "$KV.etl_coordination_jn_lease.>";
    perms["publish"]["allow"].as_array_mut().unwrap().retain(|s| s != missing);
    let narrow =
        format!("{{ user: \"narrow-jn\", password: {:?}, permissions: {perms} }}", password("narrow-jn"));
    let s = Secured::start_with(&["jn", "jm"], &narrow);
    let (tmp, data) = dataset(1, 10);
    s.create_buckets("jn");
    let n = s.as_user("narrow-jn");
    let (code, err) = refused_child(n.worker("jn", "n1", &data, &tmp.path().join("n.jsonl"), &SLOW));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("publish allow {missing:?}")) && err.contains("nats-permissions --job jn"),
        "{err}"
    );
    // jm's buckets were never created, and its workers may not create them.
    let jm = s.as_user("etl-jm");
    let (code, err) = refused_child(jm.worker("jm", "m1", &data, &tmp.path().join("m.jsonl"), &SLOW));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("does not exist") && err.contains("etl-coord nats-buckets --job jm"), "{err}");
}
