//! Why an export stopped: something the user changes (a flag, the config, the data as it
//! is: exit 2, the message says what to change), or a failure reading the shards or
//! writing the output (exit 1), with what was being done and its cause.
//!
//! Invariant: a [`ExportError::Usage`] stays one when context is added around it
//! ([`ExportError::is_usage`] looks through the causes).

use std::fmt::Display;

/// Why an export stopped.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A flag, the config or the data as it is: the message says what to change.
    #[error("{0}")]
    Usage(String),
    /// Something the export found wrong in what it read or wrote (its own checks).
    #[error("{0}")]
    Broken(String),
    /// What was being done, and the failure that stopped it.
    #[error("{what}: {source}")]
    Failed {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// An export step's result.
pub type Result<T, E = ExportError> = std::result::Result<T, E>;

impl ExportError {
    /// Whether the user's input caused it (exit 2), through any context added.
    pub fn is_usage(&self) -> bool {
        match self {
            ExportError::Usage(_) => true,
            ExportError::Broken(_) => false,
            ExportError::Failed { source, .. } => source
                .downcast_ref::<ExportError>()
                .is_some_and(ExportError::is_usage),
        }
    }

    /// A failure with no cause below it.
    pub fn broken(msg: impl Display) -> ExportError {
        ExportError::Broken(msg.to_string())
    }

    /// The user's to fix.
    pub fn usage(msg: impl Display) -> ExportError {
        ExportError::Usage(msg.to_string())
    }
}

/// Adds what was being done to an error, as the export's steps report them.
pub trait Context<T> {
    fn context(self, what: impl Display) -> Result<T>;
    fn with_context<S: Display>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Display) -> Result<T> {
        self.map_err(|e| ExportError::Failed {
            what: what.to_string(),
            source: Box::new(e),
        })
    }

    fn with_context<S: Display>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| ExportError::Failed {
            what: what().to_string(),
            source: Box::new(e),
        })
    }
}

/// Errors from the crates the export reads and writes with, when no more is said.
macro_rules! failed_from {
    ($($t:ty => $what:literal),* $(,)?) => {$(
        impl From<$t> for ExportError {
            fn from(e: $t) -> ExportError {
                ExportError::Failed { what: $what.into(), source: Box::new(e) }
            }
        }
    )*};
}

failed_from!(
    std::io::Error => "input/output",
    serde_json::Error => "JSON",
    arrow_schema::ArrowError => "Arrow",
    parquet::errors::ParquetError => "Parquet",
    crate::output::shard::ShardError => "reading a shard",
);

impl From<crate::output::export::OutError> for ExportError {
    fn from(e: crate::output::export::OutError) -> ExportError {
        match e {
            crate::output::export::OutError::Io { .. } => ExportError::Failed {
                what: "--out".into(),
                source: Box::new(e),
            },
            _ => ExportError::Usage(e.to_string()),
        }
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Display) -> Result<T> {
        self.ok_or_else(|| ExportError::Broken(what.to_string()))
    }

    fn with_context<S: Display>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| ExportError::Broken(what().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A usage error keeps its exit code through added context; a failure does not
    /// become one.
    #[test]
    fn usage_survives_context() {
        let e: Result<()> = Err(ExportError::usage("--holdout 2: must be a fraction"));
        let wrapped = e.context("exporting `a`").unwrap_err();
        assert!(wrapped.is_usage());
        assert_eq!(
            wrapped.to_string(),
            "exporting `a`: --holdout 2: must be a fraction"
        );
        let io: std::result::Result<(), std::io::Error> = Err(std::io::Error::other("disk full"));
        assert!(!io.context("writing out.jsonl").unwrap_err().is_usage());
    }
}
