//! The parallel stage's work on one chunk: each row parsed, filtered to this partition,
//! rendered (by spool's builder, or the server for the whole chunk at once) and encoded
//! for the sink.
//!
//! Invariants: rows an earlier run took in are only hashed, never built again; a panic
//! while rendering or tokenizing rejects its row only; a server that cannot be reached
//! marks the row [`Prepared::Unavailable`] (intake stops) rather than rejecting it.

use super::render::{Planned, Render};
use crate::input::row::{Entry, Parser, Raw, RawEntry, Rejection, Row};
use crate::prompt::remote::{IdsSource, RemoteError, RenderInput};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use serde_json::{Map, Value};

/// A row after the parallel stage; `T` is the sink's encoded item.
pub(super) enum Prepared<T> {
    Rejected(Rejection),
    /// A good row another partition owns, or one already committed: not built.
    Elsewhere {
        row: u64,
        committed: bool,
    },
    /// A good row; `built` is `None` for rows taken in by an earlier run (only checked).
    Row {
        row: u64,
        id: String,
        hash: [u8; 16],
        /// Its size in the file (the batch is cut by bytes too).
        bytes: usize,
        built: Option<Result<Ready<T>, String>>,
    },
    /// A new row the server could not render for a reason that is not the row's (down,
    /// overloaded): intake stops here rather than reject it.
    Unavailable(String),
}

/// A new row built and encoded for the sink on a worker thread, so the sequential stage
/// only checks ids and batches.
pub(super) struct Ready<T> {
    /// Prompt tokens (`None` without a tokenizer).
    pub(super) tokens: Option<u64>,
    pub(super) item: T,
}

/// The sink's encoder of a new row, its prompt and who made the prompt's ids.
pub(super) type Encode<T> = fn(&Row, BuiltPrompt, Option<IdsSource>) -> T;

/// Parses and builds one chunk (the parallel stage); `encode` is the sink's encoder. With
/// a server renderer, the chunk's new rows are rendered there together (one call, several
/// requests in flight) after they are all parsed.
pub(super) fn prepare<T>(
    parser: &Parser,
    builder: &PromptBuilder,
    encode: Encode<T>,
    render: &Render,
    scanned: u64,
    chunk: Vec<RawEntry>,
) -> Vec<Prepared<T>> {
    let server = render.server.as_deref();
    let mut out = Vec::with_capacity(chunk.len());
    // (place in `out`, the row, what the server renders).
    let mut remote: Vec<(usize, Row, RenderInput)> = Vec::new();
    for raw in chunk {
        let line = raw.line();
        let bytes = raw_bytes(&raw);
        let row = match parser.parse(raw) {
            Entry::Rejected(r) => {
                out.push(Prepared::Rejected(r));
                continue;
            }
            Entry::Row(row) => render.shaped(row),
        };
        if let Some(f) = &render.filter {
            let owned = f.partition.owns(&render.dataset, &row.id);
            if !owned || f.committed.contains(&row.id) {
                out.push(Prepared::Elsewhere {
                    row: row.row,
                    committed: owned,
                });
                continue;
            }
        }
        if line <= scanned {
            out.push(Prepared::Row {
                row: row.row,
                id: row.id,
                hash: row.hash,
                bytes,
                built: None,
            });
            continue;
        }
        let built = match server {
            Some(_) => match render.plan(builder, &row, true) {
                Ok(Planned::Input(input)) => {
                    out.push(Prepared::Row {
                        row: row.row,
                        id: row.id.clone(),
                        hash: row.hash,
                        bytes,
                        built: None,
                    });
                    remote.push((out.len() - 1, row, input));
                    continue;
                }
                Ok(Planned::AsIs(b)) => Ok((b, None)),
                Err(why) => Err(why),
            },
            None => build_locally(render, builder, &row),
        };
        out.push(Prepared::Row {
            row: row.row,
            id: row.id.clone(),
            hash: row.hash,
            bytes,
            built: Some(built.map(|(b, from)| ready(encode, &row, b, from))),
        });
    }
    if let (Some(server), false) = (server, remote.is_empty()) {
        let inputs: Vec<RenderInput> = remote.iter().map(|(_, _, i)| i.clone()).collect();
        let rendered = server.render_blocking(&inputs);
        for ((at, row, _), r) in remote.into_iter().zip(rendered) {
            match r {
                Ok(b) => {
                    if let Prepared::Row { built, .. } = &mut out[at] {
                        *built = Some(Ok(ready(encode, &row, b, Some(IdsSource::Server))));
                    }
                }
                Err(RemoteError::Refused(why)) => {
                    if let Prepared::Row { built, .. } = &mut out[at] {
                        *built = Some(Err(format!(
                            "the server refused to render the prompt: {why}"
                        )));
                    }
                }
                Err(RemoteError::Unavailable(why)) => out[at] = Prepared::Unavailable(why),
            }
        }
    }
    out
}

/// A row rendered by spool's builder; a panic in the template engine or the tokenizer
/// rejects this row only (a lost chunk would stall the in-order collector).
pub(super) fn build_locally(
    render: &Render,
    builder: &PromptBuilder,
    row: &Row,
) -> Result<(BuiltPrompt, Option<IdsSource>), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| render.build(builder, row)))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!(
                "internal error while rendering or tokenizing: {what}"
            ))
        })
}

/// A built row encoded for the sink.
pub(super) fn ready<T>(
    encode: Encode<T>,
    row: &Row,
    b: BuiltPrompt,
    from: Option<IdsSource>,
) -> Ready<T> {
    Ready {
        tokens: b.token_ids.as_ref().map(|ids| ids.len() as u64),
        item: encode(row, b, from),
    }
}

pub(super) fn raw_bytes(r: &RawEntry) -> usize {
    match &r.raw {
        Raw::Line(b) => b.len(),
        Raw::Bad(s) => s.len(),
        Raw::Object(o) => object_bytes(o),
    }
}

/// About the memory of a Parquet row's JSON: its strings, 64 bytes a value besides.
pub(super) fn object_bytes(o: &Map<String, Value>) -> usize {
    fn value(v: &Value) -> usize {
        64 + match v {
            Value::String(s) => s.len(),
            Value::Array(a) => a.iter().map(value).sum(),
            Value::Object(o) => o.iter().map(|(k, v)| k.len() + value(v)).sum(),
            _ => 0,
        }
    }
    o.iter().map(|(k, v)| k.len() + value(v)).sum()
}
