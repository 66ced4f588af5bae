//! The sizes every input row and file is held to, so that memory stays bounded whatever a
//! file holds: a compressed line that expands a thousandfold, a Parquet cell that repeats
//! one dictionary string, a row of a million tiny JSON values.
//!
//! Invariants: a row past a row limit is rejected with its line and the run goes on; a
//! file past a file limit stops intake of its dataset with a [`LimitError`] naming the
//! file, where and which limit — never an abort. Sizes are checked before the memory is
//! taken: a line is cut at [`MAX_ROW_BYTES`] while it is read, a JSON row is parsed with a
//! budget of values ([`parse_json_bounded`]), a Parquet row's cells are measured before
//! they are copied, and Parquet pages are checked from their headers before they are
//! decompressed (`super::parquet`).

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::cell::Cell;
use std::fmt;
use std::path::PathBuf;

/// Most bytes of one row: a decompressed line, or the cells of a Parquet row (strings by
/// their length, every other value as 8 bytes). A prompt of a million tokens is ~4 MB.
pub const MAX_ROW_BYTES: usize = 16 << 20;

/// Most JSON values in one row (every string, number, array and object, nested ones too).
pub const MAX_ROW_VALUES: usize = 1 << 18;

/// Most a compressed line file may expand: decompressed bytes past
/// [`EXPANSION_FLOOR`] must stay within this many times the compressed bytes read.
pub const MAX_EXPANSION: u64 = 1000;

/// Decompressed bytes read before [`MAX_EXPANSION`] is checked (a small file of short
/// repeated rows may compress far better than text does).
pub const EXPANSION_FLOOR: u64 = 64 << 20;

/// Largest zstd window a `.zst` input may ask for (2^27 = 128 MiB, libzstd's own default;
/// `zstd --long` writes 2^27).
pub const ZSTD_WINDOW_LOG_MAX: u32 = 27;

/// Most bytes of a Parquet file's footer (its metadata).
pub const MAX_FOOTER_BYTES: u64 = 64 << 20;

/// Most bytes of one Parquet page once decompressed, as its header declares it.
pub const MAX_PAGE_BYTES: u64 = 256 << 20;

/// Most values (entries, nulls included) of one column in one Parquet row group: a row
/// group is decoded in batches whose rows together hold at most this many.
pub const MAX_GROUP_VALUES: u64 = 16 << 20;

/// Values of one column decoded per Parquet batch, on average: rows per batch is this
/// divided by the row group's values per row (at most 1024 rows).
pub const BATCH_VALUES: u64 = 1 << 20;

/// A file past a limit: intake of its dataset stops here.
#[derive(Debug, thiserror::Error)]
#[error("dataset file {path}: {what}; intake of this dataset stopped (the limits are in the README, \"Input rows\")")]
pub struct LimitError {
    pub path: PathBuf,
    /// Where and which limit, e.g. "line 3: decompressed 65 MiB from 59 KiB".
    pub what: String,
}

/// Parses one JSON text into a [`Value`] holding at most `max_values` values; `Err` is the
/// rejection reason (not JSON, or too many values). The result is the value serde_json
/// itself would give.
pub fn parse_json_bounded(text: &str, max_values: usize) -> Result<Value, String> {
    let budget = Cell::new(max_values);
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Bounded(&budget)
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
    parsed.map_err(|e| {
        if budget.get() == 0 && e.to_string().starts_with(TOO_MANY) {
            format!("row has more than {max_values} JSON values")
        } else {
            format!("not valid JSON: {e}")
        }
    })
}

const TOO_MANY: &str = "too many JSON values";

/// A [`Value`] built by serde_json's parser, one value of the budget at a time.
#[derive(Clone, Copy)]
struct Bounded<'a>(&'a Cell<usize>);

impl Bounded<'_> {
    fn take<E: serde::de::Error>(&self) -> Result<(), E> {
        match self.0.get() {
            0 => Err(E::custom(TOO_MANY)),
            n => {
                self.0.set(n - 1);
                Ok(())
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::from(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.take()?;
        Ok(Value::from(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.take()?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.take()?;
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.take()?;
        Ok(Value::String(v))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.take()?;
        Ok(Value::Null)
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(self)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.take()?;
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(self)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// `n` bytes for a message: `30 MiB`, `60 KiB`, `512 B`.
pub fn size(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the budget the value is serde_json's own, duplicate keys and all; one value
    /// more is a rejection naming the limit; bad JSON is still "not valid JSON".
    #[test]
    fn json_is_parsed_within_a_budget_of_values() {
        for text in [
            r#"{"a": [1, -2, 3.5, "x", null, true, {"b": {}}], "a": 7, "c": 18446744073709551615}"#,
            r#"[]"#,
            r#""s""#,
        ] {
            assert_eq!(
                parse_json_bounded(text, 100).unwrap(),
                serde_json::from_str::<Value>(text).unwrap()
            );
        }
        // 1 object + 1 array + 3 numbers = 5 values.
        let text = r#"{"a": [1, 2, 3]}"#;
        assert!(parse_json_bounded(text, 5).is_ok());
        assert_eq!(
            parse_json_bounded(text, 4).unwrap_err(),
            "row has more than 4 JSON values"
        );
        assert!(parse_json_bounded("{\"a\": ", 5)
            .unwrap_err()
            .starts_with("not valid JSON"));
        assert!(parse_json_bounded("{} x", 5)
            .unwrap_err()
            .starts_with("not valid JSON"));
    }
}
