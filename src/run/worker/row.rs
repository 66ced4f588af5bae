//! A generation made into its shard row: thinking and tool calls split out of raw text by
//! the run's [`RunSyntax`], the prompt's and completion's ids settled, the stop reason and
//! timings recorded.
//!
//! Invariant: the split reads the text the server's own parsers would read (for families
//! whose markers are special tokens, the ids decoded with them kept, less a final stop
//! token); the item and the generation move into the row, never copied.

use super::request::Prepared;
use super::Ctx;
use crate::config::{Api, Reasoning};
use crate::prompt::syntax::Syntax;
use crate::run::scheduler::Lease;
use crate::store::row::ShardRow;
use crate::upstream::{CountSource, Generation};
use std::time::SystemTime;

/// A run's [`Syntax`] with the stop-token ids its split drops from the end of the ids.
pub(crate) struct RunSyntax {
    pub(crate) syntax: Syntax,
    /// End-of-turn ids a server's output ids end with (the matched stop token), dropped
    /// before the ids are decoded for the split, as SGLang's detokenizer drops them.
    stop_ids: Vec<u32>,
}

impl RunSyntax {
    /// The stop ids of `syntax`'s family in `tokenizer`'s vocabulary. gpt-oss keeps its
    /// `<|call|>`: SGLang leaves it in the text for its tool parser.
    pub(crate) fn new(syntax: Syntax, tokenizer: Option<&crate::prompt::Tokenizer>) -> RunSyntax {
        let mut stop_ids = Vec::new();
        if let (Some(f), Some(t)) = (syntax.family(), tokenizer) {
            let (end, after_call) = f.end_of_turn();
            let keep_call = f == crate::prompt::syntax::Family::GptOss;
            // The families' other end-of-sequence tokens (GLM's and Qwen's `<|endoftext|>`,
            // Kimi's `[EOS]`) end a reply too.
            let others = [Some("<|endoftext|>"), Some("[EOS]")];
            for tok in [Some(end), after_call.filter(|_| !keep_call)]
                .into_iter()
                .chain(others)
                .flatten()
            {
                stop_ids.extend(t.token_to_id(tok));
            }
        }
        RunSyntax { syntax, stop_ids }
    }

    /// The text the split reads: the server's, or for families whose markers are special
    /// tokens, the completion's ids decoded with special tokens kept (less a final stop
    /// token), as SGLang's chat server decodes them for its parsers.
    pub(super) fn text_of<'a>(
        &self,
        text: &'a str,
        ids: Option<&[u32]>,
        tok: Option<&crate::prompt::Tokenizer>,
    ) -> std::borrow::Cow<'a, str> {
        let (Some(ids), Some(tok), true) = (ids, tok, self.syntax.reads_token_text()) else {
            return text.into();
        };
        let ids = match ids.split_last() {
            Some((last, rest)) if self.stop_ids.contains(last) => rest,
            _ => ids,
        };
        tok.decode(ids).map_or(text.into(), Into::into)
    }
}

/// The shard row of a generation. Takes the item and the generation by value: their
/// strings and ids move into the row instead of being copied (one row per completion is
/// the hot path of a fast server).
pub(crate) fn to_row(
    ctx: &Ctx,
    lease: &Lease,
    id: String,
    req: Prepared,
    g: Generation,
    attempts: u32,
    turn: u32,
) -> (ShardRow, CountSource) {
    ctx.faults.row.panic_if_due();
    let tok = ctx.builder.tokenizer();
    let server_ids = g.token_ids.is_some();
    // The ids cover everything generated, thinking included: the raw text is encoded
    // whole. Thinking a server's parser split off cannot be put back byte for byte, so
    // then no ids are made up (only counted: the thinking's and the answer's).
    let completion_ids = match (g.token_ids, tok, &g.reasoning) {
        (Some(ids), _, _) => Some(ids),
        (None, Some(t), None) => t.encode(&g.text, false).ok(),
        (None, _, _) => None,
    };
    let split_count = match (&g.reasoning, tok) {
        (Some(r), Some(t)) if !server_ids => t
            .encode(r, false)
            .ok()
            .zip(t.encode(&g.text, false).ok())
            .map(|(a, b)| (a.len() + b.len()) as u32),
        _ => None,
    };
    let (completion_tokens, source) = match (g.completion_tokens, server_ids, tok) {
        (Some(n), _, _) => (n, CountSource::Server),
        (None, true, _) => (
            completion_ids.as_ref().map_or(0, |i| i.len() as u32),
            CountSource::TokenIds,
        ),
        (None, false, Some(_)) => (
            completion_ids
                .as_ref()
                .map(|i| i.len() as u32)
                .or(split_count)
                .unwrap_or(g.chunks),
            CountSource::Tokenizer,
        ),
        (None, false, None) => (g.chunks, CountSource::Chunks),
    };
    let (prompt_token_ids, prompt_ids_source) = crate::run::prompt_ids::settle(
        ctx.cfg.server.api == Api::Chat,
        &ctx.dmetrics[lease.lane],
        &ctx.names[lease.lane],
        lease.row,
        crate::run::prompt_ids::Sides {
            chat_rendered: req.messages.is_some(),
            ours: req.prompt_ids,
            ours_from: req.ids_from,
            theirs: g.prompt_token_ids,
            usage: g.prompt_tokens,
        },
    );
    let prompt_tokens = g
        .prompt_tokens
        .or_else(|| prompt_token_ids.as_ref().map(|i| i.len() as u32))
        .unwrap_or(0);
    let completed_at_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    // Thinking the server split off is kept as sent; raw text is split by the run's
    // syntax unless the dataset keeps it raw.
    let syntax = &ctx.syntax.syntax;
    let mode = ctx.gens[lease.lane].reasoning;
    let splits = g.reasoning.is_none()
        && g.tool_calls.is_none()
        && (syntax.reasoning.is_some() || (syntax.tools.is_some() && req.tools.is_some()))
        && mode != Reasoning::Raw;
    let raw = if splits {
        ctx.syntax
            .text_of(&g.text, completion_ids.as_deref(), tok)
            .into_owned()
    } else {
        g.text
    };
    let (reasoning, completion) = match (g.reasoning, &syntax.reasoning) {
        (Some(r), _) => (Some(r), raw),
        (None, Some(r)) if mode == Reasoning::Save => {
            r.split(&raw, &req.prompt, &req.draw.chat_template_kwargs)
        }
        (None, _) => (None, raw),
    };
    // Calls a server's parser did not take out are taken out of raw text when tools were
    // offered and the syntax has a parser for them.
    let offered = req.tools.as_ref().and_then(|t| t.as_array());
    let (completion, tool_calls) = match (g.tool_calls, syntax.tools, offered) {
        (Some(t), _, _) => (completion, Some(t)),
        (None, Some(parser), Some(tools)) if mode != Reasoning::Raw => {
            parser.split(&completion, tools)
        }
        (None, _, _) => (completion, None),
    };
    let stop_reason = crate::run::ending::stop_reason(
        &g.finish_reason,
        &g.matched,
        req.draw.sampling.stop.as_deref().unwrap_or_default(),
    );
    let sampling = Some(req.draw.record).filter(|r| r != "{}");
    (
        ShardRow {
            id,
            dataset: ctx.names[lease.lane].clone(),
            row: lease.row,
            prompt: req.prompt,
            messages: req.messages_text,
            prompt_token_ids,
            completion,
            completion_token_ids: completion_ids,
            prompt_tokens,
            completion_tokens,
            finish_reason: g.finish_reason,
            model: ctx.cfg.server.model.clone(),
            attempts,
            latency_ms: g.latency_ms,
            ttft_ms: g.ttft_ms,
            completed_at_ms,
            sample: lease.sample,
            turn,
            reasoning,
            tool_calls: tool_calls.map(|t| t.to_string()),
            tools: req.tools_text,
            sampling,
            partial: None,
            prompt_ids_source,
            stop_reason,
        },
        source,
    )
}
