//! One sample of an item with several generations: its turns in order, in one lease.
//!
//! Invariant: turn k is requested only after turn k−1 is committed and acknowledged, and
//! its history is exactly the replies the queue keeps for this sample (read at the start,
//! then the acknowledged ones), so a restart resumes at the first turn not kept and a
//! history never holds another run's or another sample's reply. The lease ends once: the
//! committer ends it with the sample's last generation (or refuses it), or this module
//! ends or gives it back.

use crate::config::Turns;
use crate::prompt::conversation::{replies_before, Conversation, Reply};
use crate::run::scheduler::Lease;
use crate::run::worker::{
    generate, leased_item, panic_message, prepare, render_on_server, to_row, Ctx, Ended, Finished,
};
use crate::store::queue::Outcome;
use crate::store::row::ShardRow;
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How a sample's worker hands its lease over: exactly one of these, applied by
/// [`converse`].
enum Flow {
    /// The sample ended without a generation to commit (`Some(why)`: before its last turn).
    Ended(Option<String>),
    /// Given back unfinished: it resumes at its next turn.
    GiveBack,
    /// The committer has the lease (it ended it with the sample's last generation, or
    /// refused a generation).
    Handed,
}

/// One sample of an item with several generations: its turns in order, each committed
/// (and acknowledged) before the next is requested, so a turn's history is exactly the
/// replies the queue keeps. A panic ends the sample as failed, once.
pub(crate) async fn converse(ctx: &Ctx, lease: Lease) {
    let mut handed = false;
    let flow = AssertUnwindSafe(sample_turns(ctx, &lease, &mut handed))
        .catch_unwind()
        .await
        .unwrap_or_else(|payload| {
            let reason = format!("failed: spool panicked: {}", panic_message(&*payload));
            tracing::error!(dataset = %ctx.names[lease.lane], row = lease.row, sample = lease.sample, reason = %reason, "sample failed");
            if handed {
                Flow::Handed
            } else {
                Flow::Ended(Some(reason))
            }
        });
    lease.waiting.store(false, Ordering::Relaxed);
    match flow {
        Flow::Ended(partial) => ctx.commits.sample_ended(lease, partial),
        Flow::GiveBack => ctx.sched.release(&lease),
        Flow::Handed => {}
    }
}

/// A generated reply as later turns' histories hold it.
fn reply_of(row: &ShardRow) -> Reply {
    Reply {
        content: row.completion.clone(),
        reasoning: row.reasoning.clone(),
        tool_calls: row
            .tool_calls
            .as_deref()
            .and_then(|t| serde_json::from_str(t).ok()),
    }
}

async fn sample_turns(ctx: &Ctx, lease: &Lease, handed: &mut bool) -> Flow {
    let name = &ctx.names[lease.lane];
    let Some(mut item) = leased_item(ctx, lease) else {
        return Flow::GiveBack;
    };
    let (item_kept, kept): (bool, Vec<ShardRow>) = match ctx.queue.generations(lease.ds, lease.row)
    {
        Ok(g) => (
            !g.is_empty(),
            g.into_iter().filter(|r| r.sample == lease.sample).collect(),
        ),
        Err(e) => {
            tracing::error!(dataset = %name, row = lease.row, error = %e, "cannot read the item's kept generations");
            return Flow::GiveBack;
        }
    };
    let spec = &ctx.gens[lease.lane];
    let source: Option<serde_json::Value> = item
        .messages
        .as_deref()
        .and_then(|m| serde_json::from_str(m).ok());
    let conversation = match (spec.turns, &source) {
        (Turns::All, Some(serde_json::Value::Array(m))) => Some(Conversation::new(m.clone())),
        _ => None,
    };
    let total = conversation.as_ref().map_or(1, |c| c.turns());
    let mut replies: Vec<Reply> = kept.iter().map(reply_of).collect();
    let first = replies.len() as u32;
    let mut server = lease.server;
    ctx.sched.note_start(lease, item_kept, total);
    for k in first..total {
        if k > first {
            match turn_gate(ctx, lease).await {
                Some(true) => {}
                Some(false) => return Flow::Ended(Some("budget".into())),
                None => return Flow::GiveBack,
            }
        }
        if ctx.stop.is_cancelled() {
            return Flow::GiveBack;
        }
        let (messages, turn) = match &conversation {
            Some(c) => match c.request(k, &replies, spec.history_reasoning) {
                Ok(m) => (Some(serde_json::Value::Array(m)), k),
                Err(why) => return Flow::Ended(Some(why)),
            },
            None => (source.clone(), replies_before(source.as_ref())),
        };
        let mut req = match prepare(ctx, lease, &mut item, true, messages, k == 0) {
            Ok(r) => r,
            Err(reason) => return Flow::Ended(Some(format!("failed: {reason}"))),
        };
        match render_on_server(ctx, &mut req).await {
            Ok(()) => {}
            Err(Ended::GiveBack) => return Flow::GiveBack,
            Err(Ended::Failed(reason)) => return Flow::Ended(Some(format!("failed: {reason}"))),
        }
        req.server = server;
        req.turn = Some(turn);
        let mut attempts = 0;
        let a = match generate(ctx, lease, &req, &mut attempts).await {
            Ok(a) => a,
            Err(Ended::GiveBack) => return Flow::GiveBack,
            Err(Ended::Failed(reason)) => return Flow::Ended(Some(format!("failed: {reason}"))),
        };
        if server.is_none() {
            ctx.sched.note_server(lease, a.server);
        }
        server = Some(a.server);
        let ttft_s = a.generation.ttft_ms.map(|t| f64::from(t) / 1000.0);
        let duration_s = a.duration_s;
        let (row, count_source) = to_row(
            ctx,
            lease,
            item.id.clone(),
            req,
            a.generation,
            attempts,
            turn,
        );
        let reply = reply_of(&row);
        let ends_sample = if k + 1 >= total {
            Some(None)
        } else {
            let mut next = replies.clone();
            next.push(reply.clone());
            match conversation
                .as_ref()
                .map(|c| c.request(k + 1, &next, spec.history_reasoning))
            {
                Some(Err(why)) => Some(Some(why)),
                _ => None,
            }
        };
        let last = ends_sample.is_some();
        let (ack, acked) = tokio::sync::oneshot::channel();
        *handed = last;
        ctx.commits.finished(Finished {
            lease: lease.clone(),
            outcome: Outcome::Generated {
                ds: lease.ds,
                result: Box::new(row),
            },
            count_source,
            duration_s,
            ttft_s,
            ends_sample,
            ack: Some(ack),
        });
        if last {
            return Flow::Handed;
        }
        match acked.await {
            Ok(true) => replies.push(reply),
            // Refused (the committer ended the lease) or the committer is gone (the run
            // is stopping on its error; the item stays pending).
            Ok(false) => return Flow::Handed,
            Err(_) => return Flow::GiveBack,
        }
    }
    // Every turn of this sample is already kept (a resumed item).
    Flow::Ended(None)
}

/// Waits until a conversation may take its next turn: true go, false the budget is met;
/// `None` when the run stops meanwhile (the lease is given back).
async fn turn_gate(ctx: &Ctx, lease: &Lease) -> Option<bool> {
    loop {
        let notified = ctx.sched.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match ctx.sched.may_continue(lease) {
            Some(go) => {
                lease.waiting.store(false, Ordering::Relaxed);
                return Some(go);
            }
            None => lease.waiting.store(true, Ordering::Relaxed),
        }
        tokio::select! {
            _ = &mut notified => {}
            // Streamed tokens move the estimates without a notification.
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = ctx.stop.cancelled() => return None,
        }
    }
}
