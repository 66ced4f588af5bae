//! `spool export`: the shards in the forms drafter-training tools read.
//!
//! - `sharegpt`: JSONL, one line per shard row (per generation of an item),
//!   `{"id", "dataset", "sample", "turn", "conversations": [...input turns, {"role": "assistant", "content": completion}]}`,
//!   the assistant turn with `reasoning_content` when the row's `reasoning` is set.
//!   This is the shape SpecForge's `regenerate_train_data.py` writes (turns as
//!   `{role, content}`, the regenerated assistant turn last), so its data preparation takes
//!   it as is. The input turns are the row's messages exactly as enqueued (ShareGPT input
//!   already converted to `{role, content}`, a trailing assistant turn dropped); a `prompt`
//!   row becomes one `user` turn holding the prompt text.
//! - `tokens`: one zstd Parquet file, `{id: string, dataset: string, input_ids:
//!   list<int32>, loss_mask: list<uint8>}` with `input_ids = prompt_token_ids ++
//!   completion_token_ids` and `loss_mask` 0 for each prompt id, 1 for each completion id.
//!   Rows without ids (no `[tokenizer]` in the run) cannot be exported in this form; they
//!   are counted and reported.
//!
//! Streaming: shards are read one at a time through the shard reader, batch by batch, with
//! only the columns the format needs decoded; the output is written as it goes (Parquet row groups of at
//! most [`ROW_GROUP_ROWS`] rows), so memory does not grow with the number of shards.
//! Order: datasets in config order, shards in index order, rows in shard order. The output
//! is written under a temporary name next to `--out` and renamed when complete, so a
//! reader never sees half an export. Only complete `part-*.parquet` files are read, so an
//! export may run while `spool run` is still writing.

use crate::config::Config;
use crate::output::reader::{column, ids_at, opt_column, ShardReader};
use crate::output::shard::{folder_entries, parse_shard_index};
use anyhow::{anyhow, bail, Context, Result};
use arrow_array::builder::{Int32Builder, ListBuilder, StringBuilder, UInt8Builder};
use arrow_array::{Array, ArrayRef, ListArray, RecordBatch, StringArray, UInt32Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde_json::{json, Value};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Rows per row group of a `tokens` file.
pub const ROW_GROUP_ROWS: usize = 4096;

/// The output form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// JSONL `{id, dataset, conversations}` (SpecForge's regenerated-data shape).
    Sharegpt,
    /// Parquet `{id, dataset, input_ids, loss_mask}`.
    Tokens,
}

/// What an export wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportReport {
    pub rows: u64,
    pub shards: u64,
    /// Rows left out of a `tokens` export because they have no token ids.
    pub without_ids: u64,
}

/// The `tokens` file's schema.
pub fn tokens_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("dataset", DataType::Utf8, false),
        Field::new(
            "input_ids",
            DataType::List(Arc::new(Field::new("item", DataType::Int32, false))),
            false,
        ),
        Field::new(
            "loss_mask",
            DataType::List(Arc::new(Field::new("item", DataType::UInt8, false))),
            false,
        ),
    ]))
}

/// Complete shards of a dataset, in index order.
fn shards_of(output_dir: &Path, dataset: &str) -> Result<Vec<PathBuf>> {
    let dir = output_dir.join(dataset);
    let entries = folder_entries(&dir).with_context(|| format!("cannot list {}", dir.display()))?;
    let mut v = Vec::new();
    for e in entries {
        if let Some(i) = parse_shard_index(&e.file_name().to_string_lossy()) {
            v.push((i, e.path()));
        }
    }
    v.sort();
    Ok(v.into_iter().map(|(_, p)| p).collect())
}

/// Reads the `columns` of a shard batch by batch (schema checked first). Past the footer,
/// errors name the file in export's own words, with the reader's cause.
fn read_columns(
    path: &Path,
    columns: &[&str],
    mut f: impl FnMut(&RecordBatch) -> Result<()>,
) -> Result<()> {
    let batches = ShardReader::open_checked(path)?
        .batches(Some(columns))
        .map_err(|e| anyhow!(e.detail()))
        .with_context(|| format!("cannot read {}", path.display()))?;
    for batch in batches {
        let batch = batch
            .map_err(|e| anyhow!(e.detail()))
            .with_context(|| format!("cannot decode {}", path.display()))?;
        f(&batch)?;
    }
    Ok(())
}

fn strings<'a>(path: &Path, b: &'a RecordBatch, name: &str) -> Result<&'a StringArray> {
    Ok(column::<StringArray>(path, b, name)?)
}

fn lists<'a>(path: &Path, b: &'a RecordBatch, name: &str) -> Result<&'a ListArray> {
    Ok(column::<ListArray>(path, b, name)?)
}

/// What a `sharegpt` line says of one generation besides its input turns.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reply<'a> {
    pub completion: &'a str,
    /// The thinking, kept apart from the text: the assistant turn's `reasoning_content`.
    pub reasoning: Option<&'a str>,
    pub sample: u32,
    pub turn: u32,
}

/// One `sharegpt` line: the input turns plus the reply as the assistant turn (with its
/// `reasoning_content` when the model's thinking was kept apart), and which sample and
/// turn of the item it is.
pub fn sharegpt_line(
    id: &str,
    dataset: &str,
    prompt: &str,
    messages: Option<&str>,
    reply: Reply<'_>,
) -> Result<Value> {
    let mut turns = match messages {
        Some(m) => match serde_json::from_str::<Value>(m)
            .with_context(|| format!("item `{id}`: stored messages are not JSON"))?
        {
            Value::Array(a) => a,
            _ => bail!("item `{id}`: stored messages are not a JSON array"),
        },
        None => vec![json!({"role": "user", "content": prompt})],
    };
    let mut assistant = json!({"role": "assistant", "content": reply.completion});
    if let Some(r) = reply.reasoning {
        assistant["reasoning_content"] = json!(r);
    }
    turns.push(assistant);
    Ok(
        json!({"id": id, "dataset": dataset, "sample": reply.sample, "turn": reply.turn,
        "conversations": turns}),
    )
}

/// Where the output goes while it is written.
fn temp_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.tmp"))
}

/// Writes the shards of `cfg`'s datasets (or only `dataset`) to `out` in `format`.
pub fn export(
    cfg: &Config,
    format: Format,
    out: &Path,
    dataset: Option<&str>,
) -> Result<ExportReport> {
    let names: Vec<&str> = cfg
        .datasets
        .iter()
        .map(|d| d.name.as_str())
        .filter(|n| dataset.is_none_or(|d| d == *n))
        .collect();
    if let Some(d) = dataset {
        if names.is_empty() {
            bail!(crate::config::ConfigError::Invalid {
                path: cfg.source.clone(),
                key: "--dataset".into(),
                detail: format!("no dataset `{d}` in the config"),
            });
        }
    }
    if let Some(dir) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let tmp = temp_path(out);
    let res = match format {
        Format::Sharegpt => export_sharegpt(cfg, &names, &tmp),
        Format::Tokens => export_tokens(cfg, &names, &tmp),
    };
    let report = match res {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, out)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    Ok(report)
}

fn export_sharegpt(cfg: &Config, names: &[&str], tmp: &Path) -> Result<ExportReport> {
    let file = File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut report = ExportReport::default();
    for name in names {
        for shard in shards_of(&cfg.output_dir, name)? {
            report.shards += 1;
            let columns = [
                "id",
                "prompt",
                "messages",
                "completion",
                "sample",
                "turn",
                "reasoning",
            ];
            read_columns(&shard, &columns, |b| {
                let (id, prompt) = (strings(&shard, b, "id")?, strings(&shard, b, "prompt")?);
                let messages = strings(&shard, b, "messages")?;
                let completion = strings(&shard, b, "completion")?;
                // Absent in shards written before the generation columns.
                let sample = opt_column::<UInt32Array>(&shard, b, "sample")?;
                let turn = opt_column::<UInt32Array>(&shard, b, "turn")?;
                let reasoning = opt_column::<StringArray>(&shard, b, "reasoning")?;
                for i in 0..b.num_rows() {
                    let m = messages.is_valid(i).then(|| messages.value(i));
                    let reply = Reply {
                        completion: completion.value(i),
                        reasoning: reasoning.filter(|r| r.is_valid(i)).map(|r| r.value(i)),
                        sample: sample.map_or(0, |a| a.value(i)),
                        turn: turn.map_or(0, |a| a.value(i)),
                    };
                    let line = sharegpt_line(id.value(i), name, prompt.value(i), m, reply)?;
                    serde_json::to_writer(&mut w, &line)?;
                    w.write_all(b"\n")?;
                    report.rows += 1;
                }
                Ok(())
            })?;
        }
    }
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(report)
}

/// Accumulates `tokens` rows and writes them a row group at a time.
struct TokensWriter {
    writer: ArrowWriter<File>,
    id: StringBuilder,
    dataset: StringBuilder,
    ids: ListBuilder<Int32Builder>,
    mask: ListBuilder<UInt8Builder>,
    rows: usize,
}

impl TokensWriter {
    fn new(file: File) -> Result<Self> {
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
            .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
            .build();
        let item = |t| Arc::new(Field::new("item", t, false));
        Ok(Self {
            writer: ArrowWriter::try_new(file, tokens_schema(), Some(props))?,
            id: StringBuilder::new(),
            dataset: StringBuilder::new(),
            ids: ListBuilder::new(Int32Builder::new()).with_field(item(DataType::Int32)),
            mask: ListBuilder::new(UInt8Builder::new()).with_field(item(DataType::UInt8)),
            rows: 0,
        })
    }

    fn push(&mut self, id: &str, dataset: &str, prompt: &[u32], completion: &[u32]) -> Result<()> {
        self.id.append_value(id);
        self.dataset.append_value(dataset);
        for &t in prompt.iter().chain(completion) {
            let t = i32::try_from(t)
                .with_context(|| format!("item `{id}`: token id {t} does not fit int32"))?;
            self.ids.values().append_value(t);
        }
        self.ids.append(true);
        self.mask.values().append_value_n(0, prompt.len());
        self.mask.values().append_value_n(1, completion.len());
        self.mask.append(true);
        self.rows += 1;
        if self.rows >= ROW_GROUP_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.id.finish()),
            Arc::new(self.dataset.finish()),
            Arc::new(self.ids.finish()),
            Arc::new(self.mask.finish()),
        ];
        let batch = RecordBatch::try_new(tokens_schema(), columns)?;
        self.writer.write(&batch)?;
        self.writer.flush()?;
        self.rows = 0;
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        self.flush()?;
        let file = self.writer.into_inner()?;
        file.sync_all()?;
        Ok(())
    }
}

fn export_tokens(cfg: &Config, names: &[&str], tmp: &Path) -> Result<ExportReport> {
    let file = File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut w = TokensWriter::new(file)?;
    let mut report = ExportReport::default();
    for name in names {
        for shard in shards_of(&cfg.output_dir, name)? {
            report.shards += 1;
            read_columns(
                &shard,
                &["id", "prompt_token_ids", "completion_token_ids"],
                |b| {
                    let id = strings(&shard, b, "id")?;
                    let prompt = lists(&shard, b, "prompt_token_ids")?;
                    let completion = lists(&shard, b, "completion_token_ids")?;
                    for i in 0..b.num_rows() {
                        match (ids_at(&shard, prompt, i)?, ids_at(&shard, completion, i)?) {
                            (Some(p), Some(c)) => {
                                w.push(id.value(i), name, &p, &c)?;
                                report.rows += 1;
                            }
                            _ => report.without_ids += 1,
                        }
                    }
                    Ok(())
                },
            )?;
        }
    }
    if report.rows == 0 && report.without_ids > 0 {
        bail!(
            "none of the {} completed rows has token ids (the run had no [tokenizer]): a `tokens` export needs them",
            report.without_ids
        );
    }
    w.finish()?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `sharegpt` line is the stored input turns (or the prompt as one user turn) plus the
    /// completion as the assistant turn, with its reasoning as `reasoning_content`;
    /// messages that are not JSON are an error.
    #[test]
    fn sharegpt_lines_append_the_completion() {
        let m = r#"[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]"#;
        let reply = |completion| Reply {
            completion,
            ..Reply::default()
        };
        let v = sharegpt_line("a", "d", "<rendered>", Some(m), reply("ans")).unwrap();
        assert_eq!(
            v,
            json!({"id": "a", "dataset": "d", "sample": 0, "turn": 0, "conversations": [
                {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "ans"}]})
        );
        let v = sharegpt_line("b", "d", "raw prompt", None, reply("x")).unwrap();
        assert_eq!(
            v["conversations"],
            json!([{"role": "user", "content": "raw prompt"}, {"role": "assistant", "content": "x"}])
        );
        assert!(sharegpt_line("c", "d", "p", Some("{"), reply("x")).is_err());
        // The thinking goes with the assistant turn; the sample and turn say which
        // generation of the item the line is.
        let thought = Reply {
            completion: "4",
            reasoning: Some("2+2"),
            sample: 2,
            turn: 1,
        };
        let v = sharegpt_line("e", "d", "p", None, thought).unwrap();
        assert_eq!(
            v["conversations"][1],
            json!({"role": "assistant", "content": "4", "reasoning_content": "2+2"})
        );
        assert_eq!(
            (v["sample"].as_u64(), v["turn"].as_u64()),
            (Some(2), Some(1))
        );
    }

    /// The export is written under a hidden temporary name beside `--out`.
    #[test]
    fn temp_file_is_hidden_next_to_the_output() {
        assert_eq!(
            temp_path(Path::new("/x/y.parquet")),
            Path::new("/x/.y.parquet.tmp")
        );
    }
}
