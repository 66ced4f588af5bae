//! `openai-batch`: the batch output file of OpenAI's Batch API, as vLLM's `run-batch`
//! writes it: one JSON line per request,
//! `{"id": "batch_req_…", "custom_id", "response": {"status_code": 200, "request_id",
//! "body": <chat.completion | text_completion>}, "error": null}`.
//!
//! One line per item and turn: the samples of an item's first turn are one line's
//! `choices` (index = sample), as a request with `n` answers; a later turn of a
//! conversation (`turns = "all"`: each sample has its own history) is a line per sample,
//! `custom_id` `<id>#t<turn>s<sample>`. A chat row (`messages`) answers with a
//! `chat.completion`, a prompt row with a `text_completion`.
//!
//! After each dataset's generations come its failed items (the queue's `f` records) and its
//! rejected rows (`_rejected.jsonl`), each a line with `response: null` and
//! `error: {code, message}`. Failed items are read from the queue only when no run holds it;
//! while one does, they are left out and a warning says so.
//!
//! Invariants: ids are derived from (dataset, item, turn, sample), so the same shards give
//! the same file; the sink holds one item's rows at a time.

use super::{Accounting, ExportContext, ExportRow, Jsonl, Sink};
use crate::output::export::error::{Context, Result};
use crate::store::queue::{Queue, QueueError};
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// The `error.code` of a failed item.
pub const CODE_FAILED: &str = "request_failed";
/// The `error.code` of a rejected input row.
pub const CODE_REJECTED: &str = "rejected_row";

/// The queue, when it can be read.
enum QueueAccess {
    Open(Box<Queue>),
    /// No queue folder: nothing has failed.
    Absent,
    /// A run holds it.
    Held,
}

/// Lines written for one dataset.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchCounts {
    pub responses: u64,
    pub failed: u64,
    pub rejected: u64,
}

/// The `openai-batch` writer.
pub struct BatchSink {
    out: Jsonl,
    output_dir: PathBuf,
    queue: QueueAccess,
    dataset: Option<String>,
    item: Vec<ExportRow>,
    counts: BatchCounts,
}

/// OpenAI batch output lines.
pub fn output_sink(tmp: &Path, ctx: &ExportContext) -> Result<Box<dyn Sink>> {
    let queue = if ctx.data_dir.is_dir() {
        match Queue::open(&ctx.data_dir) {
            Ok(q) => QueueAccess::Open(Box::new(q)),
            Err(QueueError::Locked { path }) => {
                tracing::warn!(queue = %path.display(),
                    "a `spool run` holds the queue: failed items are not in this openai-batch export (rejected rows are); export again once it has stopped");
                QueueAccess::Held
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("cannot read the failed items in {}", ctx.data_dir.display())
                })
            }
        }
    } else {
        QueueAccess::Absent
    };
    Ok(Box::new(BatchSink {
        out: Jsonl::create(tmp)?,
        output_dir: ctx.output_dir.clone(),
        queue,
        dataset: None,
        item: Vec::new(),
        counts: BatchCounts::default(),
    }))
}

impl BatchSink {
    /// Writes the held item's lines.
    fn flush_item(&mut self) -> Result<()> {
        if self.item.is_empty() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.item);
        for (custom_id, group) in group_item(&rows) {
            self.out.line(&response_line(&group, &custom_id)?)?;
            self.counts.responses += 1;
        }
        Ok(())
    }

    /// Writes the failed items and rejected rows of the dataset just read.
    fn end_dataset(&mut self) -> Result<()> {
        self.flush_item()?;
        let Some(name) = self.dataset.take() else {
            return Ok(());
        };
        if let QueueAccess::Open(q) = &self.queue {
            if let Some(ds) = q.states().into_iter().find(|s| s.name == name) {
                let failures = q
                    .failures(ds.index, usize::MAX)
                    .with_context(|| format!("dataset {name}: cannot read the failed items"))?;
                for (row, f) in failures {
                    let id = q
                        .item(ds.index, row)
                        .with_context(|| format!("dataset {name}: cannot read item {row}"))?
                        .map(|i| i.id)
                        .unwrap_or_else(|| format!("row-{row}"));
                    let message = format!("failed after {} attempt(s): {}", f.attempts, f.reason);
                    self.out.line(&error_line(
                        &name,
                        &id,
                        &format!("f{row}"),
                        CODE_FAILED,
                        &message,
                    ))?;
                    self.counts.failed += 1;
                }
            }
        }
        let path = self
            .output_dir
            .join(&name)
            .join(crate::output::verify::REJECTED_FILE);
        match std::fs::File::open(&path) {
            Ok(f) => {
                for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
                    let line = line.with_context(|| format!("cannot read {}", path.display()))?;
                    if line.trim().is_empty() {
                        continue;
                    }
                    let r: Value = serde_json::from_str(&line)
                        .with_context(|| format!("{}: line {}: not JSON", path.display(), i + 1))?;
                    let (file, at, reason) = (
                        r["file"].as_str().unwrap_or(""),
                        r["line"].as_u64().unwrap_or(0),
                        r["reason"].as_str().unwrap_or(""),
                    );
                    let file_name = Path::new(file)
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    // A row refused before its id was read answers under its place.
                    let id = r["id"]
                        .as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| format!("{file_name}:{at}"));
                    let message = format!("{file}: line {at}: {reason}");
                    self.out.line(&error_line(
                        &name,
                        &id,
                        &format!("r{at}"),
                        CODE_REJECTED,
                        &message,
                    ))?;
                    self.counts.rejected += 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
        let c = std::mem::take(&mut self.counts);
        tracing::info!(dataset = %name, responses = c.responses, failed = c.failed,
            rejected = c.rejected, failed_read = matches!(self.queue, QueueAccess::Open(_) | QueueAccess::Absent),
            "openai-batch lines written");
        Ok(())
    }
}

impl Sink for BatchSink {
    fn begin_dataset(&mut self, name: &str) -> Result<()> {
        self.end_dataset()?;
        self.dataset = Some(name.to_owned());
        Ok(())
    }

    fn push(&mut self, row: &ExportRow) -> Result<()> {
        if self.item.first().is_some_and(|r| r.row.id != row.row.id) {
            self.flush_item()?;
        }
        self.item.push(row.clone());
        Ok(())
    }

    fn finish(mut self: Box<Self>, _: &Accounting) -> Result<()> {
        self.end_dataset()?;
        self.out.finish()
    }
}

/// An item's rows as output lines: the first turn's samples together under the item's id,
/// each later (turn, sample) alone under `<id>#t<turn>s<sample>`.
fn group_item(rows: &[ExportRow]) -> Vec<(String, Vec<&ExportRow>)> {
    let first_turn = rows.iter().map(|r| r.row.turn).min().unwrap_or(0);
    let mut out: Vec<(String, Vec<&ExportRow>)> = Vec::new();
    let mut first: Vec<&ExportRow> = rows.iter().filter(|r| r.row.turn == first_turn).collect();
    first.sort_by_key(|r| r.row.sample);
    if let Some(r) = first.first() {
        out.push((r.row.id.clone(), first));
    }
    let mut later: Vec<&ExportRow> = rows.iter().filter(|r| r.row.turn != first_turn).collect();
    later.sort_by_key(|r| (r.row.turn, r.row.sample));
    for r in later {
        out.push((
            format!("{}#t{}s{}", r.row.id, r.row.turn, r.row.sample),
            vec![r],
        ));
    }
    out
}

/// A stable hex tag for a line's ids.
fn tag(parts: &[&str]) -> String {
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend_from_slice(p.as_bytes());
        bytes.push(0);
    }
    format!(
        "{:016x}",
        twox_hash::XxHash64::oneshot(0x6261_7463_6870, &bytes)
    )
}

/// The line of one request that was answered: `rows` share the prompt (one per sample).
pub fn response_line(rows: &[&ExportRow], custom_id: &str) -> Result<Value> {
    let first = &rows
        .first()
        .context("an output line needs at least one row")?
        .row;
    let t = tag(&[&first.dataset, custom_id]);
    let chat = first.messages.is_some();
    let mut choices = Vec::with_capacity(rows.len());
    let mut completion_tokens = 0u64;
    let mut created = 0i64;
    for r in rows {
        let row = &r.row;
        completion_tokens += u64::from(row.completion_tokens);
        created = created.max(row.completed_at_ms / 1000);
        let mut choice = if chat {
            json!({"index": row.sample, "message": super::sharegpt::openai_assistant(r)?,
                "logprobs": null, "finish_reason": row.finish_reason})
        } else {
            let mut c = json!({"index": row.sample, "text": row.completion, "logprobs": null,
                "finish_reason": row.finish_reason});
            if let Some(t) = &row.reasoning {
                c["reasoning_content"] = json!(t);
            }
            c
        };
        if let Some(p) = &row.partial {
            choice["partial"] = json!(p);
        }
        choices.push(choice);
    }
    let prompt_tokens = u64::from(first.prompt_tokens);
    let body = json!({
        "id": format!("{}-{t}", if chat { "chatcmpl" } else { "cmpl" }),
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": first.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens},
    });
    let request_id = if rows.len() == 1 && custom_id != first.id {
        format!(
            "{}-{}-s{}t{}",
            first.dataset, first.row, first.sample, first.turn
        )
    } else {
        format!("{}-{}", first.dataset, first.row)
    };
    Ok(json!({
        "id": format!("batch_req_{t}"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": null,
    }))
}

/// The line of a request with no answer.
pub fn error_line(dataset: &str, custom_id: &str, place: &str, code: &str, message: &str) -> Value {
    json!({
        "id": format!("batch_req_{}", tag(&[dataset, custom_id, place])),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": code, "message": message},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    fn row(id: &str, sample: u32, turn: u32, messages: Option<&str>) -> ExportRow {
        prepare(
            ShardRow {
                id: id.into(),
                dataset: "d".into(),
                row: 3,
                prompt: "p".into(),
                messages: messages.map(Into::into),
                completion: format!("answer {sample}"),
                prompt_tokens: 5,
                completion_tokens: 2,
                finish_reason: "stop".into(),
                model: "m".into(),
                completed_at_ms: 1_700_000_000_123,
                sample,
                turn,
                reasoning: (sample == 1).then(|| "think".into()),
                ..ShardRow::default()
            },
            "".into(),
            None,
        )
    }

    /// An item's samples of its first turn are one chat.completion with a choice per
    /// sample and usage counting the prompt once; later turns are a line each.
    #[test]
    fn samples_are_choices_and_later_turns_lines() {
        let m = Some(r#"[{"role":"user","content":"q"}]"#);
        let rows = vec![row("a", 0, 0, m), row("a", 1, 0, m), row("a", 0, 1, m)];
        let groups = group_item(&rows);
        let ids: Vec<&str> = groups.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(ids, ["a", "a#t1s0"]);
        let v = response_line(&groups[0].1, &groups[0].0).unwrap();
        assert_eq!(v["custom_id"], "a");
        assert!(v["id"].as_str().unwrap().starts_with("batch_req_"));
        assert_eq!(v["error"], Value::Null);
        let r = &v["response"];
        assert_eq!(r["status_code"], 200);
        assert_eq!(r["request_id"], "d-3");
        let b = &r["body"];
        assert_eq!(b["object"], "chat.completion");
        assert_eq!(b["created"], 1_700_000_000);
        assert_eq!(b["choices"].as_array().unwrap().len(), 2);
        assert_eq!(b["choices"][1]["index"], 1);
        assert_eq!(b["choices"][1]["message"]["reasoning_content"], "think");
        assert_eq!(b["choices"][0]["message"]["content"], "answer 0");
        assert_eq!(
            b["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
        );
        let again = response_line(&groups[0].1, &groups[0].0).unwrap();
        assert_eq!(again, v, "the same rows give the same line");
        let p = response_line(&[&row("b", 0, 0, None)], "b").unwrap();
        assert_eq!(p["response"]["body"]["object"], "text_completion");
        assert_eq!(p["response"]["body"]["choices"][0]["text"], "answer 0");
    }

    /// A request with no answer is `response: null` with an `{code, message}` error.
    #[test]
    fn failures_are_error_lines() {
        let v = error_line(
            "d",
            "x",
            "f3",
            CODE_FAILED,
            "failed after 6 attempt(s): 500",
        );
        assert_eq!(v["response"], Value::Null);
        assert_eq!(
            v["error"],
            json!({"code": "request_failed", "message": "failed after 6 attempt(s): 500"})
        );
        assert_eq!(v["custom_id"], "x");
    }
}
