//! The NATS subjects a job's clients use, as permissions an operator grants per job.
//!
//! Found by running workers, `status` and `requeue` against a server that denies everything
//! else and widening until the failure suites passed (docs/DESIGN.md, "Least privilege"), and
//! checked against what the client library sends on paths a run rarely takes (an ordered
//! consumer that recreates itself deletes its old consumer first).

use etl_coordination_core::JobName;

/// What a client of a job may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// Use the job's existing buckets: what workers, `status` and `requeue` need.
    Use,
    /// Use them and create them when missing (an operator's set-up user, or workers allowed to
    /// create their own buckets).
    Create,
}

/// The subjects a client of one job may publish to and subscribe to. Nothing of any other
/// job, and no JetStream API call but those named, is included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permissions {
    /// Subjects to allow publishing to.
    pub publish: Vec<String>,
    /// Subjects to allow subscribing to.
    pub subscribe: Vec<String>,
}

/// The two bucket names of `job`: state, then lease.
pub fn bucket_names(job: &JobName) -> [String; 2] {
    [format!("etl_coordination_{job}_state"), format!("etl_coordination_{job}_lease")]
}

/// The reply-subject prefix of a job's connections. Outside the usual `_INBOX.` so that users
/// allowed to subscribe to `_INBOX.>` (a common grant) cannot read this job's replies.
pub fn inbox_prefix(job: &JobName) -> String {
    format!("_INBOX_etl_coordination_{job}")
}

/// The permissions a client of `job` needs for `access`.
pub fn permissions(job: &JobName, access: Access) -> Permissions {
    let mut publish = vec!["$JS.API.INFO".to_owned()];
    for bucket in bucket_names(job) {
        let stream = format!("KV_{bucket}");
        if access == Access::Create {
            publish.push(format!("$JS.API.STREAM.CREATE.{stream}"));
            // To raise a bucket's bound (`nats-buckets --nats-max-bytes`), and to make a state
            // bucket of an earlier release refuse rollup headers.
            publish.push(format!("$JS.API.STREAM.UPDATE.{stream}"));
        }
        publish.extend([
            // Open the bucket and read its configuration.
            format!("$JS.API.STREAM.INFO.{stream}"),
            // Reads through the stream leader (never direct gets: docs/NATS.md).
            format!("$JS.API.STREAM.MSG.GET.{stream}"),
            // Watches and listings: ordered push consumers, created unnamed; after a
            // reconnect (or a gap) one deletes its consumer and creates a named one.
            format!("$JS.API.CONSUMER.CREATE.{stream}"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
            format!("$JS.API.CONSUMER.DELETE.{stream}.*"),
            // Flow-control replies of those consumers.
            format!("$JS.FC.{stream}.>"),
            // Writes: creates, compare-and-swaps, deletes (all publishes to the key's subject).
            format!("$KV.{bucket}.>"),
        ]);
    }
    Permissions { publish, subscribe: vec![format!("{}.>", inbox_prefix(job))] }
}

impl Permissions {
    /// The allow-list entry of `list` that matches `subject`, if any.
    pub fn covering<'a>(list: &'a [String], subject: &str) -> Option<&'a str> {
        list.iter().map(String::as_str).find(|p| subject_matches(p, subject))
    }

    /// A user entry for a NATS server's `authorization { users: [...] }` block: `user`, a
    /// password read from the environment variable `password_var` when the server starts,
    /// and these permissions.
    pub fn server_config_user(&self, user: &str, password_var: &str) -> String {
        let list =
            |items: &[String]| items.iter().map(|s| format!("        {s:?}")).collect::<Vec<_>>().join("\n");
        format!(
            "{{\n  user: {user:?}\n  password: ${password_var}\n  permissions: {{\n    publish: {{\n      allow: [\n{}\n      ]\n    }}\n    subscribe: {{\n      allow: [\n{}\n      ]\n    }}\n  }}\n}}\n",
            list(&self.publish),
            list(&self.subscribe)
        )
    }
}

/// The NATS account of one job: the server's boundary between jobs. Subjects, streams and
/// replies of one account are invisible to every other (no exports or imports are declared),
/// so nothing a client of another job sends, whatever its permissions allow and whatever reply
/// subject or stream configuration it gives, reaches this job's buckets; permissions within one
/// shared account cannot promise that (a reply subject is not checked against them, a stream a
/// set-up user creates may source, mirror or republish another job's subjects).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Account {
    /// The account's name in the server configuration: [`account_name`].
    pub name: String,
    /// Its users: each with the permissions of its [`Access`] for this job.
    pub users: Vec<AccountUser>,
    /// Its JetStream limits.
    pub limits: AccountLimits,
}

/// A user of a job's account.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccountUser {
    /// The user name.
    pub user: String,
    /// The environment variable the server reads the password from when it starts.
    pub password_var: String,
    /// What it may do with the job's buckets.
    pub access: Access,
}

impl AccountUser {
    /// A user `user` with the password in `$password_var` and `access`.
    pub fn new(user: impl Into<String>, password_var: impl Into<String>, access: Access) -> Self {
        AccountUser { user: user.into(), password_var: password_var.into(), access }
    }
}

/// The JetStream limits of a job's account. Its streams are the job's two buckets, on file
/// storage only (no memory storage).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccountLimits {
    /// Bytes of file storage, counted over every replica of both buckets. A standalone server
    /// reserves it from its `max_file_store` when it starts; a cluster reserves only the
    /// buckets' bounds, on each node that holds a replica.
    pub max_file: i64,
    /// Consumers each bucket may have at once: a worker holds two watches on the state bucket
    /// and one on the lease bucket, and a listing (`status`, a worker's start) one while it
    /// runs.
    pub max_consumers: i64,
}

impl AccountLimits {
    /// Consumers of a bucket at once by default: the two watches on the state bucket of each of
    /// some 500 workers.
    pub const DEFAULT_MAX_CONSUMERS: i64 = 1024;

    /// `max_file` bytes of storage, [`Self::DEFAULT_MAX_CONSUMERS`] consumers.
    pub fn new(max_file: i64) -> Self {
        AccountLimits { max_file, max_consumers: Self::DEFAULT_MAX_CONSUMERS }
    }
}

/// The account name of `job` in a server configuration.
pub fn account_name(job: &JobName) -> String {
    format!("etl_coordination_{job}")
}

impl Account {
    /// The account of `job` with `users` and `limits`.
    pub fn new(job: &JobName, users: Vec<AccountUser>, limits: AccountLimits) -> Self {
        Account { name: account_name(job), users, limits }
    }

    /// The account's entry for the `accounts { ... }` block of a NATS server configuration:
    /// JetStream on with its limits (two streams, file storage only, each stream bounded), and
    /// its users with the permissions [`permissions`] gives them.
    ///
    /// `max_bytes_required` makes the server refuse a stream without a `max_bytes`: a bound is
    /// reserved when the stream is created, and the sum of the bounds (times their replicas)
    /// may not pass `max_file`, so the account cannot take more of the server's storage than
    /// its entry says, on a cluster as on a single server (a cluster does not reserve
    /// `max_file` itself). The buckets' bounds are therefore required: `nats-buckets
    /// --nats-max-bytes --nats-lease-max-bytes`.
    pub fn server_config(&self, job: &JobName) -> String {
        let indent = |text: &str| text.lines().map(|l| format!("    {l}\n")).collect::<String>();
        let users: String = self
            .users
            .iter()
            .map(|u| indent(&permissions(job, u.access).server_config_user(&u.user, &u.password_var)))
            .collect();
        format!(
            "{:?}: {{\n  jetstream: {{ max_file: {}, max_mem: 0, max_streams: 2, max_consumers: {}, max_bytes_required: true }}\n  users: [\n{users}  ]\n}}\n",
            self.name, self.limits.max_file, self.limits.max_consumers
        )
    }
}

/// NATS subject matching: `*` matches one token, a final `>` one or more.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str) -> JobName {
        JobName::new(name.to_owned()).unwrap()
    }

    #[test]
    fn subjects_match_as_nats_matches_them() {
        assert!(subject_matches("$KV.b.>", "$KV.b.split.x"));
        assert!(!subject_matches("$KV.b.>", "$KV.b"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.d"));
        assert!(!subject_matches("$JS.API.INFO", "$JS.API.INFO.x"));
    }

    #[test]
    fn a_job_s_permissions_cover_its_buckets_and_nothing_of_another_job() {
        let p = permissions(&job("orders"), Access::Use);
        for s in [
            "$KV.etl_coordination_orders_state.split.a",
            "$JS.API.STREAM.MSG.GET.KV_etl_coordination_orders_lease",
            "$JS.API.CONSUMER.CREATE.KV_etl_coordination_orders_state",
            "$JS.API.CONSUMER.CREATE.KV_etl_coordination_orders_state.c_1.$KV.etl_coordination_orders_state.>",
            "$JS.API.CONSUMER.DELETE.KV_etl_coordination_orders_state.c_1",
        ] {
            assert!(Permissions::covering(&p.publish, s).is_some(), "{s}");
        }
        for s in [
            "$KV.etl_coordination_orders2_state.split.a",
            "$KV.etl_coordination_other_lease.lease.a",
            "$JS.API.STREAM.CREATE.KV_etl_coordination_orders_state",
            "$JS.API.STREAM.DELETE.KV_etl_coordination_orders_state",
            "$JS.API.STREAM.UPDATE.KV_etl_coordination_orders_state",
            "$JS.API.DIRECT.GET.KV_etl_coordination_orders_state.$KV.etl_coordination_orders_state.x",
        ] {
            assert!(Permissions::covering(&p.publish, s).is_none(), "{s}");
        }
        assert!(Permissions::covering(&p.subscribe, "_INBOX_etl_coordination_orders.abc.1").is_some());
        assert!(Permissions::covering(&p.subscribe, "_INBOX.abc.1").is_none());
        let c = permissions(&job("orders"), Access::Create);
        for s in [
            "$JS.API.STREAM.CREATE.KV_etl_coordination_orders_state",
            "$JS.API.STREAM.UPDATE.KV_etl_coordination_orders_state",
        ] {
            assert!(Permissions::covering(&c.publish, s).is_some(), "{s}");
        }
        // The lease bucket's bound may be raised too.
        assert!(
            Permissions::covering(&c.publish, "$JS.API.STREAM.UPDATE.KV_etl_coordination_orders_lease")
                .is_some()
        );
    }

    #[test]
    fn the_server_config_entry_quotes_subjects_and_reads_the_password_from_the_environment() {
        let text = permissions(&job("j"), Access::Use).server_config_user("etl-j", "ETL_J_PASSWORD");
        assert!(text.contains("user: \"etl-j\""), "{text}");
        assert!(text.contains("password: $ETL_J_PASSWORD"), "{text}");
        assert!(text.contains("\"$KV.etl_coordination_j_state.>\""), "{text}");
    }

    #[test]
    fn the_account_entry_bounds_jetstream_and_holds_each_user_with_its_permissions() {
        let users = vec![
            AccountUser::new("etl-j", "ETL_J", Access::Use),
            AccountUser::new("setup-j", "SETUP_J", Access::Create),
        ];
        let text = Account::new(&job("j"), users, AccountLimits::new(1 << 30)).server_config(&job("j"));
        assert!(text.starts_with("\"etl_coordination_j\": {\n"), "{text}");
        assert!(
            text.contains(
                "jetstream: { max_file: 1073741824, max_mem: 0, max_streams: 2, max_consumers: 1024, max_bytes_required: true }"
            ),
            "{text}"
        );
        for (user, var) in [("etl-j", "ETL_J"), ("setup-j", "SETUP_J")] {
            assert!(text.contains(&format!("user: {user:?}")) && text.contains(&format!("password: ${var}")));
        }
        // The set-up user's entry alone creates streams.
        let (worker, setup) = text.split_once("setup-j").unwrap();
        assert!(!worker.contains("STREAM.CREATE") && setup.contains("STREAM.CREATE"), "{text}");
        assert_eq!(text.matches('{').count(), text.matches('}').count(), "{text}");
    }
}
