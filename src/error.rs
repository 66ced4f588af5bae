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

/// The exit code an error deserves: bad config, bad input files and a locked data dir are
/// the user's to fix (2); everything else is a runtime failure (1).
pub fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.downcast_ref::<ConfigError>().is_some()
            || cause
                .downcast_ref::<crate::dataset::DatasetError>()
                .is_some()
            || cause
                .downcast_ref::<crate::template::TemplateError>()
                .is_some()
            || matches!(
                cause.downcast_ref::<crate::queue::QueueError>(),
                Some(crate::queue::QueueError::Locked { .. })
            )
            || matches!(
                cause.downcast_ref::<crate::intake::IntakeError>(),
                Some(
                    crate::intake::IntakeError::Changed { .. }
                        | crate::intake::IntakeError::Shrunk { .. }
                        | crate::intake::IntakeError::Dataset(_)
                )
            )
        {
            return exit::USAGE;
        }
    }
    exit::FAILURE
}
