//! `--holdout F`: a held-out evaluation split, chosen by hashing each item's id.
//!
//! An item is held out when XXH64 (seed 1) of `dataset \0 id`, as a fraction of 2^64, is
//! below F. So the split is deterministic (the same shards give the same split, in every
//! form and on every machine; more rows later never move an item), per dataset (each
//! dataset holds out about F of its items), and whole conversations go one way: every
//! sample and turn of an item is on the same side.
//!
//! Invariant: a row goes to exactly one of the two outputs.

use super::{Accounting, ExportRow, Sink};
use crate::output::export::error::{ExportError, Result};
use std::path::{Path, PathBuf};

/// The held-out fraction, checked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Holdout {
    fraction: f64,
}

impl Holdout {
    /// A split holding out `fraction` of each dataset's items; it must be in (0, 1).
    pub fn new(fraction: f64) -> Result<Self> {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(ExportError::usage(format!(
                "--holdout {fraction}: must be a fraction between 0 and 1 (e.g. 0.02)"
            )));
        }
        Ok(Holdout { fraction })
    }

    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    /// Whether item `id` of `dataset` is held out.
    pub fn is_eval(&self, dataset: &str, id: &str) -> bool {
        let mut key = Vec::with_capacity(dataset.len() + 1 + id.len());
        key.extend_from_slice(dataset.as_bytes());
        key.push(0);
        key.extend_from_slice(id.as_bytes());
        let h = twox_hash::XxHash64::oneshot(1, &key);
        (h as f64) < self.fraction * 2f64.powi(64)
    }

    /// Whether `row` is held out.
    pub fn holds(&self, row: &ExportRow) -> bool {
        self.is_eval(&row.row.dataset, &row.row.id)
    }
}

/// Where the eval file of an export to `out` goes: `x.jsonl` → `x.eval.jsonl` (the last
/// extension kept), `x` → `x.eval`.
pub fn eval_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    let eval = match name.rsplit_once('.') {
        Some((stem, ext)) if !stem.is_empty() => format!("{stem}.eval.{ext}"),
        _ => format!("{name}.eval"),
    };
    out.with_file_name(eval)
}

/// Sends held-out rows to `eval`, the rest to `train`.
pub struct SplitSink {
    pub holdout: Holdout,
    pub train: Box<dyn Sink>,
    pub eval: Box<dyn Sink>,
}

impl Sink for SplitSink {
    fn begin_dataset(&mut self, name: &str) -> Result<()> {
        self.train.begin_dataset(name)?;
        self.eval.begin_dataset(name)
    }

    fn push(&mut self, row: &ExportRow) -> Result<()> {
        if self.holdout.holds(row) {
            self.eval.push(row)
        } else {
            self.train.push(row)
        }
    }

    fn finish(self: Box<Self>, accounting: &Accounting) -> Result<()> {
        self.train.finish(accounting)?;
        self.eval.finish(accounting)
    }
}

/// A sink that writes nothing: where held-out rows go for forms without an eval file
/// (a draft vocabulary is built from the training rows only).
pub struct Discard;

impl Sink for Discard {
    fn push(&mut self, _: &ExportRow) -> Result<()> {
        Ok(())
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split is a fixed function of (dataset, id), near the fraction asked, and
    /// independent between datasets; out-of-range fractions are refused.
    #[test]
    fn the_split_is_a_hash_of_dataset_and_id() {
        let h = Holdout::new(0.1).unwrap();
        let ids: Vec<String> = (0..20_000).map(|i| format!("q{i}")).collect();
        let a: Vec<bool> = ids.iter().map(|i| h.is_eval("a", i)).collect();
        let again: Vec<bool> = ids.iter().map(|i| h.is_eval("a", i)).collect();
        assert_eq!(a, again);
        let n = a.iter().filter(|&&x| x).count();
        assert!((1800..2200).contains(&n), "{n}");
        let b: Vec<bool> = ids.iter().map(|i| h.is_eval("b", i)).collect();
        assert_ne!(a, b, "each dataset has its own split");
        // A larger fraction holds out a superset.
        let wide = Holdout::new(0.3).unwrap();
        assert!(ids
            .iter()
            .all(|i| !h.is_eval("a", i) || wide.is_eval("a", i)));
        for bad in [0.0, 1.0, -0.1, f64::NAN] {
            assert!(Holdout::new(bad).is_err(), "{bad}");
        }
    }

    /// The eval file sits beside the train file with `.eval` before its extension.
    #[test]
    fn eval_files_sit_beside_the_train_file() {
        assert_eq!(
            eval_path(Path::new("/d/x.jsonl")),
            Path::new("/d/x.eval.jsonl")
        );
        assert_eq!(
            eval_path(Path::new("t.parquet")),
            Path::new("t.eval.parquet")
        );
        assert_eq!(eval_path(Path::new("/d/x")), Path::new("/d/x.eval"));
        assert_eq!(eval_path(Path::new("/d/.x")), Path::new("/d/.x.eval"));
    }
}
