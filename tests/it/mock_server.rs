//! The mock inference server over real HTTP: every endpoint's shapes (streaming and not),
//! text ↔ token-id consistency, the capacity model, faults, abort and the request log.
//! Each test starts its own mock on `127.0.0.1:0` and talks to it with `reqwest`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use spool::mock::{self, MockConfig, MockState, MockStats, Outcome, ReasoningField};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A mock running in this process.
struct Mock {
    url: String,
    state: Arc<MockState>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Mock {
    async fn start(cfg: MockConfig) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let state = MockState::new(cfg).expect("config");
        let (stop, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(mock::serve_state(listener, Arc::clone(&state), async {
            let _ = rx.await;
        }));
        Mock {
            url,
            state,
            stop,
            task,
        }
    }

    fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// Waits (bounded) until the stats satisfy `pred`.
    async fn wait(&self, what: &str, pred: impl FnMut(&MockStats) -> bool) {
        tokio::time::timeout(Duration::from_secs(10), self.state.wait_until(pred))
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}: {:?}", self.state.stats()));
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("mock stops")
            .expect("join")
            .expect("serve");
    }
}

fn client() -> reqwest::Client {
    spool::upstream::tls::install_provider();
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// The payloads of the `data:` events of a whole SSE body, in order.
fn sse_payloads(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                .to_owned()
        })
        .collect()
}

/// The JSON events of a finished stream, checking it ends with `[DONE]`.
fn sse_json(body: &str) -> Vec<Value> {
    let mut p = sse_payloads(body);
    assert_eq!(
        p.pop().as_deref(),
        Some("[DONE]"),
        "stream must end with [DONE]"
    );
    p.iter()
        .map(|s| serde_json::from_str(s).expect("event is JSON"))
        .collect()
}

/// The mock's detokenizer: id `t` reads `" w{t}"`.
fn detok(ids: &[u64]) -> String {
    ids.iter().map(|t| format!(" w{t}")).collect()
}

fn ids_of(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

async fn post(m: &Mock, path: &str, body: Value) -> reqwest::Response {
    client()
        .post(m.at(path))
        .json(&body)
        .send()
        .await
        .expect("send")
}

async fn post_json(m: &Mock, path: &str, body: Value) -> Value {
    let r = post(m, path, body).await;
    assert_eq!(r.status(), 200);
    r.json().await.expect("json body")
}

async fn post_text(m: &Mock, path: &str, body: Value) -> String {
    let r = post(m, path, body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    r.text().await.expect("body")
}

/// `serve` itself answers the info endpoints with the configured model and context, and
/// stops when its shutdown future resolves.
#[tokio::test]
async fn serve_answers_health_models_and_model_info() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let cfg = MockConfig {
        model: "m-test".into(),
        context_len: 4096,
        ..MockConfig::for_tests()
    };
    let (stop, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(mock::serve(listener, cfg, async {
        let _ = rx.await;
    }));
    let c = client();
    let h = c.get(format!("{url}/health")).send().await.expect("health");
    assert_eq!(h.status(), 200);
    assert!(h.text().await.expect("body").is_empty());
    let models: Value = c
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "m-test");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["owned_by"], "spool-mock");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    let info: Value = c
        .get(format!("{url}/get_model_info"))
        .send()
        .await
        .expect("info")
        .json()
        .await
        .expect("json");
    assert_eq!(info["model_path"], "m-test");
    assert_eq!(info["is_generation"], true);
    assert_eq!(info["max_context_length"], 4096);
    let missing = c.get(format!("{url}/nope")).send().await.expect("404");
    assert_eq!(missing.status(), 404);
    let _ = stop.send(());
    task.await.expect("join").expect("serve");
}

/// SGLang non-streaming: the documented shape, text == detokenized ids, counts agree, the
/// same prompt gives the same output again, and a cap gives finish_reason "length".
#[tokio::test]
async fn generate_non_streaming_shape_and_determinism() {
    let m = Mock::start(MockConfig::for_tests()).await;
    let req = json!({"text": "one two three four", "sampling_params": {"max_new_tokens": 10000, "temperature": 0.7}, "rid": "g1"});
    let a = post_json(&m, "/generate", req.clone()).await;
    let ids = ids_of(&a["output_ids"]);
    assert!(!ids.is_empty());
    assert_eq!(a["text"], detok(&ids));
    let meta = &a["meta_info"];
    assert_eq!(meta["id"], "g1");
    assert_eq!(meta["prompt_tokens"], 4);
    assert_eq!(meta["completion_tokens"], ids.len());
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "stop", "matched": 151645})
    );
    assert!(meta["e2e_latency"].as_f64().expect("latency") >= 0.0);
    let b = post_json(&m, "/generate", req).await;
    assert_eq!(a["output_ids"], b["output_ids"], "same prompt, same output");

    // Capped: a prefix of the same output, finish "length".
    let cap = (ids.len() / 2).max(1);
    let c = post_json(
        &m,
        "/generate",
        json!({"text": "one two three four", "sampling_params": {"max_new_tokens": cap}}),
    )
    .await;
    assert_eq!(ids_of(&c["output_ids"]), ids[..cap]);
    assert_eq!(
        c["meta_info"]["finish_reason"],
        json!({"type": "length", "length": cap})
    );
    // Token-id prompts count one token per id.
    let d = post_json(&m, "/generate", json!({"input_ids": [1, 2, 3, 4, 5, 6, 7]})).await;
    assert_eq!(d["meta_info"]["prompt_tokens"], 7);
    m.stop().await;
}

/// SGLang streaming: cumulative events grow by prefix and the incremental server's deltas
/// concatenate to the same final text and ids; `completion_tokens` is the running total in
/// both modes; only the last event has a finish_reason; both match the non-streaming answer.
#[tokio::test]
async fn generate_streaming_cumulative_and_incremental_agree() {
    let slow = MockConfig {
        // 400 tokens at 800 tok/s: half a second of streaming, so even a reader slowed by a
        // loaded machine sees several events (the mock coalesces for slow readers).
        time_scale: 4.0,
        per_request_tps: 200.0,
        ..MockConfig::for_tests()
    };
    let cum = Mock::start(slow.clone()).await;
    let inc = Mock::start(MockConfig {
        incremental: true,
        ..slow
    })
    .await;
    let req = json!({"text": "stream me please", "sampling_params": {"max_new_tokens": 400, "ignore_eos": true}, "stream": true});

    let cev = sse_json(&post_text(&cum, "/generate", req.clone()).await);
    assert!(cev.len() >= 2, "expected several events, got {}", cev.len());
    let mut prev: Vec<u64> = Vec::new();
    for (i, e) in cev.iter().enumerate() {
        let ids = ids_of(&e["output_ids"]);
        assert!(
            ids.starts_with(&prev),
            "cumulative output must grow by prefix"
        );
        assert_eq!(e["text"], detok(&ids));
        assert_eq!(e["meta_info"]["completion_tokens"], ids.len());
        assert_eq!(e["meta_info"]["prompt_tokens"], 3);
        assert_eq!(e["meta_info"]["finish_reason"].is_null(), i + 1 < cev.len());
        prev = ids;
    }
    let final_ids = prev;

    let iev = sse_json(&post_text(&inc, "/generate", req.clone()).await);
    let (mut text, mut ids, mut count) = (String::new(), Vec::new(), 0u64);
    for (i, e) in iev.iter().enumerate() {
        let delta = ids_of(&e["output_ids"]);
        assert_eq!(e["text"], detok(&delta));
        text.push_str(e["text"].as_str().expect("text"));
        ids.extend(delta);
        count = e["meta_info"]["completion_tokens"].as_u64().expect("count");
        assert_eq!(count, ids.len() as u64, "running total, not a delta");
        assert_eq!(e["meta_info"]["finish_reason"].is_null(), i + 1 < iev.len());
    }
    assert_eq!(ids, final_ids);
    assert_eq!(text, detok(&final_ids));
    assert_eq!(count, final_ids.len() as u64);

    let mut unary = req;
    unary["stream"] = json!(false);
    let whole = post_json(&cum, "/generate", unary).await;
    assert_eq!(ids_of(&whole["output_ids"]), final_ids);
    assert_eq!(
        cev.last().expect("last")["meta_info"]["finish_reason"],
        whole["meta_info"]["finish_reason"]
    );
    cum.stop().await;
    inc.stop().await;
}

/// vLLM completions, non-streaming: OpenAI shape, `token_ids`/`prompt_token_ids` when
/// asked (consistent with text and usage), none when not; prompts as text or ids.
#[tokio::test]
async fn completions_non_streaming_shape_and_token_ids() {
    let m = Mock::start(MockConfig::for_tests()).await;
    let r = post_json(
        &m,
        "/v1/completions",
        json!({"model": "x", "prompt": "a b c", "max_tokens": 5000, "temperature": 0.0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(r["object"], "text_completion");
    assert!(r["id"].as_str().expect("id").starts_with("cmpl-"));
    assert_eq!(r["model"], "mock-model");
    assert!(r["created"].as_u64().is_some());
    let ch = &r["choices"][0];
    assert_eq!(ch["index"], 0);
    assert!(ch["logprobs"].is_null());
    let ids = ids_of(&ch["token_ids"]);
    assert_eq!(ch["text"], detok(&ids));
    assert_eq!(ch["finish_reason"], "stop");
    assert_eq!(ids_of(&ch["prompt_token_ids"]).len(), 3);
    assert_eq!(r["usage"]["prompt_tokens"], 3);
    assert_eq!(r["usage"]["completion_tokens"], ids.len());
    assert_eq!(r["usage"]["total_tokens"], 3 + ids.len());

    // Same prompt over SGLang's API: same completion.
    let g = post_json(
        &m,
        "/generate",
        json!({"text": "a b c", "sampling_params": {"max_new_tokens": 5000}}),
    )
    .await;
    assert_eq!(ids_of(&g["output_ids"]), ids);

    let plain = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": [5, 6, 7, 8], "max_tokens": 3}),
    )
    .await;
    assert!(plain["choices"][0].get("token_ids").is_none());
    assert_eq!(plain["choices"][0]["finish_reason"], "length");
    assert_eq!(plain["usage"]["prompt_tokens"], 4);
    assert_eq!(plain["usage"]["completion_tokens"], 3);
    m.stop().await;
}

/// vLLM completions, streaming: text deltas match token-id deltas, the last content chunk
/// carries finish_reason, then a `choices: []` usage chunk, then `[DONE]`.
#[tokio::test]
async fn completions_streaming_deltas_and_usage_chunk() {
    let m = Mock::start(MockConfig {
        time_scale: 20.0,
        per_request_tps: 200.0,
        ..MockConfig::for_tests()
    })
    .await;
    let body = post_text(
        &m,
        "/v1/completions",
        json!({"prompt": "x y", "max_tokens": 300, "stream": true,
               "stream_options": {"include_usage": true}, "return_token_ids": true}),
    )
    .await;
    let ev = sse_json(&body);
    let (usage, content) = ev.split_last().expect("events");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["object"], "text_completion");
    let (mut text, mut ids) = (String::new(), Vec::new());
    for (i, e) in content.iter().enumerate() {
        let ch = &e["choices"][0];
        let delta = ids_of(&ch["token_ids"]);
        assert_eq!(ch["text"], detok(&delta));
        text.push_str(ch["text"].as_str().expect("text"));
        ids.extend(delta);
        assert_eq!(ch["finish_reason"].is_null(), i + 1 < content.len());
        assert!(e["usage"].is_null());
        assert_eq!(ch.get("prompt_token_ids").is_some(), i == 0);
    }
    assert_eq!(text, detok(&ids));
    assert_eq!(usage["usage"]["completion_tokens"], ids.len());
    assert_eq!(usage["usage"]["prompt_tokens"], 2);

    // Without include_usage: no usage chunk, no usage key.
    let ev = sse_json(
        &post_text(
            &m,
            "/v1/completions",
            json!({"prompt": "x y", "max_tokens": 300, "stream": true}),
        )
        .await,
    );
    assert!(ev
        .iter()
        .all(|e| e.get("usage").is_none() && e["choices"][0].is_object()));
    let streamed: String = ev
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().expect("text").to_owned())
        .collect();
    assert_eq!(streamed, text, "same prompt, same output");
    m.stop().await;
}

/// vLLM chat: non-streaming `chat.completion` with the assistant message; streaming opens
/// with the role delta, content deltas concatenate to the same message, usage chunk last.
#[tokio::test]
async fn chat_streaming_and_non_streaming_agree() {
    let m = Mock::start(MockConfig::for_tests()).await;
    let messages =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]);
    let whole = post_json(
        &m,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 1000, "return_token_ids": true}),
    )
    .await;
    assert_eq!(whole["object"], "chat.completion");
    assert!(whole["id"].as_str().expect("id").starts_with("chatcmpl-"));
    let msg = &whole["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let ids = ids_of(&whole["choices"][0]["token_ids"]);
    assert_eq!(msg["content"], detok(&ids));
    // "system: be brief\nuser: hi there\n" → 6 words.
    assert_eq!(whole["usage"]["prompt_tokens"], 6);
    assert_eq!(whole["usage"]["completion_tokens"], ids.len());

    let ev = sse_json(
        &post_text(
            &m,
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 1000, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await,
    );
    assert_eq!(ev[0]["object"], "chat.completion.chunk");
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage, rest) = ev.split_last().expect("events");
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], ids.len());
    let content: String = rest
        .iter()
        .map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(content, msg["content"].as_str().expect("content"));
    assert_eq!(
        rest.last().expect("last")["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    m.stop().await;
}

/// `--no-token-ids` ignores `return_token_ids`; `--no-usage` sends no usage anywhere.
#[tokio::test]
async fn no_token_ids_and_no_usage_flags() {
    let m = Mock::start(MockConfig {
        no_token_ids: true,
        no_usage: true,
        ..MockConfig::for_tests()
    })
    .await;
    let r = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": "p", "max_tokens": 100, "return_token_ids": true}),
    )
    .await;
    assert!(r.get("usage").is_none());
    assert!(r["choices"][0].get("token_ids").is_none());
    let ev = sse_json(
        &post_text(
            &m,
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "p"}], "max_tokens": 100, "stream": true,
                   "stream_options": {"include_usage": true}, "return_token_ids": true}),
        )
        .await,
    );
    for e in &ev {
        assert!(e.get("usage").is_none());
        assert!(e["choices"][0].get("token_ids").is_none());
    }
    m.stop().await;
}

/// Injected 429s carry `Retry-After` and an OpenAI error body; injected 500s the vLLM
/// internal-error body. Info endpoints never fail.
#[tokio::test]
async fn injected_429_and_500() {
    let m = Mock::start(MockConfig {
        fail_429: 1.0,
        retry_after_s: 7,
        ..MockConfig::for_tests()
    })
    .await;
    let r = post(&m, "/v1/completions", json!({"prompt": "p"})).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["object"], "error");
    assert_eq!(body["code"], 429);
    let h = client().get(m.at("/health")).send().await.expect("health");
    assert_eq!(h.status(), 200);
    assert_eq!(m.state.stats().count(Outcome::Http429), 1);
    m.stop().await;

    let m = Mock::start(MockConfig {
        fail_500: 1.0,
        ..MockConfig::for_tests()
    })
    .await;
    let r = post(&m, "/generate", json!({"text": "p", "stream": true})).await;
    assert_eq!(r.status(), 500);
    let body: Value = r.json().await.expect("json");
    assert_eq!(
        body,
        json!({"object": "error", "message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500})
    );
    m.stop().await;
}

/// A prompt filling the context is refused with each server's message (vLLM's 400; SGLang's
/// 400, or its 200 stream with an error event when streaming); a cap past the context is
/// clamped instead.
#[tokio::test]
async fn context_length_rejections_and_clamp() {
    let m = Mock::start(MockConfig {
        context_len: 10,
        mean_tokens: 1000.0,
        ..MockConfig::for_tests()
    })
    .await;
    let ten = "a b c d e f g h i j";
    let r = post(
        &m,
        "/v1/completions",
        json!({"prompt": ten, "max_tokens": 5}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["object"], "error");
    assert_eq!(body["type"], "BadRequestError");
    assert_eq!(body["code"], 400);
    assert_eq!(
        body["message"],
        "This model's maximum context length is 10 tokens. However, you requested 15 tokens (10 in the messages, 5 in the completion). Please reduce the length of the messages or completion."
    );
    let r = post(
        &m,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "a b c d e f g h i"}], "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 400);

    let r = post(&m, "/generate", json!({"text": ten})).await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.expect("json");
    assert_eq!(
        body["error"]["message"],
        "The input (10 tokens) is longer than the model's context length (10 tokens)."
    );
    let ev = sse_payloads(&post_text(&m, "/generate", json!({"text": ten, "stream": true})).await);
    assert_eq!(ev.len(), 2);
    let err: Value = serde_json::from_str(&ev[0]).expect("json");
    assert!(err["error"]["message"]
        .as_str()
        .expect("msg")
        .contains("context length"));
    assert_eq!(ev[1], "[DONE]");

    // 6 prompt tokens leave 4: a 100-token cap is clamped to 4.
    let ok = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": "a b c d e f", "max_tokens": 100}),
    )
    .await;
    assert_eq!(ok["usage"]["completion_tokens"], 4);
    assert_eq!(ok["choices"][0]["finish_reason"], "length");
    m.wait("the 400s", |s| s.count(Outcome::BadRequest) == 4)
        .await;
    m.stop().await;
}

/// Bad JSON and missing prompts are 400s in the server's error shape.
#[tokio::test]
async fn bad_bodies_are_400() {
    let m = Mock::start(MockConfig::for_tests()).await;
    let c = client();
    let r = c
        .post(m.at("/v1/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["object"], "error");
    let r = post(&m, "/v1/completions", json!({"max_tokens": 3})).await;
    assert_eq!(r.status(), 400);
    let r = post(&m, "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!(r.status(), 400);
    let r = post(&m, "/generate", json!({"sampling_params": {}})).await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.expect("json");
    assert!(body["error"]["message"].as_str().is_some());
    m.stop().await;
}

/// Capacity: 20 concurrent requests of 200 tokens on a 1000 tok/s × 10 server take about
/// 4000 / 10 000 = 0.4 s (never less), and one request alone runs at its per-request cap.
#[tokio::test]
async fn capacity_is_shared_by_concurrent_requests() {
    let m = Mock::start(MockConfig {
        capacity_tps: 1000.0,
        per_request_tps: 1000.0,
        time_scale: 10.0,
        mean_tokens: 1e7, // every completion hits its cap
        sigma: 0.1,
        ..MockConfig::for_tests()
    })
    .await;
    let c = client();
    let start = Instant::now();
    let reqs = (0..20).map(|i| {
        let c = c.clone();
        let url = m.at("/v1/completions");
        async move {
            let r: Value = c
                .post(url)
                .json(&json!({"prompt": format!("prompt {i}"), "max_tokens": 200}))
                .send()
                .await
                .expect("send")
                .json()
                .await
                .expect("json");
            r["usage"]["completion_tokens"].as_u64().expect("count")
        }
    });
    let counts = futures_util::future::join_all(reqs).await;
    let took = start.elapsed().as_secs_f64();
    assert!(counts.iter().all(|&n| n == 200));
    assert!(
        (0.38..2.0).contains(&took),
        "20 × 200 tokens at 10k tok/s took {took:.3}s"
    );
    assert_eq!(m.state.stats().tokens_generated, 4000);
    m.stop().await;

    // Alone, the per-request cap binds: 200 tokens at 100 × 10 tok/s = 0.2 s.
    let m = Mock::start(MockConfig {
        capacity_tps: 1000.0,
        per_request_tps: 100.0,
        time_scale: 10.0,
        mean_tokens: 1e7,
        sigma: 0.1,
        ..MockConfig::for_tests()
    })
    .await;
    let start = Instant::now();
    post_json(
        &m,
        "/generate",
        json!({"text": "solo", "sampling_params": {"max_new_tokens": 200}}),
    )
    .await;
    let took = start.elapsed().as_secs_f64();
    assert!((0.19..1.5).contains(&took), "took {took:.3}s");
    m.stop().await;
}

/// Opens a slow SGLang stream and returns it after its first event.
async fn open_slow_stream(
    m: &Mock,
    rid: &str,
) -> (
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>,
    String,
) {
    let r = post(
        m,
        "/generate",
        json!({"text": "long one", "sampling_params": {"max_new_tokens": 100000}, "stream": true, "rid": rid}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\n\n") {
        let chunk = s.next().await.expect("an event").expect("bytes");
        seen.push_str(std::str::from_utf8(&chunk).expect("utf8"));
    }
    (s, seen)
}

fn slow_config() -> MockConfig {
    MockConfig {
        time_scale: 1.0,
        per_request_tps: 200.0,
        mean_tokens: 1e7,
        sigma: 0.1,
        ..MockConfig::for_tests()
    }
}

/// `/abort_request` ends a running SGLang stream: a last event with finish_reason
/// "abort", then `[DONE]`; the request leaves the batch and counts as aborted.
#[tokio::test]
async fn abort_request_ends_the_stream() {
    let m = Mock::start(slow_config()).await;
    let (mut s, mut seen) = open_slow_stream(&m, "to-abort").await;
    assert_eq!(m.state.stats().active, 1);
    let r = post(&m, "/abort_request", json!({"rid": "to-abort"})).await;
    assert_eq!(r.status(), 200);
    while let Some(chunk) = s.next().await {
        seen.push_str(std::str::from_utf8(&chunk.expect("clean end")).expect("utf8"));
    }
    let ev = sse_json(&seen);
    let last = ev.last().expect("events");
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort");
    assert_eq!(last["meta_info"]["id"], "to-abort");
    let n = last["meta_info"]["completion_tokens"]
        .as_u64()
        .expect("count");
    assert!(n < 100_000);
    m.wait("the abort", |s| {
        s.count(Outcome::Aborted) == 1 && s.active == 0
    })
    .await;
    m.stop().await;
}

/// `--log` writes one flushed JSON line per generation request with its endpoint, rid
/// (body rid or `X-Request-Id`), outcome and counts, including clients that went away.
#[tokio::test]
async fn log_file_has_one_line_per_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mock.jsonl");
    let m = Mock::start(MockConfig {
        log: Some(path.clone()),
        ..slow_config()
    })
    .await;
    let fast = post_json(
        &m,
        "/generate",
        json!({"text": "hi", "rid": "r-ok", "sampling_params": {"max_new_tokens": 3}}),
    )
    .await;
    assert_eq!(fast["meta_info"]["completion_tokens"], 3);
    let r = client()
        .post(m.at("/v1/completions"))
        .header("X-Request-Id", "hdr-1")
        .json(&json!({"prompt": "a b", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .expect("send");
    let _ = r.text().await.expect("body");
    let r = post(&m, "/v1/chat/completions", json!({"messages": "nope"})).await;
    assert_eq!(r.status(), 400);
    let (s, _) = open_slow_stream(&m, "r-gone").await;
    drop(s); // the client goes away mid-stream
    m.wait("four ended requests", |s| s.ended() == 4).await;

    let text = std::fs::read_to_string(&path).expect("log");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    let find = |rid: &str| {
        lines
            .iter()
            .find(|l| l["rid"] == rid)
            .unwrap_or_else(|| panic!("no line for {rid}: {text}"))
    };
    let ok = find("r-ok");
    assert_eq!(ok["endpoint"], "/generate");
    assert_eq!(ok["outcome"], "ok");
    assert_eq!(ok["stream"], false);
    assert_eq!(ok["prompt_tokens"], 1);
    assert_eq!(ok["completion_tokens"], 3);
    assert!(ok["ts_ms"].as_u64().expect("ts") > 1_600_000_000_000);
    let hdr = find("hdr-1");
    assert_eq!(hdr["endpoint"], "/v1/completions");
    assert_eq!(
        (hdr["outcome"].as_str(), hdr["stream"].as_bool()),
        (Some("ok"), Some(true))
    );
    assert_eq!(hdr["completion_tokens"], 2);
    let gone = find("r-gone");
    assert_eq!(gone["outcome"], "client_gone");
    assert!(gone["completion_tokens"].as_u64().expect("count") >= 1);
    let bad = lines
        .iter()
        .find(|l| l["outcome"] == "400")
        .expect("400 line");
    assert_eq!(bad["endpoint"], "/v1/chat/completions");
    assert!(bad["rid"].is_null());
    assert_eq!(m.state.stats().active, 0, "a gone client frees its slot");
    m.stop().await;
}

/// `drop_mid_stream` cuts the connection: a stream errors after some events and never
/// sends `[DONE]`; a non-streaming request gets no complete response.
#[tokio::test]
async fn dropped_connections_fail_the_attempt() {
    let m = Mock::start(MockConfig {
        drop_mid_stream: 1.0,
        time_scale: 20.0,
        per_request_tps: 200.0,
        ..MockConfig::for_tests()
    })
    .await;
    let r = post(
        &m,
        "/generate",
        json!({"text": "cut", "sampling_params": {"max_new_tokens": 200}, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut seen = String::new();
    let mut failed = false;
    while let Some(chunk) = s.next().await {
        match chunk {
            Ok(b) => seen.push_str(std::str::from_utf8(&b).expect("utf8")),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the body must end in an error: {seen}");
    assert!(!seen.contains("[DONE]"));
    let got = client()
        .post(m.at("/v1/completions"))
        .json(&json!({"prompt": "cut", "max_tokens": 200}))
        .send()
        .await;
    let complete = match got {
        Ok(r) => r.bytes().await.is_ok(),
        Err(_) => false,
    };
    assert!(
        !complete,
        "a non-streaming drop must not deliver a whole body"
    );
    m.wait("two drops", |s| s.count(Outcome::Dropped) == 2)
        .await;
    m.stop().await;
}

/// `malformed` answers 200 with a truncated JSON body, or slips one broken event into a
/// stream that otherwise completes.
#[tokio::test]
async fn malformed_bodies_and_events() {
    let m = Mock::start(MockConfig {
        malformed: 1.0,
        ..MockConfig::for_tests()
    })
    .await;
    let r = post(
        &m,
        "/v1/completions",
        json!({"prompt": "p", "max_tokens": 50}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("body");
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
    let body = post_text(&m, "/generate", json!({"text": "p", "stream": true})).await;
    let payloads = sse_payloads(&body);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let bad = payloads
        .iter()
        .filter(|p| serde_json::from_str::<Value>(p).is_err() && *p != "[DONE]")
        .count();
    assert_eq!(bad, 1);
    m.wait("two malformed", |s| s.count(Outcome::Malformed) == 2)
        .await;
    m.stop().await;
}

/// A hanging request never answers: the client's timeout ends it (logged "hang"), and a
/// shutdown releases one still hanging so the server stops.
#[tokio::test]
async fn hanging_requests_end_with_the_client_or_shutdown() {
    let m = Mock::start(MockConfig {
        hang: 1.0,
        ..MockConfig::for_tests()
    })
    .await;
    let r = client()
        .post(m.at("/generate"))
        .json(&json!({"text": "wait"}))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(r.is_err_and(|e| e.is_timeout()));
    m.wait("the hang to end", |s| s.count(Outcome::Hang) == 1)
        .await;

    let url = m.at("/v1/completions");
    let pending = tokio::spawn(async move {
        client()
            .post(url)
            .json(&json!({"prompt": "wait"}))
            .send()
            .await
    });
    m.wait("a second hang", |s| s.in_flight == 1).await;
    let state = Arc::clone(&m.state);
    m.stop().await;
    let r = pending.await.expect("join");
    let complete = match r {
        Ok(resp) => resp.bytes().await.is_ok(),
        Err(_) => false,
    };
    assert!(!complete);
    assert_eq!(state.stats().count(Outcome::Hang), 2);
}

/// The mock's whole token model: words `" w{t}"`, the think and tool-call markers
/// 32001–32004, and `0x1000000 + c` for the character `c`.
fn detok_all(ids: &[u64]) -> String {
    ids.iter()
        .map(|&t| match t {
            32_001 => "<think>\n".to_owned(),
            32_002 => "\n</think>\n\n".to_owned(),
            32_003 => "<tool_call>\n".to_owned(),
            32_004 => "\n</tool_call>".to_owned(),
            t if t >= 0x0100_0000 => char::from_u32((t - 0x0100_0000) as u32)
                .expect("char id")
                .to_string(),
            t => format!(" w{t}"),
        })
        .collect()
}

/// Streams that arrive over several events: 2,000 tokens/s per request at 1000× time.
fn thinking_config() -> MockConfig {
    MockConfig {
        think: true,
        per_request_tps: 2.0,
        ..MockConfig::for_tests()
    }
}

/// A chat request of one user message.
fn chat_body(text: &str, extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1000,
        "return_token_ids": true,
    });
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
    body
}

/// The chunks of a chat stream after the role chunk, without the usage chunk.
fn chat_chunks(ev: &[Value]) -> Vec<&Value> {
    ev.iter()
        .skip(1)
        .filter(|e| !e["choices"].as_array().expect("choices").is_empty())
        .collect()
}

/// The concatenated `delta.{field}` strings of a chat stream.
fn delta_text(chunks: &[&Value], field: &str) -> String {
    chunks
        .iter()
        .filter_map(|e| e["choices"][0]["delta"][field].as_str())
        .collect()
}

/// The concatenated `token_ids` of a chat stream.
fn delta_ids(chunks: &[&Value]) -> Vec<u64> {
    chunks
        .iter()
        .flat_map(|e| ids_of(&e["choices"][0]["token_ids"]))
        .collect()
}

/// `--think`: every completion opens with `<think>\n` (id 32001), the thinking words, then
/// `\n</think>\n\n` (id 32002) and the answer, on every API; the text is the concatenation
/// of the ids' texts and usage counts the markers; the ids fed back as a prompt read as
/// the same tokens.
#[tokio::test]
async fn think_blocks_open_every_completion_and_agree_with_the_ids() {
    let m = Mock::start(thinking_config()).await;
    let r = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": "why is the sky blue", "max_tokens": 1000, "return_token_ids": true}),
    )
    .await;
    let c = &r["choices"][0];
    let ids = ids_of(&c["token_ids"]);
    assert_eq!(ids[0], 32_001);
    let close = ids.iter().position(|&t| t == 32_002).expect("close marker");
    assert!(close > 1, "thinking words come between the markers");
    assert!(ids.len() > close + 1, "answer words follow the block");
    let text = c["text"].as_str().expect("text");
    assert_eq!(text, detok_all(&ids));
    assert!(text.starts_with("<think>\n w"), "{text}");
    assert!(
        text.contains(" w") && text.contains("\n</think>\n\n w"),
        "{text}"
    );
    assert_eq!(r["usage"]["completion_tokens"], ids.len());
    assert_eq!(c["finish_reason"], "stop");

    let g = post_json(
        &m,
        "/generate",
        json!({"text": "why is the sky blue", "sampling_params": {"max_new_tokens": 1000}}),
    )
    .await;
    let gids = ids_of(&g["output_ids"]);
    assert_eq!(gids, ids, "same prompt, same plan on both APIs");
    assert_eq!(g["text"], text);

    // The markers' text reads back as the markers: the completion fed back as ids and as
    // text is the same prompt.
    let as_text = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": text, "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(as_text["usage"]["prompt_tokens"], ids.len());
    assert_eq!(ids_of(&as_text["choices"][0]["prompt_token_ids"]), ids);
    m.stop().await;
}

/// `--reasoning-parser` splits the think block off chat answers: the whole answer's
/// `reasoning_content` (or `reasoning` with `--reasoning-field reasoning`) holds the
/// thinking words without markers and `content` the answer; a stream sends the thinking
/// as delta events of that field before any content event. Token ids and usage cover
/// everything, markers included, and the text of the ids is the markers around the two.
/// `/v1/completions` is never split.
#[tokio::test]
async fn the_reasoning_parser_splits_thinking_off_chat_answers() {
    for field in [ReasoningField::ReasoningContent, ReasoningField::Reasoning] {
        let name = field.as_str();
        let other = if name == "reasoning" {
            "reasoning_content"
        } else {
            "reasoning"
        };
        let m = Mock::start(MockConfig {
            reasoning_parser: true,
            reasoning_field: field,
            ..thinking_config()
        })
        .await;
        let whole = post_json(
            &m,
            "/v1/chat/completions",
            chat_body("think hard", json!({})),
        )
        .await;
        let msg = &whole["choices"][0]["message"];
        let ids = ids_of(&whole["choices"][0]["token_ids"]);
        let reasoning = msg[name].as_str().expect("reasoning field");
        let content = msg["content"].as_str().expect("content");
        assert!(msg.get(other).is_none(), "{name}: only one field: {msg}");
        assert!(!reasoning.contains("think>") && !content.contains("think>"));
        assert!(!reasoning.is_empty() && !content.is_empty());
        assert_eq!(
            detok_all(&ids),
            format!("<think>\n{reasoning}\n</think>\n\n{content}"),
            "{name}: ids cover the markers, the thinking and the answer"
        );
        assert_eq!(whole["usage"]["completion_tokens"], ids.len());

        let ev = sse_json(
            &post_text(
                &m,
                "/v1/chat/completions",
                chat_body("think hard", json!({"stream": true})),
            )
            .await,
        );
        let chunks = chat_chunks(&ev);
        assert_eq!(delta_text(&chunks, name), reasoning, "{name}");
        assert_eq!(delta_text(&chunks, "content"), content, "{name}");
        assert_eq!(delta_text(&chunks, other), "");
        let first_content = chunks
            .iter()
            .position(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
            })
            .expect("a content event");
        let last_reasoning = chunks
            .iter()
            .rposition(|e| e["choices"][0]["delta"].get(name).is_some())
            .expect("a reasoning event");
        assert!(last_reasoning < first_content, "thinking streams first");
        assert_eq!(
            delta_ids(&chunks),
            ids,
            "{name}: stream ids are the whole ids"
        );
        assert_eq!(
            chunks.last().expect("last")["choices"][0]["finish_reason"],
            "stop"
        );

        let raw = post_json(
            &m,
            "/v1/completions",
            json!({"prompt": "think hard", "max_tokens": 1000}),
        )
        .await;
        let raw_text = raw["choices"][0]["text"].as_str().expect("text");
        assert!(
            raw_text.starts_with("<think>\n"),
            "completions keep the block: {raw_text}"
        );
        m.stop().await;
    }

    // Without the parser the block stays in the chat content.
    let m = Mock::start(thinking_config()).await;
    let whole = post_json(
        &m,
        "/v1/chat/completions",
        chat_body("think hard", json!({})),
    )
    .await;
    let msg = &whole["choices"][0]["message"];
    assert!(msg.get("reasoning_content").is_none());
    let ids = ids_of(&whole["choices"][0]["token_ids"]);
    assert_eq!(msg["content"], detok_all(&ids));
    assert!(msg["content"]
        .as_str()
        .expect("content")
        .starts_with("<think>\n"));
    m.stop().await;
}

/// Thinking is switched off per request by `chat_template_kwargs.enable_thinking = false`
/// on chat, and by a prompt ending with an empty think block (as text or as the marker
/// ids) on the others: then no marker is generated and the parser finds no reasoning.
#[tokio::test]
async fn enable_thinking_false_and_an_empty_think_block_switch_thinking_off() {
    let m = Mock::start(MockConfig {
        reasoning_parser: true,
        ..thinking_config()
    })
    .await;
    let no_markers = |ids: &[u64]| !ids.iter().any(|t| (32_001..=32_002).contains(t));
    let on = post_json(&m, "/v1/chat/completions", chat_body("q", json!({}))).await;
    assert!(on["choices"][0]["message"]["reasoning_content"].is_string());
    let off = post_json(
        &m,
        "/v1/chat/completions",
        chat_body(
            "q",
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
        ),
    )
    .await;
    let msg = &off["choices"][0]["message"];
    assert!(msg["reasoning_content"].is_null(), "{msg}");
    let ids = ids_of(&off["choices"][0]["token_ids"]);
    assert!(!ids.is_empty() && no_markers(&ids));
    assert_eq!(msg["content"], detok(&ids));

    let text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let c = post_json(
        &m,
        "/v1/completions",
        json!({"prompt": text, "max_tokens": 1000, "return_token_ids": true}),
    )
    .await;
    let ids = ids_of(&c["choices"][0]["token_ids"]);
    assert!(!ids.is_empty() && no_markers(&ids), "{ids:?}");
    let g = post_json(
        &m,
        "/generate",
        json!({"input_ids": [7, 8, 32_001, 32_002], "sampling_params": {"max_new_tokens": 1000}}),
    )
    .await;
    assert!(no_markers(&ids_of(&g["output_ids"])));
    // A prompt that opened the block gets the thinking and the close marker only.
    let g = post_json(
        &m,
        "/generate",
        json!({"input_ids": [7, 8, 32_001], "sampling_params": {"max_new_tokens": 1000}}),
    )
    .await;
    let ids = ids_of(&g["output_ids"]);
    assert_ne!(ids[0], 32_001);
    assert_eq!(ids.iter().filter(|&&t| t == 32_002).count(), 1);
    m.stop().await;
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "fetch", "parameters": {"type": "object"}}}
    ])
}

/// With `tools` and a user message last, a chat answer is one tool call: a whole answer
/// has `content` null, `tool_calls[0]` with a `call_` id, an offered tool's name and JSON
/// arguments, finish reason `tool_calls`, and token ids spelling the Hermes-style call; a
/// stream announces the call (index, id, type, name) then sends the arguments in pieces
/// that assemble to the same JSON. With a `tool` result last it answers text.
#[tokio::test]
async fn tool_calls_whole_and_streamed() {
    let m = Mock::start(MockConfig {
        reasoning_parser: true,
        ..thinking_config()
    })
    .await;
    let body = chat_body("find cats", json!({"tools": tools()}));
    let whole = post_json(&m, "/v1/chat/completions", body.clone()).await;
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let msg = &choice["message"];
    assert!(msg["content"].is_null(), "{msg}");
    assert!(
        msg["reasoning_content"].is_string(),
        "thinking precedes the call"
    );
    let calls = msg["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert!(call["id"].as_str().expect("id").starts_with("call_"));
    assert_eq!(call["type"], "function");
    let name = call["function"]["name"].as_str().expect("name");
    assert!(["search", "fetch"].contains(&name), "{name}");
    let args_text = call["function"]["arguments"].as_str().expect("arguments");
    let args: Value = serde_json::from_str(args_text).expect("arguments are JSON");
    assert!(args["q"].as_str().expect("q").starts_with('w'));
    let ids = ids_of(&choice["token_ids"]);
    let text = detok_all(&ids);
    assert!(
        text.ends_with(&format!(
            "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args_text}}}\n</tool_call>"
        )),
        "{text}"
    );
    assert_eq!(whole["usage"]["completion_tokens"], ids.len());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = sse_json(&post_text(&m, "/v1/chat/completions", streamed).await);
    let chunks = chat_chunks(&ev);
    let pieces: Vec<&Value> = chunks
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert!(pieces.len() >= 2, "a head and argument pieces: {pieces:?}");
    let head = pieces[0];
    assert_eq!(head["index"], 0);
    assert_eq!(head["type"], "function");
    assert!(head["id"].as_str().expect("id").starts_with("call_"));
    assert_eq!(head["function"]["name"], name);
    assert!(head["function"].get("arguments").is_none());
    let assembled: String = pieces[1..]
        .iter()
        .map(|p| {
            assert_eq!(p["index"], 0);
            p["function"]["arguments"].as_str().expect("piece")
        })
        .collect();
    assert_eq!(assembled, args_text);
    serde_json::from_str::<Value>(&assembled).expect("assembled arguments are JSON");
    assert_eq!(
        delta_ids(&chunks),
        ids,
        "the stream's ids are every generated id"
    );
    assert_eq!(
        chunks.last().expect("last")["choices"][0]["finish_reason"],
        "tool_calls"
    );

    let mut after = body.clone();
    after["messages"] = json!([
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "three cats"}
    ]);
    let reply = post_json(&m, "/v1/chat/completions", after).await;
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["tool_calls"], json!([]));
    assert!(choice["message"]["content"]
        .as_str()
        .is_some_and(|c| c.starts_with(" w")));
    // The history's call and result are rendered into the prompt.
    let prompt = reply["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    // "tools: search fetch\n" 3 + "user: find cats\n" 3 + "assistant: <tool_call> {name}\n"
    // 3 + "tool: three cats\n" 3.
    assert_eq!(prompt, 12);
    m.stop().await;
}

/// A request seed changes the output on every API: the same seed gives the same
/// completion, another seed another one; without a seed the output is the prompt's.
#[tokio::test]
async fn seeds_pick_the_output() {
    let m = Mock::start(MockConfig::for_tests()).await;
    for (path, seeded) in [
        ("/v1/chat/completions", "seed"),
        ("/v1/completions", "seed"),
        ("/generate", "sampling_seed"),
    ] {
        let ids = |seed: Option<i64>| {
            let mut body = match path {
                "/generate" => json!({"text": "user: same prompt\n",
                    "sampling_params": {"max_new_tokens": 1000}}),
                "/v1/completions" => json!({"prompt": "user: same prompt\n",
                    "max_tokens": 1000, "return_token_ids": true}),
                _ => chat_body("same prompt", json!({})),
            };
            if let Some(s) = seed {
                match path {
                    "/generate" => body["sampling_params"][seeded] = json!(s),
                    _ => body[seeded] = json!(s),
                }
            }
            let m = &m;
            async move {
                let r = post_json(m, path, body).await;
                match path {
                    "/generate" => ids_of(&r["output_ids"]),
                    _ => ids_of(&r["choices"][0]["token_ids"]),
                }
            }
        };
        let unseeded = ids(None).await;
        assert_eq!(unseeded, ids(None).await, "{path}: no seed, same output");
        let a = ids(Some(1)).await;
        assert_eq!(a, ids(Some(1)).await, "{path}: same seed, same output");
        let b = ids(Some(2)).await;
        assert_ne!(a, b, "{path}: another seed, another output");
        assert_ne!(a, unseeded, "{path}: a seed changes the output");
        assert_ne!(ids(Some(-3)).await, a, "{path}: negative seeds are seeds");
    }
    m.stop().await;
}

/// `--log-bodies` adds each request's body, as received, to its log line: a chat turn's
/// messages (with the assistant's `reasoning_content` of history) can be read back, and
/// a body that is not JSON is kept as text. History reasoning counts as prompt tokens.
#[tokio::test]
async fn the_log_carries_request_bodies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mock.jsonl");
    let m = Mock::start(MockConfig {
        log: Some(path.clone()),
        log_bodies: true,
        ..MockConfig::for_tests()
    })
    .await;
    let messages = json!([
        {"role": "user", "content": "turn one"},
        {"role": "assistant", "content": "w1 w2", "reasoning_content": "w3 w4 w5"},
        {"role": "user", "content": "turn two"}
    ]);
    let body = json!({"messages": messages, "max_tokens": 5, "seed": 11});
    let r = post_json(&m, "/v1/chat/completions", body.clone()).await;
    // "user: turn one\n" 3 + "assistant: <think> w3 w4 w5 </think> w1 w2\n" 8 + 3.
    assert_eq!(r["usage"]["prompt_tokens"], 14);
    let bad = client()
        .post(m.at("/v1/completions"))
        .body("not json")
        .send()
        .await
        .expect("send");
    assert_eq!(bad.status(), 400);
    m.wait("two ended requests", |s| s.ended() == 2).await;
    let text = std::fs::read_to_string(&path).expect("log");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    let chat = lines
        .iter()
        .find(|l| l["endpoint"] == "/v1/chat/completions")
        .expect("chat line");
    assert_eq!(chat["request"], body);
    assert_eq!(
        chat["request"]["messages"][1]["reasoning_content"],
        "w3 w4 w5"
    );
    let raw = lines
        .iter()
        .find(|l| l["endpoint"] == "/v1/completions")
        .expect("completions line");
    assert_eq!(raw["request"], "not json");

    // Without the flag no body is logged.
    let quiet_path = dir.path().join("quiet.jsonl");
    let q = Mock::start(MockConfig {
        log: Some(quiet_path.clone()),
        ..MockConfig::for_tests()
    })
    .await;
    post_json(&q, "/v1/chat/completions", body).await;
    q.wait("one ended request", |s| s.ended() == 1).await;
    let line: Value = serde_json::from_str(
        std::fs::read_to_string(&quiet_path)
            .expect("log")
            .trim_end(),
    )
    .expect("JSON line");
    assert!(line.get("request").is_none(), "{line}");
    q.stop().await;
    m.stop().await;
}
