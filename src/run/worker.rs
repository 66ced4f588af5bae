//! One task per leased item: attempts against a server with retries until the item
//! completes, fails for good, or must be given back (shutdown, budget cancel).
//!
//! Invariant: every lease ends in exactly one of: a `Finished` sent to the committer, or
//! `Scheduler::release` — also when the task panics: a panic inside an attempt is that
//! attempt's failure (retried like a malformed answer, the item failed with the panic's
//! message after `max_attempts`), a panic anywhere else fails the item at once; and a
//! server's in-flight count is restored by a guard however the attempt ends. Otherwise
//! the scheduler would wait forever for a lease that never ends. A connection refused
//! burns no attempt.
//!
//! Faults: transient errors are retried after [`backoff`] (exponential, jitter, never
//! sooner than `Retry-After`); other 4xx fail the item with the server's message. A server
//! that cannot be reached burns no attempt; while every server is down the worker waits
//! for one to come back (the monitor probes them) and reports it to
//! [`Servers::every_server_down`], which logs it. After the shutdown signal no new attempt
//! is started: a worker between attempts gives its lease back at once.
//!
//! A generation's request is built by [`prepare`] (the sample's draw, the template with
//! the row's tools, unless the intake's rendering holds; with `source = "server"` the
//! server renders it, [`render_on_server`]) and its row by [`to_row`]
//! (thinking and tool calls split out of raw text by the run's [`RunSyntax`]); items of
//! several generations run their turns in [`crate::run::turns`]; `request` and `row` hold
//! those two.

mod request;
mod row;

pub(crate) use request::{prepare, render_on_server, Prepared};
pub(crate) use row::{to_row, RunSyntax};

use crate::config::{Api, Config, GenerationSpec};
use crate::observe::metrics::DatasetMetrics;
use crate::prompt::conversation::replies_before;
use crate::prompt::draw::Drawer;
use crate::prompt::remote::RemoteRenderer;
use crate::prompt::PromptBuilder;
use crate::run::scheduler::{Lease, Scheduler};
use crate::run::servers::{RouteKey, Servers};
use crate::store::queue::{Failure, Item, Outcome, Queue};
use crate::upstream::{CountSource, GenerateRequest, Generation, Upstream, UpstreamError};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A finished attempt on its way to the committer.
pub(crate) struct Finished {
    pub(crate) lease: Lease,
    pub(crate) outcome: Outcome,
    pub(crate) count_source: CountSource,
    pub(crate) duration_s: f64,
    pub(crate) ttft_s: Option<f64>,
    /// For a generation of an open item: `None` while its sample goes on, else how the
    /// sample ended (`Some(why)` before its last turn).
    pub(crate) ends_sample: Option<Option<String>>,
    /// Told whether the generation was committed; the sample's next turn waits for it.
    pub(crate) ack: Option<tokio::sync::oneshot::Sender<bool>>,
}

/// Everything workers share.
pub(crate) struct Ctx {
    pub(crate) cfg: Arc<Config>,
    pub(crate) queue: Arc<Queue>,
    pub(crate) sched: Arc<Scheduler>,
    pub(crate) upstream: Upstream,
    pub(crate) servers: Arc<Servers>,
    pub(crate) builder: Arc<PromptBuilder>,
    pub(crate) names: Vec<String>,
    pub(crate) dmetrics: Vec<DatasetMetrics>,
    /// Per lane: what is generated per row (thinking, turns, samples).
    pub(crate) gens: Vec<GenerationSpec>,
    /// Per lane: the per-generation draws.
    pub(crate) drawers: Vec<Drawer>,
    /// How raw completions are split into reasoning, answer and tool calls.
    pub(crate) syntax: RunSyntax,
    /// Cancelled on shutdown (signal or fatal error): no new attempt starts; a worker
    /// waiting between attempts gives its lease back.
    pub(crate) stop: CancellationToken,
    /// Cancelled after the shutdown grace: workers give their leases back at once.
    pub(crate) hard_stop: CancellationToken,
    pub(crate) commits: crate::run::committer::Commits,
    pub(crate) nonce: AtomicU64,
    /// Panics a test injects (none in a plain run).
    pub(crate) faults: FaultPoints,
    /// `[tokenizer] source = "server"`: prompts rendered per generation are rendered there.
    pub(crate) renderer: Option<Arc<dyn RemoteRenderer>>,
}

/// The injected panics of [`crate::knobs::Faults`]: `panic_in_request` and `panic_in_row`.
mod fault {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// One place that can be made to panic, armed by a knob.
    pub(crate) struct Point {
        /// The knob's variable, named in the panic's message.
        knob: &'static str,
        what: &'static str,
        /// The inclusive range of times reached (from 1) that panic; `None`: disarmed.
        armed: Option<(u64, u64)>,
        /// Times this place was reached (only counted while armed).
        reached: AtomicU64,
    }

    /// The fault points of one run's workers, counted across all of them.
    pub(crate) struct Points {
        /// Inside a request attempt, before it is sent.
        pub(super) request: Point,
        /// While a completed answer's shard row is built (outside any attempt).
        pub(super) row: Point,
    }

    impl Points {
        /// The points armed as `faults` says (none by default).
        pub(crate) fn new(faults: &crate::knobs::Faults) -> Points {
            use crate::knobs::{FAULT_PANIC_IN_REQUEST, FAULT_PANIC_IN_ROW};
            Points {
                request: Point::new(FAULT_PANIC_IN_REQUEST, "request", faults.panic_in_request),
                row: Point::new(FAULT_PANIC_IN_ROW, "row", faults.panic_in_row),
            }
        }
    }

    impl Point {
        fn new(knob: &'static str, what: &'static str, armed: Option<(u64, u64)>) -> Point {
            Point {
                knob,
                what,
                armed,
                reached: AtomicU64::new(0),
            }
        }

        /// Panics when this is one of the armed times this place is reached.
        pub(super) fn panic_if_due(&self) {
            let Some((first, last)) = self.armed else {
                return;
            };
            let n = self.reached.fetch_add(1, Ordering::Relaxed) + 1;
            if (first..=last).contains(&n) {
                panic!("injected panic in {} {n} ({})", self.what, self.knob);
            }
        }
    }
}

pub(crate) use fault::Points as FaultPoints;

/// Resolves once some server is back in rotation (the monitor's probe or another
/// worker's success puts it back).
async fn until_a_server_is_up(servers: &Servers) {
    while !servers.any_up() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Exponential backoff with jitter (half to full), never shorter than `Retry-After`:
/// 0.5 s doubling per attempt, capped at 60 s before jitter.
pub(crate) fn backoff(attempt: u32, retry_after: Option<Duration>) -> Duration {
    let base = 0.5f64 * 2f64.powi(attempt.saturating_sub(1).min(10) as i32);
    let capped = base.min(60.0);
    let jittered = capped * (0.5 + rand::random::<f64>() * 0.5);
    let d = Duration::from_secs_f64(jittered);
    match retry_after {
        Some(r) => d.max(r),
        None => d,
    }
}

/// How a lease's work ends: exactly one of these is applied, in one place ([`work`]).
enum End {
    /// Given back unfinished (shutdown, budget cancel): the row stays pending.
    GiveBack,
    /// An outcome for the committer.
    Commit {
        outcome: Outcome,
        count_source: CountSource,
        duration_s: f64,
        ttft_s: Option<f64>,
    },
}

/// Why one attempt failed: the server's answer, or a panic in the code handling it.
enum AttemptError {
    Upstream(UpstreamError),
    /// The attempt's future panicked (the message): a bug met on this answer. Counted as a
    /// failed attempt like a malformed answer, so a panic that depends on what the server
    /// sent is retried and one that does not fails the item after `max_attempts`.
    Panic(String),
}

impl AttemptError {
    fn is_unreachable(&self) -> bool {
        matches!(self, AttemptError::Upstream(e) if e.is_unreachable())
    }

    fn is_retriable(&self) -> bool {
        match self {
            AttemptError::Upstream(e) => e.is_retriable(),
            AttemptError::Panic(_) => true,
        }
    }

    fn is_throttled(&self) -> bool {
        matches!(
            self,
            AttemptError::Upstream(UpstreamError::Status { code: 429, .. })
        )
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            AttemptError::Upstream(e) => e.retry_after(),
            AttemptError::Panic(_) => None,
        }
    }
}

impl std::fmt::Display for AttemptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttemptError::Upstream(e) => e.fmt(f),
            AttemptError::Panic(msg) => write!(f, "the request panicked: {msg}"),
        }
    }
}

/// The text of a panic's payload (what `panic!` was given), for the log and the item's
/// failure reason.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_string())
}

/// Sends one leased item until it completes, fails for good, or must be given back.
///
/// Whatever happens inside (a panic included), the lease ends exactly once, here: a panic
/// outside an attempt fails the item at once with the panic's message, so the scheduler's
/// count of work in flight always comes back down and the run ends.
pub(crate) async fn work(ctx: &Ctx, lease: Lease) {
    if lease.multi {
        return crate::run::turns::converse(ctx, lease).await;
    }
    let mut attempts = 0u32;
    let end = AssertUnwindSafe(generate_item(ctx, &lease, &mut attempts))
        .catch_unwind()
        .await
        .unwrap_or_else(|payload| {
            let reason = format!("spool panicked handling this item: {}", panic_message(&*payload));
            tracing::error!(dataset = %ctx.names[lease.lane], row = lease.row, reason = %reason, "item failed permanently");
            End::Commit {
                outcome: Outcome::Failed {
                    ds: lease.ds,
                    row: lease.row,
                    failure: Failure {
                        reason,
                        attempts: attempts.max(1),
                    },
                },
                count_source: CountSource::Server,
                duration_s: 0.0,
                ttft_s: None,
            }
        });
    match end {
        End::GiveBack => ctx.sched.release(&lease),
        End::Commit {
            outcome,
            count_source,
            duration_s,
            ttft_s,
        } => {
            ctx.commits.finished(Finished {
                lease,
                outcome,
                count_source,
                duration_s,
                ttft_s,
                ends_sample: None,
                ack: None,
            });
        }
    }
}

/// The item of a lease, or `None` (logged) when the queue does not have it.
pub(crate) fn leased_item(ctx: &Ctx, lease: &Lease) -> Option<Item> {
    match ctx.queue.item(lease.ds, lease.row) {
        Ok(Some(i)) => Some(i),
        other => {
            tracing::error!(dataset = %ctx.names[lease.lane], row = lease.row, result = ?other.err(), "leased item missing from the queue");
            None
        }
    }
}

/// A single-generation item: one request, one row.
async fn generate_item(ctx: &Ctx, lease: &Lease, attempts: &mut u32) -> End {
    let Some(mut item) = leased_item(ctx, lease) else {
        return End::GiveBack;
    };
    let messages: Option<serde_json::Value> = item
        .messages
        .as_deref()
        .and_then(|m| serde_json::from_str(m).ok());
    let turn = replies_before(messages.as_ref());
    let mut req = match prepare(ctx, lease, &mut item, false, messages, true) {
        Ok(r) => r,
        Err(reason) => return failed(lease, reason, (*attempts).max(1)),
    };
    match render_on_server(ctx, &mut req).await {
        Ok(()) => {}
        Err(Ended::GiveBack) => return End::GiveBack,
        Err(Ended::Failed(reason)) => return failed(lease, reason, (*attempts).max(1)),
    }
    match generate(ctx, lease, &req, attempts).await {
        Ok(a) => {
            let ttft_s = a.generation.ttft_ms.map(|t| f64::from(t) / 1000.0);
            let duration_s = a.duration_s;
            let (row, count_source) =
                to_row(ctx, lease, item.id, req, a.generation, *attempts, turn);
            End::Commit {
                outcome: Outcome::Done {
                    ds: lease.ds,
                    result: Box::new(row),
                },
                count_source,
                duration_s,
                ttft_s,
            }
        }
        Err(Ended::GiveBack) => End::GiveBack,
        Err(Ended::Failed(reason)) => failed(lease, reason, *attempts),
    }
}

fn failed(lease: &Lease, reason: String, attempts: u32) -> End {
    End::Commit {
        outcome: Outcome::Failed {
            ds: lease.ds,
            row: lease.row,
            failure: Failure { reason, attempts },
        },
        count_source: CountSource::Server,
        duration_s: 0.0,
        ttft_s: None,
    }
}

/// Why a generation did not come back.
pub(crate) enum Ended {
    /// Given back unfinished (shutdown, budget cancel).
    GiveBack,
    /// Failed for good, and why.
    Failed(String),
}

/// A generation that came back, and where from.
pub(crate) struct Answer {
    pub(crate) generation: Generation,
    pub(crate) server: usize,
    pub(crate) duration_s: f64,
}

/// The attempts of one generation, with retries; `attempts` counts those burned (read by
/// [`work`] when this panics).
pub(crate) async fn generate(
    ctx: &Ctx,
    lease: &Lease,
    prep: &Prepared,
    attempts: &mut u32,
) -> Result<Answer, Ended> {
    let lane = lease.lane;
    let name = &ctx.names[lane];
    let dm = &ctx.dmetrics[lane];
    let max_attempts = ctx.cfg.server.max_attempts;
    let chat = ctx.cfg.server.api == Api::Chat;
    let kwargs = (chat && !prep.draw.chat_template_kwargs.is_empty())
        .then_some(&prep.draw.chat_template_kwargs);
    let tools = if chat { prep.tools.as_ref() } else { None };
    let mut unreachable_waits = 0u32;
    let route = RouteKey::of(prep.prompt_ids.as_deref(), &prep.prompt);
    loop {
        // With per-server limits this waits for room (a shutdown or cancel gives it back).
        let si = tokio::select! {
            biased;
            i = ctx.servers.pick_for(prep.server, &route) => i,
            _ = lease.cancel.cancelled() => return Err(Ended::GiveBack),
            _ = ctx.stop.cancelled() => return Err(Ended::GiveBack),
        };
        let server = &ctx.servers.list[si];
        // `<dataset>-<row>-<nonce>`; a generation of an open item names its sample and
        // turn in the last part, so a server's log tells them apart.
        let nonce = ctx.nonce.fetch_add(1, Ordering::Relaxed);
        let rid = match prep.turn {
            Some(turn) if lease.multi => {
                format!("{name}-{}-s{}t{turn}n{nonce}", lease.row, lease.sample)
            }
            _ => format!("{name}-{}-{nonce}", lease.row),
        };
        *attempts += 1;
        lease.streamed.store(0, Ordering::Relaxed);
        let sink = |n: u32| {
            lease.streamed.fetch_add(n, Ordering::Relaxed);
            server.streamed.fetch_add(u64::from(n), Ordering::Relaxed);
            dm.streamed_tokens.inc_by(u64::from(n));
        };
        let req = GenerateRequest {
            rid: &rid,
            prompt: &prep.prompt,
            prompt_ids: prep.prompt_ids.as_deref(),
            messages: prep.messages.as_ref(),
            sampling: &prep.draw.sampling,
            tools,
            chat_template_kwargs: kwargs,
        };
        let started = Instant::now();
        // A panic inside the attempt (the HTTP client, a parser) is this attempt's failure;
        // the in-flight count is restored by the guard whether it ends, panics or is dropped.
        let in_flight = server.begin();
        let attempt = AssertUnwindSafe(async {
            ctx.faults.request.panic_if_due();
            ctx.upstream.generate(&server.url, &req, &sink).await
        })
        .catch_unwind();
        let res = tokio::select! {
            r = attempt => Some(r),
            _ = lease.cancel.cancelled() => None,
            _ = ctx.hard_stop.cancelled() => None,
        };
        drop(in_flight);
        let res = match res {
            Some(Ok(r)) => r.map_err(AttemptError::Upstream),
            Some(Err(payload)) => {
                let msg = panic_message(&*payload);
                tracing::warn!(dataset = %name, row = lease.row, attempt = *attempts, panic = %msg,
                    "the request panicked; counted as a failed attempt");
                Err(AttemptError::Panic(msg))
            }
            None => {
                // Budget cancel or hard stop: abort upstream, give the item back. The abort
                // is best effort and must not hold up a shutdown past its grace.
                let (up, url, rid) = (ctx.upstream.clone(), server.url.clone(), rid.clone());
                tokio::spawn(async move { up.abort(&url, &rid).await });
                let wasted = lease.streamed.load(Ordering::Relaxed);
                if lease.cancel.is_cancelled() && wasted > 0 {
                    ctx.commits.wasted(lease.ds, u64::from(wasted));
                }
                return Err(Ended::GiveBack);
            }
        };
        let err = match res {
            Ok(g) => {
                ctx.servers.ok(si);
                return Ok(Answer {
                    generation: g,
                    server: si,
                    duration_s: started.elapsed().as_secs_f64(),
                });
            }
            Err(e) => e,
        };
        if err.is_unreachable() {
            // Says nothing about the item: no attempt burned; wait for a server.
            *attempts -= 1;
            ctx.servers.error(si);
            unreachable_waits += 1;
            tracing::debug!(dataset = %name, row = lease.row, error = %err, "server unreachable; no attempt counted");
            let all_down = ctx.servers.every_server_down();
            // Try again after the backoff (a server that answers requests but not its
            // health probe is still found), or as soon as a probe finds one back.
            let wait = backoff(unreachable_waits.min(6), None);
            let back = async {
                if all_down {
                    until_a_server_is_up(&ctx.servers).await
                } else {
                    std::future::pending().await
                }
            };
            let go_on = tokio::select! {
                go = sleep_or_stop(ctx, lease, wait) => go,
                _ = back => !ctx.stop.is_cancelled(),
            };
            if !go_on {
                return Err(Ended::GiveBack);
            }
            continue;
        }
        // A 429 says the server is alive and busy: its Retry-After paces this item, and it
        // does not count towards taking the server out of rotation.
        if err.is_retriable() && !err.is_throttled() {
            ctx.servers.error(si);
        }
        if err.is_retriable() && *attempts < max_attempts {
            dm.retry.inc();
            tracing::debug!(dataset = %name, row = lease.row, attempt = *attempts, error = %err, "attempt failed; retrying");
            if !sleep_or_stop(ctx, lease, backoff(*attempts, err.retry_after())).await {
                return Err(Ended::GiveBack);
            }
            continue;
        }
        let reason = describe(&err, *attempts);
        tracing::warn!(dataset = %name, row = lease.row, sample = lease.sample, reason = %reason, "generation failed permanently");
        return Err(Ended::Failed(reason));
    }
}

fn describe(e: &AttemptError, attempts: u32) -> String {
    if e.is_retriable() {
        format!("{e} (gave up after {attempts} attempts)")
    } else {
        e.to_string()
    }
}

/// Sleeps before another attempt unless the lease must be given back first (budget
/// cancel, shutdown: no new attempt starts after the signal); false = give it back.
async fn sleep_or_stop(ctx: &Ctx, lease: &Lease, d: Duration) -> bool {
    if ctx.stop.is_cancelled() {
        return false;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => !ctx.stop.is_cancelled(),
        _ = lease.cancel.cancelled() => false,
        _ = ctx.stop.cancelled() => false,
        _ = ctx.hard_stop.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{backoff, RunSyntax};
    use crate::prompt::syntax::Syntax;
    use crate::prompt::Tokenizer;
    use std::time::Duration;

    /// For a family whose markers are special tokens the split reads the ids' text, less a
    /// final stop token; spool's own Qwen3 split keeps reading the server's text.
    #[test]
    fn the_split_reads_the_ids_text_for_marker_families() {
        let tok = Tokenizer::from_file(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tokenizers/qwen3/tokenizer.json"),
        )
        .unwrap();
        let raw = "<think>a</think>b<|tool_calls_section_begin|>";
        let mut ids = tok.encode(raw, false).unwrap();
        ids.push(tok.token_to_id("<|im_end|>").unwrap());
        let kimi = RunSyntax::new(
            Syntax::of_template("<|tool_calls_section_begin|><think>"),
            Some(&tok),
        );
        assert_eq!(kimi.text_of("ab", Some(&ids), Some(&tok)), raw);
        assert_eq!(kimi.text_of("ab", None, Some(&tok)), "ab");
        let qwen = RunSyntax::new(
            Syntax::of_template("<think></think><tool_call></tool_call>"),
            Some(&tok),
        );
        assert_eq!(qwen.text_of("ab", Some(&ids), Some(&tok)), "ab");
    }

    /// Each attempt's backoff lies in half to all of 0.5 s doubled per attempt, capped at
    /// 60 s, and is jittered.
    #[test]
    fn backoff_doubles_with_jitter_and_is_capped() {
        for attempt in 1..=12u32 {
            let full = (0.5 * 2f64.powi(attempt as i32 - 1)).min(60.0);
            let mut seen = Vec::new();
            for _ in 0..200 {
                let d = backoff(attempt, None).as_secs_f64();
                assert!(
                    d >= full * 0.5 - 1e-9 && d <= full + 1e-9,
                    "attempt {attempt}: {d} outside [{}, {full}]",
                    full * 0.5
                );
                seen.push(d);
            }
            // Jitter: 200 draws are not all the same.
            let (lo, hi) = seen
                .iter()
                .fold((f64::MAX, 0f64), |(l, h), d| (l.min(*d), h.max(*d)));
            assert!(hi - lo > full * 0.1, "attempt {attempt}: no jitter");
        }
    }

    /// A server's `Retry-After` is a floor on the backoff, and a short one does not shorten it.
    #[test]
    fn backoff_never_undercuts_retry_after() {
        for attempt in 1..=8 {
            let ra = Duration::from_secs(7);
            assert!(backoff(attempt, Some(ra)) >= ra);
        }
        // A short Retry-After does not shorten the backoff either.
        assert!(backoff(6, Some(Duration::from_millis(1))) >= Duration::from_secs(8));
    }
}
