//! `openai-batch`: placeholder until the OpenAI batch output lands.

use super::{ExportContext, Sink};
use anyhow::{bail, Result};
use std::path::Path;

/// OpenAI batch output lines.
pub fn output_sink(_tmp: &Path, _ctx: &ExportContext) -> Result<Box<dyn Sink>> {
    bail!("--format openai-batch is not built yet")
}
