//! Thinking in raw text: the markers a chat template wraps it in, and the split of a raw
//! completion into its reasoning and its answer (the token ids stay whole).
//!
//! Invariant: the split trims newlines exactly where Qwen3's template trims them when it
//! re-renders an assistant turn (`reasoning_content.strip('\n')`, `content.lstrip('\n')`),
//! so a reply split here and sent back as history renders as the model wrote it.

use super::ChatTemplate;

/// Marker pairs known in chat templates, tried in order; a template is taken to use a
/// pair when its source holds the close marker (templates whose generation prompt opens
/// the block, such as DeepSeek-R1's, may not write the open marker at all).
const KNOWN: &[(&str, &str)] = &[("<think>", "</think>"), ("◁think▷", "◁/think▷")];

/// The markers around a model's thinking (`<think>` / `</think>` for Qwen3 and
/// DeepSeek-R1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkMarkers {
    pub open: String,
    pub close: String,
}

impl ThinkMarkers {
    /// The markers `template` uses, if it has any.
    pub fn of_template(template: &ChatTemplate) -> Option<ThinkMarkers> {
        Self::of_source(template.source())
    }

    /// The markers a template source uses, if it has any.
    pub fn of_source(source: &str) -> Option<ThinkMarkers> {
        KNOWN
            .iter()
            .find(|(_, close)| source.contains(close))
            .map(|(open, close)| ThinkMarkers {
                open: (*open).to_owned(),
                close: (*close).to_owned(),
            })
    }

    /// (reasoning, answer) of a raw completion. Thinking cut off before its close marker
    /// is all reasoning; a completion without markers is all answer.
    ///
    /// With a close marker, the reasoning is what precedes the first close marker (after
    /// the last open marker before it, as Qwen3's template takes it), and the answer is
    /// everything after that first close marker: an answer that itself mentions the close
    /// marker keeps it (Qwen3's template would cut at the last one).
    pub fn split(&self, text: &str) -> (Option<String>, String) {
        match text.find(&self.close) {
            Some(at) => {
                let before = &text[..at];
                let thinking = match before.rfind(&self.open) {
                    Some(o) => &before[o + self.open.len()..],
                    None => before,
                };
                let answer = &text[at + self.close.len()..];
                (
                    Some(thinking.trim_matches('\n').to_owned()),
                    answer.trim_start_matches('\n').to_owned(),
                )
            }
            None => match text.find(&self.open) {
                Some(o) => (
                    Some(text[o + self.open.len()..].trim_matches('\n').to_owned()),
                    String::new(),
                ),
                None => (None, text.to_owned()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};
    use std::path::Path;

    fn qwen3() -> ChatTemplate {
        ChatTemplate::from_file(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tokenizers/qwen3/tokenizer_config.json"),
        )
        .unwrap()
    }

    fn markers() -> ThinkMarkers {
        ThinkMarkers::of_template(&qwen3()).unwrap()
    }

    /// Qwen3's template is found to use `<think>`/`</think>`; a template without them has
    /// no markers; a DeepSeek-R1-style template that only writes the close marker (its
    /// generation prompt opens the block) still gets the pair.
    #[test]
    fn markers_are_found_in_templates() {
        assert_eq!(
            markers(),
            ThinkMarkers {
                open: "<think>".into(),
                close: "</think>".into()
            }
        );
        assert_eq!(
            ThinkMarkers::of_source("{% for m in messages %}{{ m.content }}{% endfor %}"),
            None
        );
        let r1 = "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}";
        assert_eq!(ThinkMarkers::of_source(r1).unwrap().open, "<think>");
    }

    /// The four shapes of a raw completion: open…close, close only, open cut off, none.
    #[test]
    fn the_four_shapes_split() {
        let m = markers();
        assert_eq!(
            m.split("<think>\nplan a\nplan b\n</think>\n\nThe answer."),
            (Some("plan a\nplan b".into()), "The answer.".into())
        );
        assert_eq!(
            m.split("\nalready open\n</think>\n\nYes."),
            (Some("already open".into()), "Yes.".into())
        );
        assert_eq!(
            m.split("<think>\nhalf a thou"),
            (Some("half a thou".into()), String::new())
        );
        assert_eq!(m.split("plain\n"), (None, "plain\n".into()));
        // An answer that mentions the close marker keeps it.
        assert_eq!(
            m.split("<think>x</think>\nuse </think> to close"),
            (Some("x".into()), "use </think> to close".into())
        );
    }

    /// A reply split here and sent back as an assistant turn with `reasoning_content`
    /// renders, in Qwen3's template, exactly as the raw text does (the template's own
    /// split of `content`), so the history the model sees is what it wrote.
    #[test]
    fn a_split_reply_re_renders_as_the_raw_text() {
        let t = qwen3();
        let raw = "<think>\n\nstep one\nstep two\n\n</think>\n\n\nFinal.";
        let (reasoning, answer) = markers().split(raw);
        let user = json!({"role": "user", "content": "q"});
        let as_raw = json!([user, {"role": "assistant", "content": raw}]);
        let as_split = json!([user, {"role": "assistant", "content": answer,
            "reasoning_content": reasoning.unwrap()}]);
        let none = Map::new();
        let a = t.render(&as_raw, false, &none).unwrap();
        let b = t.render(&as_split, false, &none).unwrap();
        assert!(
            a.contains("<think>\nstep one\nstep two\n</think>\n\nFinal."),
            "{a}"
        );
        assert_eq!(a, b);
    }
}
