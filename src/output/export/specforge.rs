//! `specforge` and `specforge-chat`: placeholder until the SpecForge forms land.

use super::Sink;
use anyhow::{bail, Result};
use std::path::Path;

/// `specforge`: `{id, input_ids, loss_mask}` JSONL.
pub fn ids_sink(_tmp: &Path) -> Result<Box<dyn Sink>> {
    bail!("--format specforge is not built yet")
}

/// `specforge-chat`: conversation rows (per item, or per assistant turn with `per_turn`).
pub fn chat_sink(_tmp: &Path, _per_turn: bool) -> Result<Box<dyn Sink>> {
    bail!("--format specforge-chat is not built yet")
}
