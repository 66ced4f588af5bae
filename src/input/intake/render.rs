//! How a dataset's rows become prompts: the parser and the [`Render`] settings fixed per
//! dataset (filter, template variables, turns, who renders), and the plan of one row's
//! prompt before it is rendered.
//!
//! Invariant: a row's id and content hash stay the row's own whatever shape it is taken in
//! as (a `prompt` row as one user turn); `prompt_format = "chat"` with nothing to render a
//! chat row is refused for the dataset, never row by row.

use super::{IntakeError, IntakeOptions, ItemFilter};
use crate::config::{DatasetConfig, HistoryReasoning, PromptFormat, Sampling, Turns};
use crate::input::dataset::DatasetReader;
use crate::input::row::{Input, Parser, Row};
use crate::prompt::conversation::Conversation;
use crate::prompt::draw::Drawer;
use crate::prompt::remote::{IdsSource, RemoteRenderer, RenderInput};
use crate::prompt::{BuiltPrompt, PromptBuilder};
use serde_json::{Map, Value};
use std::sync::Arc;

/// How the workers render a row's prompt: the same for every row of a dataset.
pub(super) struct Render {
    /// The dataset's name and the partition's filter ([`IntakeOptions::filter`]).
    pub(super) dataset: String,
    pub(super) filter: Option<ItemFilter>,
    /// See [`IntakeOptions::server_templates`].
    pub(super) server_templates: bool,
    pub(super) turns: Turns,
    /// The dataset's template variables that every generation gets (`enable_thinking =
    /// false` for `reasoning = "disable"`); a row's `tools` are added to them.
    pub(super) kwargs: Map<String, Value>,
    /// See [`IntakeOptions::server`].
    pub(super) server: Option<Arc<dyn RemoteRenderer>>,
    /// A `prompt` row is taken in as one user turn (`prompt_format = "chat"`, the default
    /// where a chat template renders prompts): rendered, stored and shown as a chat row.
    pub(super) prompts_as_chat: bool,
}

/// What a row's prompt is, before it is rendered.
pub(super) enum Planned {
    /// Rendered by spool's builder, or the server.
    Input(RenderInput),
    /// Sent as the messages themselves, unrendered (`api = "chat"` without a template).
    AsIs(BuiltPrompt),
}

impl Render {
    /// The row as intake takes it in: a `prompt` row as one user turn when prompts go in
    /// chat form. Its id and content hash stay the row's own.
    pub(super) fn shaped(&self, mut row: Row) -> Row {
        if let (true, Input::Prompt(p)) = (self.prompts_as_chat, &mut row.input) {
            let text = std::mem::take(p);
            row.input = Input::Messages(Value::Array(vec![
                serde_json::json!({"role": "user", "content": text}),
            ]));
        }
        row
    }

    /// What one row's prompt is made of: its messages (turn 0's request with `turns =
    /// "all"`) with the dataset's fixed variables and the row's tools, or its text.
    pub(super) fn plan(
        &self,
        builder: &PromptBuilder,
        row: &Row,
        server: bool,
    ) -> Result<Planned, String> {
        let m = match &row.input {
            Input::Prompt(p) => {
                if row.tools.is_some() {
                    return Err("`tools` needs `messages` or `conversations` (a `prompt` is                                 sent as is, with no template to put them in)"
                        .into());
                }
                // The chat API renders it as a user turn: ids of the bare text would not
                // be what the model saw.
                if self.server_templates && !builder.has_template() && !server {
                    return Ok(Planned::AsIs(BuiltPrompt {
                        text: p.clone(),
                        token_ids: None,
                    }));
                }
                return Ok(Planned::Input(RenderInput::text(builder, p)));
            }
            Input::Messages(m) => m,
        };
        let first;
        let messages = match self.turns {
            Turns::Last => m,
            Turns::All => {
                let c = Conversation::new(m.as_array().cloned().unwrap_or_default());
                if c.turns() == 0 {
                    return Err("the conversation has no assistant turn to generate (no                                 assistant message, and it does not end with a user or tool                                 message)"
                        .into());
                }
                first = Value::Array(c.request(0, &[], HistoryReasoning::Drop)?);
                &first
            }
        };
        if self.server_templates && !builder.has_template() && !server {
            return Ok(Planned::AsIs(BuiltPrompt {
                text: messages.to_string(),
                token_ids: None,
            }));
        }
        let mut kwargs = self.kwargs.clone();
        if let Some(tools) = &row.tools {
            kwargs.insert("tools".into(), tools.clone());
        }
        Ok(Planned::Input(RenderInput::Chat {
            messages: messages.clone(),
            kwargs,
        }))
    }

    /// The prompt of one row rendered by spool's builder, and who made its ids.
    pub(super) fn build(
        &self,
        builder: &PromptBuilder,
        row: &Row,
    ) -> Result<(BuiltPrompt, Option<IdsSource>), String> {
        let built = match self.plan(builder, row, false)? {
            Planned::AsIs(b) => b,
            Planned::Input(i) => i.build(builder).map_err(|e| e.to_string())?,
        };
        let from = built.token_ids.as_ref().map(|_| IdsSource::Client);
        Ok((built, from))
    }
}

/// The parser and the renderer of `d`'s rows, as `opts` sets them; chat rows are
/// rendered by the server with `source = "server"`, else by `builder`'s template.
/// `prompt_format = "chat"` with nothing to render a chat row is refused.
pub(super) fn stage(
    reader: &DatasetReader,
    d: &DatasetConfig,
    opts: &IntakeOptions,
    builder: &PromptBuilder,
) -> Result<(Parser, Render), IntakeError> {
    let renders_chat = match &opts.server {
        Some(server) => server.renders_chat(),
        None => builder.has_template(),
    };
    let prompts_as_chat = match opts.generation.prompt_format {
        Some(PromptFormat::Raw) => false,
        Some(PromptFormat::Chat) if !renders_chat && !opts.server_templates => {
            return Err(IntakeError::Generation {
                dataset: d.name.clone(),
                detail: "prompt_format = \"chat\" needs a chat template to render a prompt as a user turn ([tokenizer] chat_template, or a model folder holding one; with source = \"server\", a server that renders chat messages)".into(),
            })
        }
        // The chat API sends a prompt as one user turn itself.
        Some(PromptFormat::Chat) | None => renders_chat,
    };
    let turns = opts.generation.turns;
    let parser = reader
        .parser()
        .whole_conversations(turns == Turns::All)
        .samples(opts.generation.samples);
    let kwargs = Drawer::new(
        &Sampling::default(),
        &opts.generation.chat_template_kwargs,
        opts.generation.reasoning,
    )
    .map_err(|detail| IntakeError::Generation {
        dataset: d.name.clone(),
        detail,
    })?
    .fixed_kwargs();
    let render = Render {
        dataset: d.name.clone(),
        filter: opts.filter.clone(),
        server_templates: opts.server_templates,
        turns,
        kwargs,
        server: opts.server.clone(),
        prompts_as_chat,
    };
    Ok((parser, render))
}
