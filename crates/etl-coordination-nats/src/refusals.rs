//! What the server refused a job's connection (credentials, a permission), and the setup
//! error that says what to do about it.

use std::future::Future;

use etl_coordination_core::{JobName, StoreError};
use tokio::sync::watch;

use crate::config::{NatsAuth, NatsConfig};
use crate::permissions::{Access, Permissions, permissions};
use crate::setup::setup;

/// What the server refused a connection (an `-ERR` line), as the client's event callback saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The credentials, or their absence.
    Credentials,
    /// A missing permission: `publish` to or `subscribe` to `subject`.
    Permission { verb: &'static str, subject: String },
}

impl Refusal {
    /// `Permissions Violation for Publish to "S"` / `... for Subscription to "S"`, or refused
    /// credentials (`Authorization Violation`, `User Authentication Expired` or `Revoked`).
    /// `Authentication Timeout` is not one: the server closed a connection that did not
    /// authenticate in time (a slow TLS handshake on a loaded node), and the client reconnects
    /// with the same credentials, which the server may well accept.
    pub(crate) fn parse(e: &async_nats::ServerError) -> Option<Refusal> {
        let text = match e {
            async_nats::ServerError::AuthorizationViolation => return Some(Refusal::Credentials),
            async_nats::ServerError::Other(t) => t,
            async_nats::ServerError::SlowConsumer(_) => return None,
        };
        let lower = text.to_lowercase();
        if lower.contains("authentication timeout") {
            return None;
        }
        if lower.contains("authorization violation") || lower.contains("authentication") {
            return Some(Refusal::Credentials);
        }
        if !lower.contains("permissions violation") {
            return None;
        }
        let verb = if lower.contains("for subscription") { "subscribe" } else { "publish" };
        let subject = text.split('"').nth(1).unwrap_or(text).to_owned();
        Some(Refusal::Permission { verb, subject })
    }
}

/// What a connection was refused, and how to say what to do about it: a job's connection, or
/// (`job: None`) the listing of every job.
#[derive(Clone)]
pub(crate) struct Refusals {
    pub(crate) rx: watch::Receiver<Option<Refusal>>,
    pub(crate) url: String,
    pub(crate) job: Option<JobName>,
    pub(crate) credentials: String,
}

impl Refusals {
    pub(crate) fn new(
        config: &NatsConfig,
        job: Option<&JobName>,
    ) -> (Refusals, watch::Sender<Option<Refusal>>) {
        let (tx, rx) = watch::channel(None);
        let credentials = match &config.auth {
            NatsAuth::None => "no credentials given".to_owned(),
            NatsAuth::Token(_) => "a token".to_owned(),
            NatsAuth::UserPassword(u, _) => format!("user {u:?}"),
            NatsAuth::CredentialsFile(p) => format!("credentials file {}", p.display()),
        };
        (Refusals { rx, url: config.url.clone(), job: job.cloned(), credentials }, tx)
    }

    /// The setup error of the first refusal, if there was one.
    pub(crate) fn error(&self) -> Option<StoreError> {
        self.rx.borrow().as_ref().map(|r| setup(self.describe(r)))
    }

    pub(crate) fn describe(&self, refusal: &Refusal) -> String {
        let (url, who) = (&self.url, &self.credentials);
        let Some(job) = &self.job else {
            return match refusal {
                Refusal::Credentials => format!(
                    "NATS at {url} refused the connection's credentials ({who}): authorization violation; check \
                     them against the server's authorization block"
                ),
                Refusal::Permission { verb, subject } => format!(
                    "NATS at {url} denied {who} permission to {verb} to {subject:?}: listing jobs reads every \
                     stream of the account ($JS.API.STREAM.NAMES, $JS.API.STREAM.INFO.>, \
                     $JS.API.STREAM.MSG.GET.>), which a job's own user may not; list with an account \
                     administrator's credentials, or read one job with `etl-coord status --job NAME`"
                ),
            };
        };
        let Refusal::Permission { verb, subject } = refusal else {
            return format!(
                "NATS at {url} refused the connection's credentials ({who}): authorization violation; \
                 give job {job}'s credentials (a user and password, a token or a creds file) and check them \
                 against the server's authorization block"
            );
        };
        if let Some(stream) = subject.strip_prefix("$JS.API.STREAM.CREATE.") {
            let bucket = stream.strip_prefix("KV_").unwrap_or(stream);
            return format!(
                "bucket {bucket} does not exist and NATS at {url} does not allow {who} to create it (publish to \
                 {subject:?} denied): create job {job}'s buckets first as a user allowed to, with `etl-coord \
                 nats-buckets --job {job}` (its permissions: `etl-coord nats-permissions --job {job} --create`), \
                 or grant this user publish on {subject:?}"
            );
        }
        if let Some(stream) = subject.strip_prefix("$JS.API.STREAM.UPDATE.") {
            let bucket = stream.strip_prefix("KV_").unwrap_or(stream);
            return format!(
                "NATS at {url} does not allow {who} to update bucket {bucket} (publish to {subject:?} denied), \
                 which making it refuse rollup headers needs: the set-up user's permissions in the server's \
                 configuration predate it; replace them with what `etl-coord nats-permissions --job {job} \
                 --create` prints now, then run `etl-coord nats-buckets --job {job}` again"
            );
        }
        let needed = permissions(job, Access::Use);
        let list = if *verb == "subscribe" { &needed.subscribe } else { &needed.publish };
        match Permissions::covering(list, subject) {
            Some(entry) => format!(
                "NATS at {url} denied {who} permission to {verb} to {subject:?}: a client of job {job} needs \
                 every permission `etl-coord nats-permissions --job {job}` prints; this one is missing: \
                 {verb} allow {entry:?}"
            ),
            None => format!(
                "NATS at {url} denied {who} permission to {verb} to {subject:?}, which is not among job {job}'s \
                 permissions (`etl-coord nats-permissions --job {job}`): please report this as a bug"
            ),
        }
    }

    /// Runs `fut` unless the connection has been refused, and ends it with the refusal's error
    /// as soon as one arrives (a refused request would otherwise only time out).
    pub(crate) async fn guard<T>(
        &self,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        tokio::select! {
            r = fut => match (r, self.error()) {
                (Err(_), Some(refused)) => Err(refused),
                (r, _) => r,
            },
            refused = self.refused() => Err(match refused {
                // The request was cut short: a write may still have applied. The fence keeps that
                // safe (the worker stops on a setup error); the message keeps it honest.
                StoreError::Setup(msg) => setup(format!("{msg} (a request in flight when the refusal came may have applied)")),
                other => other,
            }),
        }
    }

    /// Resolves when the connection has been refused; never if it is not (also once the
    /// connection is closed and nothing can be refused any more).
    pub(crate) async fn refused(&self) -> StoreError {
        let mut rx = self.rx.clone();
        if rx.wait_for(Option::is_some).await.is_err() {
            std::future::pending::<()>().await;
        }
        self.error().expect("a refusal was recorded")
    }
}

#[cfg(test)]
mod tests {
    use async_nats::ServerError;

    use super::Refusal;

    fn parse(line: &str) -> Option<Refusal> {
        Refusal::parse(&ServerError::Other(line.to_owned()))
    }

    #[test]
    fn refused_credentials_and_permissions_are_refusals_and_a_slow_handshake_is_not() {
        assert_eq!(Refusal::parse(&ServerError::AuthorizationViolation), Some(Refusal::Credentials));
        for line in ["Authorization Violation", "User Authentication Expired", "User Authentication Revoked"]
        {
            assert_eq!(parse(line), Some(Refusal::Credentials), "{line}");
        }
        assert_eq!(
            parse(r#"Permissions Violation for Subscription to "_INBOX.x.>""#),
            Some(Refusal::Permission { verb: "subscribe", subject: "_INBOX.x.>".into() })
        );
        assert_eq!(
            parse(r#"Permissions Violation for Publish to "$KV.b.k""#),
            Some(Refusal::Permission { verb: "publish", subject: "$KV.b.k".into() })
        );
        // Transient: the client reconnects with the same credentials.
        for line in ["Authentication Timeout", "Stale Connection", "Maximum Connections Exceeded"] {
            assert_eq!(parse(line), None, "{line}");
        }
    }
}
