//! The shard's contract with its readers: the columns, their types and nullability, the
//! key-value metadata keys, and which columns are written without a dictionary.
//!
//! [`schema`] is the single Rust definition; `schemas/shard.schema.json` is the
//! machine-readable copy, and a unit test keeps the two equal. List columns use the Arrow
//! convention: item field named `item`, non-nullable (`list<item: uint32 not null>` in
//! pyarrow's spelling; in Parquet a 3-level LIST `repeated group list { required int32 item
//! (UINT_32) }`). A token id is never null, and pyarrow, DuckDB and parquet-rs read this as
//! written (checked by `tests/it/shard_read.rs`). Strings are Utf8 (i32 offsets).
//!
//! Encoding is not part of the contract (any Parquet reader decodes either): the columns in
//! [`PLAIN_COLUMNS`] are written without a dictionary; every other column keeps
//! parquet-rs's default dictionary encoding, which pays for `dataset`, `finish_reason`,
//! `model` and the small integers.
//!
//! Invariant: writers and readers both check against [`schema`], so a shard that passes
//! [`check_schema`] decodes into every column type named here; columns are only appended,
//! so a shard written before [`GENERATION_COLUMNS`] or [`SOURCE_COLUMNS`] is a prefix of
//! the schema and reads, the missing columns as 0 or null.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use arrow_schema::{DataType, Field, FieldRef, Schema, SchemaRef, TimeUnit};
use parquet::schema::types::ColumnPath;

use crate::output::shard::ShardError;

/// Metadata key: the spool version that wrote the shard (required).
pub const META_VERSION: &str = "spool.version";
/// Metadata key: sha256 of the config file (required).
pub const META_CONFIG_SHA256: &str = "spool.config_sha256";
/// Metadata key: the effective sampling parameters as JSON (required).
pub const META_SAMPLING: &str = "spool.sampling";
/// Metadata key: sha256 of the tokenizer file, when a tokenizer is used.
pub const META_TOKENIZER_SHA256: &str = "spool.tokenizer_sha256";
/// Metadata key: where completion token counts came from (server, tokenizer, chunks).
pub const META_COUNT_SOURCE: &str = "spool.count_source";
/// Keys every shard written by `spool run` carries; `spool verify` checks them.
pub const REQUIRED_METADATA_KEYS: &[&str] = &[META_VERSION, META_CONFIG_SHA256, META_SAMPLING];

/// parquet-rs stores the Arrow schema under this key; it is not caller metadata.
pub(crate) const ARROW_SCHEMA_KEY: &str = "ARROW:schema";

/// Columns written without dictionary encoding, because a dictionary buys nothing there.
/// `id` and `row` are unique per dataset, so within a shard; `prompt`, `messages` and
/// `completion` are long texts that do not repeat, so a dictionary only grows until
/// parquet-rs falls back to plain. The token-id lists do repeat ids, but a row group holds
/// millions of them over a vocabulary of ~150 k, so a dictionary costs a hash per id for a
/// file of about the same size after zstd (measured by `make bench-shard`).
pub const PLAIN_COLUMNS: &[&str] = &[
    "id",
    "row",
    "prompt",
    "messages",
    "completion",
    "prompt_token_ids",
    "completion_token_ids",
];

/// The columns appended for several generations per item, in order. A shard written
/// before them has exactly the columns before them; it still reads, these as 0 (`sample`,
/// `turn`) or null.
pub const GENERATION_COLUMNS: &[&str] = &[
    "sample",
    "turn",
    "reasoning",
    "tool_calls",
    "tools",
    "sampling",
    "partial",
];

/// The columns appended after [`GENERATION_COLUMNS`]: who rendered the prompt ids. A
/// shard written before them reads them as null.
pub const SOURCE_COLUMNS: &[&str] = &["prompt_ids_source"];

/// Whether `name` is a column some shards lack (written before it was appended).
pub fn is_appended(name: &str) -> bool {
    GENERATION_COLUMNS.contains(&name) || SOURCE_COLUMNS.contains(&name)
}

/// The item field of the token-id list columns: named `item`, never null.
pub(crate) fn list_item_field() -> FieldRef {
    Arc::new(Field::new("item", DataType::UInt32, false))
}

/// The shard schema (names, types, nullability, order). Writers and readers both check
/// against it, so it is the one definition of the output contract.
pub fn schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            let ids = DataType::List(list_item_field());
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Utf8, false),
                Field::new("dataset", DataType::Utf8, false),
                Field::new("row", DataType::UInt64, false),
                Field::new("prompt", DataType::Utf8, false),
                Field::new("messages", DataType::Utf8, true),
                Field::new("prompt_token_ids", ids.clone(), true),
                Field::new("completion", DataType::Utf8, false),
                Field::new("completion_token_ids", ids, true),
                Field::new("prompt_tokens", DataType::UInt32, false),
                Field::new("completion_tokens", DataType::UInt32, false),
                Field::new("finish_reason", DataType::Utf8, false),
                Field::new("model", DataType::Utf8, false),
                Field::new("attempts", DataType::UInt32, false),
                Field::new("latency_ms", DataType::UInt32, false),
                Field::new("ttft_ms", DataType::UInt32, true),
                Field::new(
                    "completed_at",
                    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                    false,
                ),
                Field::new("sample", DataType::UInt32, false),
                Field::new("turn", DataType::UInt32, false),
                Field::new("reasoning", DataType::Utf8, true),
                Field::new("tool_calls", DataType::Utf8, true),
                Field::new("tools", DataType::Utf8, true),
                Field::new("sampling", DataType::Utf8, true),
                Field::new("partial", DataType::Utf8, true),
                Field::new("prompt_ids_source", DataType::Utf8, true),
            ]))
        })
        .clone()
}

/// The Parquet leaf path of top-level column `name`: the column itself, or for a list
/// column its values (`name.list.item`, the 3-level LIST layout the module doc describes).
pub(crate) fn leaf_path(name: &str) -> ColumnPath {
    let is_list = schema()
        .field_with_name(name)
        .is_ok_and(|f| matches!(f.data_type(), DataType::List(_)));
    let mut parts = vec![name.to_string()];
    if is_list {
        parts.extend(["list".to_string(), list_item_field().name().clone()]);
    }
    ColumnPath::new(parts)
}

/// Fails unless `found` has exactly the shard columns (names, types, nullability, order),
/// or exactly those before [`SOURCE_COLUMNS`] or before [`GENERATION_COLUMNS`] (a shard
/// written before them).
pub(crate) fn check_schema(path: &Path, found: &Schema) -> Result<(), ShardError> {
    let expected = schema();
    let all = expected.fields().len();
    let before_source = all - SOURCE_COLUMNS.len();
    let before = before_source - GENERATION_COLUMNS.len();
    let n = found.fields().len();
    if n != all && n != before_source && n != before {
        return Err(ShardError::schema(
            path,
            format!(
                "{n} columns, expected {all} (or {before_source}, written before \
                 prompt_ids_source, or {before}, before the generation columns)",
            ),
        ));
    }
    for (i, (f, e)) in found.fields().iter().zip(expected.fields()).enumerate() {
        if f.name() != e.name()
            || f.data_type() != e.data_type()
            || f.is_nullable() != e.is_nullable()
        {
            return Err(ShardError::schema(
                path,
                format!(
                    "column {i} is {:?} {} (nullable {}), expected {:?} {} (nullable {})",
                    f.name(),
                    f.data_type(),
                    f.is_nullable(),
                    e.name(),
                    e.data_type(),
                    e.is_nullable()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pyarrow's `str(type)` for the types the schema uses.
    fn pyarrow_type(t: &DataType) -> String {
        match t {
            DataType::Utf8 => "string".into(),
            DataType::UInt32 => "uint32".into(),
            DataType::UInt64 => "uint64".into(),
            DataType::List(item) => format!(
                "list<{}: {}{}>",
                item.name(),
                pyarrow_type(item.data_type()),
                if item.is_nullable() { "" } else { " not null" }
            ),
            DataType::Timestamp(TimeUnit::Millisecond, Some(tz)) => {
                format!("timestamp[ms, tz={tz}]")
            }
            other => panic!("no pyarrow spelling for {other}"),
        }
    }

    /// `schemas/shard.schema.json` names exactly the columns, types, nullability and
    /// metadata keys of [`schema`] and the `META_*` constants, in order.
    #[test]
    fn shard_schema_matches_schema_file() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../schemas/shard.schema.json")).unwrap();
        assert_eq!(doc["name"], "spool shard");
        assert_eq!(doc["version"], 1);
        let columns = doc["columns"].as_array().unwrap();
        let fields = schema();
        assert_eq!(columns.len(), fields.fields().len());
        let names: Vec<&str> = columns
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        let (rest, source) = names.split_at(names.len() - SOURCE_COLUMNS.len());
        assert_eq!(source, SOURCE_COLUMNS);
        assert_eq!(
            &rest[rest.len() - GENERATION_COLUMNS.len()..],
            GENERATION_COLUMNS
        );
        for (c, f) in columns.iter().zip(fields.fields()) {
            assert_eq!(c["name"].as_str().unwrap(), f.name());
            assert_eq!(
                c["type"].as_str().unwrap(),
                pyarrow_type(f.data_type()),
                "{}",
                f.name()
            );
            assert_eq!(
                c["nullable"].as_bool().unwrap(),
                f.is_nullable(),
                "{}",
                f.name()
            );
            assert!(!c["description"].as_str().unwrap().is_empty());
        }
        let keys: Vec<(&str, bool)> = doc["metadata_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| (k["key"].as_str().unwrap(), k["required"].as_bool().unwrap()))
            .collect();
        let required: Vec<&str> = keys.iter().filter(|k| k.1).map(|k| k.0).collect();
        assert_eq!(required, REQUIRED_METADATA_KEYS);
        let names: Vec<&str> = keys.iter().map(|k| k.0).collect();
        assert_eq!(
            names,
            [
                META_VERSION,
                META_CONFIG_SHA256,
                META_SAMPLING,
                META_TOKENIZER_SHA256,
                META_COUNT_SOURCE
            ]
        );
    }
}
