//! `speculators`: placeholder until the speculators form lands.

use super::{ExportContext, Sink};
use anyhow::{bail, Result};
use std::path::Path;

/// One row per generation in speculators' shape.
pub fn sink(_tmp: &Path, _ctx: &ExportContext) -> Result<Box<dyn Sink>> {
    bail!("--format speculators is not built yet")
}
