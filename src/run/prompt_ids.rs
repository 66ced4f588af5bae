//! The prompt ids a finished generation keeps, and who made them (the shard column
//! `prompt_ids_source`).
//!
//! With `api = "chat"` the server renders the prompt itself, so the ids it answers with
//! (vLLM's `prompt_token_ids` for `return_token_ids`, SGLang's for
//! `return_prompt_token_ids`) are the prompt the model saw: they are kept, marked
//! `server`. Where spool rendered the prompt too, the two are compared — its ids against
//! the server's, or, when the server returns none, its count against `usage.prompt_tokens`
//! — and a disagreement is counted in `spool_prompt_token_disagreements_total` and logged
//! the first time for each dataset: spool's template is not the server's, and ids kept
//! from it would be off-policy. Other APIs send spool's ids (or the server's, rendered at
//! intake), which are kept as they are.

use crate::observe::metrics::DatasetMetrics;
use crate::prompt::remote::IdsSource;
use std::sync::atomic::Ordering;

/// What a generation's prompt was, on spool's side and the server's.
pub(crate) struct Sides {
    /// The ids spool sent or rendered, and who made them.
    pub ours: Option<Vec<u32>>,
    pub ours_from: Option<IdsSource>,
    /// `ours` is a chat rendering (a `prompt` row's ids encode its bare text, which the
    /// chat API wraps in a user turn: not comparable).
    pub chat_rendered: bool,
    /// The chat answer's prompt ids, and its `usage.prompt_tokens`.
    pub theirs: Option<Vec<u32>>,
    pub usage: Option<u32>,
}

/// Where they disagree, said for the log: `None` when they agree or cannot be compared.
fn disagreement(s: &Sides) -> Option<String> {
    let ours = s
        .ours
        .as_ref()
        .filter(|_| s.ours_from == Some(IdsSource::Client) && s.chat_rendered)?;
    match (&s.theirs, s.usage) {
        (Some(theirs), _) if theirs != ours => {
            let at = ours.iter().zip(theirs).take_while(|(a, b)| a == b).count();
            Some(format!(
                "the server's prompt ids differ from spool's from token {at} ({} against spool's {})",
                theirs.len(),
                ours.len()
            ))
        }
        (Some(_), _) => None,
        (None, Some(n)) if n as usize != ours.len() => Some(format!(
            "the server counts {n} prompt tokens, spool's rendering {}",
            ours.len()
        )),
        (None, _) => None,
    }
}

/// The ids a chat row keeps and who made them; counts (and the first time logs) a
/// disagreement with spool's rendering. For other APIs, `ours` as it is.
pub(crate) fn settle(
    chat: bool,
    dm: &DatasetMetrics,
    dataset: &str,
    row: u64,
    sides: Sides,
) -> (Option<Vec<u32>>, Option<IdsSource>) {
    if !chat {
        return (sides.ours, sides.ours_from);
    }
    if let Some(why) = disagreement(&sides) {
        dm.prompt_disagreements.inc();
        if !dm.disagreement_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(dataset = %dataset, row, detail = %why,
                "the server rendered this prompt differently from spool's template: the shards keep the server's ids where it returns them; further disagreements are counted in spool_prompt_token_disagreements_total (see the start-up template check, or set [tokenizer] source = \"server\")");
        }
    }
    match sides.theirs {
        Some(ids) => (Some(ids), Some(IdsSource::Server)),
        None => (sides.ours, sides.ours_from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::metrics::Metrics;

    fn sides(
        ours: Option<Vec<u32>>,
        from: Option<IdsSource>,
        theirs: Option<Vec<u32>>,
        usage: Option<u32>,
    ) -> Sides {
        Sides {
            ours,
            ours_from: from,
            chat_rendered: true,
            theirs,
            usage,
        }
    }

    /// A chat answer's ids are kept as the server's; without them spool's stay spool's;
    /// a disagreement (ids, or the count when the server returns no ids) is counted once
    /// per answer, agreement and rows spool did not render are not.
    #[test]
    fn chat_rows_keep_the_servers_ids_and_count_disagreements() {
        let m = Metrics::new();
        let dm = m.dataset("a");
        let c = Some(IdsSource::Client);
        let got = settle(
            true,
            &dm,
            "a",
            0,
            sides(Some(vec![1, 2]), c, Some(vec![1, 2]), Some(2)),
        );
        assert_eq!(got, (Some(vec![1, 2]), Some(IdsSource::Server)));
        assert_eq!(dm.prompt_disagreements.get(), 0);
        let got = settle(
            true,
            &dm,
            "a",
            1,
            sides(Some(vec![1, 2]), c, Some(vec![1, 3]), None),
        );
        assert_eq!(got, (Some(vec![1, 3]), Some(IdsSource::Server)));
        assert_eq!(dm.prompt_disagreements.get(), 1);
        let got = settle(true, &dm, "a", 2, sides(Some(vec![1, 2]), c, None, Some(3)));
        assert_eq!(got, (Some(vec![1, 2]), Some(IdsSource::Client)));
        assert_eq!(dm.prompt_disagreements.get(), 2);
        settle(true, &dm, "a", 3, sides(Some(vec![1, 2]), c, None, Some(2)));
        settle(true, &dm, "a", 4, sides(None, None, None, Some(9)));
        let server = Some(IdsSource::Server);
        settle(
            true,
            &dm,
            "a",
            5,
            sides(Some(vec![1]), server, None, Some(9)),
        );
        assert_eq!(dm.prompt_disagreements.get(), 2);
        assert!(dm.disagreement_warned.load(Ordering::Relaxed));
        let got = settle(
            false,
            &dm,
            "a",
            6,
            sides(Some(vec![1]), c, Some(vec![2]), Some(5)),
        );
        assert_eq!(got, (Some(vec![1]), c));
        // A plain prompt's ids (its bare text) are not compared with the chat rendering.
        let plain = Sides {
            chat_rendered: false,
            ..sides(Some(vec![1]), c, None, Some(5))
        };
        assert_eq!(settle(true, &dm, "a", 7, plain), (Some(vec![1]), c));
        assert_eq!(dm.prompt_disagreements.get(), 2);
    }
}
