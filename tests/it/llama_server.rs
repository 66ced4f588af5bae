//! The server's own rendering against a real llama.cpp server: `llama-server` built from
//! the llama.cpp source in the llama-cpp-python sdist, serving a tiny Qwen3 GGUF (random
//! weights, the Qwen3 fixture's tokenizer and template), both made by
//! `scripts/llama-server.sh DIR` (25 minutes on 2 shared cores here, so not in `make test`:
//! `make test-llama-server` builds them and runs this with `SPOOL_TEST_LLAMA_SERVER=DIR`).

use crate::process::spool;
use crate::support::*;
use serde_json::{json, Value};
use spool::prompt::remote::IdsSource;
use spool::upstream::render::{detect, Detected, RenderKind};
use spool::upstream::{Upstream, UpstreamOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `llama-server` on a free loopback port, killed when dropped.
struct LlamaServer {
    child: Child,
    url: String,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn built() -> PathBuf {
    PathBuf::from(std::env::var("SPOOL_TEST_LLAMA_SERVER").expect(
        "SPOOL_TEST_LLAMA_SERVER names the folder scripts/llama-server.sh built (llama-server, tiny-qwen3.gguf)",
    ))
}

/// Starts llama-server with Jinja templates (the model's, or `template`), and waits until
/// its `/health` answers 200 (it loads the model first).
async fn start(template: Option<&Path>) -> LlamaServer {
    let dir = built();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = Command::new(dir.join("llama-server"));
    c.arg("-m")
        .arg(dir.join("tiny-qwen3.gguf"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-c", "4096", "--jinja"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(t) = template {
        c.arg("--chat-template-file").arg(t);
    }
    let server = LlamaServer {
        child: c.spawn().expect("llama-server starts"),
        url: format!("http://127.0.0.1:{port}"),
    };
    spool::upstream::tls::install_provider();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let up = client.get(format!("{}/health", server.url)).send().await;
        if up.is_ok_and(|r| r.status().is_success()) {
            return server;
        }
        assert!(
            Instant::now() < deadline,
            "llama-server not healthy in 2 min"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn post(url: &str, path: &str, body: Value) -> Value {
    let (status, v) = post_json(url, path, body).await;
    assert_eq!(status, 200, "{path}: {v}");
    v
}

/// A config of chats and plain prompts against `url` with the Qwen3 `[tokenizer]` and
/// `lines`; short completions.
fn config(dir: &Path, url: &str, lines: &str) -> PathBuf {
    write_chats(&dir.join("chat.jsonl"), "c", 6);
    write_prompts(&dir.join("plain.jsonl"), "p", 3);
    let ds = |name, file| Ds {
        name,
        file,
        budget: None,
    };
    let cfg = write_config(
        dir,
        url,
        "completions",
        false,
        &[ds("chat", "chat.jsonl"), ds("plain", "plain.jsonl")],
        &format!("{}{lines}", qwen_table()),
    );
    crate::process::edit_config(&cfg, "max_tokens = 200", "max_tokens = 8");
    cfg
}

/// Against llama-server: spool finds its `/apply-template` and `/tokenize`; spool's
/// rendering of Qwen3's template equals the server's id for id (the check passes and the
/// run finishes); with `source = "server"` every stored row has exactly the ids the
/// server gives for its messages; a server started with another template stops the run
/// with exit 2 and the diff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs scripts/llama-server.sh; run by make test-llama-server"]
async fn llama_server_renders_as_spool_does() {
    let server = start(None).await;
    let up = Upstream::new(UpstreamOptions {
        api: spool::config::Api::Completions,
        model: "tiny".into(),
        api_key: None,
        stream: false,
        request_timeout: Duration::from_secs(30),
        max_response_bytes: 1 << 20,
        pool_size: 2,
    })
    .unwrap();
    assert_eq!(
        detect(&up, &server.url, "tiny").await,
        Detected::Renders(RenderKind::LlamaCpp)
    );

    let tmp = tempfile::tempdir().unwrap();
    let client = tmp.path().join("client");
    std::fs::create_dir_all(&client).unwrap();
    let out = spool(&config(&client, &server.url, ""), &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("template check passed"), "{stderr}");

    let on_server = tmp.path().join("server");
    std::fs::create_dir_all(&on_server).unwrap();
    let out = spool(
        &config(&on_server, &server.url, "source = \"server\"\n"),
        &["run"],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = shard_rows(&on_server.join("out"), "chat");
    assert_eq!(rows.len(), 6);
    for r in rows {
        let messages: Value = serde_json::from_str(r.messages.as_deref().unwrap()).unwrap();
        let text = post(
            &server.url,
            "/apply-template",
            json!({"messages": messages}),
        )
        .await;
        let text = text["prompt"].as_str().unwrap().to_string();
        let ids = post(
            &server.url,
            "/tokenize",
            json!({"content": text, "add_special": true, "parse_special": true}),
        )
        .await;
        let ids: Vec<u32> = ids["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(r.prompt, text);
        assert_eq!(r.prompt_token_ids, Some(ids));
        assert_eq!(r.prompt_ids_source, Some(IdsSource::Server));
    }
    drop(server);

    let different = tmp.path().join("different.jinja");
    std::fs::write(
        &different,
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
    )
    .unwrap();
    let server = start(Some(&different)).await;
    let stopped = tmp.path().join("stopped");
    std::fs::create_dir_all(&stopped).unwrap();
    let out = spool(&config(&stopped, &server.url, ""), &["run"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("dataset `chat`, row 0 (line 1, id `c0`)"),
        "{stderr}"
    );
    assert!(stderr.contains("server text:"), "{stderr}");
}
