//! Identifier newtypes. Names that end up inside store keys are validated here so that a bad
//! name is rejected with a clear error before anything touches the store.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest accepted job name, instance id or split id. Keys must stay well below the store's
/// subject length limits.
pub const MAX_NAME_LEN: usize = 128;

/// A name was rejected: says which kind of name, what was given and which rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {value:?}: {rule}")]
pub struct NameError {
    /// Which kind of name (job name, instance id, split id).
    pub kind: &'static str,
    /// The rejected value.
    pub value: String,
    /// The rule it broke.
    pub rule: &'static str,
}

fn validate(kind: &'static str, value: &str) -> Result<(), NameError> {
    let err = |rule| NameError { kind, value: value.to_owned(), rule };
    if value.is_empty() {
        return Err(err("must not be empty"));
    }
    if value.len() > MAX_NAME_LEN {
        return Err(err("must be at most 128 characters"));
    }
    if !value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(err("may contain only [A-Za-z0-9_-] (substitute dots and other characters)"));
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        // Shared, not owned: a worker keeps each id in several indices (issue 32, a million
        // splits), and a clone is a reference count.
        pub struct $name(std::sync::Arc<str>);

        impl $name {
            /// Validates `value` (charset `[A-Za-z0-9_-]`, 1 to 128 characters).
            pub fn new(value: impl Into<String>) -> Result<Self, NameError> {
                let value = value.into();
                validate($kind, &value)?;
                Ok(Self(value.into()))
            }

            /// The name as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = NameError;
            fn try_from(value: String) -> Result<Self, NameError> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0.to_string()
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::new(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", self.0)
            }
        }
    };
}

name_type!(
    /// One coordinated source run. It suffixes the store's bucket names, so two jobs never share
    /// coordination state.
    JobName,
    "job name"
);
name_type!(
    /// A replica's stable identity (for example the pod name with dots substituted). Two live
    /// processes sharing one id is a fatal error (P3).
    InstanceId,
    "instance id"
);
name_type!(
    /// A split's deterministic id, chosen by the planner. Deterministic ids make re-planning
    /// idempotent (P4).
    SplitId,
    "split id"
);

impl SplitId {
    /// Below every valid split id (the empty string is never valid): a bound for range lookups
    /// in sets ordered by `(weight, id)`, never a split's id.
    pub(crate) fn floor() -> Self {
        SplitId("".into())
    }
}

macro_rules! number_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

number_type!(
    /// A random number chosen at process start. Together with the instance id it names one
    /// process lifetime, so a restarted process can tell its predecessor's leases from a twin's.
    Incarnation
);
number_type!(
    /// Per-split ownership counter, bumped on every ownership change. It is the fencing token a
    /// lane hands to its sink.
    Epoch
);
number_type!(
    /// A store revision. Revisions increase per key (S4); nothing may assume absolute values.
    Revision
);
number_type!(
    /// Tags one store request emitted by the core so its result can be routed back.
    OpId
);

impl Epoch {
    /// The next epoch (ownership change).
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }
}

/// An owner of a split: one process lifetime of one instance.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct Owner {
    /// The owning instance.
    pub instance: InstanceId,
    /// The owning process lifetime.
    pub incarnation: Incarnation,
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{:x}", self.instance, self.incarnation.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_accept_the_documented_charset() {
        assert!(InstanceId::new("pod-7_a").is_ok());
        assert!(SplitId::new("a".repeat(128)).is_ok());
    }

    #[test]
    fn names_reject_dots_empty_and_long_values_with_the_rule() {
        let err = InstanceId::new("web-1.svc").unwrap_err();
        assert_eq!(err.kind, "instance id");
        assert!(err.to_string().contains("substitute dots"), "{err}");
        assert!(JobName::new("").unwrap_err().to_string().contains("empty"));
        assert!(SplitId::new("a".repeat(129)).is_err());
        assert!(SplitId::new("a>b").is_err());
    }
}
