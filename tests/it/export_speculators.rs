//! `spool export --format speculators | token-freq | draft-vocab` from a real run (mock
//! server, Qwen3 tokenizer, two samples, multi-turn chats), read back by the frameworks'
//! own code: speculators' `prepare-data` and training loader, its token counts and vocab
//! mapping, and SpecForge's vocab mapping.

use crate::support::*;
use serde_json::{json, Value};
use spool::output::export::{ExportOptions, ExportReport, Format};
use spool::store::row::ShardRow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Qwen3's `<|im_end|>`, appended to completions that stopped without it.
const IM_END: u32 = 151645;
/// Qwen3's `config.json` `vocab_size` (the lm_head rows; the tokenizer has 151669 ids).
const QWEN3_VOCAB: usize = 151936;

fn export(
    cfg: &spool::config::Config,
    format: Format,
    out: &Path,
    dataset: Option<&str>,
    draft_vocab: Option<usize>,
    target_vocab: Option<usize>,
) -> Result<ExportReport, spool::output::export::error::ExportError> {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            dataset: dataset.map(Into::into),
            draft_vocab,
            target_vocab,
            ..ExportOptions::new(format, out)
        },
    )
}

/// A model folder as HuggingFace lays it out: Qwen3's tokenizer files and a `config.json`
/// with the model's `vocab_size`.
fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("qwen3");
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures().join("tokenizers/qwen3");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("config.json"),
        json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
               "vocab_size": QWEN3_VOCAB, "hidden_size": 1024, "num_attention_heads": 16,
               "num_key_value_heads": 8, "num_hidden_layers": 2, "intermediate_size": 3072})
        .to_string(),
    )
    .unwrap();
    dir
}

/// `n` ShareGPT conversations of three user turns (the original replies are regenerated).
fn write_conversations(path: &Path, prefix: &str, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        let mut conv = vec![json!({"from": "system", "value": "You are terse."})];
        for k in 0..3 {
            conv.push(json!({"from": "human", "value": format!("Question {k} of {prefix}{i}?")}));
            conv.push(json!({"from": "gpt", "value": format!("ORIGINAL-{i}-{k}")}));
        }
        s.push_str(&json!({"id": format!("{prefix}{i}"), "conversations": conv}).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

/// Runs a helper of tests/python with `args`; its stdout is one JSON value.
fn python(script: &str, args: &[&Path]) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed for {script}): {e}"));
    assert!(
        out.status.success(),
        "{script} failed (it needs the framework installed):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{script}: {e}: {stdout}"))
}

/// The tensors of a safetensors file: (dtype, shape, little-endian bytes) by name, and its
/// metadata.
type Tensors = (
    HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    HashMap<String, String>,
);

fn read_safetensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    (tensors, meta.metadata().clone().unwrap_or_default())
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A run with two samples per prompt and three-turn conversations, exported as
/// `speculators`: one line per generation whose ids are the shard's prompt ids ++
/// completion ids (end-of-turn appended) under a 0/1 mask, keyed `<id>_s<sample>_gen<turn>`.
/// speculators' own `prepare-data` and training loader read the file and give the same
/// (input_ids, loss_mask) pairs token for token, its `token_freq.pt` equals spool's
/// `token-freq` counts, its vocab mapping equals spool's `draft-vocab` d2t/t2d (a clean
/// cut, a tie at the cut, and fewer seen ids than N) — read from spool's `d2t-N.npy` /
/// `t2d-N.npy` by speculators' own loaders, as they are — and SpecForge's mapping equals
/// them too except, where ids tie at the cut, in which of the tied ids it keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculators_token_freq_and_draft_vocab_read_by_the_frameworks() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    write_chats(&dir.path().join("chat.jsonl"), "c", 20);
    write_conversations(&dir.path().join("conv.jsonl"), "v", 8);
    write_prompts(&dir.path().join("tiny.jsonl"), "t", 2);
    let table = format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        model.join("tokenizer.json").display(),
        model.join("tokenizer_config.json").display()
    );
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "chat",
                file: "chat.jsonl",
                budget: None,
            },
            Ds {
                name: "conv",
                file: "conv.jsonl",
                budget: None,
            },
            Ds {
                name: "tiny",
                file: "tiny.jsonl",
                budget: None,
            },
        ],
        &table,
    );
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    let text = text
        .replace(
            "path = \"chat.jsonl\"\n",
            "path = \"chat.jsonl\"\nsamples = 2\n[dataset.sampling]\ntemperature = [0.6, 1.0]\n",
        )
        .replace(
            "name = \"conv\"\n",
            "name = \"conv\"\nsamples = 2\nturns = \"all\"\n",
        );
    std::fs::write(&cfg_path, text).unwrap();
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let out = dir.path().join("out");
    let shards: Vec<ShardRow> = ["chat", "conv", "tiny"]
        .iter()
        .flat_map(|d| shard_rows(&out, d))
        .collect();
    assert_eq!(shards.len(), 20 * 2 + 8 * 2 * 3 + 2, "every generation");
    let cfg = load(&cfg_path);
    let ex = dir.path().join("export");

    // speculators: one line per generation, checked against the shards.
    let rows_path = ex.join("rows.jsonl");
    let r = export(&cfg, Format::Speculators, &rows_path, None, None, None).unwrap();
    assert_eq!(r.accounting.kept(), shards.len() as u64);
    let lines: Vec<Value> = std::fs::read_to_string(&rows_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), shards.len());
    let by_key: HashMap<(String, String), &ShardRow> = shards
        .iter()
        .map(|s| {
            (
                (
                    s.dataset.clone(),
                    format!("{}_s{}_gen{}", s.id, s.sample, s.turn),
                ),
                s,
            )
        })
        .collect();
    let mut seen = HashSet::new();
    let mut appended = 0;
    for l in &lines {
        let m = &l["metadata"];
        let key = (
            m["dataset"].as_str().unwrap().to_string(),
            l["id"].as_str().unwrap().to_string(),
        );
        assert!(seen.insert(key.clone()), "{key:?} twice");
        let s = by_key[&key];
        assert_eq!(
            l["primary_id"],
            format!("{}_s{}", s.id, s.sample),
            "{key:?}"
        );
        assert_eq!(
            (m["sample"].as_u64(), m["turn"].as_u64()),
            (Some(s.sample.into()), Some(s.turn.into()))
        );
        let p = s.prompt_token_ids.clone().unwrap();
        let mut c = s.completion_token_ids.clone().unwrap();
        let add = s.finish_reason == "stop" && c.last() != Some(&IM_END);
        if add {
            c.push(IM_END);
            appended += 1;
        }
        assert_eq!(m["end_of_turn_appended"], add, "{key:?}");
        let want: Vec<u32> = p.iter().chain(&c).copied().collect();
        let got: Vec<u32> = serde_json::from_value(l["input_ids"].clone()).unwrap();
        assert_eq!(got, want, "{key:?}: prompt ids ++ completion ids");
        let mask: Vec<u8> = serde_json::from_value(l["loss_mask"].clone()).unwrap();
        let want_mask: Vec<u8> = std::iter::repeat_n(0, p.len())
            .chain(std::iter::repeat_n(1, c.len()))
            .collect();
        assert_eq!(mask, want_mask, "{key:?}");
        assert_eq!(m["finish_reason"], s.finish_reason.as_str());
        // What generated the row: the config's sampling with the row's draw over it.
        let sampling: Value = serde_json::from_str(m["sampling"].as_str().unwrap()).unwrap();
        assert_eq!(sampling["max_tokens"], 200, "{key:?}");
        let drawn: Value = serde_json::from_str(s.sampling.as_deref().unwrap()).unwrap();
        assert_eq!(sampling["temperature"], drawn["temperature"], "{key:?}");
    }
    assert!(
        appended > 0,
        "the mock leaves the end of turn out of some completions"
    );
    let turns: HashSet<u64> = lines
        .iter()
        .map(|l| l["metadata"]["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(turns, HashSet::from([0, 1, 2]));

    // Completion-token counts over the kept rows, from the exported rows.
    let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
    for l in &lines {
        for (t, m) in l["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(l["loss_mask"].as_array().unwrap())
        {
            if m == 1 {
                *counts.entry(t.as_u64().unwrap() as u32).or_default() += 1;
            }
        }
    }
    let tokens: u64 = counts.values().sum();

    // token-freq: int64 counts over the model's vocabulary (config.json's vocab_size).
    let tf_path = ex.join("token_freq.safetensors");
    export(&cfg, Format::TokenFreq, &tf_path, None, None, None).unwrap();
    let (t, meta) = read_safetensors(&tf_path);
    let (dtype, shape, bytes) = &t["counts"];
    assert_eq!(
        (*dtype, shape.as_slice()),
        (safetensors::Dtype::I64, &[QWEN3_VOCAB][..])
    );
    let file_counts = i64s(bytes);
    for (i, &n) in file_counts.iter().enumerate() {
        assert_eq!(
            n as u64,
            counts.get(&(i as u32)).copied().unwrap_or(0),
            "id {i}"
        );
    }
    assert_eq!(meta["tokens"], tokens.to_string());
    assert_eq!(meta["rows"], lines.len().to_string());
    assert_eq!(meta["target_vocab_size"], QWEN3_VOCAB.to_string());

    // draft-vocab at a clean cut and at a tie, both small enough for SpecForge's
    // O(N × V) mapping; and fewer seen ids than N on the two-prompt dataset.
    let mut sorted: Vec<u64> = counts.values().copied().collect();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let clean = (8..300)
        .find(|&n| sorted[n - 1] > sorted[n])
        .expect("a cut between two counts");
    let tie = (clean + 1..300)
        .find(|&n| sorted[n - 1] == sorted[n])
        .expect("a cut inside a run of equal counts");
    let mut drafts = Vec::new();
    for n in [clean, tie] {
        let p = ex.join(format!("draft_{n}.safetensors"));
        export(&cfg, Format::DraftVocab, &p, None, Some(n), None).unwrap();
        let (t, meta) = read_safetensors(&p);
        let d2t = i64s(&t["d2t"].2);
        let t2d = &t["t2d"];
        assert_eq!(
            (t["d2t"].0, t2d.0),
            (safetensors::Dtype::I64, safetensors::Dtype::BOOL)
        );
        assert_eq!((d2t.len(), t2d.1.as_slice()), (n, &[QWEN3_VOCAB][..]));
        assert_eq!(
            t2d.2.iter().filter(|&&b| b == 1).count(),
            n,
            "t2d.sum() == N"
        );
        let ids: Vec<i64> = d2t.iter().enumerate().map(|(i, d)| d + i as i64).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(ids.iter().all(|&i| t2d.2[i as usize] == 1));
        // The N most frequent: no id left out is more frequent than one kept.
        let kept_min = ids.iter().map(|&i| counts[&(i as u32)]).min().unwrap();
        assert_eq!(kept_min, sorted[n - 1]);
        assert_eq!(meta["draft_vocab_size"], n.to_string());
        drafts.push(p);
    }
    assert!(ex.join(format!("draft_{clean}.safetensors")).exists());

    let tiny_rows = ex.join("tiny.jsonl");
    export(
        &cfg,
        Format::Speculators,
        &tiny_rows,
        Some("tiny"),
        None,
        None,
    )
    .unwrap();
    let tiny_tf = ex.join("tiny_freq.safetensors");
    export(&cfg, Format::TokenFreq, &tiny_tf, Some("tiny"), None, None).unwrap();
    let tiny_distinct: usize = read_safetensors(&tiny_tf).1["distinct_ids"]
        .parse()
        .unwrap();
    let fill_n = tiny_distinct + 40;
    // Its own folder: the .npy files beside it are named by N only.
    let fill = ex.join("tiny").join("tiny_draft.safetensors");
    export(
        &cfg,
        Format::DraftVocab,
        &fill,
        Some("tiny"),
        Some(fill_n),
        None,
    )
    .unwrap();
    let fill_meta = read_safetensors(&fill).1;
    assert_eq!(fill_meta["unseen_ids_added"], "40");

    // speculators reads them.
    let spec = json!({
        "model": model,
        "work": dir.path().join("py"),
        "cases": [
            {"rows": rows_path, "token_freq": tf_path, "draft": drafts},
            {"rows": tiny_rows, "token_freq": tiny_tf, "draft": [fill]},
        ],
    });
    let spec_path = dir.path().join("spec.json");
    std::fs::write(&spec_path, spec.to_string()).unwrap();
    let res = python("speculators_prepare.py", &[&spec_path]);
    assert_eq!(
        res["target_vocab"], QWEN3_VOCAB,
        "speculators reads the same config"
    );
    let big = &res["cases"][0];
    assert_eq!(big["rows"], lines.len());
    assert_eq!(
        big["prepared"],
        lines.len(),
        "prepare-data keeps every row: {big}"
    );
    assert_eq!(big["pairs_equal"], true, "token for token: {big}");
    assert_eq!(big["supervised_tokens"], tokens);
    assert_eq!(
        big["text_equal"],
        lines.len(),
        "text is the decoded ids: {big}"
    );
    assert_eq!(big["token_freq_equal"], true, "{big}");
    for c in &res["cases"].as_array().unwrap()[..] {
        assert_eq!(c["pairs_equal"], true, "{c}");
        assert_eq!(c["token_freq_equal"], true, "{c}");
        for d in c["draft"].as_array().unwrap() {
            assert_eq!(
                (&d["d2t_equal"], &d["t2d_equal"]),
                (&json!(true), &json!(true)),
                "{d}"
            );
            assert_eq!(d["dtypes"], json!(["torch.int64", "torch.bool"]));
            assert_eq!(d["npy_loads"], true, "{d}");
            assert_eq!(d["npy_found"], true, "{d}");
            assert_eq!(d["npy_dtypes"], json!(["int64", "bool"]), "{d}");
        }
    }

    // SpecForge's mapping from the same rows.
    let sf_work = dir.path().join("sf");
    let mut args: Vec<&Path> = vec![&rows_path, &sf_work];
    args.extend(drafts.iter().map(|p| p.as_path()));
    let sf = python("vocab_specforge.py", &args);
    let sf = sf.as_array().unwrap();
    assert!(sf.iter().all(|d| d["pt_loads"] == true), "{sf:?}");
    assert_eq!(sf[0]["equal"], true, "a clean cut: {}", sf[0]);
    assert_eq!(sf[1]["differ_only_in_ties"], true, "{}", sf[1]);
    assert_eq!(sf[1]["t2d_sum_theirs"], tie);
    let sf_tiny = python("vocab_specforge.py", &[&tiny_rows, &sf_work, &fill]);
    assert_eq!(sf_tiny[0]["differ_only_in_ties"], true, "{}", sf_tiny[0]);
    assert_eq!(sf_tiny[0]["pt_loads"], true, "{}", sf_tiny[0]);
    eprintln!(
        "speculators: {} rows ({} through prepare-data, {} with text = decode), {} completion tokens, {} distinct ids; draft N = {clean} (clean), {tie} (tie: SpecForge differs in {} ids), {fill_n} (fill: SpecForge equal = {})",
        lines.len(),
        big["prepared"],
        big["text_equal"],
        tokens,
        counts.len(),
        sf[1]["ids_differing"],
        sf_tiny[0]["equal"]
    );
}

/// `draft-vocab` needs the model's vocabulary size: without `--target-vocab` or a
/// `config.json` beside the tokenizer it refuses, saying so, and writes nothing;
/// `--target-vocab` (library and CLI) gives t2d that length; `token-freq` falls back to
/// the tokenizer's size and says so in its metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_vocab_needs_the_models_vocabulary_size() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("p.jsonl"), "p", 6);
    let qwen = fixtures().join("tokenizers/qwen3");
    let table = format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        qwen.join("tokenizer.json").display(),
        qwen.join("tokenizer_config.json").display()
    );
    let cfg_path = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        true,
        &[Ds {
            name: "p",
            file: "p.jsonl",
            budget: None,
        }],
        &table,
    );
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let cfg = load(&cfg_path);
    let out = dir.path().join("dv.safetensors");
    let err = format!(
        "{:#}",
        export(&cfg, Format::DraftVocab, &out, None, Some(16), None).unwrap_err()
    );
    assert!(
        err.contains("--target-vocab") && err.contains("config.json"),
        "{err}"
    );
    assert!(!out.exists());
    let err = format!(
        "{:#}",
        export(&cfg, Format::DraftVocab, &out, None, None, Some(100)).unwrap_err()
    );
    assert!(err.contains("--draft-vocab N"), "{err}");
    // A vocabulary smaller than the ids is refused, naming a row.
    let err = format!(
        "{:#}",
        export(&cfg, Format::DraftVocab, &out, None, Some(4), Some(100)).unwrap_err()
    );
    assert!(
        err.contains("outside the target vocabulary of 100"),
        "{err}"
    );

    let st = Command::new(spool_bin())
        .args([
            "export",
            "-q",
            "--format",
            "draft-vocab",
            "--draft-vocab",
            "16",
        ])
        .args(["--target-vocab", &QWEN3_VOCAB.to_string(), "--out"])
        .arg(&out)
        .arg("-c")
        .arg(&cfg_path)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let (t, meta) = read_safetensors(&out);
    assert_eq!(t["t2d"].1, vec![QWEN3_VOCAB]);
    assert_eq!(t["d2t"].1, vec![16]);
    assert_eq!(meta["target_vocab_source"], "--target-vocab");

    let tf = dir.path().join("tf.safetensors");
    export(&cfg, Format::TokenFreq, &tf, None, None, None).unwrap();
    let (t, meta) = read_safetensors(&tf);
    assert_eq!(
        t["counts"].1,
        vec![151669],
        "the tokenizer's ids, added tokens included"
    );
    assert!(
        meta["target_vocab_source"].contains("tokenizer's size"),
        "{meta:?}"
    );
}
