//! `token-freq` and `draft-vocab`: what a drafter with a reduced vocabulary is built from,
//! as safetensors files.
//!
//! - `token-freq`: one int64 tensor `counts` of length V (the target vocabulary): how often
//!   each id is a completion token (loss mask 1, the appended end-of-turn id included) in
//!   the kept rows. speculators' `token_freq.pt` and SpecForge's counter hold the same
//!   numbers as a `{id: count}` dict of the ids seen.
//! - `draft-vocab`: `d2t` (int64, N) and `t2d` (bool, V) for an N-token draft vocabulary:
//!   the N most frequent ids, ties broken by the smaller id, and when fewer than N ids were
//!   seen the smallest unseen ids below N fill the rest; the chosen ids in ascending order
//!   are draft ids 0..N, `d2t[i] = target_id - i`, `t2d[target_id]` is true for exactly
//!   the chosen ids. This is speculators' `build_vocab_mappings_from_distribution`. Beside
//!   the file go `d2t-N.npy` and `t2d-N.npy` (int64, bool), the files `speculators train`
//!   loads as they are (`--d2t-path`/`--t2d-path`, or found by those names in its
//!   `--data-path` with `--draft-vocab-size N`). SpecForge's `vocab_mapping_path` takes a
//!   `torch.save`d dict of the same two tensors: `torch.save(load_file(FILE), "x.pt")`.
//!
//! Invariants: memory is one counter per target id, whatever the number of rows; every
//! counted id is below V (an id at or past V fails the export naming its row), so
//! `t2d.sum() == N` and `d2t[i] + i` is the i-th chosen id, strictly increasing.
//!
//! V is `--target-vocab`, else `vocab_size` of the `config.json` beside `tokenizer.json`
//! (the model's, as both frameworks read it: the lm_head rows, 151936 for Qwen3, more than
//! the tokenizer's 151669 ids). `token-freq` alone falls back to the tokenizer's size, then
//! to the largest id seen + 1; `draft-vocab` refuses without the model's size, because a
//! `t2d` of another length is rejected by both frameworks when they load it.

use super::{Accounting, ExportContext, ExportRow, Sink};
use crate::output::export::error::{Context, ExportError, Result};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The `token-freq` tensor's name.
pub const COUNTS: &str = "counts";
/// The `draft-vocab` tensors' names.
pub const D2T: &str = "d2t";
pub const T2D: &str = "t2d";

/// The target vocabulary's size and where it came from (written into the file's metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetVocab {
    pub size: usize,
    pub source: String,
}

/// The target vocabulary size: `given`, else the model's `config.json` beside the
/// tokenizer. None when neither says it.
pub fn model_vocab(ctx: &ExportContext, given: Option<usize>) -> Result<Option<TargetVocab>> {
    if let Some(size) = given {
        if size == 0 {
            return Err(ExportError::usage("--target-vocab must be > 0"));
        }
        return Ok(Some(TargetVocab {
            size,
            source: "--target-vocab".into(),
        }));
    }
    let Some(tok) = &ctx.tokenizer else {
        return Ok(None);
    };
    let path = tok.origin().with_file_name("config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    // Multimodal configs keep the language model's size under `text_config`, where both
    // frameworks look for it.
    let (key, size) = match v.get("text_config").and_then(|t| t.get("vocab_size")) {
        Some(s) => ("text_config.vocab_size", s),
        None => match v.get("vocab_size") {
            Some(s) => ("vocab_size", s),
            None => return Ok(None),
        },
    };
    let size = size
        .as_u64()
        .filter(|&s| s > 0)
        .and_then(|s| usize::try_from(s).ok())
        .with_context(|| {
            format!(
                "{}: key `{key}`: {size} is not a positive integer",
                path.display()
            )
        })?;
    Ok(Some(TargetVocab {
        size,
        source: format!("{} ({key})", path.display()),
    }))
}

/// Counts of completion token ids, growing only when no vocabulary size is fixed.
#[derive(Debug, Clone)]
pub struct TokenCounts {
    counts: Vec<u64>,
    /// The fixed size ids must stay below; None lets the table grow.
    fixed: Option<TargetVocab>,
    rows: u64,
    tokens: u64,
}

impl TokenCounts {
    /// An empty table of `fixed.size` counters, or one that grows with the ids seen.
    pub fn new(fixed: Option<TargetVocab>, initial: usize) -> Self {
        let len = fixed.as_ref().map_or(initial, |v| v.size);
        Self {
            counts: vec![0; len],
            fixed,
            rows: 0,
            tokens: 0,
        }
    }

    /// Counts the completion ids of `row` (those under loss mask 1); rows without ids
    /// (which the gates leave out of these formats) count nothing.
    pub fn add(&mut self, row: &ExportRow) -> Result<()> {
        let r = &row.row;
        let (Some(_), Some(ids)) = (&r.prompt_token_ids, &r.completion_token_ids) else {
            return Ok(());
        };
        for &t in ids {
            let t = t as usize;
            if t >= self.counts.len() {
                match &self.fixed {
                    Some(v) => return Err(ExportError::usage(format!(
                        "dataset `{}` item `{}` sample {} turn {}: completion token id {t} is outside the target vocabulary of {} (from {}); pass --target-vocab with the model's vocab_size",
                        r.dataset, r.id, r.sample, r.turn, v.size, v.source
                    ))),
                    None => self.counts.resize(t + 1, 0),
                }
            }
            self.counts[t] += 1;
        }
        self.rows += 1;
        self.tokens += ids.len() as u64;
        Ok(())
    }

    /// The counters, one per id below the table's length.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Rows counted.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Completion tokens counted.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Ids seen at least once.
    pub fn distinct(&self) -> usize {
        self.counts.iter().filter(|&&c| c > 0).count()
    }
}

/// The `n` target ids of a draft vocabulary, ascending: the most frequent (a tie goes to
/// the smaller id), then, when fewer than `n` ids were seen, the smallest unseen ids
/// below `n`. Exactly speculators' `build_vocab_mappings_from_distribution`. Needs
/// `n <= counts.len()`.
pub fn draft_ids(counts: &[u64], n: usize) -> Vec<u32> {
    let mut seen: Vec<u32> = (0..counts.len())
        .filter(|&i| counts[i] > 0)
        .map(|i| i as u32)
        .collect();
    seen.sort_unstable_by_key(|&i| (std::cmp::Reverse(counts[i as usize]), i));
    seen.truncate(n);
    if seen.len() < n {
        // Unseen ids have a count of 0, so they are exactly the ids not chosen yet.
        let fill: Vec<u32> = (0..n as u32)
            .filter(|&i| counts[i as usize] == 0)
            .take(n - seen.len())
            .collect();
        seen.extend(fill);
    }
    seen.sort_unstable();
    seen
}

/// `d2t` (offsets: `d2t[i] = ids[i] - i`) and `t2d` (true at each of `ids`) for draft ids
/// `ids` (ascending, each below `target`).
pub fn mappings(ids: &[u32], target: usize) -> (Vec<i64>, Vec<bool>) {
    let d2t = ids
        .iter()
        .enumerate()
        .map(|(i, &t)| i64::from(t) - i as i64)
        .collect();
    let mut t2d = vec![false; target];
    for &t in ids {
        t2d[t as usize] = true;
    }
    (d2t, t2d)
}

/// A tensor held as little-endian bytes, for `safetensors::serialize`.
struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Tensor {
    fn i64(v: &[i64]) -> Self {
        Self {
            dtype: Dtype::I64,
            shape: vec![v.len()],
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn bool(v: &[bool]) -> Self {
        Self {
            dtype: Dtype::BOOL,
            shape: vec![v.len()],
            data: v.iter().map(|&b| u8::from(b)).collect(),
        }
    }
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` with `metadata` as one safetensors file at `path`, synced.
fn write_safetensors(
    path: &Path,
    tensors: &[(&str, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (*n, t)), Some(metadata))
        .with_context(|| format!("cannot serialise {}", path.display()))?;
    super::write_file(path, &bytes)
}

/// The metadata both files carry.
fn common_metadata(
    kind: &str,
    vocab: &TargetVocab,
    c: &TokenCounts,
    ctx: &ExportContext,
) -> HashMap<String, String> {
    HashMap::from([
        ("format".into(), format!("spool.{kind}")),
        ("spool.version".into(), env!("CARGO_PKG_VERSION").into()),
        ("target_vocab_size".into(), vocab.size.to_string()),
        ("target_vocab_source".into(), vocab.source.clone()),
        ("rows".into(), c.rows.to_string()),
        ("tokens".into(), c.tokens.to_string()),
        ("distinct_ids".into(), c.distinct().to_string()),
        ("datasets".into(), ctx.datasets.join(",")),
    ])
}

/// `token-freq`: counts every completion id, written at the end.
struct TokenFreqSink {
    path: PathBuf,
    counts: TokenCounts,
    /// Used when neither `--target-vocab` nor a model config fixed the size.
    fallback: Option<TargetVocab>,
    ctx: ExportContext,
}

/// Counts of every completion token id (see the module doc).
pub fn token_freq_sink(
    tmp: &Path,
    ctx: &ExportContext,
    target_vocab: Option<usize>,
) -> Result<Box<dyn Sink>> {
    let fixed = model_vocab(ctx, target_vocab)?;
    let fallback = ctx.tokenizer.as_ref().map(|t| TargetVocab {
        size: t.vocab_size(),
        source: format!(
            "{} (the tokenizer's size: no --target-vocab, no config.json beside it)",
            t.origin().display()
        ),
    });
    let initial = fallback.as_ref().map_or(0, |v| v.size);
    Ok(Box::new(TokenFreqSink {
        path: tmp.to_path_buf(),
        counts: TokenCounts::new(fixed, initial),
        fallback,
        ctx: ctx.clone(),
    }))
}

impl Sink for TokenFreqSink {
    fn push(&mut self, row: &ExportRow) -> Result<()> {
        self.counts.add(row)
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        let c = &self.counts;
        let len = c.counts().len();
        let vocab = match (&c.fixed, &self.fallback) {
            (Some(v), _) => v.clone(),
            // The tokenizer's size, unless an id past it grew the table.
            (None, Some(f)) if f.size == len => f.clone(),
            _ => TargetVocab {
                size: len,
                source: "the largest id seen + 1 (no --target-vocab, no model config)".into(),
            },
        };
        let counts: Vec<i64> = c
            .counts()
            .iter()
            .map(|&n| i64::try_from(n).unwrap_or(i64::MAX))
            .collect();
        let meta = common_metadata("token-freq", &vocab, c, &self.ctx);
        write_safetensors(&self.path, &[(COUNTS, Tensor::i64(&counts))], meta)
    }
}

/// The `.npy` files written beside a `draft-vocab` export to `out` with N draft ids:
/// `d2t-N.npy`, `t2d-N.npy` (speculators' names).
pub fn npy_paths(out: &Path, n: usize) -> [PathBuf; 2] {
    [D2T, T2D].map(|t| out.with_file_name(format!("{t}-{n}.npy")))
}

/// `draft-vocab`: counts like `token-freq`, then picks the draft ids at the end.
struct DraftVocabSink {
    path: PathBuf,
    /// Where the `.npy` files go while the export is written (renamed with it).
    npy: [PathBuf; 2],
    counts: TokenCounts,
    vocab: TargetVocab,
    n: usize,
    ctx: ExportContext,
}

/// The `d2t`/`t2d` mapping of an `n`-token draft vocabulary (see the module doc).
pub fn draft_vocab_sink(
    tmp: &Path,
    out: &Path,
    ctx: &ExportContext,
    n: usize,
    target_vocab: Option<usize>,
) -> Result<Box<dyn Sink>> {
    let Some(vocab) = model_vocab(ctx, target_vocab)? else {
        let beside = match &ctx.tokenizer {
            Some(t) => format!("no config.json beside {}", t.origin().display()),
            None => "the config has no [tokenizer]".into(),
        };
        return Err(ExportError::usage(format!(
            "--format draft-vocab needs the target model's vocabulary size ({beside}): pass --target-vocab N with the model config's vocab_size (151936 for Qwen3)"
        )));
    };
    if n == 0 || n > vocab.size {
        return Err(ExportError::usage(format!(
            "--draft-vocab {n}: must be between 1 and the target vocabulary's {} (from {})",
            vocab.size, vocab.source
        )));
    }
    Ok(Box::new(DraftVocabSink {
        path: tmp.to_path_buf(),
        npy: npy_paths(out, n).map(|p| super::temp_path(&p)),
        counts: TokenCounts::new(Some(vocab.clone()), 0),
        vocab,
        n,
        ctx: ctx.clone(),
    }))
}

impl Sink for DraftVocabSink {
    fn push(&mut self, row: &ExportRow) -> Result<()> {
        self.counts.add(row)
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        let c = &self.counts;
        let ids = draft_ids(c.counts(), self.n);
        let (d2t, t2d) = mappings(&ids, self.vocab.size);
        let covered: u64 = ids.iter().map(|&i| c.counts()[i as usize]).sum();
        let padded = ids.iter().filter(|&&i| c.counts()[i as usize] == 0).count();
        let mut meta = common_metadata("draft-vocab", &self.vocab, c, &self.ctx);
        meta.insert("draft_vocab_size".into(), self.n.to_string());
        meta.insert("covered_tokens".into(), covered.to_string());
        meta.insert("unseen_ids_added".into(), padded.to_string());
        meta.insert(
            "selection".into(),
            "most frequent completion ids, ties to the smaller id, unseen ids below N fill; ascending (speculators' build_vocab_mappings_from_distribution)".into(),
        );
        super::write_file(
            &self.npy[0],
            &super::npy::encode(&super::npy::Array::I64(&d2t)),
        )?;
        super::write_file(
            &self.npy[1],
            &super::npy::encode(&super::npy::Array::Bool(&t2d)),
        )?;
        write_safetensors(
            &self.path,
            &[(D2T, Tensor::i64(&d2t)), (T2D, Tensor::bool(&t2d))],
            meta,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    fn counts(pairs: &[(usize, u64)], len: usize) -> Vec<u64> {
        let mut c = vec![0; len];
        for &(i, n) in pairs {
            c[i] = n;
        }
        c
    }

    /// The most frequent ids are chosen and come out ascending; a tie at the cut goes to
    /// the smaller id.
    #[test]
    fn top_n_by_count_then_smaller_id() {
        let c = counts(&[(9, 5), (3, 7), (4, 2), (7, 2), (1, 2), (8, 1)], 12);
        assert_eq!(draft_ids(&c, 2), vec![3, 9]);
        // 1, 4 and 7 tie at 2: the two smaller ones win.
        assert_eq!(draft_ids(&c, 4), vec![1, 3, 4, 9]);
        assert_eq!(draft_ids(&c, 5), vec![1, 3, 4, 7, 9]);
        assert_eq!(draft_ids(&c, 6), vec![1, 3, 4, 7, 8, 9]);
    }

    /// With fewer seen ids than N, the smallest unseen ids below N fill the rest, as
    /// speculators does — also when a seen id lies past N (then not every id below N is
    /// needed, and the smallest are taken).
    #[test]
    fn fewer_seen_ids_than_n_fill_with_the_smallest_unseen() {
        let c = counts(&[(5, 3), (2, 1)], 10);
        assert_eq!(draft_ids(&c, 4), vec![0, 1, 2, 5]);
        let c = counts(
            &[
                (0, 1),
                (2, 1),
                (3, 1),
                (4, 1),
                (5, 1),
                (6, 1),
                (7, 1),
                (100, 1),
            ],
            200,
        );
        // SpecForge would add 8 here (its set's iteration order); speculators adds 1.
        assert_eq!(draft_ids(&c, 9), vec![0, 1, 2, 3, 4, 5, 6, 7, 100]);
        // Nothing seen at all: the first N ids.
        assert_eq!(draft_ids(&[0; 8], 3), vec![0, 1, 2]);
    }

    /// d2t holds offsets and t2d marks exactly the chosen ids: t2d.sum() == N,
    /// d2t[i] + i is the i-th draft id, and a full vocabulary maps to itself.
    #[test]
    fn d2t_and_t2d_invariants() {
        let c: Vec<u64> = (0..500u64).map(|i| (i * 7919) % 13).collect();
        for n in [1, 17, 64, 499, 500] {
            let ids = draft_ids(&c, n);
            assert_eq!(ids.len(), n);
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "ascending, no repeats");
            let (d2t, t2d) = mappings(&ids, c.len());
            assert_eq!(t2d.len(), 500);
            assert_eq!(t2d.iter().filter(|&&b| b).count(), n);
            for (i, &t) in ids.iter().enumerate() {
                assert_eq!(d2t[i] + i as i64, i64::from(t));
                assert!(t2d[t as usize]);
            }
            // Every chosen count is at least every unchosen count.
            let min_in = ids.iter().map(|&i| c[i as usize]).min().unwrap();
            let max_out = (0..500u32)
                .filter(|i| !ids.contains(i))
                .map(|i| c[i as usize])
                .max()
                .unwrap_or(0);
            assert!(min_in >= max_out, "n={n}: {min_in} < {max_out}");
        }
        let (d2t, _) = mappings(&draft_ids(&c, 500), 500);
        assert!(
            d2t.iter().all(|&d| d == 0),
            "the whole vocabulary maps to itself"
        );
    }

    fn row(completion: Vec<u32>) -> ExportRow {
        prepare(
            ShardRow {
                id: "a".into(),
                dataset: "d".into(),
                prompt_token_ids: Some(vec![1, 1, 1]),
                completion_token_ids: Some(completion),
                finish_reason: "length".into(),
                ..ShardRow::default()
            },
            "".into(),
            None,
        )
    }

    /// Only completion ids are counted; a fixed vocabulary refuses an id past it, naming
    /// the row, and an unfixed one grows.
    #[test]
    fn counts_are_of_completion_ids_within_the_vocabulary() {
        let v = TargetVocab {
            size: 10,
            source: "test".into(),
        };
        let mut c = TokenCounts::new(Some(v), 0);
        c.add(&row(vec![2, 2, 9])).unwrap();
        assert_eq!(c.counts(), &counts(&[(2, 2), (9, 1)], 10)[..]);
        assert_eq!((c.rows(), c.tokens(), c.distinct()), (1, 3, 2));
        let err = format!("{:#}", c.add(&row(vec![10])).unwrap_err());
        assert!(err.contains("item `a`") && err.contains("10"), "{err}");
        let mut g = TokenCounts::new(None, 4);
        g.add(&row(vec![6])).unwrap();
        assert_eq!(g.counts().len(), 7);
    }

    /// The safetensors file holds the tensors with their dtypes and the metadata, as
    /// `safetensors` reads it back.
    #[test]
    fn safetensors_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v.safetensors");
        let (d2t, t2d) = mappings(&[1, 4], 6);
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        write_safetensors(
            &p,
            &[(D2T, Tensor::i64(&d2t)), (T2D, Tensor::bool(&t2d))],
            meta,
        )
        .unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(m.metadata().as_ref().unwrap()["k"], "v");
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let d = st.tensor(D2T).unwrap();
        assert_eq!((d.dtype(), d.shape()), (Dtype::I64, &[2][..]));
        let got: Vec<i64> = d
            .data()
            .chunks(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![1, 3]);
        let t = st.tensor(T2D).unwrap();
        assert_eq!(
            (t.dtype(), t.data()),
            (Dtype::BOOL, &[0, 1, 0, 0, 1, 0][..])
        );
    }
}
