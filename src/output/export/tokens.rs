//! `tokens` / `tokens-jsonl`: one row per generation, `{id, dataset, sample, turn,
//! input_ids, loss_mask, finish_reason}` with `input_ids = prompt ids ++ completion ids`
//! (the end-of-turn id included, see [`super::rows`]) and `loss_mask` 0 for each prompt id,
//! 1 for each completion id.
//!
//! Parquet: zstd, row groups of at most [`ROW_GROUP_ROWS`] rows, ids as int32 (what
//! PyTorch takes; every real vocabulary fits).

use super::{Accounting, ExportRow, Jsonl, Sink};
use crate::output::export::error::{Context, Result};
use arrow_array::builder::{Int32Builder, ListBuilder, StringBuilder, UInt32Builder, UInt8Builder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde_json::json;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// Rows per row group of a `tokens` file.
pub const ROW_GROUP_ROWS: usize = 4096;

/// The `tokens` file's schema.
pub fn tokens_schema() -> SchemaRef {
    let list = |t| DataType::List(Arc::new(Field::new("item", t, false)));
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("dataset", DataType::Utf8, false),
        Field::new("sample", DataType::UInt32, false),
        Field::new("turn", DataType::UInt32, false),
        Field::new("input_ids", list(DataType::Int32), false),
        Field::new("loss_mask", list(DataType::UInt8), false),
        Field::new("finish_reason", DataType::Utf8, false),
    ]))
}

/// Accumulates `tokens` rows and writes them a row group at a time.
struct ParquetTokens {
    writer: ArrowWriter<File>,
    id: StringBuilder,
    dataset: StringBuilder,
    sample: UInt32Builder,
    turn: UInt32Builder,
    ids: ListBuilder<Int32Builder>,
    mask: ListBuilder<UInt8Builder>,
    finish: StringBuilder,
    rows: usize,
}

impl ParquetTokens {
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
            sample: UInt32Builder::new(),
            turn: UInt32Builder::new(),
            ids: ListBuilder::new(Int32Builder::new()).with_field(item(DataType::Int32)),
            mask: ListBuilder::new(UInt8Builder::new()).with_field(item(DataType::UInt8)),
            finish: StringBuilder::new(),
            rows: 0,
        })
    }

    fn push(&mut self, row: &ExportRow, ids: &[u32], mask: &[u8]) -> Result<()> {
        let r = &row.row;
        self.id.append_value(&r.id);
        self.dataset.append_value(&r.dataset);
        self.sample.append_value(r.sample);
        self.turn.append_value(r.turn);
        for &t in ids {
            let t = i32::try_from(t)
                .with_context(|| format!("item `{}`: token id {t} does not fit int32", r.id))?;
            self.ids.values().append_value(t);
        }
        self.ids.append(true);
        self.mask.values().append_slice(mask);
        self.mask.append(true);
        self.finish.append_value(&r.finish_reason);
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
            Arc::new(self.sample.finish()),
            Arc::new(self.turn.finish()),
            Arc::new(self.ids.finish()),
            Arc::new(self.mask.finish()),
            Arc::new(self.finish.finish()),
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

/// The `tokens` writer, Parquet or JSONL.
pub struct TokensSink {
    out: Out,
}

enum Out {
    Parquet(Box<ParquetTokens>),
    Jsonl(Jsonl),
}

impl TokensSink {
    pub fn parquet(path: &Path) -> Result<Self> {
        let file = crate::output::files::replace(path, crate::output::files::FILE_MODE)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self {
            out: Out::Parquet(Box::new(ParquetTokens::new(file)?)),
        })
    }

    pub fn jsonl(path: &Path) -> Result<Self> {
        Ok(Self {
            out: Out::Jsonl(Jsonl::create(path)?),
        })
    }
}

impl Sink for TokensSink {
    fn push(&mut self, row: &ExportRow) -> Result<()> {
        // The gates leave out rows without ids for this format.
        let Some((ids, mask)) = row.ids_and_mask() else {
            return Ok(());
        };
        match &mut self.out {
            Out::Parquet(p) => p.push(row, &ids, &mask),
            Out::Jsonl(j) => {
                let r = &row.row;
                j.line(
                    &json!({"id": r.id, "dataset": r.dataset, "sample": r.sample,
                    "turn": r.turn, "input_ids": ids, "loss_mask": mask,
                    "finish_reason": r.finish_reason}),
                )
            }
        }
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        match self.out {
            Out::Parquet(p) => p.finish(),
            Out::Jsonl(j) => j.finish(),
        }
    }
}
