//! Dataset file → queue, idempotently (SPEC §3, §4.1).
//!
//! Lines already taken in by an earlier run are only checked (same content hash, or the run
//! refuses); lines after them are parsed, rendered, tokenized and enqueued in batches; bad
//! rows are appended to `output_dir/<dataset>/_rejected.jsonl`.
//!
//! Invariants: a batch of items and the scan position that covers them are one queue batch,
//! so a crash mid-intake resumes at the first line not taken in; the file is read as a
//! stream, memory bounded by one batch; no prompt is enqueued twice.

use crate::config::DatasetConfig;
use crate::dataset::{DatasetError, DatasetReader, Entry, Input, Rejection};
use crate::queue::{Item, Queue, QueueError};
use crate::template::PromptBuilder;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Rows per queue batch.
const BATCH: usize = 1024;

/// Why intake stopped.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("{path}: line {line} changed since it was enqueued (id `{id}`); spool will not mix two versions of a dataset. Restore the file, or use a new dataset name or data_dir")]
    Changed {
        path: PathBuf,
        line: u64,
        id: String,
    },
    #[error("{path}: the file has {lines} lines but {scanned} were enqueued before; it was truncated or replaced")]
    Shrunk {
        path: PathBuf,
        lines: u64,
        scanned: u64,
    },
    #[error("cannot write {path}: {source}")]
    Rejects {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What one intake pass did.
#[derive(Debug, Clone, Default)]
pub struct IntakeReport {
    pub added: u64,
    pub rejected: u64,
    pub lines: u64,
}

/// Appends rejected rows to `_rejected.jsonl` (created only if there is one).
struct RejectLog {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl RejectLog {
    fn write(&mut self, r: &Rejection) -> Result<(), IntakeError> {
        let err = |source| IntakeError::Rejects {
            path: self.path.clone(),
            source,
        };
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir).map_err(err)?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)
                .map_err(err)?;
            self.file = Some(f);
        }
        let mut line = serde_json::to_vec(r).unwrap_or_default();
        line.push(b'\n');
        if let Some(f) = &mut self.file {
            f.write_all(&line).map_err(err)?;
        }
        tracing::warn!(file = %r.file, line = r.line, reason = %r.reason, "row rejected");
        Ok(())
    }

    fn sync(&mut self) -> Result<(), IntakeError> {
        if let Some(f) = &self.file {
            f.sync_data().map_err(|source| IntakeError::Rejects {
                path: self.path.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

/// Takes in new rows of `d` (dataset index `ds`) and checks the old ones.
/// `server_templates`: the server applies the chat template (`api = "chat"`), so messages
/// need no local template; without one, the `prompt` column holds the messages as JSON.
pub fn intake(
    queue: &Queue,
    ds: u16,
    d: &DatasetConfig,
    builder: &PromptBuilder,
    output_dir: &Path,
    server_templates: bool,
) -> Result<IntakeReport, IntakeError> {
    let state = queue.state(ds).ok_or_else(|| QueueError::Corrupt {
        key: d.name.clone(),
        detail: "dataset not opened".into(),
    })?;
    let mut reader = DatasetReader::open(&d.path, &d.name)?;
    let mut rejects = RejectLog {
        path: output_dir.join(&d.name).join("_rejected.jsonl"),
        file: None,
    };
    let mut report = IntakeReport::default();
    let mut items: u64 = state.items;
    let mut batch: Vec<(u64, Item)> = Vec::new();
    let mut batch_rejected = 0u64;
    let mut batch_ids = std::collections::HashMap::<String, u64>::new();
    let cap = d.max_prompts.unwrap_or(u64::MAX);
    let mut last_line = 0;
    while let Some(entry) = reader.next_entry()? {
        let line = reader.lines_read();
        last_line = line;
        let already = line <= state.scanned_lines;
        match entry {
            Entry::Rejected(r) => {
                if !already {
                    rejects.write(&r)?;
                    batch_rejected += 1;
                    report.rejected += 1;
                }
            }
            Entry::Row(r) => {
                if already {
                    if let Some(old) = queue.item(ds, r.row)? {
                        if old.hash != r.hash {
                            return Err(IntakeError::Changed {
                                path: d.path.clone(),
                                line,
                                id: old.id,
                            });
                        }
                    }
                    continue;
                }
                if items >= cap {
                    // Past max_prompts: not taken in, and not counted as scanned.
                    last_line = line - 1;
                    break;
                }
                let dup = match batch_ids.get(&r.id) {
                    Some(&row) => Some(row),
                    None => queue.row_of_id(ds, &r.id)?,
                };
                if let Some(first) = dup {
                    rejects.write(&Rejection {
                        file: d.path.display().to_string(),
                        line,
                        row: r.row,
                        reason: format!("duplicate id `{}` (first at line {})", r.id, first + 1),
                    })?;
                    batch_rejected += 1;
                    report.rejected += 1;
                    continue;
                }
                let built = match &r.input {
                    Input::Prompt(p) => builder.build_text(p),
                    Input::Messages(m) if server_templates && !builder.has_template() => {
                        Ok(crate::template::BuiltPrompt {
                            text: m.to_string(),
                            token_ids: None,
                        })
                    }
                    Input::Messages(m) => builder.build_chat(m),
                };
                let built = match built {
                    Ok(b) => b,
                    Err(e) => {
                        rejects.write(&Rejection {
                            file: d.path.display().to_string(),
                            line,
                            row: r.row,
                            reason: e.to_string(),
                        })?;
                        batch_rejected += 1;
                        report.rejected += 1;
                        continue;
                    }
                };
                let messages = match &r.input {
                    Input::Messages(m) => Some(m.to_string()),
                    Input::Prompt(_) => None,
                };
                batch_ids.insert(r.id.clone(), r.row);
                batch.push((
                    r.row,
                    Item {
                        id: r.id,
                        hash: r.hash,
                        prompt: built.text,
                        messages,
                        prompt_ids: built.token_ids,
                    },
                ));
                items += 1;
                report.added += 1;
            }
        }
        if batch.len() >= BATCH || batch_rejected as usize >= BATCH {
            rejects.sync()?;
            queue.enqueue(ds, &batch, line, batch_rejected)?;
            batch.clear();
            batch_ids.clear();
            batch_rejected = 0;
        }
    }
    if last_line < state.scanned_lines && items < cap {
        return Err(IntakeError::Shrunk {
            path: d.path.clone(),
            lines: last_line,
            scanned: state.scanned_lines,
        });
    }
    rejects.sync()?;
    queue.enqueue(
        ds,
        &batch,
        last_line.max(state.scanned_lines),
        batch_rejected,
    )?;
    queue.flush()?;
    report.lines = last_line;
    Ok(report)
}
