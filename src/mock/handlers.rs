//! HTTP handlers: parse → validate → draw a fault → plan → join the batch → answer, either
//! once at the end (non-streaming) or as an SSE stream fed by the engine's progress.
//!
//! Invariants:
//! - Every generation request produces exactly one [`Record`], which logs and counts its
//!   outcome when dropped; dropping it without an outcome means the client went away
//!   (hyper dropped the handler future or the response body).
//! - A cut connection is a response body that fails: hyper then aborts the connection
//!   without a final chunk, which clients see as a truncated response.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api::{self, sse_event, Api, FinishOut, Rejection, Render, SSE_DONE};
use super::engine::{Job, JobState, Progress};
use super::log::LogLine;
use super::sim::{Fault, Finish, Limits, Plan, Shape, Think};
use super::{MockState, Outcome};

/// One request's outcome record: logged and counted exactly once, on drop.
struct Record {
    st: Arc<MockState>,
    api: Api,
    rid: Option<String>,
    stream: bool,
    prompt_tokens: u32,
    completion_tokens: u32,
    outcome: Option<Outcome>,
    /// The body as received, kept for the log with `--log-bodies`.
    body: Option<Bytes>,
    /// The outcome if the request is dropped before one is set.
    on_drop: Outcome,
    start: Instant,
}

impl Record {
    fn new(st: &Arc<MockState>, api: Api, rid: Option<String>) -> Self {
        st.counters.started();
        Self {
            st: Arc::clone(st),
            api,
            rid,
            stream: false,
            prompt_tokens: 0,
            completion_tokens: 0,
            outcome: None,
            body: None,
            on_drop: Outcome::ClientGone,
            start: Instant::now(),
        }
    }

    /// Seconds of simulated time since the request arrived (what a real server would say).
    fn sim_latency(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.st.cfg.time_scale
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(self.on_drop);
        // Log first, then count: whoever waits on the counters finds the line written.
        if let Some(log) = &self.st.log {
            log.write(&LogLine {
                endpoint: self.api.endpoint(),
                rid: self.rid.as_deref(),
                outcome,
                stream: self.stream,
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.completion_tokens,
                latency_ms: u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX),
                request: self.body.as_deref(),
            });
        }
        self.st.counters.ended(outcome);
    }
}

/// `POST /generate` (SGLang).
pub(crate) async fn generate(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(st, Api::Generate, &headers, body).await
}

/// `POST /v1/completions` (vLLM/OpenAI).
pub(crate) async fn completions(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(st, Api::Completions, &headers, body).await
}

/// `POST /v1/chat/completions` (vLLM/OpenAI).
pub(crate) async fn chat(
    State(st): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(st, Api::Chat, &headers, body).await
}

async fn handle(st: Arc<MockState>, api: Api, headers: &HeaderMap, body: Bytes) -> Response {
    let header_rid = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut rec = Record::new(&st, api, header_rid.clone());
    if st.cfg.log_bodies {
        rec.body = Some(body.clone());
    }
    let req = match api::parse_with(api, &body, header_rid, st.cfg.context_len, &st.rendering) {
        Ok(r) => r,
        Err(rej) => {
            rec.rid = rej.rid.clone();
            rec.stream = rej.stream;
            rec.outcome = Some(Outcome::BadRequest);
            return reject(api, &rej);
        }
    };
    rec.rid = req.rid.clone();
    rec.stream = req.stream;
    if st.cfg.refuse_stream_ids && api == Api::Chat && req.stream && req.return_token_ids {
        rec.outcome = Some(Outcome::BadRequest);
        let rej = Rejection {
            status: 400,
            message: "return_token_ids is not supported with streaming on /v1/chat/completions. \
                Please set stream=false when using return_token_ids=true."
                .into(),
            stream: req.stream,
            rid: req.rid.clone(),
        };
        return reject(api, &rej);
    }
    let prompt = u32::try_from(req.prompt_ids.len()).unwrap_or(u32::MAX);
    rec.prompt_tokens = prompt;

    // Reject only a prompt that leaves no room at all; a too-large cap is clamped.
    let ctx = st.cfg.context_len;
    if prompt >= ctx {
        let message = match api {
            Api::Generate => api::sglang_context_message(ctx, prompt),
            _ => api::openai_context_message(ctx, prompt, req.max_tokens),
        };
        rec.outcome = Some(Outcome::BadRequest);
        let rej = Rejection {
            status: 400,
            message,
            stream: req.stream,
            rid: req.rid.clone(),
        };
        return reject(api, &rej);
    }
    let max_tokens = req.max_tokens.min(ctx - prompt);

    let fault = st.draw_fault();
    match fault {
        Fault::Http500 => {
            rec.outcome = Some(Outcome::Http500);
            let body = api::openai_error(500, "InternalServerError", "Internal server error");
            return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
        }
        Fault::Http429 => {
            rec.outcome = Some(Outcome::Http429);
            let secs = st.cfg.retry_after_s;
            let body = api::openai_error(
                429,
                "RateLimitError",
                &format!("Too many requests: the server is overloaded, retry after {secs} s"),
            );
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [(RETRY_AFTER, secs.to_string())],
                Json(body),
            )
                .into_response();
        }
        Fault::Hang => {
            // Never answer: the client disconnecting drops this future (and `rec` logs
            // "hang"); a shutdown cuts the connection.
            rec.on_drop = Outcome::Hang;
            st.until_shutdown().await;
            rec.outcome = Some(Outcome::Hang);
            return cut_connection();
        }
        Fault::None | Fault::Malformed | Fault::Drop => {}
    }

    let think = match (st.cfg.think && req.thinking_allowed, req.think_opened) {
        (false, _) => Think::Off,
        (true, true) => Think::Opened,
        (true, false) => Think::Block,
    };
    let limits = Limits {
        max_tokens,
        min_tokens: req.min_tokens,
        ignore_eos: req.ignore_eos,
    };
    let mut plan = match &st.vocab {
        Some(v) => v.plan(&st.lengths, req.key, limits, think),
        None => st.lengths.plan(
            req.key,
            limits,
            Shape {
                think,
                tools: &req.tools,
            },
        ),
    };
    let mut render = st.render(&req);
    // A stop string ends the output where it matches, even on the last token of a cut.
    render.stop = render.stop_cut(&plan.ids, &req.stop);
    if let Some(cut) = &render.stop {
        plan.ids.truncate(cut.ids);
        plan.finish = Finish::Stop;
    }
    let total = u32::try_from(plan.ids.len()).unwrap_or(u32::MAX);
    let job = st.engine.submit(&req.prompt_ids, total, req.rid.clone());
    if req.stream {
        stream_response(Streamer::new(render, plan, job, fault, rec))
    } else {
        unary(render, plan, job, fault, rec).await
    }
}

/// A refusal in the shape of the API's server. SGLang answers a *streaming* request that
/// fails validation with a 200 event stream holding one error event (its real behaviour).
fn reject(api: Api, rej: &Rejection) -> Response {
    let status = StatusCode::from_u16(rej.status).unwrap_or(StatusCode::BAD_REQUEST);
    match api {
        Api::Generate if rej.stream => {
            let mut body = sse_event(&api::sglang_error(&rej.message)).to_vec();
            body.extend_from_slice(SSE_DONE);
            sse_headers(Body::from(body))
        }
        Api::Generate => (status, Json(api::sglang_error(&rej.message))).into_response(),
        Api::Completions | Api::Chat => (
            status,
            Json(api::openai_error(
                rej.status,
                "BadRequestError",
                &rej.message,
            )),
        )
            .into_response(),
    }
}

fn sse_headers(body: Body) -> Response {
    (
        StatusCode::OK,
        [
            (CONTENT_TYPE, "text/event-stream"),
            (CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn cut_error() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "mock: connection cut")
}

/// A response whose body fails at once: hyper closes the connection without a complete
/// response, which is as close to "closed before responding" as a handler can get.
fn cut_connection() -> Response {
    let body = futures_util::stream::once(async { Err::<Bytes, io::Error>(cut_error()) });
    (
        StatusCode::OK,
        [(CONTENT_TYPE, "application/json")],
        Body::from_stream(body),
    )
        .into_response()
}

/// Non-streaming: wait for the last token (or the drop point), answer once.
async fn unary(
    render: Render,
    plan: Plan,
    mut job: Job,
    fault: Fault,
    mut rec: Record,
) -> Response {
    let total = plan.ids.len();
    let drop_at = (fault == Fault::Drop).then_some(total / 2);
    let mut p = job.current();
    while p.state == JobState::Running {
        if drop_at.is_some_and(|d| p.produced as usize >= d) {
            break;
        }
        p = job.next().await;
    }
    rec.completion_tokens = p.produced;
    let latency = rec.sim_latency();
    match p.state {
        JobState::Done | JobState::Running if drop_at.is_some() => {
            rec.outcome = Some(Outcome::Dropped);
            cut_connection()
        }
        JobState::Done => {
            let body = render.full(&plan, total, plan.finish.into(), latency);
            if fault == Fault::Malformed {
                rec.outcome = Some(Outcome::Malformed);
                let half = Bytes::copy_from_slice(&body[..body.len() / 2]);
                return (StatusCode::OK, [(CONTENT_TYPE, "application/json")], half)
                    .into_response();
            }
            rec.outcome = Some(Outcome::Ok);
            json_bytes(body)
        }
        JobState::Aborted => {
            rec.outcome = Some(Outcome::Aborted);
            let upto = (p.produced as usize).min(total);
            json_bytes(render.full(&plan, upto, FinishOut::Abort, latency))
        }
        JobState::Shutdown | JobState::Running => {
            rec.outcome = Some(Outcome::Dropped);
            cut_connection()
        }
    }
}

/// A 200 with an already serialised JSON body.
fn json_bytes(body: Vec<u8>) -> Response {
    (StatusCode::OK, [(CONTENT_TYPE, "application/json")], body).into_response()
}

enum Phase {
    Open,
    /// Everything queued, then fail the body.
    Cut,
    Closed,
}

/// The state of one event stream: turns engine progress into SSE events.
struct Streamer {
    render: Render,
    plan: Plan,
    finish: FinishOut,
    job: Job,
    /// Output ids whose progress has been turned into events.
    seen: usize,
    /// Output ids sent to the client (chat holds back ids a parser hides).
    sent: usize,
    first: bool,
    drop_at: Option<usize>,
    malformed_at: Option<usize>,
    malformed_sent: bool,
    queue: VecDeque<Bytes>,
    phase: Phase,
    rec: Record,
}

impl Streamer {
    fn new(render: Render, plan: Plan, job: Job, fault: Fault, rec: Record) -> Self {
        let half = plan.ids.len() / 2;
        let queue = render.prelude().iter().map(sse_event).collect();
        Self {
            render,
            finish: plan.finish.into(),
            plan,
            job,
            seen: 0,
            sent: 0,
            first: true,
            drop_at: (fault == Fault::Drop).then_some(half),
            malformed_at: (fault == Fault::Malformed).then_some(half),
            malformed_sent: false,
            queue,
            phase: Phase::Open,
            rec,
        }
    }

    /// The next body chunk; `None` ends the body cleanly, `Some(Err)` cuts the connection.
    async fn next_chunk(&mut self) -> Option<Result<Bytes, io::Error>> {
        loop {
            if let Some(b) = self.queue.pop_front() {
                return Some(Ok(b));
            }
            match self.phase {
                Phase::Closed => return None,
                Phase::Cut => {
                    self.phase = Phase::Closed;
                    return Some(Err(cut_error()));
                }
                Phase::Open => {}
            }
            let mut p = self.job.current();
            while p.state == JobState::Running && p.produced as usize <= self.seen {
                p = self.job.next().await;
            }
            self.advance(p);
        }
    }

    /// Queues the events for progress `p` and moves the phase on.
    fn advance(&mut self, p: Progress) {
        let mut upto = (p.produced as usize).min(self.plan.ids.len());
        let mut cut = p.state == JobState::Shutdown;
        if let Some(d) = self.drop_at {
            if upto >= d {
                upto = d;
                cut = true;
            }
        }
        if let Some(m) = self.malformed_at {
            if m <= upto {
                if m > self.seen {
                    self.emit(m, None);
                }
                self.emit_malformed();
                self.malformed_at = None;
            }
        }
        if cut {
            if upto > self.seen {
                self.emit(upto, None);
            }
            self.rec.outcome = Some(Outcome::Dropped);
            self.phase = Phase::Cut;
            return;
        }
        match p.state {
            JobState::Done | JobState::Aborted => {
                let aborted = p.state == JobState::Aborted;
                let finish = if aborted {
                    FinishOut::Abort
                } else {
                    self.finish
                };
                // The last content event carries the finish reason, new tokens or not.
                self.emit(upto, Some(finish));
                if let Some(u) = self.render.usage_event(upto as u32) {
                    self.queue.push_back(sse_event(&u));
                }
                self.queue.push_back(Bytes::from_static(SSE_DONE));
                self.rec.outcome = Some(if aborted {
                    Outcome::Aborted
                } else if self.malformed_sent {
                    Outcome::Malformed
                } else {
                    Outcome::Ok
                });
                self.phase = Phase::Closed;
            }
            JobState::Running | JobState::Shutdown => {
                if upto > self.seen {
                    self.emit(upto, None);
                }
            }
        }
    }

    fn emit(&mut self, upto: usize, finish: Option<FinishOut>) {
        self.seen = upto;
        self.rec.completion_tokens = upto as u32;
        if self.render.api == Api::Chat {
            let (events, sent) = self.render.chat_events(&self.plan, self.sent, upto, finish);
            self.sent = sent;
            self.queue.extend(events.iter().map(sse_event));
            return;
        }
        let latency = self.rec.sim_latency();
        let v = self.render.content(
            &self.plan.ids[..upto],
            self.sent,
            finish,
            self.first,
            latency,
        );
        self.first = false;
        self.sent = upto;
        self.queue.push_back(sse_event(&v));
    }

    /// An extra event cut half way through its JSON (the real events still follow, so a
    /// client that skips bad events loses nothing; a strict one fails the attempt).
    fn emit_malformed(&mut self) {
        let latency = self.rec.sim_latency();
        let v = self
            .render
            .content(&self.plan.ids[..self.sent], self.sent, None, false, latency);
        let text = v.to_string().into_bytes();
        let mut ev = b"data: ".to_vec();
        ev.extend_from_slice(&text[..text.len() / 2]);
        ev.extend_from_slice(b"\n\n");
        self.queue.push_back(Bytes::from(ev));
        self.malformed_sent = true;
    }
}

fn stream_response(streamer: Streamer) -> Response {
    let body = futures_util::stream::unfold(streamer, |mut s| async move {
        let chunk = s.next_chunk().await;
        chunk.map(|c| (c, s))
    });
    sse_headers(Body::from_stream(body))
}

/// `POST /abort_request` (SGLang): `{"rid": ".."}` or `{"abort_all": true}`; 200, empty.
pub(crate) async fn abort_request(State(st): State<Arc<MockState>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let msg = format!("JSON decode error: {e}");
            return (StatusCode::BAD_REQUEST, Json(api::sglang_error(&msg))).into_response();
        }
    };
    let n = if v.get("abort_all").and_then(Value::as_bool) == Some(true) {
        st.engine.abort_all()
    } else if let Some(rid) = v.get("rid").and_then(Value::as_str) {
        st.engine.abort_rid(rid)
    } else {
        let msg = "rid is required (or abort_all: true)";
        return (StatusCode::BAD_REQUEST, Json(api::sglang_error(msg))).into_response();
    };
    tracing::debug!(aborted = n, "mock: abort_request");
    StatusCode::OK.into_response()
}

/// `GET /health` (both families): 200, empty.
pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /v1/models` (vLLM).
pub(crate) async fn models(State(st): State<Arc<MockState>>) -> Json<Value> {
    let m = &st.cfg.model;
    Json(json!({
        "object": "list",
        "data": [{
            "id": m,
            "object": "model",
            "created": super::log::now_ms() / 1000,
            "owned_by": "spool-mock",
            "root": m,
            "parent": null,
            "max_model_len": st.cfg.context_len
        }]
    }))
}

/// `GET /get_model_info` (SGLang).
pub(crate) async fn model_info(State(st): State<Arc<MockState>>) -> Json<Value> {
    let m = &st.cfg.model;
    Json(json!({
        "model_path": m,
        "tokenizer_path": m,
        "is_generation": true,
        "max_context_length": st.cfg.context_len,
        "context_length": st.cfg.context_len
    }))
}

/// Unknown paths: FastAPI's 404.
pub(crate) async fn not_found() -> (StatusCode, Json<Value>) {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"})))
}
