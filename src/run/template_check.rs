//! The start-up template check (`[tokenizer] template_check`): a few rows of each dataset
//! rendered by spool and by the server, compared id for id, before intake and before any
//! generation.
//!
//! Which rows: `input::intake::sample_rows` — among a dataset's first 2,000 lines, its
//! first three good rows and then the first with each of tools, a system prompt, an
//! earlier assistant turn, a tool result and reasoning in an earlier turn: at most 8,
//! each as intake would render it.
//!
//! What counts as a difference: the ids differ (the first differing token and character
//! are shown, with both renderings around them); or spool cannot render a row the server
//! renders (intake would reject it). A row the server refuses is not compared (logged).
//! Texts are compared only where ids are missing: llama.cpp's text loses a leading BOS
//! that its ids keep.
//!
//! What a difference does: `true` (the default with `source = "client"`) stops the run
//! with exit 2 before anything is enqueued, so no row is taken in with ids the model was
//! not trained on; `"warn"` (the default with `source = "server"`, where spool's
//! rendering is sent nowhere) logs the same and goes on.

use crate::config::{Config, DatasetConfig, TemplateCheck};
use crate::error::{Error, Kind};
use crate::input::intake::{sample_rows, IntakeOptions, SampledRow};
use crate::prompt::remote::{RemoteError, RemoteRenderer};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use std::fmt::Write as _;
use std::sync::Arc;

/// Characters of text shown on each side of the first difference.
const TEXT_AROUND: usize = 60;
/// Token ids shown on each side of the first difference.
const IDS_AROUND: usize = 8;

/// What the check found.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Rows rendered by both and compared.
    pub compared: usize,
    /// The differences, described for the user (dataset, row, positions, renderings).
    pub differences: Vec<String>,
    /// Rows the server refused, and why.
    pub refused: Vec<String>,
}

/// Runs the check over every dataset (`options` gives a dataset's intake options) and
/// acts on what it finds: `Ok` to go on, an exit-2 error to stop.
pub async fn run(
    cfg: &Config,
    builder: &Arc<PromptBuilder>,
    renderer: &dyn RemoteRenderer,
    mode: TemplateCheck,
    options: impl Fn(&DatasetConfig) -> IntakeOptions,
) -> Result<CheckReport, Error> {
    let mut report = CheckReport::default();
    if mode == TemplateCheck::Off {
        return Ok(report);
    }
    for d in &cfg.datasets {
        let (d2, b, opts) = (d.clone(), builder.clone(), options(d));
        let rows = tokio::task::spawn_blocking(move || sample_rows(&d2, &b, &opts))
            .await
            .map_err(Error::runtime)??;
        let before = report.compared;
        for row in &rows {
            compare(&d.name, row, builder, renderer, &mut report).await?;
        }
        tracing::debug!(dataset = %d.name, rows = report.compared - before, "template check: rows compared");
    }
    for r in &report.refused {
        tracing::warn!("template check: {r}");
    }
    if report.differences.is_empty() {
        if report.compared > 0 {
            tracing::info!(rows = report.compared, datasets = cfg.datasets.len(), server = %renderer.describe(),
                "template check passed: spool renders these rows exactly as the server does, id for id");
        } else {
            tracing::info!(
                "template check: no row to compare (no row spool renders, or every one refused)"
            );
        }
        return Ok(report);
    }
    let mut text = format!(
        "template check: spool's rendering differs from the server's on {} of {} row(s) compared ({})\n",
        report.differences.len(),
        report.compared,
        renderer.describe()
    );
    for d in &report.differences {
        text.push_str(d);
        text.push('\n');
    }
    text.push_str(
        "Fix the chat template (`tokenizer.chat_template`), or send the server's rendering \
         (`[tokenizer] source = \"server\"`), or go on regardless (`template_check = \"warn\"`).",
    );
    match mode {
        TemplateCheck::Warn => {
            tracing::warn!("{text}");
            Ok(report)
        }
        _ => Err(Error::new(Kind::Usage, anyhow::anyhow!(text))),
    }
}

/// Renders one row both ways and records what it finds.
async fn compare(
    dataset: &str,
    row: &SampledRow,
    builder: &PromptBuilder,
    renderer: &dyn RemoteRenderer,
    report: &mut CheckReport,
) -> Result<(), Error> {
    let name = format!(
        "dataset `{dataset}`, row {} (line {}, id `{}`)",
        row.line.saturating_sub(1),
        row.line,
        row.id
    );
    let server = match renderer.render(&row.input).await {
        Ok(b) => b,
        Err(RemoteError::Refused(why)) => {
            report
                .refused
                .push(format!("{name}: the server refused it: {why}"));
            return Ok(());
        }
        Err(RemoteError::Unavailable(why)) => {
            return Err(Error::new(
                Kind::Runtime,
                anyhow::anyhow!("template check: the server did not render {name}: {why}"),
            ))
        }
    };
    report.compared += 1;
    match row.input.build(builder) {
        Ok(ours) => {
            if let Some(d) = difference(&ours, &server) {
                report.differences.push(format!("{name}:\n{d}"));
            }
        }
        Err(e) => report.differences.push(format!(
            "{name}: spool cannot render it ({e}); the server can, so intake would reject it"
        )),
    }
    Ok(())
}

/// How `ours` differs from `theirs`, said for the user; `None` when they agree.
pub fn difference(ours: &BuiltPrompt, theirs: &BuiltPrompt) -> Option<String> {
    let ids_differ = match (&ours.token_ids, &theirs.token_ids) {
        (Some(a), Some(b)) => Some(a != b),
        _ => None,
    };
    if !ids_differ.unwrap_or(ours.text != theirs.text) {
        return None;
    }
    let mut s = String::new();
    let at_char = first_difference(
        &ours.text.chars().collect::<Vec<_>>(),
        &theirs.text.chars().collect::<Vec<_>>(),
    );
    match (&ours.token_ids, &theirs.token_ids) {
        (Some(a), Some(b)) => {
            let at = first_difference(a, b).unwrap_or(a.len().min(b.len()));
            let _ = writeln!(
                s,
                "  first difference at token {at} (spool {} tokens, the server {}); in the text at character {}",
                a.len(),
                b.len(),
                at_char.map_or("- (the texts are equal)".to_string(), |c| c.to_string()),
            );
            let _ = writeln!(s, "  spool ids:   {}", window_ids(a, at));
            let _ = writeln!(s, "  server ids:  {}", window_ids(b, at));
        }
        _ => {
            let _ = writeln!(
                s,
                "  first difference in the text at character {}",
                at_char.unwrap_or(0)
            );
        }
    }
    if let Some(c) = at_char {
        let _ = writeln!(s, "  spool text:  {}", window_text(&ours.text, c));
        let _ = writeln!(s, "  server text: {}", window_text(&theirs.text, c));
    }
    Some(s.trim_end().to_string())
}

/// The first index where `a` and `b` differ (the shorter one's length when one is a
/// prefix of the other); `None` when they are equal.
fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(a.iter().zip(b).take_while(|(x, y)| x == y).count())
}

/// The ids around `at`, with `…` where cut, and the first differing one marked.
fn window_ids(ids: &[u32], at: usize) -> String {
    let at = at.min(ids.len());
    let from = at.saturating_sub(IDS_AROUND);
    let to = (at + IDS_AROUND).min(ids.len());
    let mut s = String::new();
    if from > 0 {
        s.push_str("… ");
    }
    s.push('[');
    for (i, id) in ids[from..to].iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        if from + i == at {
            s.push_str(">>");
        }
        let _ = write!(s, "{id}");
    }
    if at == ids.len() {
        s.push_str(if ids.is_empty() {
            ">>(end)"
        } else {
            ", >>(end)"
        });
    }
    s.push(']');
    if to < ids.len() {
        s.push_str(" …");
    }
    s
}

/// The text around character `at`, quoted with escapes (newlines visible), the first
/// differing character after `>>`.
fn window_text(text: &str, at: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    let at = at.min(chars.len());
    let from = at.saturating_sub(TEXT_AROUND);
    let to = (at + TEXT_AROUND).min(chars.len());
    let before: String = chars[from..at].iter().collect();
    let after: String = chars[at..to].iter().collect();
    format!(
        "{}{:?} >> {:?}{}",
        if from > 0 { "…" } else { "" },
        before,
        after,
        if to < chars.len() { "…" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(text: &str, ids: Option<Vec<u32>>) -> BuiltPrompt {
        BuiltPrompt {
            text: text.into(),
            token_ids: ids,
        }
    }

    /// Equal ids agree whatever the texts (llama.cpp's text lacks the BOS its ids have);
    /// differing ids name the first differing token and character and show both sides
    /// around them, newlines escaped.
    #[test]
    fn differences_name_the_first_token_and_character() {
        let a = built("<s>hi\nthere", Some(vec![1, 5, 6, 7]));
        assert_eq!(
            difference(&a, &built("hi\nthere", Some(vec![1, 5, 6, 7]))),
            None
        );
        let b = built("<s>hi\nwhere", Some(vec![1, 5, 6, 9]));
        let d = difference(&a, &b).unwrap();
        assert!(d.contains("token 3 (spool 4 tokens, the server 4)"), "{d}");
        assert!(d.contains("character 6"), "{d}");
        assert!(d.contains("spool ids:   [1, 5, 6, >>7]"), "{d}");
        assert!(d.contains("server ids:  [1, 5, 6, >>9]"), "{d}");
        assert!(d.contains(r#"spool text:  "<s>hi\n" >> "there""#), "{d}");
        assert!(d.contains(r#"server text: "<s>hi\n" >> "where""#), "{d}");
        // One a prefix of the other: the difference is where the shorter one ends.
        let c = built("<s>hi\nthere!", Some(vec![1, 5, 6, 7, 8]));
        let d = difference(&a, &c).unwrap();
        assert!(d.contains("token 4 (spool 4 tokens, the server 5)"), "{d}");
        assert!(d.contains("[1, 5, 6, 7, >>(end)]"), "{d}");
        // Without ids, texts are compared.
        assert!(difference(&built("a", None), &built("a", None)).is_none());
        assert!(difference(&built("ab", None), &built("ac", None))
            .unwrap()
            .contains("character 1"));
    }

    /// Long renderings are cut around the difference, with `…` where cut.
    #[test]
    fn long_renderings_are_shown_around_the_difference() {
        let ids: Vec<u32> = (0..100).collect();
        let mut other = ids.clone();
        other[50] = 7;
        let w = window_ids(&ids, 50);
        assert_eq!(
            w,
            "… [42, 43, 44, 45, 46, 47, 48, 49, >>50, 51, 52, 53, 54, 55, 56, 57] …"
        );
        let text = "x".repeat(200) + "Y" + &"z".repeat(200);
        let w = window_text(&text, 200);
        assert!(w.starts_with('…') && w.ends_with('…'), "{w}");
        assert!(w.contains(" >> \"Yzz"), "{w}");
        assert_eq!(w.matches('x').count(), TEXT_AROUND);
    }
}
