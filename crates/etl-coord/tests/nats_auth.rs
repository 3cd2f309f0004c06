//! Least privilege on a shared NATS: the real-process failure suite (kill -9 takeover, drain,
//! stopped zombie, poison split, NATS outage, leader kill) with a job's generated permissions
//! over TLS, and what a client with another job's, missing, wrong or too narrow credentials,
//! or without the CA, is told.
//!
//! Each test starts its own server the way deploy/ sets one up: TLS with a certificate from the
//! development CA (`deploy/nats/dev-ca.sh`, needs openssl), and one account per job exactly as
//! `etl-coord nats-account` prints it: the workers' user and a set-up user that creates the
//! buckets (`etl-coord nats-buckets`), with the permissions of `etl-coord nats-permissions`, and
//! JetStream limits. Then what a client of one job tries against another with what its
//! permissions allow (a reply subject in the other job's bucket, a stream that mirrors, sources,
//! republishes into or captures the other job's subjects, filling the storage both share) is
//! shown to reach nothing of the other job. Needs `NATS_SERVER_BIN` (`cargo xtask ci`).

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

/// A TLS server with one account per job, as `etl-coord nats-account` prints it: the job's
/// workers' user `etl-JOB` and its set-up user `setup-JOB` (creates the buckets), passwords from
/// config variables (the server reads `$VAR` from its environment when the file does not
/// define it), and JetStream limits.
struct Secured {
    server: NatsServer,
    certs: tempfile::TempDir,
}

/// The JetStream storage of each job's account in [`Secured`] unless a test says otherwise.
const MAX_FILE: &str = "64MiB";

impl Secured {
    fn start(jobs: &[&str]) -> Secured {
        Self::start_with(jobs, &[], &[])
    }

    /// Also with `extra` user entries, each in the account of the job it names, and the
    /// storage of the accounts `max_file` names ([`MAX_FILE`] for the others).
    fn start_with(jobs: &[&str], extra: &[(&str, String)], max_file: &[(&str, &str)]) -> Secured {
        Self::start_loose(jobs, extra, max_file, &[])
    }

    /// Also with the accounts of the jobs `loose` names written as a user may write one by
    /// hand, without `max_bytes_required` (streams in them may be unbounded).
    fn start_loose(
        jobs: &[&str],
        extra: &[(&str, String)],
        max_file: &[(&str, &str)],
        loose: &[&str],
    ) -> Secured {
        let certs = tempfile::tempdir().unwrap();
        dev_certs(certs.path());
        let var = |user: &str| format!("PW_{}", user.replace('-', "_").to_uppercase());
        let mut vars = String::new();
        let mut accounts = String::new();
        for job in jobs {
            let (user, setup) = (format!("etl-{job}"), format!("setup-{job}"));
            for u in [&user, &setup] {
                vars.push_str(&format!("{}: {:?}\n", var(u), password(u)));
            }
            let mut account = stdout(&run(etl_coord().args([
                "nats-account",
                "--job",
                job,
                "--user",
                &user,
                "--password-var",
                &var(&user),
                "--setup-user",
                &setup,
                "--setup-password-var",
                &var(&setup),
                "--max-file",
                max_file.iter().find(|(j, _)| j == job).map_or(MAX_FILE, |(_, m)| m),
            ])));
            if loose.contains(job) {
                assert!(account.contains(", max_bytes_required: true"), "{account}");
                account = account.replace(", max_bytes_required: true", "");
            }
            for (_, entry) in extra.iter().filter(|(j, _)| j == job) {
                assert!(account.contains("  users: [\n"), "{account}");
                account = account.replacen("  users: [\n", &format!("  users: [\n{entry}\n"), 1);
            }
            accounts.push_str(&account);
        }
        let cert = |f: &str| certs.path().join(f).display().to_string();
        let server = NatsServer::start_with(&format!(
            "{vars}tls {{ cert_file: {:?}, key_file: {:?} }}\naccounts {{\n{accounts}}}\n",
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

    /// A raw client of `user` (`ROLE-JOB`: TLS, its password, its job's reply prefix, the
    /// only one its permissions let it receive on), for what etl-coord never sends; on `rt`.
    fn client(&self, rt: &tokio::runtime::Runtime, user: &str) -> async_nats::Client {
        let job = user.split_once('-').expect("ROLE-JOB").1;
        let options = async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
            .add_root_certificates(self.ca())
            .require_tls(true)
            .custom_inbox_prefix(format!("_INBOX_etl_coordination_{job}"));
        rt.block_on(options.connect(self.server.url())).unwrap_or_else(|e| panic!("{user} connects: {e}"))
    }

    /// Creates `job`'s buckets as its set-up user, with the bounds its account requires (within
    /// [`MAX_FILE`]).
    fn create_buckets(&self, job: &str) {
        self.create_bounded(job, &["--nats-max-bytes", "32MiB", "--nats-lease-max-bytes", "8MiB"]);
    }

    /// Creates `job`'s buckets as its set-up user with the bound flags `bounds`.
    fn create_bounded(&self, job: &str, bounds: &[&str]) {
        let setup = self.as_user(&format!("setup-{job}"));
        let out = stdout(&run(setup
            .command()
            .args(["nats-buckets", "--job", job, "--store", &setup.url])
            .args(bounds)));
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
    let s = Secured::start_with(&["jn", "jm"], &[("jn", narrow)], &[]);
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

/// A user of `job`'s account allowed everything in it: the test's own eyes inside the account
/// (what lands there, what its streams hold).
fn observer(job: &str) -> (&str, String) {
    let user = format!("observer-{job}");
    (job, format!("{{ user: {user:?}, password: {:?} }}", password(&user)))
}

/// A JetStream API request as `client` (an observer), its JSON answer.
fn api(
    rt: &tokio::runtime::Runtime,
    client: &async_nats::Client,
    subject: &str,
    body: &str,
) -> serde_json::Value {
    let reply = rt
        .block_on(client.request(subject.to_owned(), body.to_owned().into()))
        .unwrap_or_else(|e| panic!("{subject}: {e}"));
    serde_json::from_slice(&reply.payload).unwrap()
}

/// Messages in a stream, as its account's observer sees them.
fn messages(rt: &tokio::runtime::Runtime, observer: &async_nats::Client, stream: &str) -> u64 {
    let info = api(rt, observer, &format!("$JS.API.STREAM.INFO.{stream}"), "");
    info["state"]["messages"].as_u64().unwrap_or_else(|| panic!("{stream}: {info}"))
}

/// The last sequence a stream stored (moves with every write, an overwrite included), as its
/// account's observer sees it.
fn last_seq(rt: &tokio::runtime::Runtime, observer: &async_nats::Client, stream: &str) -> u64 {
    let info = api(rt, observer, &format!("$JS.API.STREAM.INFO.{stream}"), "");
    info["state"]["last_seq"].as_u64().unwrap_or_else(|| panic!("{stream}: {info}"))
}

/// Writes `key` = `value` into `bucket` as `client` (an observer of its account); the
/// sequence the stream stored it at.
fn put(
    rt: &tokio::runtime::Runtime,
    client: &async_nats::Client,
    bucket: &str,
    key: &str,
    value: &str,
) -> u64 {
    let js = async_nats::jetstream::new(client.clone());
    rt.block_on(async { js.publish(format!("$KV.{bucket}.{key}"), value.to_owned().into()).await?.await })
        .unwrap_or_else(|e| panic!("{bucket}.{key}: {e}"))
        .sequence
}

#[test]
fn an_answer_addressed_into_another_job_s_bucket_stays_in_the_sender_s_account() {
    let s = Secured::start_with(&["ra", "rb"], &[observer("ra"), observer("rb")], &[]);
    s.create_buckets("ra");
    s.create_buckets("rb");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_rt = rt.enter();
    let (in_a, in_b) = (s.client(&rt, "observer-ra"), s.client(&rt, "observer-rb"));
    let target = "$KV.etl_coordination_rb_state.split.injected";
    let mut landed = rt.block_on(in_a.subscribe(target)).unwrap();
    rt.block_on(in_a.flush()).unwrap();
    // A request etl-ra's permissions allow, its answer addressed into rb's state bucket: NATS
    // checks no reply subject against permissions, so only the account boundary stops it.
    let attacker = s.client(&rt, "etl-ra");
    rt.block_on(attacker.publish_with_reply(
        "$JS.API.STREAM.INFO.KV_etl_coordination_ra_state",
        target,
        "".into(),
    ))
    .unwrap();
    rt.block_on(attacker.flush()).unwrap();
    // The server answered, in ra's account (where no bucket of rb exists)...
    let answer = rt
        .block_on(tokio::time::timeout(Duration::from_secs(10), futures_util::StreamExt::next(&mut landed)))
        .expect("the server answers the request")
        .unwrap();
    assert!(String::from_utf8_lossy(&answer.payload).contains("KV_etl_coordination_ra_state"));
    // ...and rb's bucket holds nothing of it.
    assert_eq!(last_seq(&rt, &in_b, "KV_etl_coordination_rb_state"), 0, "rb's state bucket was written");
    // Nor later: rb's next write is the bucket's first message.
    assert_eq!(
        put(&rt, &in_b, "etl_coordination_rb_state", "split.after", "rb's"),
        1,
        "rb's bucket was written"
    );
}

#[test]
fn a_job_s_set_up_user_cannot_mirror_source_republish_into_capture_or_claim_another_job() {
    let s = Secured::start_with(&["sa", "sb", "sc"], &[observer("sa"), observer("sb")], &[]);
    s.create_buckets("sb");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_rt = rt.enter();
    let (in_a, in_b) = (s.client(&rt, "observer-sa"), s.client(&rt, "observer-sb"));
    put(&rt, &in_b, "etl_coordination_sb_state", "split.x", "sb's record");
    let written = last_seq(&rt, &in_b, "KV_etl_coordination_sb_state");
    let victim = "KV_etl_coordination_sb_state";
    let attacker = s.client(&rt, "setup-sa");
    let js = async_nats::jetstream::new(attacker.clone());
    let (own_state, own_lease) = ("KV_etl_coordination_sa_state", "KV_etl_coordination_sa_lease");
    let delete = |stream: &str| {
        api(&rt, &in_a, &format!("$JS.API.STREAM.DELETE.{stream}"), "");
    };
    // More storage than its account's: a stream without a bound, or with one past the
    // account's max_file, is refused, so sa cannot fill the store sb writes to.
    let code = |config: async_nats::jetstream::stream::Config| {
        let refused =
            rt.block_on(js.create_stream(config)).expect_err("a stream beyond the account's storage");
        refused.to_string()
    };
    let unbounded = code(async_nats::jetstream::stream::Config {
        name: own_state.into(),
        subjects: vec!["$KV.etl_coordination_sa_state.>".into()],
        ..Default::default()
    });
    assert!(unbounded.contains("10113"), "an unbounded stream: {unbounded}");
    let past = code(async_nats::jetstream::stream::Config {
        name: own_state.into(),
        subjects: vec!["$KV.etl_coordination_sa_state.>".into()],
        max_bytes: 65 << 20,
        ..Default::default()
    });
    assert!(past.contains("10047"), "a bound past max_file: {past}");
    // Within it, bounded streams of its own buckets' names, for the routes below.
    const BOUND: i64 = 1 << 20;
    // A stream sa's set-up user may create (its own bucket's name) mirroring, then sourcing,
    // rb's state: the server reports the source missing, and it holds nothing.
    let source = async_nats::jetstream::stream::Source { name: victim.into(), ..Default::default() };
    for (what, config) in [
        (
            "mirror",
            async_nats::jetstream::stream::Config {
                name: own_state.into(),
                mirror: Some(source.clone()),
                max_bytes: BOUND,
                ..Default::default()
            },
        ),
        (
            "sources",
            async_nats::jetstream::stream::Config {
                name: own_state.into(),
                subjects: vec!["$KV.etl_coordination_sa_state.>".into()],
                sources: Some(vec![source.clone()]),
                max_bytes: BOUND,
                ..Default::default()
            },
        ),
    ] {
        rt.block_on(js.create_stream(config)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let t = Instant::now();
        let error = loop {
            let info = api(&rt, &in_a, &format!("$JS.API.STREAM.INFO.{own_state}"), "");
            assert_eq!(info["state"]["messages"].as_u64(), Some(0), "{what} copied sb's records: {info}");
            let status = if what == "mirror" { info["mirror"].clone() } else { info["sources"][0].clone() };
            if !status["error"].is_null() {
                break status["error"].clone();
            }
            assert!(t.elapsed() < Duration::from_secs(30), "{what}: no verdict on the source: {info}");
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(error["err_code"].as_u64(), Some(10059), "{what}: {error}");
        delete(own_state);
    }
    // Republishing what sa's stream stores into sb's state bucket: the copy goes out in sa's
    // account, sb's bucket is unchanged.
    let mut landed = rt.block_on(in_a.subscribe("$KV.etl_coordination_sb_state.>")).unwrap();
    rt.block_on(in_a.flush()).unwrap();
    let republish = async_nats::jetstream::stream::Config {
        name: own_lease.into(),
        subjects: vec!["$KV.etl_coordination_sa_lease.>".into()],
        republish: Some(async_nats::jetstream::stream::Republish {
            source: "$KV.etl_coordination_sa_lease.k".into(),
            destination: "$KV.etl_coordination_sb_state.split.x".into(),
            headers_only: false,
        }),
        max_bytes: BOUND,
        ..Default::default()
    };
    rt.block_on(js.create_stream(republish)).unwrap();
    rt.block_on(async { js.publish("$KV.etl_coordination_sa_lease.k", "forged".into()).await?.await })
        .unwrap();
    let copy = rt
        .block_on(tokio::time::timeout(Duration::from_secs(10), futures_util::StreamExt::next(&mut landed)))
        .expect("the stream republishes")
        .unwrap();
    assert_eq!(&copy.payload[..], b"forged");
    assert_eq!(last_seq(&rt, &in_b, victim), written, "sb's state bucket was written");
    // Nor later: sb's next write follows its own.
    assert_eq!(
        put(&rt, &in_b, "etl_coordination_sb_state", "split.y", "sb's"),
        written + 1,
        "sb's bucket was written"
    );
    delete(own_lease);
    // A stream capturing sb's reply subjects: sb's clients' answers never reach it.
    let capture = async_nats::jetstream::stream::Config {
        name: own_state.into(),
        subjects: vec!["_INBOX_etl_coordination_sb.>".into()],
        max_bytes: BOUND,
        ..Default::default()
    };
    rt.block_on(js.create_stream(capture)).unwrap();
    let b = s.as_user("etl-sb");
    let out = run(b.command().args(["status", "--job", "sb", "--store", &b.url]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job sb"), "sb's client got its answers");
    assert_eq!(messages(&rt, &in_a, own_state), 0, "sa captured sb's replies");
    delete(own_state);
    // Claiming the subjects of a job not set up yet: sc's set-up still creates its buckets.
    let claim = async_nats::jetstream::stream::Config {
        name: own_state.into(),
        subjects: vec!["$KV.etl_coordination_sc_state.>".into(), "$KV.etl_coordination_sc_lease.>".into()],
        max_bytes: BOUND,
        ..Default::default()
    };
    rt.block_on(js.create_stream(claim)).unwrap();
    s.create_buckets("sc");
}

#[test]
fn a_job_that_fills_its_bounded_buckets_stops_naming_the_bound_and_another_job_completes() {
    // fa's account holds 1 KiB, every stream in it bounded.
    let s = Secured::start_with(&["fa", "fb"], &[], &[("fa", "1KiB")]);
    let setup = s.as_user("setup-fa");
    let set_up = |bounds: &[&str]| {
        let mut cmd = setup.command();
        refused(cmd.args(["nats-buckets", "--job", "fa", "--store", &setup.url]).args(bounds))
    };
    // A set-up step without bounds is told which flags to give.
    let (code, err) = set_up(&[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot create bucket etl_coordination_fa_state unbounded")
            && err.contains(
                "etl-coord nats-buckets --job fa --nats-max-bytes BYTES --nats-lease-max-bytes BYTES"
            ),
        "{err}"
    );
    // Bounds past the account's storage: which to lower.
    let (code, err) = set_up(&["--nats-max-bytes", "2KiB", "--nats-lease-max-bytes", "256"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("bounded at 2048 bytes") && err.contains("lower --nats-max-bytes"), "{err}");
    // Below the account's storage: the buckets' bounds are what stops the job.
    s.create_bounded("fa", &["--nats-max-bytes", "512", "--nats-lease-max-bytes", "256"]);
    let (tmp, data) = dataset(6, 40);
    let fa = s.as_user("etl-fa");
    let (code, err) = refused_child(fa.worker("fa", "a1", &data, &tmp.path().join("a.jsonl"), &SLOW));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is full") && err.contains("etl-coord nats-buckets --job fa --nats-"), "{err}");
    let fb = s.workers_of("fb");
    let out = fb.worker("fb", "b1", &data, &tmp.path().join("b.jsonl"), &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(common::records_in(&[&tmp.path().join("b.jsonl")]).len(), 6 * 40);
}

#[test]
fn a_job_that_fills_its_account_s_storage_stops_naming_the_limit_and_another_job_completes() {
    // fa's account is written by hand, without requiring bounds: its buckets are unbounded and
    // the account's limit is what stops it.
    let s = Secured::start_loose(&["fa", "fb"], &[], &[("fa", "1KiB")], &["fa"]);
    let (tmp, data) = dataset(6, 40);
    let setup = s.as_user("setup-fa");
    let out = stdout(&run(setup.command().args(["nats-buckets", "--job", "fa", "--store", &setup.url])));
    assert!(out.contains("etl_coordination_fa_lease: created"), "{out}");
    let fa = s.as_user("etl-fa");
    let (code, err) = refused_child(fa.worker("fa", "a1", &data, &tmp.path().join("a.jsonl"), &SLOW));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("at its JetStream storage limit") && err.contains("nats-account --max-file"),
        "{err}"
    );
    let fb = s.workers_of("fb");
    let out = fb.worker("fb", "b1", &data, &tmp.path().join("b.jsonl"), &[]).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(common::records_in(&[&tmp.path().join("b.jsonl")]).len(), 6 * 40);
}
