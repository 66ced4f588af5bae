//! Shard rows as an export sees them: decoded a batch at a time, with the end of the turn
//! made explicit in the ids.
//!
//! Invariant: a completion whose generation ended its turn ([`StopReason::ends_turn`]: the
//! model's stop token, or tool calls) ends with exactly one end-of-turn id in
//! [`ExportRow::completion_ids`] — the one the server named (SGLang's `matched`, vLLM's
//! `stop_reason`), else the model's ([`TurnEnds`]); it is appended only when the server
//! left it out, and the row says so. A completion stopped by a user's stop string, cut by
//! `max_tokens` or aborted never gets one. When the id is needed and spool cannot tell
//! which it is, the export is refused (`--end-of-turn` names it) rather than guessed; a
//! row written before `stop_reason` whose `stop` may have been a stop string gets none and
//! is flagged.

use super::ExportContext;
use crate::config::Config;
use crate::output::export::error::{Context, ExportError, Result};
use crate::output::reader::{batch_to_rows, ShardReader};
use crate::output::schema::META_COUNT_SOURCE;
use crate::output::shard::{folder_entries, parse_shard_index};
pub use crate::prompt::end_of_turn::{end_of_turn_of, EndOfTurn};
use crate::prompt::model_folder::ModelFiles;
use crate::prompt::syntax::{Family, Syntax};
use crate::prompt::tokenizer::Tokenizer;
use crate::prompt::ChatTemplate;
use crate::store::row::ShardRow;
use crate::store::stop_reason::StopReason;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What an export knows of how the model ends a turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnEnds {
    /// The id appended to a turn that ended without it when the server named none; `Err`
    /// says why spool cannot tell which id that is.
    pub append: Result<EndOfTurn, String>,
    /// Every id known to close a turn (the family's closes, `generation_config.json`'s
    /// `eos_token_id`, the tokenizer config's `eos_token`): a completion ending in one of
    /// them is closed already.
    pub closing: Vec<u32>,
}

impl TurnEnds {
    /// The ends of a model whose end of turn is `eot` and nothing else.
    pub fn of(eot: EndOfTurn) -> TurnEnds {
        let mut closing = vec![eot.id];
        closing.extend(eot.after_tool_call.as_ref().map(|(id, _)| *id));
        TurnEnds {
            append: Ok(eot),
            closing,
        }
    }

    /// Ends where spool cannot tell the end-of-turn id, and why.
    pub fn unknown(why: impl Into<String>, closing: Vec<u32>) -> TurnEnds {
        TurnEnds {
            append: Err(why.into()),
            closing,
        }
    }
}

/// One shard row on its way out.
#[derive(Debug, Clone)]
pub struct ExportRow {
    pub row: ShardRow,
    /// The shard's `spool.count_source`: where `completion_tokens` came from.
    pub count_source: Arc<str>,
    /// The end-of-turn id was appended to `row.completion_token_ids` here.
    pub end_of_turn_appended: bool,
    /// A `stop` written before `stop_reason`, whose dataset sent stop strings: whether the
    /// model ended its turn is unknown, so no end-of-turn id was appended.
    pub end_of_turn_unknown: bool,
    /// Think markers are left in the answer although the thinking was split off.
    pub leftover_think: bool,
    /// Why the generation ended, as the shard's `stop_reason` column says it; None for
    /// shards written before the column, or a row whose server did not say.
    pub stop_reason: Option<String>,
}

impl ExportRow {
    /// Whether the generation ended its turn itself (its stop token or tool calls; not a
    /// stop string, a cut or an abort).
    pub fn ended_turn(&self) -> bool {
        match &self.row.stop_reason {
            Some(r) => r.ends_turn(),
            None => ends_turn(&self.row.finish_reason) && !self.end_of_turn_unknown,
        }
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
        ExportError::usage(format!(
            "{}: key `eos_token_id` must be a token id or a list of them",
            p.display()
        ))
    })
}

/// How a model of `family` (from its chat template or the configured parsers) ends a
/// turn. The id appended is the family's turn close (checked against
/// `generation_config.json` when the folder has one); for a template of no known family,
/// the one the model folder declares: `generation_config.json`'s `eos_token_id` when it
/// is one id or lists the tokenizer config's `eos_token`, else that `eos_token`. Anything
/// else — a family whose close this vocabulary lacks, several ids none of them the
/// tokenizer's — is unknown, never guessed.
pub fn turn_ends(
    tokenizer_path: &Path,
    tokenizer: &Tokenizer,
    family: Option<Family>,
) -> Result<TurnEnds> {
    let folder = folder_of(tokenizer_path);
    let gen = generation_eos(folder)?;
    let gen_file = folder.join("generation_config.json");
    let config_eos = end_of_turn_of(&folder.join("tokenizer.json"), tokenizer)
        .ok()
        .flatten();
    let mut closing: Vec<u32> = gen.clone().unwrap_or_default();
    closing.extend(config_eos.as_ref().map(|e| e.id));
    if let Some(f) = family {
        let (end, after) = f.end_of_turn();
        closing.extend(
            [Some(end), after]
                .into_iter()
                .flatten()
                .filter_map(|t| tokenizer.token_to_id(t)),
        );
    }
    closing.sort_unstable();
    closing.dedup();
    let append = match family {
        Some(f) => {
            let (end, after) = f.end_of_turn();
            match tokenizer.token_to_id(end) {
                Some(id) => {
                    let listed = match &gen {
                        Some(ids) if ids.contains(&id) => {
                            format!("; {} lists it", gen_file.display())
                        }
                        Some(_) => format!("; not in {} eos_token_id", gen_file.display()),
                        None => String::new(),
                    };
                    Ok(EndOfTurn {
                        id,
                        token: end.to_owned(),
                        source: format!("the {} family's turn close{listed}", f.name()),
                        after_tool_call: after
                            .and_then(|a| tokenizer.token_to_id(a).map(|i| (i, a.to_owned()))),
                    })
                }
                None => Err(format!(
                    "the chat template is of the {} family, whose turn close `{end}` is not a token of {}",
                    f.name(),
                    tokenizer_path.display()
                )),
            }
        }
        None => match gen {
            Some(ids) if !ids.is_empty() => match config_eos.filter(|e| ids.contains(&e.id)) {
                Some(e) => Ok(e),
                None if ids.len() == 1 => Ok(EndOfTurn {
                    id: ids[0],
                    token: tokenizer.decode(&ids[..1]).unwrap_or_default(),
                    source: format!("{} (eos_token_id)", gen_file.display()),
                    after_tool_call: None,
                }),
                None => Err(format!(
                    "{} lists several eos_token_id ({ids:?}), none of them the tokenizer config's eos_token, and the chat template is of no family spool knows",
                    gen_file.display()
                )),
            },
            _ => config_eos.ok_or_else(|| {
                format!(
                    "the chat template is of no family spool knows, and neither {} (eos_token_id) nor {} (eos_token) names one",
                    gen_file.display(),
                    folder.join("tokenizer_config.json").display()
                )
            }),
        },
    };
    Ok(TurnEnds { append, closing })
}

/// The end of turn `--end-of-turn` names: a token id, or a token of the tokenizer.
pub fn end_of_turn_arg(arg: &str, tokenizer: Option<&Tokenizer>) -> Result<EndOfTurn> {
    let source = format!("--end-of-turn {arg}");
    if let Ok(id) = arg.parse::<u32>() {
        let token = match tokenizer {
            Some(t) if (id as usize) < t.vocab_size() => t.decode(&[id]).unwrap_or_default(),
            Some(t) => {
                return Err(ExportError::usage(format!(
                    "--end-of-turn {arg}: not a token id of {} ({} ids)",
                    t.origin().display(),
                    t.vocab_size()
                )))
            }
            None => String::new(),
        };
        return Ok(EndOfTurn {
            id,
            token,
            source,
            after_tool_call: None,
        });
    }
    let Some(t) = tokenizer else {
        return Err(ExportError::usage(format!("--end-of-turn {arg}: a token needs the config's [tokenizer] to find its id; give the id instead")));
    };
    let id = t.token_to_id(arg).ok_or_else(|| {
        ExportError::usage(format!(
            "--end-of-turn {arg}: not a token of {} (give a token such as `<|im_end|>`, or its id)",
            t.origin().display()
        ))
    })?;
    Ok(EndOfTurn {
        id,
        token: arg.to_owned(),
        source,
        after_tool_call: None,
    })
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

/// The config's tokenizer and how its model ends a turn (`end_of_turn`: what
/// `--end-of-turn` names instead), for the datasets `names` whose shards are in
/// `output_dir`.
pub fn context(
    cfg: &Config,
    output_dir: &Path,
    names: Vec<String>,
    end_of_turn: Option<&str>,
) -> Result<ExportContext> {
    let tokenizer = match &cfg.tokenizer {
        Some(t) => Some(
            Tokenizer::from_file(&t.path)
                .with_context(|| format!("{}: key `tokenizer.path`", cfg.source.display()))?,
        ),
        None => None,
    };
    let ends = match (&cfg.tokenizer, &tokenizer) {
        (Some(t), Some(tok)) => turn_ends(&t.path, tok, family_of(cfg))?,
        _ => TurnEnds::unknown(
            format!(
                "{} has no [tokenizer] to learn the model's end of turn from",
                cfg.source.display()
            ),
            Vec::new(),
        ),
    };
    let ends = match end_of_turn {
        Some(arg) => {
            let eot = end_of_turn_arg(arg, tokenizer.as_ref())?;
            let mut closing = ends.closing;
            closing.push(eot.id);
            TurnEnds {
                append: Ok(eot),
                closing,
            }
        }
        None => ends,
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
        end_of_turn: Some(ends),
        datasets: names,
        data_dir: cfg.data_dir.clone(),
        output_dir: output_dir.to_path_buf(),
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

/// How the rows of one dataset's shards get their end of turn.
#[derive(Debug, Clone, Copy)]
pub struct Ending<'a> {
    /// How the model ends a turn; None when the export writes no ids (nothing appended).
    pub ends: Option<&'a TurnEnds>,
    /// The dataset's config sends stop strings: a `stop` written before `stop_reason` may
    /// have been one.
    pub stop_strings: bool,
}

/// Calls `f` with every row of the shard at `path`, in order, a decoded batch at a time.
/// Past the footer, errors name the file.
pub fn for_each_row(
    path: &Path,
    ending: Ending<'_>,
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
        .map_err(|e| ExportError::broken(e.detail()))
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut rows = Vec::new();
    for batch in batches {
        let batch = batch
            .map_err(|e| ExportError::broken(e.detail()))
            .with_context(|| format!("cannot decode {}", path.display()))?;
        rows.clear();
        batch_to_rows(path, &batch, &mut rows)
            .map_err(|e| ExportError::broken(e.detail()))
            .with_context(|| format!("cannot decode {}", path.display()))?;
        for row in rows.drain(..) {
            let row = prepare_with(row, count_source.clone(), ending)
                .with_context(|| format!("{}", path.display()))?;
            f(row)?;
        }
    }
    Ok(())
}

/// A shard row with its end of turn made explicit for a model whose end of turn is `eot`
/// (nothing appended without one), its dataset sending no stop strings: what
/// [`prepare_with`] does when the id is known.
pub fn prepare(
    row: ShardRow,
    count_source: Arc<str>,
    end_of_turn: Option<&EndOfTurn>,
) -> ExportRow {
    let ends = end_of_turn.cloned().map(TurnEnds::of);
    let ending = Ending {
        ends: ends.as_ref(),
        stop_strings: false,
    };
    // `Err` only when the id is needed and unknown; `TurnEnds::of` knows it.
    let close = closing(&row, ending).unwrap_or_default();
    finish(row, count_source, close)
}

/// A shard row with its end of turn made explicit (see the module's invariant); `Err` when
/// the row needs an end-of-turn id spool cannot tell.
pub fn prepare_with(
    row: ShardRow,
    count_source: Arc<str>,
    ending: Ending<'_>,
) -> Result<ExportRow> {
    let close = closing(&row, ending).map_err(|why| {
        ExportError::usage(format!(
            "dataset `{}`, item `{}` (sample {}, turn {}): the model ended its turn, the server \
             neither named its stop token nor left it in the ids, and spool cannot tell which \
             id ends a turn: {why}; pass --end-of-turn ID|TOKEN (e.g. --end-of-turn \
             '<|im_end|>')",
            row.dataset, row.id, row.sample, row.turn
        ))
    })?;
    Ok(finish(row, count_source, close))
}

/// What a row's ids need at their end.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Close {
    /// The id to append.
    append: Option<u32>,
    /// Whether the turn ended is unknown (a `stop` that may have been a stop string).
    unknown: bool,
}

/// The end of turn `row` needs; `Err` (why) when it needs one and spool cannot tell it.
fn closing(row: &ShardRow, ending: Ending<'_>) -> Result<Close, String> {
    // Only a row with both prompt and completion ids has ids in an export.
    let (Some(ends), Some(_), Some(ids)) = (
        ending.ends,
        row.prompt_token_ids.as_ref(),
        row.completion_token_ids.as_ref(),
    ) else {
        return Ok(Close::default());
    };
    let ended = match &row.stop_reason {
        Some(r) => r.ends_turn(),
        // Written before `stop_reason`: a `stop` is the model's own only when no stop
        // string was sent.
        None => match row.finish_reason.as_str() {
            "tool_calls" => true,
            "stop" if !ending.stop_strings && !sent_stop_strings(row) => true,
            "stop" => {
                return Ok(Close {
                    append: None,
                    unknown: true,
                })
            }
            _ => false,
        },
    };
    let last = ids.last().copied();
    if !ended || last.is_some_and(|l| ends.closing.contains(&l)) {
        return Ok(Close::default());
    }
    // The token the server named is the one the model generated.
    if let Some(StopReason::Eos(Some(id))) = row.stop_reason {
        return Ok(Close {
            append: (last != Some(id)).then_some(id),
            unknown: false,
        });
    }
    let eot = ends.append.as_ref().map_err(Clone::clone)?;
    let called = row.tool_calls.is_some() || row.stop_reason == Some(StopReason::ToolCalls);
    let after = eot.after_tool_call.as_ref().map(|(id, _)| *id);
    let close = after.filter(|_| called).unwrap_or(eot.id);
    Ok(Close {
        append: (last != Some(close)).then_some(close),
        unknown: false,
    })
}

/// Whether the row's own sampling (a batch row's) sent stop strings.
fn sent_stop_strings(row: &ShardRow) -> bool {
    row.sampling
        .as_deref()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
        .and_then(|v| {
            v.get("stop")
                .and_then(|s| s.as_array())
                .map(|a| !a.is_empty())
        })
        .unwrap_or(false)
}

/// The export row of `row` with `close` applied.
fn finish(mut row: ShardRow, count_source: Arc<str>, close: Close) -> ExportRow {
    if let (Some(id), Some(ids)) = (close.append, row.completion_token_ids.as_mut()) {
        ids.push(id);
    }
    ExportRow {
        count_source,
        end_of_turn_appended: close.append.is_some(),
        end_of_turn_unknown: close.unknown,
        leftover_think: false,
        stop_reason: row.stop_reason.as_ref().map(StopReason::to_text),
        row,
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
    /// without a family the model folder's declaration is taken (the tokenizer config's
    /// eos_token when generation_config.json lists it, or its one id); a family whose close
    /// this vocabulary lacks, or several ids none of them the tokenizer's, are unknown and
    /// say why; every declared id closes a turn; a bad file is an error naming it.
    #[test]
    fn the_end_of_turn_follows_the_family_and_the_model_folder() {
        let dir = qwen3_folder(Some(r#"{"eos_token_id": [151645, 151643]}"#));
        let p = dir.path().join("tokenizer.json");
        let tok = Tokenizer::from_file(&p).unwrap();
        let ends = turn_ends(&p, &tok, Some(Family::Qwen)).unwrap();
        let e = ends.append.unwrap();
        assert_eq!((e.id, e.token.as_str()), (151645, "<|im_end|>"));
        assert!(
            e.source.contains("qwen family") && e.source.contains("lists it"),
            "{}",
            e.source
        );
        assert_eq!(ends.closing, vec![151643, 151645]);
        let e = turn_ends(&p, &tok, None).unwrap().append.unwrap();
        assert_eq!(e.id, 151645);
        // A family whose tokens this vocabulary lacks is not guessed from the folder.
        let why = turn_ends(&p, &tok, Some(Family::MiniMax))
            .unwrap()
            .append
            .unwrap_err();
        assert!(why.contains("minimax") && why.contains("[e~["), "{why}");
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": 151643}"#,
        )
        .unwrap();
        let e = turn_ends(&p, &tok, None).unwrap().append.unwrap();
        assert_eq!((e.id, e.token.as_str()), (151643, "<|endoftext|>"));
        assert!(e.source.contains("generation_config.json"), "{}", e.source);
        // Several ids, none of them the tokenizer config's eos_token: which one is unknown.
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [151643, 151644]}"#,
        )
        .unwrap();
        let ends = turn_ends(&p, &tok, None).unwrap();
        let why = ends.append.unwrap_err();
        assert!(why.contains("several eos_token_id"), "{why}");
        assert_eq!(ends.closing, vec![151643, 151644, 151645]);
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .unwrap();
        let err = turn_ends(&p, &tok, None).unwrap_err().to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );
        let bare = qwen3_folder(None);
        let p = bare.path().join("tokenizer.json");
        let e = turn_ends(&p, &tok, None).unwrap().append.unwrap();
        assert!(e.source.contains("eos_token"), "{}", e.source);
    }

    /// `--end-of-turn` takes an id of the vocabulary or one of its tokens; anything else is
    /// refused naming the flag.
    #[test]
    fn end_of_turn_arg_takes_an_id_or_a_token() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/qwen3/tokenizer.json");
        let tok = Tokenizer::from_file(&p).unwrap();
        let e = end_of_turn_arg("<|im_end|>", Some(&tok)).unwrap();
        assert_eq!(
            (e.id, e.source.as_str()),
            (151645, "--end-of-turn <|im_end|>")
        );
        let e = end_of_turn_arg("151643", Some(&tok)).unwrap();
        assert_eq!((e.id, e.token.as_str()), (151643, "<|endoftext|>"));
        assert_eq!(end_of_turn_arg("7", None).unwrap().id, 7);
        for (arg, t) in [
            ("<|nope|>", Some(&tok)),
            ("999999999", Some(&tok)),
            ("<|im_end|>", None),
        ] {
            let err = end_of_turn_arg(arg, t).unwrap_err().to_string();
            assert!(err.contains("--end-of-turn"), "{err}");
        }
    }

    fn ends(eot: &EndOfTurn) -> TurnEnds {
        TurnEnds::of(eot.clone())
    }

    /// What was stored decides: the model's stop token gets the end of turn (the id the
    /// server named, else the model's), a stop string, a cut and an abort get none; a row
    /// written before `stop_reason` is the model's stop only when no stop string was sent
    /// (its own or its dataset's), else it gets none and says the end is unknown.
    #[test]
    fn the_stop_reason_decides_the_end_of_turn() {
        let eot = EndOfTurn {
            id: 9,
            token: "<|im_end|>".into(),
            source: "test".into(),
            after_tool_call: None,
        };
        let e = ends(&eot);
        let with = |reason: Option<StopReason>, stop_strings: bool| {
            let r = ShardRow {
                stop_reason: reason,
                ..row("stop", Some(vec![5, 6]))
            };
            let ending = Ending {
                ends: Some(&e),
                stop_strings,
            };
            let x = prepare_with(r, "server".into(), ending).unwrap();
            (
                x.row.completion_token_ids.clone().unwrap(),
                x.end_of_turn_appended,
                x.end_of_turn_unknown,
            )
        };
        assert_eq!(
            with(Some(StopReason::Eos(None)), true),
            (vec![5, 6, 9], true, false)
        );
        // The server named another stop token: that one is what the model generated.
        assert_eq!(
            with(Some(StopReason::Eos(Some(8))), false),
            (vec![5, 6, 8], true, false)
        );
        let stop = Some(StopReason::StopString("</a>".into()));
        assert_eq!(with(stop, false), (vec![5, 6], false, false));
        assert_eq!(with(None, false), (vec![5, 6, 9], true, false));
        assert_eq!(with(None, true), (vec![5, 6], false, true));
        let own = ShardRow {
            sampling: Some(r#"{"stop":["END"],"temperature":0.1}"#.into()),
            ..row("stop", Some(vec![5]))
        };
        let r = prepare(own, "server".into(), Some(&eot));
        assert!(r.end_of_turn_unknown && !r.end_of_turn_appended && !r.ended_turn());
        // A named token already there is not doubled.
        let sent = ShardRow {
            stop_reason: Some(StopReason::Eos(Some(6))),
            ..row("stop", Some(vec![5, 6]))
        };
        assert!(!prepare(sent, "server".into(), Some(&eot)).end_of_turn_appended);
    }

    /// A row that needs the model's end-of-turn id while spool cannot tell it is refused,
    /// naming the item and `--end-of-turn`; rows that need none pass (the id named by the
    /// server, a closing id already there, a stop string), and an export that writes no
    /// ids appends nothing.
    #[test]
    fn an_unknown_end_of_turn_is_refused_not_guessed() {
        let unknown = TurnEnds::unknown("no family", vec![9]);
        let ending = Ending {
            ends: Some(&unknown),
            stop_strings: false,
        };
        let r = |reason: StopReason, ids: Vec<u32>| ShardRow {
            stop_reason: Some(reason),
            ..row("stop", Some(ids))
        };
        let err = prepare_with(r(StopReason::Eos(None), vec![5]), "s".into(), ending)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("item `a`") && err.contains("no family") && err.contains("--end-of-turn"),
            "{err}"
        );
        let named = prepare_with(r(StopReason::Eos(Some(4)), vec![5]), "s".into(), ending).unwrap();
        assert_eq!(named.row.completion_token_ids, Some(vec![5, 4]));
        let closed =
            prepare_with(r(StopReason::Eos(None), vec![5, 9]), "s".into(), ending).unwrap();
        assert!(!closed.end_of_turn_appended);
        let s = StopReason::StopString("x".into());
        assert!(prepare_with(r(s, vec![5]), "s".into(), ending).is_ok());
        let no_ids = Ending {
            ends: None,
            stop_strings: false,
        };
        let plain = prepare_with(r(StopReason::Eos(None), vec![5]), "s".into(), no_ids).unwrap();
        assert!(!plain.end_of_turn_appended);
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
