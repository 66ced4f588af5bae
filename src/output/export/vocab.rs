//! `token-freq` and `draft-vocab`: placeholder until the draft vocabulary lands.

use super::{ExportContext, Sink};
use anyhow::{bail, Result};
use std::path::Path;

/// Counts of every completion token id.
pub fn token_freq_sink(_tmp: &Path, _ctx: &ExportContext) -> Result<Box<dyn Sink>> {
    bail!("--format token-freq is not built yet")
}

/// The `d2t`/`t2d` mapping of an `n`-token draft vocabulary.
pub fn draft_vocab_sink(_tmp: &Path, _ctx: &ExportContext, _n: usize) -> Result<Box<dyn Sink>> {
    bail!("--format draft-vocab is not built yet")
}
