//! `report`: one self-contained HTML page that shows what was generated, per dataset: row,
//! item, conversation and token counts, finish and stop reasons, and histograms of
//! completion lengths and of turns per conversation (inline SVG, each with its numbers in
//! a table beneath). The `hf` card shows the same sections in Markdown
//! ([`markdown_section`]), its pictures as files beside it.
//!
//! Invariants: the numbers are those of the rows the export kept ([`super::stats`]); the
//! page is written once, at the end, when the accounting is complete; every text from the
//! shards or the config is HTML-escaped.

use super::charts::histogram_svg;
use super::holdout::Holdout;
use super::stats::{histogram, label, Bucket, DatasetStats};
use super::{Accounting, ExportContext, ExportRow, Sink};
use crate::output::export::error::{Context, Result};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// At most this many bars in a histogram.
pub const BARS: usize = 24;

/// A dataset's two histograms: their bars and their pictures.
pub struct Pictures {
    pub lengths: Vec<Bucket>,
    pub turns: Vec<Bucket>,
    pub lengths_svg: String,
    pub turns_svg: String,
}

/// Draws the histograms of `s`.
pub fn pictures(s: &DatasetStats) -> Result<Pictures> {
    let lengths = histogram(&s.lengths, BARS);
    let turns = histogram(&s.turns, BARS);
    Ok(Pictures {
        lengths_svg: histogram_svg(
            &format!("{}: completion length", s.dataset),
            "completion tokens",
            "rows",
            &lengths,
        )?,
        turns_svg: histogram_svg(
            &format!("{}: turns per conversation", s.dataset),
            "generated turns",
            "conversations",
            &turns,
        )?,
        lengths,
        turns,
    })
}

/// `k1 n1, k2 n2` of a count table, or `0`.
fn reasons(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The bars as `value range | count` rows.
fn bars_table(b: &[Bucket], head: &str) -> String {
    let mut s = format!("| {head} | count |\n| --- | --- |\n");
    for x in b {
        let _ = writeln!(s, "| {} | {} |", label(x), x.count);
    }
    s
}

/// The card's section for one split: counts, reasons, and the two pictures (files
/// `images/<split>-completion-tokens.svg` and `images/<split>-turns.svg`) with their
/// numbers.
pub fn markdown_section(s: &DatasetStats, split: &str, p: &Pictures) -> String {
    let mean = if s.rows > 0 {
        s.completion_tokens as f64 / s.rows as f64
    } else {
        0.0
    };
    let mut out = format!("### `{split}`\n\n");
    out.push_str("| rows | items | conversations | prompt tokens | completion tokens | mean completion tokens |\n| --- | --- | --- | --- | --- | --- |\n");
    let _ = writeln!(
        out,
        "| {} | {} | {} | {} | {} | {mean:.1} |\n",
        s.rows, s.items, s.conversations, s.prompt_tokens, s.completion_tokens
    );
    let _ = writeln!(out, "- finish reasons: {}", reasons(&s.finish));
    let _ = writeln!(out, "- stop reasons: {}\n", reasons(&s.stop));
    if s.rows == 0 {
        return out;
    }
    let _ = writeln!(
        out,
        "![{split}: completion length](images/{split}-completion-tokens.svg)\n"
    );
    out.push_str(&bars_table(&p.lengths, "completion tokens"));
    let _ = writeln!(
        out,
        "\n![{split}: turns per conversation](images/{split}-turns.svg)\n"
    );
    out.push_str(&bars_table(&p.turns, "generated turns"));
    out.push('\n');
    out
}

/// `text` safe inside HTML.
pub fn escape(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            '\'' => s.push_str("&#39;"),
            c => s.push(c),
        }
    }
    s
}

/// The `report` writer.
pub struct ReportSink {
    path: PathBuf,
    ctx: ExportContext,
    holdout: Option<Holdout>,
    stats: Vec<DatasetStats>,
    /// Per dataset, its held-out rows (with `--holdout`).
    eval: Vec<DatasetStats>,
}

/// The `report` page (see the module doc).
pub fn sink(tmp: &Path, ctx: &ExportContext, holdout: Option<Holdout>) -> Result<Box<dyn Sink>> {
    Ok(Box::new(ReportSink {
        path: tmp.to_path_buf(),
        ctx: ctx.clone(),
        holdout,
        stats: Vec::new(),
        eval: Vec::new(),
    }))
}

impl ReportSink {
    fn page(&self, acc: &Accounting) -> Result<String> {
        let mut h = String::from("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>spool report</title>\n<style>body{font-family:sans-serif;max-width:960px;margin:2em auto;padding:0 1em}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}details{margin:.3em 0 1.2em}</style></head><body>\n");
        let _ = writeln!(
            h,
            "<h1>What was generated</h1>\n<p>Model <code>{}</code>; spool {}; datasets: {}.</p>",
            escape(&self.ctx.model),
            env!("CARGO_PKG_VERSION"),
            escape(&self.ctx.datasets.join(", "))
        );
        if let Some(ho) = &self.holdout {
            let _ = writeln!(
                h,
                "<p>Held out for evaluation (<code>--holdout {}</code>, whole items by id hash): counted apart below each dataset.</p>",
                ho.fraction()
            );
        }
        h.push_str("<h2>Rows kept</h2>\n<table><tr><th>dataset</th><th>rows read</th><th>kept</th><th>dropped</th><th>flagged</th></tr>\n");
        for d in &acc.datasets {
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&d.dataset),
                d.rows_in,
                d.kept,
                escape(&reasons(&d.dropped)),
                escape(&reasons(&d.flagged))
            );
        }
        h.push_str("</table>\n");
        for (i, s) in self.stats.iter().enumerate() {
            let _ = writeln!(h, "<h2>{}</h2>", escape(&s.dataset));
            h.push_str(&html_counts(s));
            if let Some(e) = self.eval.get(i).filter(|_| self.holdout.is_some()) {
                let _ = writeln!(
                    h,
                    "<p>Held out: {} row(s) of {} item(s) ({} completion tokens), not in the counts above.</p>",
                    e.rows, e.items, e.completion_tokens
                );
            }
            if s.rows == 0 {
                continue;
            }
            let p = pictures(s)?;
            for (svg, bars, head) in [
                (&p.lengths_svg, &p.lengths, "completion tokens"),
                (&p.turns_svg, &p.turns, "generated turns"),
            ] {
                h.push_str(svg);
                let _ = writeln!(
                    h,
                    "\n<details><summary>numbers</summary><table><tr><th>{head}</th><th>count</th></tr>"
                );
                for b in bars.iter() {
                    let _ = writeln!(h, "<tr><td>{}</td><td>{}</td></tr>", label(b), b.count);
                }
                h.push_str("</table></details>\n");
            }
        }
        h.push_str("</body></html>\n");
        Ok(h)
    }
}

/// A dataset's counts and reasons as HTML tables.
fn html_counts(s: &DatasetStats) -> String {
    let mut h = String::from("<table><tr><th>rows</th><th>items</th><th>conversations</th><th>prompt tokens</th><th>completion tokens</th></tr>\n");
    let _ = writeln!(
        h,
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr></table>",
        s.rows, s.items, s.conversations, s.prompt_tokens, s.completion_tokens
    );
    for (name, m) in [("finish reason", &s.finish), ("stop reason", &s.stop)] {
        let _ = write!(h, "<table><tr><th>{name}</th><th>rows</th></tr>");
        for (k, v) in m {
            let _ = write!(h, "<tr><td>{}</td><td>{v}</td></tr>", escape(k));
        }
        h.push_str("</table>\n");
    }
    h
}

impl Sink for ReportSink {
    fn begin_dataset(&mut self, name: &str) -> Result<()> {
        self.stats.push(DatasetStats::new(name));
        self.eval.push(DatasetStats::new(name));
        Ok(())
    }

    fn push(&mut self, row: &ExportRow) -> Result<()> {
        let held = self.holdout.is_some_and(|h| h.holds(row));
        let s = if held {
            &mut self.eval
        } else {
            &mut self.stats
        };
        s.last_mut().context("a row before its dataset")?.add(row);
        Ok(())
    }

    fn finish(mut self: Box<Self>, acc: &Accounting) -> Result<()> {
        for s in self.stats.iter_mut().chain(self.eval.iter_mut()) {
            s.end_item();
        }
        super::write_file(&self.path, self.page(acc)?.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text from outside cannot open a tag.
    #[test]
    fn escape_closes_every_door() {
        assert_eq!(
            escape("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
    }
}
