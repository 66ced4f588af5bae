//! Intake into the queue: the [`IntakeSink`] a run hands its datasets to. New items go
//! into the queue; rejected rows go into `output_dir/<dataset>/_rejected.jsonl`.
//!
//! Invariant: a batch's rejections are written and synced before the queue batch that
//! counts them, so a row counted rejected is durably in the file, and a later run (which
//! starts after the queue's scan position) never reads it again.

use crate::config::DatasetConfig;
use crate::input::dataset::PrefixMark;
use crate::input::intake::{
    IntakeError, IntakeOptions, IntakeReport, IntakeSink, Progress, SinkError,
};
use crate::input::row::{Input, Rejection, Row};
use crate::prompt::remote::IdsSource;
use crate::prompt::{BuiltPrompt, PromptBuilder};

/// The key of an item's `extra` saying the server rendered its prompt ids.
pub(crate) const PROMPT_IDS_KEY: &str = "prompt_ids";

/// Who made a queued item's prompt ids, from its `extra` (`None` when it has none).
pub(crate) fn ids_source_of(item: &Item) -> Option<IdsSource> {
    item.prompt_ids.as_ref()?;
    let server = item
        .extra
        .as_deref()
        .and_then(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .is_some_and(|e| e.get(PROMPT_IDS_KEY).and_then(|v| v.as_str()) == Some("server"));
    Some(if server {
        IdsSource::Server
    } else {
        IdsSource::Client
    })
}
use crate::store::blocks;
use crate::store::queue::{EncodedItem, Item, Queue, QueueError, ScanMark};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Takes in new rows of `d` (the queue's dataset `ds`) and checks the old ones; rejected
/// rows go under `output_dir`.
pub fn intake(
    queue: &Queue,
    ds: u16,
    d: &DatasetConfig,
    builder: &PromptBuilder,
    output_dir: &Path,
    opts: &IntakeOptions,
) -> Result<IntakeReport, IntakeError> {
    let mut sink = QueueSink {
        queue,
        ds,
        rejects: RejectLog::new(output_dir.join(&d.name).join("_rejected.jsonl")),
    };
    crate::input::intake::intake(&mut sink, d, builder, opts)
}

/// Why the queue side of intake failed.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("cannot write {path}: {source}")]
    Rejects {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One dataset of the queue, and its rejected-rows file.
struct QueueSink<'a> {
    queue: &'a Queue,
    ds: u16,
    rejects: RejectLog,
}

impl IntakeSink for QueueSink<'_> {
    type Item = EncodedItem;

    fn encode(row: &Row, prompt: BuiltPrompt, ids: Option<IdsSource>) -> EncodedItem {
        EncodedItem::new(row.row, &item_of(row, prompt, ids))
    }

    fn progress(&self) -> Option<Progress> {
        let s = self.queue.state(self.ds)?;
        Some(Progress {
            scanned_lines: s.scanned_lines,
            items: s.items,
            mark: s.scan_mark.map(|m| PrefixMark {
                lines: m.lines,
                bytes: m.bytes,
                xxh64: m.xxh64,
            }),
        })
    }

    fn id_spill_path(&self) -> PathBuf {
        self.queue
            .path()
            .join("items")
            .join(format!("{}.ids", self.ds))
    }

    fn for_each_id(&self, f: &mut dyn FnMut(&[u8], u64)) -> Result<(), SinkError> {
        Ok(self.queue.for_each_id(self.ds, f)?)
    }

    fn item_id(&self, row: u64) -> Result<Option<String>, SinkError> {
        Ok(self.queue.item_id(self.ds, row)?)
    }

    fn item_hash(&self, row: u64) -> Result<Option<(String, [u8; 16])>, SinkError> {
        Ok(self.queue.item(self.ds, row)?.map(|i| (i.id, i.hash)))
    }

    fn reject(&mut self, r: &Rejection) -> Result<(), SinkError> {
        Ok(self.rejects.write(r)?)
    }

    fn commit(
        &mut self,
        items: &[EncodedItem],
        scanned_lines: u64,
        rejected: u64,
        mark: Option<PrefixMark>,
    ) -> Result<(), SinkError> {
        self.rejects.sync()?;
        let mark = mark.map(|m| ScanMark {
            lines: m.lines,
            bytes: m.bytes,
            xxh64: m.xxh64,
        });
        self.queue
            .enqueue_encoded(self.ds, items, scanned_lines, rejected, mark)?;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), SinkError> {
        Ok(self.queue.flush()?)
    }

    fn rejects_path(&self) -> &Path {
        &self.rejects.path
    }
}

/// The queue item of a row: its messages (the whole conversation when the parser kept
/// it), its prompt as built, and its `tools`, own sampling and server-made ids in `extra`
/// as `{"tools": [...], "sampling": {...}, "prompt_ids": "server"}`.
fn item_of(row: &Row, prompt: BuiltPrompt, ids: Option<IdsSource>) -> Item {
    let messages = match &row.input {
        Input::Messages(m) => Some(m.to_string()),
        Input::Prompt(_) => None,
    };
    Item {
        id: row.id.clone(),
        hash: row.hash,
        prompt: prompt.text,
        messages,
        prompt_ids: prompt.token_ids,
        extra: extra_of(row, ids),
    }
}

/// The item's `extra`: the row's `tools`, a batch row's own `sampling`, and
/// `"prompt_ids": "server"` when the server rendered the prompt (spool's own ids are the
/// default, so items enqueued before the key read as spool's); None for a row with none
/// of these (its record stays the format-4 layout).
fn extra_of(row: &Row, ids: Option<IdsSource>) -> Option<String> {
    let mut extra = serde_json::Map::new();
    if let Some(t) = &row.tools {
        extra.insert("tools".into(), t.clone());
    }
    if let Some(s) = &row.sampling {
        extra.insert("sampling".into(), s.to_value());
    }
    if ids == Some(IdsSource::Server) {
        extra.insert(PROMPT_IDS_KEY.into(), IdsSource::Server.as_str().into());
    }
    (!extra.is_empty()).then(|| serde_json::Value::Object(extra).to_string())
}

/// Buffered rejection lines past which they are written before the batch ends (bounds
/// memory; the fsync still comes before the queue counts them).
const REJECTS_BUFFERED: usize = 1 << 20;

/// Appends rejected rows to `_rejected.jsonl` (created only if there is one). Lines are
/// buffered and written with one call per queue batch, then synced, before the queue
/// counts them: a row counted rejected is durably in the file.
struct RejectLog {
    path: PathBuf,
    file: Option<std::fs::File>,
    /// Lines not yet written.
    pending: Vec<u8>,
}

impl RejectLog {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            file: None,
            pending: Vec::new(),
        }
    }

    fn write(&mut self, r: &Rejection) -> Result<(), EnqueueError> {
        // A Rejection is strings and integers: serializing it cannot fail.
        let _ = serde_json::to_writer(&mut self.pending, r);
        self.pending.push(b'\n');
        if self.pending.len() >= REJECTS_BUFFERED {
            self.write_pending()?;
        }
        Ok(())
    }

    /// Appends the buffered lines (opening the file on the first).
    fn write_pending(&mut self) -> Result<(), EnqueueError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let err = |source| EnqueueError::Rejects {
            path: self.path.clone(),
            source,
        };
        if self.file.is_none() {
            // Durably named (folder and file): the queue's counters soon say these rows
            // were rejected, and a later run never reads them again.
            if let Some(dir) = self.path.parent() {
                blocks::create_dir_durably(dir).map_err(err)?;
            }
            let existed = self.path.exists();
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(crate::output::files::FILE_MODE)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&self.path)
                .map_err(err)?;
            if !existed {
                blocks::sync_parent(&self.path).map_err(err)?;
            }
            self.file = Some(f);
        }
        if let Some(f) = &mut self.file {
            f.write_all(&self.pending).map_err(err)?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Writes and syncs every rejection so far.
    fn sync(&mut self) -> Result<(), EnqueueError> {
        self.write_pending()?;
        if let Some(f) = &self.file {
            f.sync_data().map_err(|source| EnqueueError::Rejects {
                path: self.path.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(path: &Path) -> DatasetConfig {
        DatasetConfig {
            name: "d".into(),
            path: path.to_path_buf(),
            token_budget: None,
            max_prompts: None,
            sampling: Default::default(),
            reasoning: None,
            turns: None,
            history_reasoning: None,
            samples: None,
            chat_template_kwargs: None,
        }
    }

    fn run(q: &Queue, path: &Path, out: &Path) -> Result<IntakeReport, IntakeError> {
        let ds = q.open_dataset("d").unwrap().index;
        let opts = IntakeOptions {
            threads: 2,
            ..Default::default()
        };
        intake(
            q,
            ds,
            &cfg(path),
            &PromptBuilder::new(None, None),
            out,
            &opts,
        )
    }

    fn lines(range: std::ops::Range<usize>) -> String {
        range
            .map(|i| format!("{{\"prompt\": \"prompt number {i}\"}}\n"))
            .collect()
    }

    /// A restart hashes the already-enqueued prefix instead of parsing it; rows appended
    /// since are added; a changed prefix fails the fingerprint and the full row-by-row check
    /// finds the changed row (the run refuses, as without the fast path).
    #[test]
    fn a_restart_skips_the_unchanged_prefix_and_checks_a_changed_one() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        // A blank line and a bad row inside the prefix: both are counted as lines.
        let first = format!("{}\n{{bad\n{}", lines(0..600), lines(600..3000));
        std::fs::write(&file, &first).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.skipped_lines), (3000, 1, 0));
        let s = q.state(0).unwrap();
        let m = s.scan_mark.expect("a mark after a complete pass");
        assert_eq!((m.lines, m.bytes), (3002, first.len() as u64));
        assert_eq!(s.scanned_lines, 3002);

        // Unchanged and appended: the prefix is skipped, the new rows are added.
        let appended = format!("{first}{}", lines(3000..3010));
        std::fs::write(&file, &appended).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected, rep.skipped_lines), (10, 0, 3002));
        let s = q.state(0).unwrap();
        assert_eq!((s.items, s.rejected, s.scanned_lines), (3010, 1, 3012));
        assert_eq!(s.scan_mark.map(|m| m.lines), Some(3012));
        assert_eq!(
            q.item(0, 3011).unwrap().map(|i| i.prompt),
            Some("prompt number 3009".into())
        );
        // Nothing new: nothing added, still skipped.
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.skipped_lines), (0, 3012));

        // One row changed inside the prefix: the fingerprint differs, every row is checked
        // and the changed one is refused.
        let changed = appended.replacen("prompt number 7\"", "prompt number 8\"", 1);
        assert_ne!(changed, appended);
        std::fs::write(&file, &changed).unwrap();
        match run(&q, &file, &out) {
            Err(IntakeError::Changed { line, .. }) => assert_eq!(line, 8),
            other => panic!("expected a refusal of line 8, got {other:?}"),
        }
        // A truncated file is still noticed.
        std::fs::write(&file, lines(0..100)).unwrap();
        assert!(matches!(
            run(&q, &file, &out),
            Err(IntakeError::Shrunk { .. })
        ));
    }

    /// Duplicate ids are found through the filter within a pass, across batches, and
    /// against rows enqueued by an earlier run (the filter is seeded from the queue).
    #[test]
    fn duplicates_are_found_within_a_pass_and_across_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        // Row 2000 repeats row 3 (another batch); row 2001 repeats row 2000's neighbour 1999.
        let mut body = lines(0..2000);
        body.push_str(&lines(3..4));
        body.push_str(&lines(1999..2000));
        std::fs::write(&file, &body).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (2000, 2));
        // Appended later: a repeat of row 10 and a new row.
        body.push_str(&lines(10..11));
        body.push_str(&lines(5000..5001));
        std::fs::write(&file, &body).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (1, 1));
        let rejected = std::fs::read_to_string(out.join("d/_rejected.jsonl")).unwrap();
        let reasons: Vec<&str> = rejected.lines().collect();
        assert_eq!(reasons.len(), 3);
        assert!(reasons[0].contains("first at line 4"), "{}", reasons[0]);
        assert!(reasons[1].contains("first at line 2000"), "{}", reasons[1]);
        assert!(reasons[2].contains("first at line 11"), "{}", reasons[2]);
    }

    /// A file holding each of 3,000 prompts twice, shuffled: every first copy is enqueued
    /// and every second one rejected naming the first copy's line, whichever block (none
    /// of them cached) and spilled run the first copy sits in.
    #[test]
    fn shuffled_repeats_are_each_rejected_naming_the_first_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        let mut order: Vec<usize> = (0..3000).chain(0..3000).collect();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for i in (1..order.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let body: String = order.iter().map(|&i| lines(i..i + 1)).collect();
        std::fs::write(&file, &body).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        let rep = run(&q, &file, &out).unwrap();
        assert_eq!((rep.added, rep.rejected), (3000, 3000));
        let mut first = std::collections::HashMap::new();
        let mut want = Vec::new();
        for (at, &i) in order.iter().enumerate() {
            if let Some(&f) = first.get(&i) {
                want.push((at as u64 + 1, format!("(first at line {})", f + 1)));
            } else {
                first.insert(i, at as u64);
            }
        }
        let got: Vec<(u64, String)> = std::fs::read_to_string(out.join("d/_rejected.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let r: serde_json::Value = serde_json::from_str(l).unwrap();
                let reason = r["reason"].as_str().unwrap();
                let tail = &reason[reason.rfind('(').unwrap()..];
                (r["line"].as_u64().unwrap(), tail.to_string())
            })
            .collect();
        assert_eq!(got, want);
    }

    /// A last line without its newline is not covered by the mark: text appended to that
    /// line would change the row, so it is checked again next time.
    #[test]
    fn a_last_line_without_newline_stays_outside_the_mark() {
        let dir = tempfile::tempdir().unwrap();
        let (file, out) = (dir.path().join("p.jsonl"), dir.path().join("out"));
        let body = lines(0..300);
        std::fs::write(&file, format!("{body}{{\"prompt\": \"last\"}}")).unwrap();
        let q = Queue::open(&dir.path().join("q")).unwrap();
        assert_eq!(run(&q, &file, &out).unwrap().added, 301);
        let m = q.state(0).unwrap().scan_mark.expect("mark");
        assert!(m.lines <= 300, "{m:?}");
        // The last line grew (no newline in between): the row changed, and it is refused.
        std::fs::write(&file, format!("{body}{{\"prompt\": \"last one\"}}\n")).unwrap();
        assert!(matches!(
            run(&q, &file, &out),
            Err(IntakeError::Changed { line: 301, .. })
        ));
    }

    /// A row's `tools` become the item's `extra` as `{"tools": [...]}`; a row without
    /// them has none; messages are kept as given.
    /// A chat row offering one tool.
    fn row_with_tools() -> Row {
        crate::input::row::parse_row(
            "d",
            0,
            r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn tools_go_into_the_item_extra() {
        let row = row_with_tools();
        let built = BuiltPrompt {
            text: "p".into(),
            token_ids: None,
        };
        let item = item_of(&row, built.clone(), None);
        assert_eq!(
            item.extra.as_deref(),
            Some(r#"{"tools":[{"type":"function","function":{"name":"f"}}]}"#)
        );
        assert_eq!(
            item.messages.as_deref(),
            Some(r#"[{"role":"user","content":"x"}]"#)
        );
        let plain = crate::input::row::parse_row("d", 0, r#"{"prompt": "x"}"#).unwrap();
        assert_eq!(item_of(&plain, built.clone(), None).extra, None);
    }

    /// Ids the server rendered are marked in the item's `extra`, beside its tools, and read
    /// back as the server's; spool's own ids, and items enqueued before the mark existed,
    /// read as spool's; an item without ids has no source.
    #[test]
    fn server_made_ids_are_marked_in_the_item() {
        let row = row_with_tools();
        let built = BuiltPrompt {
            text: "p".into(),
            token_ids: Some(vec![1, 2]),
        };
        let server = item_of(&row, built.clone(), Some(IdsSource::Server));
        assert_eq!(
            server.extra.as_deref(),
            Some(
                r#"{"tools":[{"type":"function","function":{"name":"f"}}],"prompt_ids":"server"}"#
            )
        );
        assert_eq!(ids_source_of(&server), Some(IdsSource::Server));
        let plain = crate::input::row::parse_row("d", 0, r#"{"prompt": "x"}"#).unwrap();
        let client = item_of(&plain, built.clone(), Some(IdsSource::Client));
        assert_eq!(client.extra, None);
        assert_eq!(ids_source_of(&client), Some(IdsSource::Client));
        let none = item_of(
            &plain,
            BuiltPrompt {
                text: "p".into(),
                token_ids: None,
            },
            None,
        );
        assert_eq!(ids_source_of(&none), None);
        // The record round-trips with its mark.
        let back = Item::decode_record(server.id.clone(), &server.encode_record()).unwrap();
        assert_eq!(ids_source_of(&back), Some(IdsSource::Server));
    }
}
