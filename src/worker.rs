//! One task per leased item: attempts against a server with retries until the item
//! completes, fails for good, or must be given back (shutdown, budget cancel).
//!
//! Invariant: every lease ends in exactly one of: a `Finished` sent to the committer, or
//! `Scheduler::release`. A connection refused burns no attempt.

use crate::config::{Config, Sampling};
use crate::metrics::DatasetMetrics;
use crate::queue::{Failure, Item, Outcome, Queue};
use crate::scheduler::{Lease, Scheduler};
use crate::servers::Servers;
use crate::shard::ShardRow;
use crate::template::PromptBuilder;
use crate::upstream::{CountSource, GenerateRequest, Generation, Upstream, UpstreamError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A finished attempt on its way to the committer.
pub(crate) struct Finished {
    pub(crate) lease: Lease,
    pub(crate) outcome: Outcome,
    pub(crate) count_source: CountSource,
    pub(crate) duration_s: f64,
    pub(crate) ttft_s: Option<f64>,
}

/// Everything workers share.
pub(crate) struct Ctx {
    pub(crate) cfg: Config,
    pub(crate) queue: Arc<Queue>,
    pub(crate) sched: Arc<Scheduler>,
    pub(crate) upstream: Upstream,
    pub(crate) servers: Arc<Servers>,
    pub(crate) builder: Arc<PromptBuilder>,
    pub(crate) names: Vec<String>,
    pub(crate) dmetrics: Vec<DatasetMetrics>,
    pub(crate) sampling: Vec<Sampling>,
    /// Cancelled after the shutdown grace: workers give their leases back at once.
    pub(crate) hard_stop: CancellationToken,
    pub(crate) commits: mpsc::UnboundedSender<Finished>,
    pub(crate) nonce: AtomicU64,
}

/// Exponential backoff with jitter (half to full), never shorter than `Retry-After`.
fn backoff(attempt: u32, retry_after: Option<Duration>) -> Duration {
    let base = 0.5f64 * 2f64.powi(attempt.saturating_sub(1).min(10) as i32);
    let capped = base.min(60.0);
    let jittered = capped * (0.5 + rand::random::<f64>() * 0.5);
    let d = Duration::from_secs_f64(jittered);
    match retry_after {
        Some(r) => d.max(r),
        None => d,
    }
}

/// Sends one leased item until it completes, fails for good, or must be given back.
pub(crate) async fn work(ctx: &Ctx, lease: Lease) {
    let lane = lease.lane;
    let name = &ctx.names[lane];
    let dm = &ctx.dmetrics[lane];
    let item = match ctx.queue.item(lease.ds, lease.row) {
        Ok(Some(i)) => i,
        other => {
            tracing::error!(dataset = %name, row = lease.row, result = ?other.err(), "leased item missing from the queue");
            ctx.sched.release(&lease);
            return;
        }
    };
    let messages: Option<serde_json::Value> = item
        .messages
        .as_deref()
        .and_then(|m| serde_json::from_str(m).ok());
    let sampling = &ctx.sampling[lane];
    let max_attempts = ctx.cfg.server.max_attempts;
    let mut attempts = 0u32;
    let mut unreachable_waits = 0u32;
    loop {
        let si = ctx.servers.pick();
        let server = &ctx.servers.list[si];
        let rid = format!(
            "{}-{}-{}",
            name,
            lease.row,
            ctx.nonce.fetch_add(1, Ordering::Relaxed)
        );
        attempts += 1;
        lease.streamed.store(0, Ordering::Relaxed);
        let sink = |n: u32| {
            lease.streamed.fetch_add(n, Ordering::Relaxed);
            dm.streamed_tokens.inc_by(u64::from(n));
        };
        let req = GenerateRequest {
            rid: &rid,
            prompt: &item.prompt,
            prompt_ids: item.prompt_ids.as_deref(),
            messages: messages.as_ref(),
            sampling,
        };
        server.inflight.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let res = tokio::select! {
            r = ctx.upstream.generate(&server.url, &req, &sink) => Some(r),
            _ = lease.cancel.cancelled() => None,
            _ = ctx.hard_stop.cancelled() => None,
        };
        server.inflight.fetch_sub(1, Ordering::Relaxed);
        let res = match res {
            Some(r) => r,
            None => {
                // Budget cancel or hard stop: abort upstream, give the item back.
                ctx.upstream.abort(&server.url, &rid).await;
                let wasted = lease.streamed.load(Ordering::Relaxed);
                if lease.cancel.is_cancelled() && wasted > 0 {
                    let _ = ctx.queue.add_wasted(lease.ds, u64::from(wasted));
                }
                ctx.sched.release(&lease);
                return;
            }
        };
        let err = match res {
            Ok(g) => {
                ctx.servers.ok(si);
                let duration_s = started.elapsed().as_secs_f64();
                let (row, source) = to_row(ctx, &lease, &item, g, attempts);
                let ttft_s = row.ttft_ms.map(|t| f64::from(t) / 1000.0);
                let _ = ctx.commits.send(Finished {
                    outcome: Outcome::Done {
                        ds: lease.ds,
                        result: Box::new(row),
                    },
                    lease,
                    count_source: source,
                    duration_s,
                    ttft_s,
                });
                return;
            }
            Err(e) => e,
        };
        if err.is_unreachable() {
            // Says nothing about the item: no attempt burned; wait for a server.
            attempts -= 1;
            ctx.servers.error(si);
            unreachable_waits += 1;
            if !ctx.servers.any_up() {
                ctx.servers.log_all_down();
            }
            let wait = backoff(unreachable_waits.min(6), None);
            if !sleep_or_stop(ctx, &lease, wait).await {
                ctx.sched.release(&lease);
                return;
            }
            continue;
        }
        if err.is_retriable() {
            ctx.servers.error(si);
        }
        if err.is_retriable() && attempts < max_attempts {
            dm.retry.inc();
            tracing::debug!(dataset = %name, row = lease.row, attempt = attempts, error = %err, "attempt failed; retrying");
            if !sleep_or_stop(ctx, &lease, backoff(attempts, err.retry_after())).await {
                ctx.sched.release(&lease);
                return;
            }
            continue;
        }
        let reason = describe(&err, attempts);
        tracing::warn!(dataset = %name, row = lease.row, id = %item.id, reason = %reason, "item failed permanently");
        let _ = ctx.commits.send(Finished {
            outcome: Outcome::Failed {
                ds: lease.ds,
                row: lease.row,
                failure: Failure { reason, attempts },
            },
            lease,
            count_source: CountSource::Server,
            duration_s: 0.0,
            ttft_s: None,
        });
        return;
    }
}

fn describe(e: &UpstreamError, attempts: u32) -> String {
    if e.is_retriable() {
        format!("{e} (gave up after {attempts} attempts)")
    } else {
        e.to_string()
    }
}

/// Sleeps unless the lease must be given back first; false = give it back.
async fn sleep_or_stop(ctx: &Ctx, lease: &Lease, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = lease.cancel.cancelled() => false,
        _ = ctx.hard_stop.cancelled() => false,
    }
}

fn to_row(
    ctx: &Ctx,
    lease: &Lease,
    item: &Item,
    g: Generation,
    attempts: u32,
) -> (ShardRow, CountSource) {
    let tok = ctx.builder.tokenizer();
    let completion_ids = match (&g.token_ids, tok) {
        (Some(ids), _) => Some(ids.clone()),
        (None, Some(t)) => t.encode(&g.text, false).ok(),
        (None, None) => None,
    };
    let (completion_tokens, source) = match (g.completion_tokens, &g.token_ids, tok) {
        (Some(n), _, _) => (n, CountSource::Server),
        (None, Some(ids), _) => (ids.len() as u32, CountSource::TokenIds),
        (None, None, Some(_)) => (
            completion_ids
                .as_ref()
                .map(|i| i.len() as u32)
                .unwrap_or(g.chunks),
            CountSource::Tokenizer,
        ),
        (None, None, None) => (g.chunks, CountSource::Chunks),
    };
    let prompt_tokens = g
        .prompt_tokens
        .or_else(|| item.prompt_ids.as_ref().map(|i| i.len() as u32))
        .unwrap_or(0);
    let completed_at_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    (
        ShardRow {
            id: item.id.clone(),
            dataset: ctx.names[lease.lane].clone(),
            row: lease.row,
            prompt: item.prompt.clone(),
            messages: item.messages.clone(),
            prompt_token_ids: item.prompt_ids.clone(),
            completion: g.text,
            completion_token_ids: completion_ids,
            prompt_tokens,
            completion_tokens,
            finish_reason: g.finish_reason,
            model: ctx.cfg.server.model.clone(),
            attempts,
            latency_ms: g.latency_ms,
            ttft_ms: g.ttft_ms,
            completed_at_ms,
        },
        source,
    )
}
