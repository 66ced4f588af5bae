//! The application's error and how it maps to the exit codes of SPEC §1.

use crate::config::ConfigError;

/// Exit codes (SPEC §1).
pub mod exit {
    pub const OK: u8 = 0;
    pub const FAILURE: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const ITEMS_FAILED: u8 = 3;
    pub const INTERRUPTED: u8 = 130;
}

/// The error and its causes on one line, each said once. Error types that print their
/// source in their own message (most `thiserror` types here do) would otherwise repeat
/// it under `{:#}` ("No such file or directory: No such file or directory").
pub fn render(err: &anyhow::Error) -> String {
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

/// The exit code an error deserves: bad config, bad input files and a locked data dir are
/// the user's to fix (2); everything else is a runtime failure (1).
pub fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.downcast_ref::<ConfigError>().is_some()
            || cause
                .downcast_ref::<crate::input::dataset::DatasetError>()
                .is_some()
            || cause
                .downcast_ref::<crate::prompt::TemplateError>()
                .is_some()
            || matches!(
                cause.downcast_ref::<crate::store::queue::QueueError>(),
                Some(crate::store::queue::QueueError::Locked { .. })
            )
            || matches!(
                cause.downcast_ref::<crate::input::intake::IntakeError>(),
                Some(
                    crate::input::intake::IntakeError::Changed { .. }
                        | crate::input::intake::IntakeError::Shrunk { .. }
                        | crate::input::intake::IntakeError::Dataset(_)
                )
            )
        {
            return exit::USAGE;
        }
    }
    exit::FAILURE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open {path}: {source}")]
    struct Open {
        path: String,
        source: std::io::Error,
    }

    #[test]
    fn render_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = anyhow::Error::new(Open {
            path: "x.jsonl".into(),
            source: io,
        })
        .context("dataset `a`");
        assert_eq!(render(&e), "dataset `a`: cannot open x.jsonl: No such file");
        assert_eq!(format!("{e:#}").matches("No such file").count(), 2);
    }
}
