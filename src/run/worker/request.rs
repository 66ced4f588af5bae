//! A generation's request, built before it is sent: the sample's draw, the prompt (the
//! intake's rendering when it holds, else the template rendered with the drawn variables
//! and the row's tools, or the server's rendering with `source = "server"`).
//!
//! Invariant: a prompt whose ids were made by the intake is sent with those ids unless
//! something drawn per generation changes it; a prompt the server renders records that
//! the server made its ids.

use super::{Ctx, Ended};
use crate::config::Api;
use crate::input::batch::RowSampling;
use crate::prompt::draw::Draw;
use crate::prompt::remote::{IdsSource, RemoteError, RenderInput};
use crate::run::enqueue::ids_source_of;
use crate::run::scheduler::Lease;
use crate::store::queue::Item;

/// One generation's request, ready to send.
pub(crate) struct Prepared {
    pub(super) prompt: String,
    pub(super) prompt_ids: Option<Vec<u32>>,
    /// Who made `prompt_ids`.
    pub(super) ids_from: Option<IdsSource>,
    /// A prompt left to the server to render ([`render_on_server`]).
    pub(super) remote: Option<RenderInput>,
    pub(super) messages: Option<serde_json::Value>,
    /// The messages as the row records them (JSON text).
    pub(super) messages_text: Option<String>,
    pub(super) draw: Draw,
    pub(super) tools: Option<serde_json::Value>,
    pub(super) tools_text: Option<String>,
    /// The server to keep (a conversation's earlier turns went there).
    pub(crate) server: Option<usize>,
    /// The turn it generates (named in the request id of an open item's generation).
    pub(crate) turn: Option<u32>,
}

/// Builds a generation's request: the draw for its sample, the template rendered with the
/// drawn variables and the row's tools unless the intake's rendering holds (`first`: the
/// item's stored prompt is this request's, when nothing is drawn per row). `Err` says why
/// the prompt cannot be rendered.
pub(crate) fn prepare(
    ctx: &Ctx,
    lease: &Lease,
    item: &mut Item,
    reuse: bool,
    messages: Option<serde_json::Value>,
    first: bool,
) -> Result<Prepared, String> {
    let drawer = &ctx.drawers[lease.lane];
    let mut draw = drawer.draw(&ctx.names[lease.lane], &item.id, lease.sample);
    let extra = item
        .extra
        .as_deref()
        .and_then(|e| serde_json::from_str::<serde_json::Value>(e).ok());
    // A batch row's own sampling, within the dataset's limits.
    if let Some(own) = extra.as_ref().and_then(RowSampling::from_extra) {
        own.apply(&mut draw, lease.sample);
    }
    let tools = extra.and_then(|mut e| e.get_mut("tools").map(serde_json::Value::take));
    let tools_text = tools.as_ref().map(|t| t.to_string());
    let chat = ctx.cfg.server.api == Api::Chat;
    let stored = first && drawer.is_fixed();
    let kwargs = || {
        let mut extra = draw.chat_template_kwargs.clone();
        if let Some(t) = &tools {
            extra.insert("tools".into(), t.clone());
        }
        extra
    };
    let (prompt, prompt_ids, ids_from, remote) = match &messages {
        Some(m) if !stored && ctx.renderer.is_some() => {
            let input = RenderInput::Chat {
                messages: m.clone(),
                kwargs: kwargs(),
            };
            (String::new(), None, None, Some(input))
        }
        Some(m) if !stored && ctx.builder.has_template() => {
            // Tool-call arguments reach the template as objects, as the servers pass them.
            let objects = crate::prompt::syntax::arguments_as_objects(m);
            let built = ctx
                .builder
                .build_chat_with(objects.as_ref().unwrap_or(m), &kwargs())
                .map_err(|e| e.to_string())?;
            let from = built.token_ids.as_ref().map(|_| IdsSource::Client);
            (built.text, built.token_ids, from, None)
        }
        Some(m) if !stored && chat => (m.to_string(), None, None, None),
        // The stored prompt moves into the request unless the item serves more turns.
        _ if reuse => (
            item.prompt.clone(),
            item.prompt_ids.clone(),
            ids_source_of(item),
            None,
        ),
        _ => {
            let from = ids_source_of(item);
            let ids = item.prompt_ids.take();
            (std::mem::take(&mut item.prompt), ids, from, None)
        }
    };
    let messages_text = match (&messages, first) {
        (_, true) if lease.multi => messages.as_ref().map(|m| m.to_string()),
        (_, true) if reuse => item.messages.clone(),
        (_, true) => item.messages.take(),
        (m, false) => m.as_ref().map(|m| m.to_string()),
    };
    Ok(Prepared {
        prompt,
        prompt_ids,
        ids_from,
        remote,
        messages,
        messages_text,
        draw,
        tools,
        tools_text,
        server: lease.server,
        turn: None,
    })
}

/// Renders on the server a prompt [`prepare`] left to it (`source = "server"`): a
/// refusal fails the generation, a server that does not answer gives the lease back.
pub(crate) async fn render_on_server(ctx: &Ctx, prep: &mut Prepared) -> Result<(), Ended> {
    let (Some(input), Some(renderer)) = (prep.remote.take(), &ctx.renderer) else {
        return Ok(());
    };
    match renderer.render(&input).await {
        Ok(b) => {
            prep.prompt = b.text;
            prep.prompt_ids = b.token_ids;
            prep.ids_from = Some(IdsSource::Server);
            Ok(())
        }
        Err(RemoteError::Refused(why)) => Err(Ended::Failed(format!(
            "the server refused to render the prompt: {why}"
        ))),
        Err(RemoteError::Unavailable(why)) => {
            tracing::warn!(error = %why, "the server could not render a prompt; the item goes back to the queue");
            Err(Ended::GiveBack)
        }
    }
}
