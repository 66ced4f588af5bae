//! Shard rows as an export sees them: decoded a batch at a time, with the end of the turn
//! made explicit in the ids.
//!
//! Invariant: a completion that ended its turn (`finish_reason` `stop` or `tool_calls`)
//! ends with the model's end-of-turn id in [`ExportRow::completion_ids`]; the id is
//! appended only when the server left it out, and the row says so. A completion cut by
//! `max_tokens` (`length`) never gets one.

use super::ExportContext;
use crate::config::Config;
use crate::output::reader::{batch_to_rows, ShardReader};
use crate::output::schema::META_COUNT_SOURCE;
use crate::output::shard::{folder_entries, parse_shard_index};
use crate::prompt::model_folder::ModelFiles;
use crate::prompt::syntax::{Family, Syntax};
use crate::prompt::tokenizer::Tokenizer;
use crate::prompt::ChatTemplate;
use crate::store::row::ShardRow;
use anyhow::{anyhow, Context, Result};
use arrow_array::cast::AsArray;
use arrow_array::Array;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The shard column saying why a generation ended, where shards have it.
pub const STOP_REASON: &str = "stop_reason";

/// The token that closes an assistant turn, and where spool learned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOfTurn {
    pub id: u32,
    pub token: String,
    /// The model family's turn close, `generation_config.json`'s `eos_token_id`,
    /// `tokenizer_config.json`'s `eos_token`, or `--end-of-turn`.
    pub source: String,
    /// The (id, token) that closes a turn ending in tool calls, where the family has
    /// another one (GLM's `<|observation|>`, gpt-oss's `<|call|>`).
    pub after_tool_call: Option<(u32, String)>,
}

/// One shard row on its way out.
#[derive(Debug, Clone)]
pub struct ExportRow {
    pub row: ShardRow,
    /// The shard's `spool.count_source`: where `completion_tokens` came from.
    pub count_source: Arc<str>,
    /// The end-of-turn id was appended to `row.completion_token_ids` here.
    pub end_of_turn_appended: bool,
    /// Think markers are left in the answer although the thinking was split off.
    pub leftover_think: bool,
    /// Why the generation ended as the shard's `stop_reason` column says, read by name;
    /// None when the shard has no such column or the row no value.
    pub stop_reason: Option<String>,
}

impl ExportRow {
    /// Whether the generation ended its turn itself (not cut, not aborted).
    pub fn ended_turn(&self) -> bool {
        ends_turn(&self.row.finish_reason)
    }

    /// Whether the generation was cut by `max_tokens`.
    pub fn truncated(&self) -> bool {
        self.row.finish_reason == "length"
    }

    /// `prompt ids ++ completion ids` and the loss mask (0 prompt, 1 completion), when the
    /// row has both.
    pub fn ids_and_mask(&self) -> Option<(Vec<u32>, Vec<u8>)> {
        let p = self.row.prompt_token_ids.as_ref()?;
        let c = self.row.completion_token_ids.as_ref()?;
        let mut ids = Vec::with_capacity(p.len() + c.len());
        ids.extend_from_slice(p);
        ids.extend_from_slice(c);
        let mut mask = vec![0u8; p.len()];
        mask.resize(p.len() + c.len(), 1);
        Some((ids, mask))
    }
}

/// Whether a finish reason means the model closed its turn.
pub fn ends_turn(finish_reason: &str) -> bool {
    matches!(finish_reason, "stop" | "tool_calls")
}

/// The end-of-turn token of the tokenizer at `tokenizer_json`: `eos_token` of the
/// `tokenizer_config.json` beside it, looked up in the tokenizer. None when there is no
/// such file or key.
pub fn end_of_turn_of(tokenizer_json: &Path, tokenizer: &Tokenizer) -> Result<Option<EndOfTurn>> {
    let cfg = tokenizer_json.with_file_name("tokenizer_config.json");
    let text = match std::fs::read_to_string(&cfg) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", cfg.display())),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", cfg.display()))?;
    let token = match &v["eos_token"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => match o.get("content") {
            Some(serde_json::Value::String(s)) => s.clone(),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let id = tokenizer.token_to_id(&token).ok_or_else(|| {
        anyhow!(
            "{}: key `eos_token`: `{token}` is not a token of {}",
            cfg.display(),
            tokenizer_json.display()
        )
    })?;
    Ok(Some(EndOfTurn {
        id,
        token,
        source: format!("{} (eos_token)", cfg.display()),
        after_tool_call: None,
    }))
}

/// The folder of a tokenizer path (a model folder, or the folder of `tokenizer.json`).
fn folder_of(path: &Path) -> &Path {
    if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    }
}

/// `eos_token_id` of the `generation_config.json` in `folder` (one id or a list), or
/// `None` when there is no such file.
fn generation_eos(folder: &Path) -> Result<Option<Vec<u32>>> {
    let p = folder.join("generation_config.json");
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", p.display())),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    let id = |x: &serde_json::Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
    let ids = match &v["eos_token_id"] {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::Array(a) => a.iter().map(id).collect::<Option<Vec<u32>>>(),
        one => id(one).map(|i| vec![i]),
    };
    ids.map(Some).ok_or_else(|| {
        anyhow!(
            "{}: key `eos_token_id` must be a token id or a list of them",
            p.display()
        )
    })
}

/// The end of an assistant turn for a model of `family` (from its chat template or the
/// configured parsers): the family's turn close, checked against `generation_config.json`
/// when the folder has one; for other models `generation_config.json`'s `eos_token_id`
/// (the tokenizer config's `eos_token` when it is listed, else the first), else the
/// tokenizer config's `eos_token`.
pub fn end_of_turn_for(
    tokenizer_path: &Path,
    tokenizer: &Tokenizer,
    family: Option<Family>,
) -> Result<Option<EndOfTurn>> {
    let folder = folder_of(tokenizer_path);
    let gen = generation_eos(folder)?;
    let gen_file = folder.join("generation_config.json");
    let config_eos = end_of_turn_of(&folder.join("tokenizer.json"), tokenizer)
        .ok()
        .flatten();
    if let Some(f) = family {
        let (end, after) = f.end_of_turn();
        if let Some(id) = tokenizer.token_to_id(end) {
            let listed = match &gen {
                Some(ids) if ids.contains(&id) => format!("; {} lists it", gen_file.display()),
                Some(_) => format!("; not in {} eos_token_id", gen_file.display()),
                None => String::new(),
            };
            return Ok(Some(EndOfTurn {
                id,
                token: end.to_owned(),
                source: format!("the {} family's turn close{listed}", f.name()),
                after_tool_call: after
                    .and_then(|a| tokenizer.token_to_id(a).map(|i| (i, a.to_owned()))),
            }));
        }
    }
    match gen {
        Some(ids) if !ids.is_empty() => {
            if let Some(e) = config_eos.filter(|e| ids.contains(&e.id)) {
                return Ok(Some(e));
            }
            let id = ids[0];
            Ok(Some(EndOfTurn {
                id,
                token: tokenizer.decode(&[id]).unwrap_or_default(),
                source: format!("{} (eos_token_id)", gen_file.display()),
                after_tool_call: None,
            }))
        }
        _ => Ok(config_eos),
    }
}

/// The family a config's chat template (or its `[tokenizer]` parser names) implies.
fn family_of(cfg: &Config) -> Option<Family> {
    let t = cfg.tokenizer.as_ref()?;
    let template = match &t.chat_template {
        Some(p) => ChatTemplate::from_file(p).ok(),
        None => ModelFiles::locate(&t.path)
            .ok()
            .and_then(|files| files.chat_template)
            .and_then(|p| ChatTemplate::from_file(&p).ok()),
    };
    let syntax = template
        .map(|tpl| Syntax::of_template(tpl.source()))
        .unwrap_or_default()
        .overridden(t.reasoning_parser.as_deref(), t.tool_parser.as_deref());
    syntax.family()
}

/// The config's tokenizer and its end-of-turn token, for the datasets `names`.
pub fn context(cfg: &Config, names: Vec<String>) -> Result<ExportContext> {
    let (tokenizer, end_of_turn) = match &cfg.tokenizer {
        Some(t) => {
            let tok = Tokenizer::from_file(&t.path)
                .with_context(|| format!("{}: key `tokenizer.path`", cfg.source.display()))?;
            let eot = end_of_turn_for(&t.path, &tok, family_of(cfg))?;
            (Some(tok), eot)
        }
        None => (None, None),
    };
    let sampling = cfg
        .datasets
        .iter()
        .filter(|d| names.contains(&d.name))
        .map(|d| (d.name.clone(), cfg.sampling_of(d)))
        .collect();
    let generation = names
        .iter()
        .filter_map(|n| cfg.datasets.iter().find(|d| &d.name == n))
        .map(|d| super::hf::generation_json(cfg, d))
        .collect();
    Ok(ExportContext {
        tokenizer,
        end_of_turn,
        datasets: names,
        data_dir: cfg.data_dir.clone(),
        output_dir: cfg.output_dir.clone(),
        sampling,
        model: cfg.server.model.clone(),
        generation,
    })
}

/// Sealed shards of a dataset, in index order.
pub fn shards_of(output_dir: &Path, dataset: &str) -> Result<Vec<PathBuf>> {
    let dir = output_dir.join(dataset);
    if !dir.exists() {
        return Ok(Vec::new());
    }
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

/// Calls `f` with every row of the shard at `path`, in order, a decoded batch at a time.
/// Past the footer, errors name the file.
pub fn for_each_row(
    path: &Path,
    end_of_turn: Option<&EndOfTurn>,
    mut f: impl FnMut(ExportRow) -> Result<()>,
) -> Result<()> {
    let reader = ShardReader::open_checked(path)?;
    let count_source: Arc<str> = reader
        .metadata()
        .into_iter()
        .find(|(k, _)| k == META_COUNT_SOURCE)
        .map(|(_, v)| v)
        .unwrap_or_default()
        .into();
    let batches = reader
        .batches(None)
        .map_err(|e| anyhow!(e.detail()))
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut rows = Vec::new();
    for batch in batches {
        let batch = batch
            .map_err(|e| anyhow!(e.detail()))
            .with_context(|| format!("cannot decode {}", path.display()))?;
        rows.clear();
        batch_to_rows(path, &batch, &mut rows)
            .map_err(|e| anyhow!(e.detail()))
            .with_context(|| format!("cannot decode {}", path.display()))?;
        let stop = stop_reasons(&batch);
        for (i, row) in rows.drain(..).enumerate() {
            let mut row = prepare(row, count_source.clone(), end_of_turn);
            row.stop_reason = stop.get(i).cloned().flatten();
            f(row)?;
        }
    }
    Ok(())
}

/// Each row's `stop_reason` in `batch`, read by name: empty when the batch has no such
/// string column (shards written before it), None where a row has no value.
fn stop_reasons(batch: &arrow_array::RecordBatch) -> Vec<Option<String>> {
    let Some(c) = batch
        .column_by_name(STOP_REASON)
        .and_then(|c| c.as_string_opt::<i32>())
    else {
        return Vec::new();
    };
    (0..c.len())
        .map(|i| c.is_valid(i).then(|| c.value(i).to_owned()))
        .collect()
}

/// A shard row with its end of turn made explicit.
pub fn prepare(
    mut row: ShardRow,
    count_source: Arc<str>,
    end_of_turn: Option<&EndOfTurn>,
) -> ExportRow {
    let mut appended = false;
    if let (Some(eot), Some(ids)) = (end_of_turn, row.completion_token_ids.as_mut()) {
        let called = row.tool_calls.is_some() || row.finish_reason == "tool_calls";
        let after = eot.after_tool_call.as_ref().map(|(id, _)| *id);
        let close = after.filter(|_| called).unwrap_or(eot.id);
        let closed = ids
            .last()
            .is_some_and(|l| *l == eot.id || Some(*l) == after);
        if ends_turn(&row.finish_reason) && !closed {
            ids.push(close);
            appended = true;
        }
    }
    ExportRow {
        row,
        count_source,
        end_of_turn_appended: appended,
        leftover_think: false,
        stop_reason: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(finish: &str, ids: Option<Vec<u32>>) -> ShardRow {
        ShardRow {
            id: "a".into(),
            dataset: "d".into(),
            prompt_token_ids: Some(vec![1, 2]),
            completion_token_ids: ids,
            finish_reason: finish.into(),
            ..ShardRow::default()
        }
    }

    /// The end-of-turn id is appended to a completion that stopped without it, never
    /// doubled when the server sent it, and never added to one cut by `max_tokens`.
    #[test]
    fn end_of_turn_is_appended_only_when_the_turn_ended_without_it() {
        let eot = EndOfTurn {
            id: 9,
            token: "<|im_end|>".into(),
            source: "test".into(),
            after_tool_call: None,
        };
        let r = prepare(row("stop", Some(vec![5, 6])), "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 6, 9]));
        assert!(r.end_of_turn_appended);
        let r = prepare(row("stop", Some(vec![5, 9])), "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 9]));
        assert!(!r.end_of_turn_appended);
        let r = prepare(row("length", Some(vec![5, 6])), "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 6]));
        assert!(r.truncated());
        let r = prepare(
            row("tool_calls", Some(vec![5])),
            "server".into(),
            Some(&eot),
        );
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 9]));
        let (ids, mask) = r.ids_and_mask().unwrap();
        assert_eq!((ids, mask), (vec![1, 2, 5, 9], vec![0, 0, 1, 1]));
    }

    /// `stop_reason` is read by name where a batch has the column, and missing otherwise.
    #[test]
    fn stop_reasons_are_read_by_name_when_present() {
        let rows = vec![row("stop", None), row("length", None)];
        let batch = crate::output::writer::rows_to_batch(&rows).unwrap();
        assert!(stop_reasons(&batch).is_empty());
        let mut fields: Vec<arrow_schema::Field> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(arrow_schema::Field::new(
            STOP_REASON,
            arrow_schema::DataType::Utf8,
            true,
        ));
        let mut cols = batch.columns().to_vec();
        cols.push(std::sync::Arc::new(arrow_array::StringArray::from(vec![
            Some("eos"),
            None,
        ])));
        let with = arrow_array::RecordBatch::try_new(
            std::sync::Arc::new(arrow_schema::Schema::new(fields)),
            cols,
        )
        .unwrap();
        assert_eq!(stop_reasons(&with), vec![Some("eos".to_string()), None]);
    }

    /// Qwen3's tokenizer config names `<|im_end|>` (151645) as the end of a turn.
    #[test]
    fn qwen3s_end_of_turn_comes_from_its_tokenizer_config() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/qwen3/tokenizer.json");
        let tok = Tokenizer::from_file(&p).unwrap();
        let eot = end_of_turn_of(&p, &tok).unwrap().unwrap();
        assert_eq!((eot.id, eot.token.as_str()), (151645, "<|im_end|>"));
    }

    /// A copy of the Qwen3 fixture's tokenizer files in a temporary model folder.
    fn qwen3_folder(generation: Option<&str>) -> tempfile::TempDir {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen3");
        let dir = tempfile::tempdir().unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        if let Some(g) = generation {
            std::fs::write(dir.path().join("generation_config.json"), g).unwrap();
        }
        dir
    }

    /// A known family's turn close wins and says whether generation_config.json lists it;
    /// without a family, generation_config.json's ids choose (the tokenizer config's
    /// eos_token when listed, else the first); a bad file is an error naming it.
    #[test]
    fn the_end_of_turn_follows_the_family_and_generation_config() {
        let dir = qwen3_folder(Some(r#"{"eos_token_id": [151645, 151643]}"#));
        let p = dir.path().join("tokenizer.json");
        let tok = Tokenizer::from_file(&p).unwrap();
        let e = end_of_turn_for(&p, &tok, Some(Family::Qwen))
            .unwrap()
            .unwrap();
        assert_eq!((e.id, e.token.as_str()), (151645, "<|im_end|>"));
        assert!(
            e.source.contains("qwen family") && e.source.contains("lists it"),
            "{}",
            e.source
        );
        let e = end_of_turn_for(&p, &tok, None).unwrap().unwrap();
        assert_eq!(e.id, 151645);
        // A family whose tokens this vocabulary lacks falls back to generation_config.
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": 151643}"#,
        )
        .unwrap();
        let e = end_of_turn_for(&p, &tok, Some(Family::MiniMax))
            .unwrap()
            .unwrap();
        assert_eq!((e.id, e.token.as_str()), (151643, "<|endoftext|>"));
        assert!(e.source.contains("generation_config.json"), "{}", e.source);
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .unwrap();
        let err = end_of_turn_for(&p, &tok, None).unwrap_err().to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );
        let bare = qwen3_folder(None);
        let p = bare.path().join("tokenizer.json");
        let e = end_of_turn_for(&p, &tok, None).unwrap().unwrap();
        assert!(e.source.contains("eos_token"), "{}", e.source);
    }

    /// A turn that ends in tool calls gets the family's after-call close (GLM's
    /// `<|observation|>`, gpt-oss's `<|call|>`); either close already there is not doubled.
    #[test]
    fn a_turn_ending_in_calls_gets_the_after_call_close() {
        let eot = EndOfTurn {
            id: 9,
            token: "<|user|>".into(),
            source: "test".into(),
            after_tool_call: Some((8, "<|observation|>".into())),
        };
        let mut called = row("stop", Some(vec![5]));
        called.tool_calls = Some("[]".into());
        let r = prepare(called.clone(), "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 8]));
        let r = prepare(row("stop", Some(vec![5])), "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 9]));
        called.completion_token_ids = Some(vec![5, 8]);
        let r = prepare(called, "server".into(), Some(&eot));
        assert_eq!(r.row.completion_token_ids, Some(vec![5, 8]));
        assert!(!r.end_of_turn_appended);
    }
}
