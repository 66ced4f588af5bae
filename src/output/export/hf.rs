//! `hf`: a folder that HuggingFace `datasets` loads as a `DatasetDict`, one split per spool
//! dataset, with a dataset card:
//!
//! ```text
//! DIR/README.md                                  # card: YAML `configs` + `dataset_info`, then counts
//! DIR/data/<split>-00000-of-00002.parquet        # the layout `push_to_hub` writes
//! DIR/data/<split>-00001-of-00002.parquet
//! ```
//!
//! `load_dataset(DIR)` reads the card's `configs` (`data_files: [{split, path:
//! data/<split>-*}]`) and `dataset_info` (features; each split's `num_examples`, which
//! `datasets` checks against the files).
//!
//! Split names must match `datasets`' `^\w+(\.\w+)*$`; dataset names are `[A-Za-z0-9_.-]+`,
//! so [`split_names`] turns `-` into `_` (and every `.` too when the dots are not between
//! word characters), and a name already taken gets `_2`, `_3`, …. The card maps each split
//! back to its dataset.
//!
//! With `--holdout`, each dataset also has a split `<split>_eval` of its held-out items
//! ([`super::holdout`]). The card shows per split the counts, the finish and stop reasons
//! and two histograms (completion length, turns per conversation) as SVG pictures in
//! `DIR/images/`, each with its numbers beneath ([`super::report::markdown_section`]).
//!
//! Invariants:
//! - Memory is bounded: rows go out a row group at a time (at most [`ROW_GROUP_ROWS`] rows
//!   or about [`ROW_GROUP_BYTES`] of text and ids); a split's file is closed past
//!   [`FILE_BYTES`] and the next one begun.
//! - Every split has at least one file (a dataset with no kept rows is an empty split), and
//!   its files are renamed to their `-NNNNN-of-NNNNN` names when the split closes, so the
//!   count in the names is right.
//! - The card is written last (the accounting is complete only then), and the folder is
//!   renamed into place by [`super::export`].

use super::holdout::Holdout;
use super::report::{markdown_section, pictures};
use super::sharegpt::{input_turns, tools_string};
use super::stats::DatasetStats;
use super::{Accounting, ExportContext, ExportRow, Sink};
use crate::config::{Config, DatasetConfig};
use crate::output::export::error::{Context, ExportError, Result};
use arrow_array::builder::{
    Int32Builder, ListBuilder, StringBuilder, StructBuilder, UInt32Builder, UInt8Builder,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Rows per row group at most (fewer when the rows are long, see [`ROW_GROUP_BYTES`]).
pub const ROW_GROUP_ROWS: usize = 1024;
/// About this many bytes of text and ids buffered close a row group.
pub const ROW_GROUP_BYTES: usize = 64 << 20;
/// A split's file is closed once it holds this many bytes (what `push_to_hub` uses).
pub const FILE_BYTES: u64 = 500 << 20;

/// The line of the card that marks a folder as an `hf` export (an export may replace it).
pub const CARD_MARK: &str = "Written by `spool export --format hf`";

/// The keys of a message kept in the `messages` column.
const MESSAGE_KEYS: [&str; 6] = [
    "role",
    "content",
    "reasoning_content",
    "tool_calls",
    "tool_call_id",
    "name",
];

fn message_fields() -> Fields {
    MESSAGE_KEYS
        .iter()
        .map(|k| Field::new(*k, DataType::Utf8, true))
        .collect()
}

/// The columns of an `hf` file.
pub fn hf_schema() -> SchemaRef {
    let list = |t| DataType::List(Arc::new(Field::new("item", t, false)));
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("dataset", DataType::Utf8, false),
        Field::new("sample", DataType::UInt32, false),
        Field::new("turn", DataType::UInt32, false),
        Field::new("messages", list(DataType::Struct(message_fields())), false),
        Field::new("prompt", DataType::Utf8, false),
        Field::new("completion", DataType::Utf8, false),
        Field::new("reasoning", DataType::Utf8, true),
        Field::new("tool_calls", DataType::Utf8, true),
        Field::new("tools", DataType::Utf8, false),
        Field::new("finish_reason", DataType::Utf8, false),
        Field::new("partial", DataType::Utf8, true),
        Field::new("prompt_tokens", DataType::UInt32, false),
        Field::new("completion_tokens", DataType::UInt32, false),
        Field::new("input_ids", list(DataType::Int32), true),
        Field::new("loss_mask", list(DataType::UInt8), true),
        Field::new("sampling", DataType::Utf8, true),
    ]))
}

/// The `features` of the card: [`hf_schema`] in `datasets`' YAML spelling.
fn features_yaml() -> String {
    let mut s = String::from("  features:\n");
    for f in hf_schema().fields() {
        let _ = writeln!(s, "  - name: {}", f.name());
        match f.data_type() {
            DataType::Utf8 => s.push_str("    dtype: string\n"),
            DataType::UInt32 => s.push_str("    dtype: uint32\n"),
            DataType::List(item) => match item.data_type() {
                DataType::Int32 => s.push_str("    list: int32\n"),
                DataType::UInt8 => s.push_str("    list: uint8\n"),
                _ => {
                    s.push_str("    list:\n");
                    for k in MESSAGE_KEYS {
                        let _ = writeln!(s, "    - name: {k}\n      dtype: string");
                    }
                }
            },
            other => {
                let _ = writeln!(s, "    dtype: {other}");
            }
        }
    }
    s
}

/// Whether `s` is a split name `datasets` accepts (`^\w+(\.\w+)*$`, ASCII here).
fn valid_split(s: &str) -> bool {
    !s.is_empty()
        && s.split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
}

/// The split name of each dataset, in order (module docs: `-` → `_`, bad dots → `_`,
/// clashes numbered).
pub fn split_names(datasets: &[String]) -> Vec<String> {
    let mut taken = HashSet::new();
    datasets
        .iter()
        .map(|d| {
            let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
            let mut s: String = d
                .chars()
                .map(|c| if word(c) || c == '.' { c } else { '_' })
                .collect();
            if !valid_split(&s) {
                s = s.chars().map(|c| if word(c) { c } else { '_' }).collect();
            }
            if s.is_empty() {
                s = "split".into();
            }
            // `all` means every split to `datasets`: it cannot name one.
            if s == "all" {
                s = "all_".into();
            }
            let mut name = s.clone();
            let mut n = 2;
            while !taken.insert(name.clone()) {
                name = format!("{s}_{n}");
                n += 1;
            }
            name
        })
        .collect()
}

/// What was asked of the server for dataset `d`: the effective sampling (a drawn value as
/// its list or table), `samples`, `turns`, `reasoning` and the template variables.
pub fn generation_json(cfg: &Config, d: &DatasetConfig) -> Value {
    let mut sampling = serde_json::to_value(cfg.sampling_of(d)).unwrap_or(Value::Null);
    if let Some(t) = &d.sampling.temperature {
        sampling["temperature"] = Value::from(t.clone());
    }
    if let Some(t) = &d.sampling.top_p {
        sampling["top_p"] = Value::from(t.clone());
    }
    let g = cfg.generation_of(d);
    json!({
        "sampling": sampling,
        "samples": g.samples,
        "turns": g.turns,
        "reasoning": g.reasoning,
        "chat_template_kwargs": g.chat_template_kwargs,
    })
}

/// The rows of one row group, column by column.
struct Columns {
    id: StringBuilder,
    dataset: StringBuilder,
    sample: UInt32Builder,
    turn: UInt32Builder,
    messages: ListBuilder<StructBuilder>,
    prompt: StringBuilder,
    completion: StringBuilder,
    reasoning: StringBuilder,
    tool_calls: StringBuilder,
    tools: StringBuilder,
    finish: StringBuilder,
    partial: StringBuilder,
    prompt_tokens: UInt32Builder,
    completion_tokens: UInt32Builder,
    ids: ListBuilder<Int32Builder>,
    mask: ListBuilder<UInt8Builder>,
    sampling: StringBuilder,
    rows: usize,
    bytes: usize,
}

impl Columns {
    fn new() -> Self {
        let item = |t| Arc::new(Field::new("item", t, false));
        let fields = message_fields();
        let builders = (0..fields.len())
            .map(|_| Box::new(StringBuilder::new()) as Box<dyn arrow_array::builder::ArrayBuilder>)
            .collect();
        Self {
            id: StringBuilder::new(),
            dataset: StringBuilder::new(),
            sample: UInt32Builder::new(),
            turn: UInt32Builder::new(),
            messages: ListBuilder::new(StructBuilder::new(fields.clone(), builders))
                .with_field(item(DataType::Struct(fields))),
            prompt: StringBuilder::new(),
            completion: StringBuilder::new(),
            reasoning: StringBuilder::new(),
            tool_calls: StringBuilder::new(),
            tools: StringBuilder::new(),
            finish: StringBuilder::new(),
            partial: StringBuilder::new(),
            prompt_tokens: UInt32Builder::new(),
            completion_tokens: UInt32Builder::new(),
            ids: ListBuilder::new(Int32Builder::new()).with_field(item(DataType::Int32)),
            mask: ListBuilder::new(UInt8Builder::new()).with_field(item(DataType::UInt8)),
            sampling: StringBuilder::new(),
            rows: 0,
            bytes: 0,
        }
    }

    fn push(&mut self, row: &ExportRow) -> Result<()> {
        let r = &row.row;
        self.id.append_value(&r.id);
        self.dataset.append_value(&r.dataset);
        self.sample.append_value(r.sample);
        self.turn.append_value(r.turn);
        let mut text = 0;
        for turn in input_turns(row)? {
            let s = self.messages.values();
            for (i, k) in MESSAGE_KEYS.iter().enumerate() {
                let b = s
                    .field_builder::<StringBuilder>(i)
                    .context("message column builder")?;
                match turn.get(*k) {
                    None | Some(Value::Null) => b.append_null(),
                    Some(Value::String(v)) => {
                        text += v.len();
                        b.append_value(v)
                    }
                    // A list of content parts, or tool calls: kept as JSON text.
                    Some(v) => {
                        let v = v.to_string();
                        text += v.len();
                        b.append_value(v)
                    }
                }
            }
            s.append(true);
        }
        self.messages.append(true);
        self.prompt.append_value(&r.prompt);
        self.completion.append_value(&r.completion);
        self.reasoning.append_option(r.reasoning.as_deref());
        self.tool_calls.append_option(r.tool_calls.as_deref());
        let tools = tools_string(row)?;
        text += tools.len();
        self.tools.append_value(tools);
        self.finish.append_value(&r.finish_reason);
        self.partial.append_option(r.partial.as_deref());
        self.prompt_tokens.append_value(r.prompt_tokens);
        self.completion_tokens.append_value(r.completion_tokens);
        match row.ids_and_mask() {
            Some((ids, mask)) => {
                for &t in &ids {
                    let t = i32::try_from(t).with_context(|| {
                        format!("item `{}`: token id {t} does not fit int32", r.id)
                    })?;
                    self.ids.values().append_value(t);
                }
                self.ids.append(true);
                self.mask.values().append_slice(&mask);
                self.mask.append(true);
                text += ids.len() * 5;
            }
            None => {
                self.ids.append_null();
                self.mask.append_null();
            }
        }
        self.sampling.append_option(r.sampling.as_deref());
        self.rows += 1;
        self.bytes += text
            + r.id.len()
            + r.prompt.len()
            + r.completion.len()
            + r.reasoning.as_ref().map_or(0, String::len)
            + r.tool_calls.as_ref().map_or(0, String::len)
            + r.sampling.as_ref().map_or(0, String::len)
            + 64;
        Ok(())
    }

    fn full(&self) -> bool {
        self.rows >= ROW_GROUP_ROWS || self.bytes >= ROW_GROUP_BYTES
    }

    /// The buffered rows as one batch; the builders start over.
    fn take(&mut self) -> Result<RecordBatch> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.id.finish()),
            Arc::new(self.dataset.finish()),
            Arc::new(self.sample.finish()),
            Arc::new(self.turn.finish()),
            Arc::new(self.messages.finish()),
            Arc::new(self.prompt.finish()),
            Arc::new(self.completion.finish()),
            Arc::new(self.reasoning.finish()),
            Arc::new(self.tool_calls.finish()),
            Arc::new(self.tools.finish()),
            Arc::new(self.finish.finish()),
            Arc::new(self.partial.finish()),
            Arc::new(self.prompt_tokens.finish()),
            Arc::new(self.completion_tokens.finish()),
            Arc::new(self.ids.finish()),
            Arc::new(self.mask.finish()),
            Arc::new(self.sampling.finish()),
        ];
        self.rows = 0;
        self.bytes = 0;
        Ok(RecordBatch::try_new(hf_schema(), columns)?)
    }
}

/// One split's counts, for the card.
#[derive(Debug, Default)]
struct SplitStats {
    split: String,
    dataset: String,
    rows: u64,
    items: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Arrow bytes of the rows in memory (what `datasets` calls a split's `num_bytes`).
    num_bytes: u64,
    /// Bytes of its Parquet files.
    file_bytes: u64,
    files: u64,
    models: BTreeSet<String>,
    /// What the card shows of it.
    shown: DatasetStats,
    /// A held-out split.
    eval: bool,
}

/// The split being written.
struct Current {
    stats: SplitStats,
    columns: Columns,
    writer: Option<ArrowWriter<File>>,
    /// Its files so far, under temporary names.
    files: Vec<PathBuf>,
    last_id: Option<String>,
}

/// The `hf` writer.
pub struct HfSink {
    dir: PathBuf,
    splits: Vec<String>,
    /// Each dataset's held-out split name (with `--holdout`).
    eval_splits: Vec<String>,
    holdout: Option<Holdout>,
    datasets: Vec<String>,
    model: String,
    generation: Vec<Value>,
    file_bytes: u64,
    /// The current dataset's splits: train, then eval with `--holdout`.
    current: Vec<Current>,
    done: Vec<SplitStats>,
}

/// A folder `datasets.load_dataset` reads as a `DatasetDict`.
pub fn sink(tmp: &Path, ctx: &ExportContext, holdout: Option<Holdout>) -> Result<Box<dyn Sink>> {
    Ok(Box::new(HfSink::create(tmp, ctx, FILE_BYTES, holdout)?))
}

impl HfSink {
    /// Creates the folder `dir` (and `dir/data`); a split's file closes past `file_bytes`.
    pub fn create(
        dir: &Path,
        ctx: &ExportContext,
        file_bytes: u64,
        holdout: Option<Holdout>,
    ) -> Result<Self> {
        let data = dir.join("data");
        crate::output::files::create_dir_all(&data, crate::output::files::DIR_MODE)
            .with_context(|| format!("cannot create {}", data.display()))?;
        // Train and eval names together, so that no two clash.
        let n = ctx.datasets.len();
        let mut names = ctx.datasets.clone();
        names.extend(ctx.datasets.iter().map(|d| format!("{d}_eval")));
        let mut splits = split_names(&names);
        let eval_splits = splits.split_off(n);
        Ok(Self {
            dir: dir.to_path_buf(),
            splits,
            eval_splits,
            holdout,
            datasets: ctx.datasets.clone(),
            model: ctx.model.clone(),
            generation: ctx.generation.clone(),
            file_bytes,
            current: Vec::new(),
            done: Vec::new(),
        })
    }

    fn open_file(&self, cur: &mut Current) -> Result<()> {
        let path =
            self.dir
                .join("data")
                .join(format!(".{}-{:05}.tmp", cur.stats.split, cur.files.len()));
        let file = crate::output::files::replace(&path, crate::output::files::FILE_MODE)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
            .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
            .build();
        cur.writer = Some(ArrowWriter::try_new(file, hf_schema(), Some(props))?);
        cur.files.push(path);
        Ok(())
    }

    /// Writes the buffered rows as a row group; closes the file past the size limit.
    fn flush(&self, cur: &mut Current) -> Result<()> {
        if cur.columns.rows == 0 {
            return Ok(());
        }
        if cur.writer.is_none() {
            self.open_file(cur)?;
        }
        let batch = cur.columns.take()?;
        for c in batch.columns() {
            cur.stats.num_bytes += c.to_data().get_slice_memory_size()? as u64;
        }
        let w = cur.writer.as_mut().context("no open file")?;
        w.write(&batch)?;
        w.flush()?;
        if w.bytes_written() as u64 >= self.file_bytes {
            close_file(cur)?;
        }
        Ok(())
    }

    /// Writes what is left of the current splits and gives their files their final names.
    fn close_split(&mut self) -> Result<()> {
        for cur in std::mem::take(&mut self.current) {
            self.close_one(cur)?;
        }
        Ok(())
    }

    fn close_one(&mut self, mut cur: Current) -> Result<()> {
        self.flush(&mut cur)?;
        cur.stats.shown.end_item();
        if cur.files.is_empty() {
            // A split without rows still has a file, so `datasets` lists it.
            self.open_file(&mut cur)?;
        }
        close_file(&mut cur)?;
        let n = cur.files.len();
        for (i, tmp) in cur.files.iter().enumerate() {
            let name = format!("{}-{i:05}-of-{n:05}.parquet", cur.stats.split);
            let path = self.dir.join("data").join(name);
            cur.stats.file_bytes += std::fs::metadata(tmp)
                .with_context(|| format!("cannot stat {}", tmp.display()))?
                .len();
            std::fs::rename(tmp, &path).with_context(|| {
                format!("cannot rename {} to {}", tmp.display(), path.display())
            })?;
        }
        cur.stats.files = n as u64;
        self.done.push(cur.stats);
        Ok(())
    }

    /// The dataset card: YAML header for `datasets`, then counts for people; `pics` are the
    /// pictures of `done`, in order.
    fn card(&self, acc: &Accounting, pics: &[super::report::Pictures]) -> String {
        let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
        let mut s = String::from("---\nconfigs:\n- config_name: default\n  data_files:\n");
        for d in &self.done {
            let _ = writeln!(
                s,
                "  - split: {}\n    path: {}",
                q(&d.split),
                q(&format!("data/{}-*", d.split))
            );
        }
        s.push_str("dataset_info:\n");
        s.push_str(&features_yaml());
        s.push_str("  splits:\n");
        for d in &self.done {
            let _ = writeln!(
                s,
                "  - name: {}\n    num_bytes: {}\n    num_examples: {}",
                q(&d.split),
                d.num_bytes,
                d.rows
            );
        }
        let download: u64 = self.done.iter().map(|d| d.file_bytes).sum();
        let size: u64 = self.done.iter().map(|d| d.num_bytes).sum();
        let _ = writeln!(
            s,
            "  download_size: {download}\n  dataset_size: {size}\ntags:\n- spool\n- synthetic\n---\n"
        );

        s.push_str("# Generated completions\n\n");
        let mut models: BTreeSet<&str> = self
            .done
            .iter()
            .flat_map(|d| d.models.iter().map(String::as_str))
            .collect();
        if models.is_empty() {
            models.insert(&self.model);
        }
        let models: Vec<&str> = models.into_iter().collect();
        let _ = writeln!(
            s,
            "{CARD_MARK} (spool {}). Model: `{}`.\n",
            env!("CARGO_PKG_VERSION"),
            models.join("`, `")
        );
        s.push_str(
            "```python\nfrom datasets import load_dataset\nds = load_dataset(\"path/to/this/folder\")  # a DatasetDict, one split per dataset\n```\n\n",
        );
        s.push_str("## Splits\n\n| split | dataset | rows | items | prompt tokens | completion tokens | files |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        for d in &self.done {
            let held = if d.eval { " (held out)" } else { "" };
            let _ = writeln!(
                s,
                "| `{}` | `{}`{held} | {} | {} | {} | {} | {} |",
                d.split, d.dataset, d.rows, d.items, d.prompt_tokens, d.completion_tokens, d.files
            );
        }
        s.push_str("\nRows are generations (one per sample and turn); items are prompts.\n\n");
        if let Some(h) = &self.holdout {
            let _ = writeln!(
                s,
                "`--holdout {}`: each dataset's `_eval` split holds the items whose id hash falls in that fraction, every row of an item on one side.\n",
                h.fraction()
            );
        }
        s.push_str("## What was generated\n\nPer split: counts, why generations ended (`finish_reason` as the server said; `stop_reason` where the shards record it, else `unknown`), and how long completions and conversations are.\n\n");
        for (d, p) in self.done.iter().zip(pics) {
            s.push_str(&markdown_section(&d.shown, &d.split, p));
        }
        s.push_str("## Rows left out or flagged\n\n| dataset | rows read | kept | dropped | flagged |\n| --- | --- | --- | --- | --- |\n");
        let reasons = |m: &std::collections::BTreeMap<String, u64>| {
            if m.is_empty() {
                "0".to_string()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{v} {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        for d in &acc.datasets {
            let _ = writeln!(
                s,
                "| `{}` | {} | {} | {} | {} |",
                d.dataset,
                d.rows_in,
                d.kept,
                reasons(&d.dropped),
                reasons(&d.flagged)
            );
        }
        s.push_str("\n## Sampling\n\nWhat was asked of the server, per dataset (a list or table is drawn from per generation; the value drawn is in each row's `sampling`).\n\n");
        for (name, g) in self.datasets.iter().zip(&self.generation) {
            let _ = writeln!(
                s,
                "- `{name}`: `{}`",
                serde_json::to_string(g).unwrap_or_default()
            );
        }
        s.push_str(COLUMNS_DOC);
        s
    }
}

fn close_file(cur: &mut Current) -> Result<()> {
    if let Some(w) = cur.writer.take() {
        let file = w.into_inner()?;
        file.sync_all()?;
    }
    Ok(())
}

const COLUMNS_DOC: &str = "
## Columns

| column | type | meaning |
| --- | --- | --- |
| `id` | string | item id (unique per dataset) |
| `dataset` | string | spool dataset name |
| `sample` | uint32 | which of the prompt's generations (0-based) |
| `turn` | uint32 | assistant replies before this one in the conversation |
| `messages` | list of {role, content, reasoning_content, tool_calls, tool_call_id, name} | the turns the generation was requested after (a prompt row: one `user` turn); non-text values as JSON text |
| `prompt` | string | the exact text sent, after the chat template |
| `completion` | string | the generated answer |
| `reasoning` | string, null | the thinking split off the answer |
| `tool_calls` | string, null | generated tool calls, OpenAI JSON |
| `tools` | string | the tools offered (OpenAI function schemas, JSON; `[]` when none) |
| `finish_reason` | string | `stop`, `length`, … |
| `partial` | string, null | why the conversation ended before its last turn |
| `prompt_tokens`, `completion_tokens` | uint32 | token counts |
| `input_ids` | list<int32>, null | prompt ids ++ completion ids (end-of-turn id included); null without a tokenizer |
| `loss_mask` | list<uint8>, null | 0 per prompt id, 1 per completion id |
| `sampling` | string, null | what was drawn for this generation (JSON) |
";

impl Sink for HfSink {
    fn begin_dataset(&mut self, name: &str) -> Result<()> {
        self.close_split()?;
        let i = self
            .datasets
            .iter()
            .position(|d| d == name)
            .with_context(|| format!("dataset `{name}` is not among those exported"))?;
        let mut splits = vec![(self.splits[i].clone(), false)];
        if self.holdout.is_some() {
            splits.push((self.eval_splits[i].clone(), true));
        }
        for (split, eval) in splits {
            let mut cur = Current {
                stats: SplitStats {
                    split,
                    dataset: name.into(),
                    shown: DatasetStats::new(name),
                    eval,
                    ..Default::default()
                },
                columns: Columns::new(),
                writer: None,
                files: Vec::new(),
                last_id: None,
            };
            self.open_file(&mut cur)?;
            self.current.push(cur);
        }
        Ok(())
    }

    fn push(&mut self, row: &ExportRow) -> Result<()> {
        let at = usize::from(self.holdout.is_some_and(|h| h.holds(row)));
        let mut splits = std::mem::take(&mut self.current);
        let res = match splits.get_mut(at) {
            Some(cur) => self.push_to(cur, row),
            None => Err(ExportError::broken("a row before its dataset")),
        };
        self.current = splits;
        res
    }

    fn finish(mut self: Box<Self>, acc: &Accounting) -> Result<()> {
        self.close_split()?;
        let pics = self
            .done
            .iter()
            .map(|d| pictures(&d.shown))
            .collect::<Result<Vec<_>>>()?;
        let images = self.dir.join("images");
        if self.done.iter().any(|d| d.rows > 0) {
            crate::output::files::create_dir_all(&images, crate::output::files::DIR_MODE)
                .with_context(|| format!("cannot create {}", images.display()))?;
        }
        for (d, p) in self.done.iter().zip(&pics) {
            if d.rows == 0 {
                continue;
            }
            for (name, svg) in [
                (format!("{}-completion-tokens.svg", d.split), &p.lengths_svg),
                (format!("{}-turns.svg", d.split), &p.turns_svg),
            ] {
                super::write_file(&images.join(name), svg.as_bytes())?;
            }
        }
        let card = self.dir.join("README.md");
        super::write_file(&card, self.card(acc, &pics).as_bytes())?;
        let mut dirs = vec![self.dir.join("data"), self.dir.clone()];
        if images.is_dir() {
            dirs.push(images);
        }
        for d in dirs {
            File::open(&d)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("cannot sync {}", d.display()))?;
        }
        Ok(())
    }
}

impl HfSink {
    fn push_to(&self, cur: &mut Current, row: &ExportRow) -> Result<()> {
        let r = &row.row;
        cur.stats.rows += 1;
        if cur.last_id.as_deref() != Some(r.id.as_str()) {
            cur.stats.items += 1;
            cur.last_id = Some(r.id.clone());
        }
        cur.stats.prompt_tokens += u64::from(r.prompt_tokens);
        cur.stats.completion_tokens += u64::from(r.completion_tokens);
        cur.stats.shown.add(row);
        if cur.stats.models.len() < 16 && !cur.stats.models.contains(&r.model) {
            cur.stats.models.insert(r.model.clone());
        }
        cur.columns.push(row)?;
        if cur.columns.full() {
            self.flush(cur)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    /// Dataset names `datasets` refuses as split names are mapped to ones it takes, and
    /// two that map alike stay apart.
    #[test]
    fn split_names_are_valid_and_distinct() {
        let names: Vec<String> = ["chat", "a-b", "a_b", "v1.2", ".x", "a..b", "2024", "all"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let s = split_names(&names);
        assert_eq!(
            s,
            ["chat", "a_b", "a_b_2", "v1.2", "_x", "a__b", "2024", "all_"]
        );
        assert!(s.iter().all(|n| valid_split(n)));
    }

    fn ctx(names: &[&str]) -> ExportContext {
        ExportContext {
            tokenizer: None,
            end_of_turn: None,
            datasets: names.iter().map(|s| s.to_string()).collect(),
            data_dir: Default::default(),
            output_dir: Default::default(),
            sampling: Default::default(),
            model: "m".into(),
            generation: names.iter().map(|_| json!({"samples": 1})).collect(),
        }
    }

    fn row(id: &str, ds: &str, text: &str) -> ExportRow {
        prepare(
            ShardRow {
                id: id.into(),
                dataset: ds.into(),
                prompt: "p".into(),
                completion: text.into(),
                prompt_token_ids: Some(vec![1, 2]),
                completion_token_ids: Some(vec![3]),
                prompt_tokens: 2,
                completion_tokens: 1,
                finish_reason: "length".into(),
                model: "m".into(),
                ..ShardRow::default()
            },
            "".into(),
            None,
        )
    }

    /// A split past the size limit goes to several files named `-NNNNN-of-NNNNN` with the
    /// right count; an empty dataset is an empty split with one file; the card's YAML
    /// names each split's files and row count.
    #[test]
    fn splits_roll_over_files_and_the_card_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("hf");
        let ctx = ctx(&["big-one", "empty"]);
        let mut sink: Box<dyn Sink> = Box::new(HfSink::create(&out, &ctx, 1, None).unwrap());
        sink.begin_dataset("big-one").unwrap();
        let n = 2 * ROW_GROUP_ROWS + 1;
        for i in 0..n {
            sink.push(&row(&format!("r{i}"), "big-one", "text"))
                .unwrap();
        }
        sink.begin_dataset("empty").unwrap();
        let mut acc = Accounting::default();
        acc.begin_dataset("big-one");
        sink.finish(&acc).unwrap();
        let mut files: Vec<String> = std::fs::read_dir(out.join("data"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                "big_one-00000-of-00003.parquet",
                "big_one-00001-of-00003.parquet",
                "big_one-00002-of-00003.parquet",
                "empty-00000-of-00001.parquet"
            ]
        );
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        assert!(card.contains("  - split: \"big_one\"\n    path: \"data/big_one-*\""));
        assert!(card.contains("  - name: \"big_one\"\n    num_bytes: "));
        assert!(card.contains(&format!("    num_examples: {n}\n")));
        assert!(card.contains("  - name: \"empty\"\n    num_bytes: 0\n    num_examples: 0\n"));
        assert!(card.contains(&format!(
            "| `big_one` | `big-one` | {n} | {n} | {} | {n} | 3 |",
            2 * n
        )));
    }
}
