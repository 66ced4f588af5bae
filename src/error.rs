//! The application's error and the one mapping from it to the process's exit code.
//!
//! Invariant: the exit code is decided by [`Kind`] alone, and every boundary error reaches
//! [`Error`] through a `From` impl that matches all of that error's variants, so a new
//! variant does not compile until it is classified. No `From<anyhow::Error>`: an untyped
//! error is classified where it is raised ([`Error::runtime`], [`Error::new`]).

use crate::config::ConfigError;
use crate::input::dataset::DatasetError;
use crate::input::dedup::SpillError;
use crate::input::intake::IntakeError;
use crate::output::archive::ArchiveError;
use crate::output::shard::ShardError;
use crate::output::verify::VerifyError;
use crate::prompt::TemplateError;
use crate::store::blocks::BlockError;
use crate::store::queue::QueueError;
use crate::upstream::UpstreamError;
use std::fmt;

/// Exit codes, as the README documents them.
pub mod exit {
    /// Finished: every item done (or within its budget).
    pub const OK: u8 = 0;
    /// A runtime failure: nothing is lost, the next run resumes.
    pub const FAILURE: u8 = 1;
    /// The user's to fix before running again (config, input, a data dir in use).
    pub const USAGE: u8 = 2;
    /// Finished, with items failed for good (`spool retry` brings them back).
    pub const ITEMS_FAILED: u8 = 3;
    /// Stopped by a signal (128 + SIGINT, as shells report it).
    pub const INTERRUPTED: u8 = 130;
}

/// What kind of ending a command had; the exit code follows from it and nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The user's to fix: bad config, bad or changed input files, a data dir in use.
    Usage,
    /// Anything else that stopped the command: storage, network, output, a bug.
    Runtime,
    /// The run finished but some items failed for good.
    ItemsFailed,
    /// Stopped by a signal before finishing.
    Interrupted,
}

impl Kind {
    /// The process's exit code for this kind of ending.
    pub fn exit_code(self) -> u8 {
        match self {
            Kind::Usage => exit::USAGE,
            Kind::Runtime => exit::FAILURE,
            Kind::ItemsFailed => exit::ITEMS_FAILED,
            Kind::Interrupted => exit::INTERRUPTED,
        }
    }
}

/// An error with its [`Kind`] and its message chain (contexts included).
pub struct Error {
    kind: Kind,
    inner: anyhow::Error,
}

impl Error {
    /// An error of the given kind; `err` keeps its causes for the message.
    pub fn new(kind: Kind, err: impl Into<anyhow::Error>) -> Error {
        Error {
            kind,
            inner: err.into(),
        }
    }

    /// A runtime failure (exit 1) from an error that has no kinds of its own.
    pub fn runtime(err: impl Into<anyhow::Error>) -> Error {
        Error::new(Kind::Runtime, err)
    }

    /// A runtime failure (exit 1) said in one message.
    pub fn msg(msg: impl fmt::Display + fmt::Debug + Send + Sync + 'static) -> Error {
        Error::new(Kind::Runtime, anyhow::Error::msg(msg))
    }

    /// What decides the exit code.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The same error, said inside `context` (the kind is kept).
    pub fn context(self, context: impl fmt::Display + Send + Sync + 'static) -> Error {
        Error {
            kind: self.kind,
            inner: self.inner.context(context),
        }
    }

    /// The message and its causes, outermost first.
    pub fn chain(&self) -> anyhow::Chain<'_> {
        self.inner.chain()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            write!(f, "{:#}", self.inner)
        } else {
            write!(f, "{}", self.inner)
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({:?})", self.inner, self.kind)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.source()
    }
}

/// `.context(..)` on results whose error converts into [`Error`], keeping its kind.
pub trait Context<T> {
    /// Wraps the error in `context`.
    fn context(self, context: impl fmt::Display + Send + Sync + 'static) -> Result<T, Error>;
    /// Wraps the error in what `f` says, built only on error.
    fn with_context<C: fmt::Display + Send + Sync + 'static>(
        self,
        f: impl FnOnce() -> C,
    ) -> Result<T, Error>;
}

impl<T, E: Into<Error>> Context<T> for Result<T, E> {
    fn context(self, context: impl fmt::Display + Send + Sync + 'static) -> Result<T, Error> {
        self.map_err(|e| e.into().context(context))
    }

    fn with_context<C: fmt::Display + Send + Sync + 'static>(
        self,
        f: impl FnOnce() -> C,
    ) -> Result<T, Error> {
        self.map_err(|e| e.into().context(f()))
    }
}

/// The exit code `err` deserves.
pub fn exit_code(err: &Error) -> u8 {
    err.kind.exit_code()
}

/// The error and its causes on one line, each said once. Error types that print their
/// source in their own message (most `thiserror` types here do) would otherwise repeat
/// it under `{:#}` ("No such file or directory: No such file or directory").
pub fn render(err: &Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let s = cause.to_string();
        if s.is_empty() || out.contains(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    out
}

// One `From` per boundary error, each matching every variant: the exit code of a new
// variant is a decision, not a default.

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Error {
        let kind = match &e {
            ConfigError::Read { .. } | ConfigError::Parse { .. } | ConfigError::Invalid { .. } => {
                Kind::Usage
            }
        };
        Error::new(kind, e)
    }
}

impl From<DatasetError> for Error {
    fn from(e: DatasetError) -> Error {
        let kind = match &e {
            DatasetError::Open { .. }
            | DatasetError::Read { .. }
            | DatasetError::Format { .. }
            | DatasetError::Parquet { .. }
            | DatasetError::Limit(_) => Kind::Usage,
        };
        Error::new(kind, e)
    }
}

impl From<TemplateError> for Error {
    fn from(e: TemplateError) -> Error {
        let kind = match &e {
            TemplateError::Load { .. }
            | TemplateError::Render { .. }
            | TemplateError::Raised { .. }
            | TemplateError::Tokenize { .. }
            | TemplateError::NoTemplate => Kind::Usage,
        };
        Error::new(kind, e)
    }
}

/// The kind of a queue error: only a data dir held by another process is the user's to fix.
fn queue_kind(e: &QueueError) -> Kind {
    match e {
        QueueError::Locked { .. } => Kind::Usage,
        QueueError::Open { .. }
        | QueueError::Storage(_)
        | QueueError::Corrupt { .. }
        | QueueError::Version { .. }
        | QueueError::Poisoned { .. }
        | QueueError::File(_)
        | QueueError::RowOrder { .. }
        | QueueError::UnknownDataset { .. }
        | QueueError::Marker { .. } => Kind::Runtime,
    }
}

impl From<QueueError> for Error {
    fn from(e: QueueError) -> Error {
        Error::new(queue_kind(&e), e)
    }
}

impl From<BlockError> for Error {
    fn from(e: BlockError) -> Error {
        let kind = match &e {
            BlockError::Io { .. } | BlockError::Corrupt { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<IntakeError> for Error {
    fn from(e: IntakeError) -> Error {
        let kind = match &e {
            IntakeError::Dataset(_)
            | IntakeError::Changed { .. }
            | IntakeError::Shrunk { .. }
            | IntakeError::Generation { .. } => Kind::Usage,
            // The sink is the queue (or the rejects file): a queue error keeps its own kind.
            IntakeError::Sink(e) => e
                .downcast_ref::<QueueError>()
                .map_or(Kind::Runtime, queue_kind),
            IntakeError::Spill(_)
            | IntakeError::NotOpened(_)
            | IntakeError::Panicked
            | IntakeError::Render { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<SpillError> for Error {
    fn from(e: SpillError) -> Error {
        Error::runtime(e)
    }
}

impl From<ArchiveError> for Error {
    fn from(e: ArchiveError) -> Error {
        let kind = match &e {
            ArchiveError::Queue(q) => queue_kind(q),
            ArchiveError::Shard(_)
            | ArchiveError::List { .. }
            | ArchiveError::Inconsistent { .. }
            | ArchiveError::NotOpen { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<ShardError> for Error {
    fn from(e: ShardError) -> Error {
        let kind = match &e {
            ShardError::Io { .. }
            | ShardError::Parquet { .. }
            | ShardError::Arrow { .. }
            | ShardError::Schema { .. }
            | ShardError::Exists { .. }
            | ShardError::Invalid { .. }
            | ShardError::Poisoned { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<VerifyError> for Error {
    fn from(e: VerifyError) -> Error {
        let kind = match &e {
            VerifyError::Queue(q) => queue_kind(q),
            VerifyError::List { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<UpstreamError> for Error {
    fn from(e: UpstreamError) -> Error {
        // A server that refuses or cannot be reached is a runtime condition; addresses the
        // user wrote are checked as config (`ConfigError`) before any request.
        let kind = match &e {
            UpstreamError::Connect { .. }
            | UpstreamError::Timeout
            | UpstreamError::Status { .. }
            | UpstreamError::StreamCut(_)
            | UpstreamError::Malformed(_)
            | UpstreamError::TooLarge(_)
            | UpstreamError::Redirect { .. }
            | UpstreamError::BadUrl { .. }
            | UpstreamError::ClientBuild(_)
            | UpstreamError::Encode(_) => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

/// A sealed log is the user's (the job is published); the rest is the store's or a record's.
impl From<crate::cluster::commits::CommitError> for Error {
    fn from(e: crate::cluster::commits::CommitError) -> Error {
        use crate::cluster::commits::CommitError;
        let kind = match &e {
            CommitError::Sealed { .. } => Kind::Usage,
            CommitError::Bucket(_)
            | CommitError::Malformed { .. }
            | CommitError::Newer { .. }
            | CommitError::Gap { .. }
            | CommitError::Untrusted { .. }
            | CommitError::Outdated { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

/// A config that is not the job's shape, a change `--reshape` refuses, a store without
/// conditional creates, no count: the user's to settle.
impl From<crate::cluster::job::JobError> for Error {
    fn from(e: crate::cluster::job::JobError) -> Error {
        use crate::cluster::job::JobError;
        let kind = match &e {
            JobError::Mismatch { .. }
            | JobError::Unsafe { .. }
            | JobError::NoConditionalCreates { .. }
            | JobError::NoCount { .. } => Kind::Usage,
            JobError::Bucket(_)
            | JobError::Untrusted { .. }
            | JobError::Newer { .. }
            | JobError::Io { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

impl From<crate::output::bucket::BucketError> for Error {
    fn from(e: crate::output::bucket::BucketError) -> Error {
        Error::runtime(e)
    }
}

/// Something at `export --out` that an export must not replace is the user's to settle.
impl From<crate::output::export::OutError> for Error {
    fn from(e: crate::output::export::OutError) -> Error {
        use crate::output::export::OutError;
        let kind = match &e {
            OutError::NotAnExport { .. }
            | OutError::Folder { .. }
            | OutError::NotAFolder { .. } => Kind::Usage,
            OutError::Io { .. } => Kind::Runtime,
        };
        Error::new(kind, e)
    }
}

/// A partition the job cannot have is the user's to fix (exit 2).
/// What the user changes (a flag, the config, the data as it is) is theirs; the rest is
/// reading shards or writing the output.
impl From<crate::output::export::error::ExportError> for Error {
    fn from(e: crate::output::export::error::ExportError) -> Error {
        let kind = if e.is_usage() {
            Kind::Usage
        } else {
            Kind::Runtime
        };
        Error::new(kind, e)
    }
}

impl From<crate::cluster::partition::PartitionError> for Error {
    fn from(e: crate::cluster::partition::PartitionError) -> Error {
        Error::new(Kind::Usage, e)
    }
}

impl From<crate::run::inputs::FetchError> for Error {
    fn from(e: crate::run::inputs::FetchError) -> Error {
        Error::runtime(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::runtime(e)
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Error {
        Error::runtime(e)
    }
}

impl From<reqwest::Error> for Error {
    fn from(e: reqwest::Error) -> Error {
        Error::runtime(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open {path}: {source}")]
    struct Open {
        path: String,
        source: std::io::Error,
    }

    /// The rendered message says each cause once, where `{:#}` would repeat a source that
    /// its wrapper already prints.
    #[test]
    fn render_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = Error::runtime(Open {
            path: "x.jsonl".into(),
            source: io,
        })
        .context("dataset `a`");
        assert_eq!(render(&e), "dataset `a`: cannot open x.jsonl: No such file");
        assert_eq!(format!("{e:#}").matches("No such file").count(), 2);
    }

    /// Exit 0 is a clean ending, which is no error: the codes of the error kinds are all
    /// different from it.
    #[test]
    fn no_error_kind_exits_0() {
        for k in [
            Kind::Usage,
            Kind::Runtime,
            Kind::ItemsFailed,
            Kind::Interrupted,
        ] {
            assert_ne!(k.exit_code(), exit::OK, "{k:?}");
        }
        assert_eq!(exit::OK, 0);
    }

    /// Exit 1: storage, output and network failures, and errors with no kinds of their own.
    #[test]
    fn runtime_failures_exit_1() {
        let errors = [
            Error::from(QueueError::Poisoned {
                cause: "disk full".into(),
            }),
            Error::from(ShardError::Exists {
                path: PathBuf::from("p"),
            }),
            Error::from(UpstreamError::Timeout),
            Error::from(IntakeError::Panicked),
            Error::from(std::io::Error::other("disk")),
            Error::msg("queue storage failed"),
        ];
        for e in errors {
            assert_eq!(exit_code(&e), 1, "{e}");
        }
    }

    /// Exit 2: bad config, bad or changed input, a data dir held by another process, also
    /// inside a wrapper and under a context.
    #[test]
    fn usage_errors_exit_2() {
        let errors = [
            Error::from(ConfigError::Parse {
                path: PathBuf::from("spool.toml"),
                detail: "x".into(),
            }),
            Error::from(DatasetError::Format {
                path: PathBuf::from("a.csv"),
            }),
            Error::from(TemplateError::NoTemplate),
            Error::from(QueueError::Locked {
                path: PathBuf::from("data"),
            })
            .context("cannot verify while a `spool run` is active"),
            Error::from(IntakeError::Changed {
                path: PathBuf::from("p.jsonl"),
                line: 4,
                id: "3".into(),
            }),
            Error::from(IntakeError::Dataset(DatasetError::Format {
                path: PathBuf::from("a.csv"),
            })),
        ];
        for e in errors {
            assert_eq!(exit_code(&e), 2, "{e}");
        }
        let r: Result<(), ConfigError> = Err(ConfigError::Parse {
            path: PathBuf::from("spool.toml"),
            detail: "x".into(),
        });
        let e = r.context("loading").unwrap_err();
        assert_eq!(exit_code(&e), 2);
        assert_eq!(render(&e), "loading: bad config spool.toml: x");
    }

    /// Exit 3: the run finished with items failed for good.
    #[test]
    fn items_failed_exits_3() {
        assert_eq!(Kind::ItemsFailed.exit_code(), 3);
    }

    /// Exit 130: stopped by a signal.
    #[test]
    fn interrupted_exits_130() {
        assert_eq!(Kind::Interrupted.exit_code(), 130);
    }
}
