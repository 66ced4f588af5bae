//! `--holdout` and what shows the data: the held-out eval split in every form, the
//! `report` page and the `hf` card's counts and histograms, checked against the shards
//! (tests/python/hf_splits.py loads the `hf` folder with HuggingFace `datasets`).

use crate::support::*;
use serde_json::Value;
use spool::output::export::{ExportOptions, Format};
use spool::store::row::ShardRow;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// A run of two datasets against the mock with Qwen3's tokenizer: 40 three-turn
/// conversations regenerated with `turns = "all"` and `samples = 2`, and 80 prompts (some
/// cut by `max_tokens`).
async fn run(dir: &Path) -> (spool::config::Config, Vec<ShardRow>) {
    let mock = Mock::start(fast_mock()).await;
    let mut conv = String::new();
    for i in 0..40 {
        let mut m = Vec::new();
        for k in 0..3 {
            m.push(serde_json::json!({"role": "user", "content": format!("Question {k} of {i}?")}));
            m.push(serde_json::json!({"role": "assistant", "content": "source"}));
        }
        conv.push_str(&serde_json::json!({"id": format!("c{i}"), "messages": m}).to_string());
        conv.push('\n');
    }
    std::fs::write(dir.join("conv.jsonl"), conv).unwrap();
    write_prompts(&dir.join("plain.jsonl"), "p", 80);
    let cfg_path = write_config(
        dir,
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "conv",
                file: "conv.jsonl",
                budget: None,
            },
            Ds {
                name: "plain",
                file: "plain.jsonl",
                budget: None,
            },
        ],
        &qwen_table(),
    );
    let text = std::fs::read_to_string(&cfg_path).unwrap().replace(
        "path = \"conv.jsonl\"\n",
        "path = \"conv.jsonl\"\nturns = \"all\"\nsamples = 2\n",
    );
    let text = text.replace(
        "path = \"plain.jsonl\"\n",
        "path = \"plain.jsonl\"\n[dataset.sampling]\nmax_tokens = 60\n",
    );
    std::fs::write(&cfg_path, text).unwrap();
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let out = dir.join("out");
    let rows = ["conv", "plain"]
        .iter()
        .flat_map(|d| shard_rows(&out, d))
        .collect();
    (load(&cfg_path), rows)
}

fn export(cfg: &spool::config::Config, format: Format, out: &Path, holdout: Option<f64>) {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            holdout,
            ..ExportOptions::new(format, out)
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e:#}", format.name()));
}

/// (dataset, item id) of each line of a JSONL export.
fn items(
    path: &Path,
    dataset: impl Fn(&Value) -> String,
    id: impl Fn(&Value) -> String,
) -> Vec<(String, String)> {
    read_jsonl(path)
        .iter()
        .map(|l| (dataset(l), id(l)))
        .collect()
}

/// Runs tests/python/hf_splits.py on an `hf` folder: {split: [[dataset, id], ...]}.
fn hf_splits(dir: &Path, cache: &Path) -> BTreeMap<String, Vec<(String, String)>> {
    let out = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/hf_splits.py"))
        .arg(dir)
        .env("HF_HOME", cache.join("home"))
        .env("HF_DATASETS_CACHE", cache.join("datasets"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .expect("python3 with datasets");
    assert!(
        out.status.success(),
        "hf_splits.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `--holdout 0.2` writes the held-out items beside the train file in every form (an
/// `_eval` split per dataset in `hf`): every kept row is on exactly one side, every row of
/// an item on the same side, the held-out items are the same in every form and in a
/// second export, each dataset holds out some of its own items, and the vocabulary forms
/// count the training rows only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holdout_is_deterministic_per_dataset_and_whole_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, rows) = run(dir.path()).await;
    assert_eq!(rows.len(), 40 * 2 * 3 + 80);
    let all: BTreeMap<(String, String), usize> = rows.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry((r.dataset.clone(), r.id.clone())).or_default() += 1;
        m
    });
    let ex = dir.path().join("ex");
    let ds = |l: &Value| l["dataset"].as_str().unwrap().to_string();
    let id = |l: &Value| l["id"].as_str().unwrap().to_string();
    let mut eval_sets = Vec::new();
    for (format, file) in [
        (Format::Sharegpt, "sg.jsonl"),
        (Format::TokensJsonl, "tokens.jsonl"),
        (Format::Tokens, "tokens.parquet"),
    ] {
        let out = ex.join(file);
        export(&cfg, format, &out, Some(0.2));
        let eval = spool::output::export::holdout::eval_path(&out);
        assert!(eval.is_file(), "{file}: no eval file at {}", eval.display());
        if format == Format::Tokens {
            // Parquet: the row counts add up.
            let n = |p: &Path| {
                parquet::file::reader::SerializedFileReader::new(std::fs::File::open(p).unwrap())
                    .map(|r| {
                        use parquet::file::reader::FileReader;
                        r.metadata().file_metadata().num_rows() as usize
                    })
                    .unwrap()
            };
            assert_eq!(n(&out) + n(&eval), rows.len(), "{file}");
            continue;
        }
        let train = items(&out, ds, id);
        let held = items(&eval, ds, id);
        assert_eq!(
            train.len() + held.len(),
            rows.len(),
            "{file}: every row once"
        );
        let t: BTreeSet<_> = train.iter().cloned().collect();
        let e: BTreeSet<_> = held.iter().cloned().collect();
        assert!(t.is_disjoint(&e), "{file}: an item on both sides");
        for item in &e {
            let n = held.iter().filter(|x| *x == item).count();
            assert_eq!(n, all[item], "{file}: {item:?} whole");
        }
        for d in ["conv", "plain"] {
            let n = e.iter().filter(|(x, _)| x == d).count();
            let of = all.keys().filter(|(x, _)| x == d).count();
            assert!(n > 0 && n < of / 2, "{file}: {d} holds out {n} of {of}");
        }
        eval_sets.push(e);
    }
    assert_eq!(eval_sets[0], eval_sets[1], "the same items in every form");
    // Again: byte for byte the same split.
    let again = ex.join("again.jsonl");
    export(&cfg, Format::Sharegpt, &again, Some(0.2));
    assert_eq!(
        std::fs::read(spool::output::export::holdout::eval_path(&again)).unwrap(),
        std::fs::read(ex.join("sg.eval.jsonl")).unwrap()
    );
    // specforge-chat lines are conversations: `<id>_s<sample>`.
    let chat = ex.join("chat.jsonl");
    export(&cfg, Format::SpecforgeChat, &chat, Some(0.2));
    let held: BTreeSet<String> = read_jsonl(&ex.join("chat.eval.jsonl"))
        .iter()
        .map(|l| {
            let id = l["id"].as_str().unwrap();
            id.rsplit_once("_s").map_or(id, |(a, _)| a).to_string()
        })
        .collect();
    let want: BTreeSet<String> = eval_sets[0].iter().map(|(_, i)| i.clone()).collect();
    assert_eq!(held, want);
    // hf: `<split>_eval` splits, loaded by `datasets`.
    let hf = ex.join("hf");
    export(&cfg, Format::Hf, &hf, Some(0.2));
    let splits = hf_splits(&hf, &dir.path().join("cache"));
    assert_eq!(
        splits.keys().cloned().collect::<Vec<_>>(),
        ["conv", "conv_eval", "plain", "plain_eval"]
    );
    let hf_eval: BTreeSet<(String, String)> = ["conv_eval", "plain_eval"]
        .iter()
        .flat_map(|s| splits[*s].iter().cloned())
        .collect();
    assert_eq!(hf_eval, eval_sets[0]);
    let total: usize = splits.values().map(Vec::len).sum();
    assert_eq!(total, rows.len());
    // token-freq counts the held-out rows in its eval file; draft-vocab skips them.
    let tf = ex.join("tf.safetensors");
    export(&cfg, Format::TokenFreq, &tf, Some(0.2));
    let meta = |p: &Path| {
        let bytes = std::fs::read(p).unwrap();
        let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        m.metadata().clone().unwrap()
    };
    let held_rows = eval_sets[0].iter().map(|k| all[k]).sum::<usize>();
    assert_eq!(
        meta(&ex.join("tf.eval.safetensors"))["rows"],
        held_rows.to_string()
    );
    assert_eq!(meta(&tf)["rows"], (rows.len() - held_rows).to_string());
    let dv = ex.join("dv.safetensors");
    spool::output::export::export(
        &cfg,
        &ExportOptions {
            holdout: Some(0.2),
            draft_vocab: Some(64),
            target_vocab: Some(151936),
            ..ExportOptions::new(Format::DraftVocab, &dv)
        },
    )
    .unwrap();
    assert_eq!(meta(&dv)["rows"], (rows.len() - held_rows).to_string());
    assert!(!ex.join("dv.eval.safetensors").exists());
    // The summary counts them.
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(ex.join("sg.jsonl.summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["holdout"], 0.2);
    let eval_rows: u64 = summary["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["eval_rows"].as_u64().unwrap())
        .sum();
    assert_eq!(eval_rows as usize, held_rows);
}

/// The numbers of one split in the card's "What was generated" section.
#[derive(Debug, Default)]
struct CardSplit {
    counts: Vec<u64>,
    finish: BTreeMap<String, u64>,
    stop: BTreeMap<String, u64>,
    /// (lo, hi, count) of the completion-length and turn histograms.
    lengths: Vec<(u64, u64, u64)>,
    turns: Vec<(u64, u64, u64)>,
}

fn parse_reasons(s: &str) -> BTreeMap<String, u64> {
    s.split(", ")
        .filter(|p| *p != "0")
        .map(|p| {
            let (k, v) = p.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

/// Reads the card's per-split sections.
fn parse_card(card: &str) -> BTreeMap<String, CardSplit> {
    let mut out: BTreeMap<String, CardSplit> = BTreeMap::new();
    let body = card.split("## What was generated").nth(1).unwrap();
    let body = body.split("\n## ").next().unwrap();
    for sec in body.split("### `").skip(1) {
        let (name, rest) = sec.split_once('`').unwrap();
        let mut s = CardSplit::default();
        let mut table = 0;
        for l in rest.lines() {
            if let Some(r) = l.strip_prefix("- finish reasons: ") {
                s.finish = parse_reasons(r);
            } else if let Some(r) = l.strip_prefix("- stop reasons: ") {
                s.stop = parse_reasons(r);
            } else if l.starts_with("| rows |") {
                table = 1;
            } else if l.starts_with("| completion tokens |") {
                table = 2;
            } else if l.starts_with("| generated turns |") {
                table = 3;
            } else if l.starts_with("| ---") || !l.starts_with("| ") {
                continue;
            } else {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                match table {
                    1 => s.counts = cells[..5].iter().map(|c| c.parse().unwrap()).collect(),
                    2 | 3 => {
                        let (lo, hi) = cells[0].split_once('–').unwrap_or((cells[0], cells[0]));
                        let b = (
                            lo.parse().unwrap(),
                            hi.parse().unwrap(),
                            cells[1].parse().unwrap(),
                        );
                        if table == 2 {
                            s.lengths.push(b)
                        } else {
                            s.turns.push(b)
                        }
                    }
                    _ => {}
                }
            }
        }
        out.insert(name.to_string(), s);
    }
    out
}

/// The `hf` card's counts equal the shards': per split its rows, items, conversations,
/// prompt and completion tokens, finish reasons (stop reasons `unknown`: these shards do
/// not record them), and each histogram bar counts exactly the shard rows (or
/// conversations) in its range; its two pictures are SVG files in `images/`. The `report`
/// page shows the same numbers with the pictures inline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_card_and_the_report_show_the_shards_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, rows) = run(dir.path()).await;
    let hf = dir.path().join("hf");
    export(&cfg, Format::Hf, &hf, None);
    let card = std::fs::read_to_string(hf.join("README.md")).unwrap();
    let splits = parse_card(&card);
    assert_eq!(
        splits.keys().collect::<Vec<_>>(),
        ["conv", "plain"],
        "{card}"
    );
    for (name, s) in &splits {
        let mine: Vec<&ShardRow> = rows.iter().filter(|r| &r.dataset == name).collect();
        let items: BTreeSet<&str> = mine.iter().map(|r| r.id.as_str()).collect();
        let mut convs: BTreeMap<(&str, u32), u64> = BTreeMap::new();
        for r in &mine {
            *convs.entry((r.id.as_str(), r.sample)).or_default() += 1;
        }
        let want = vec![
            mine.len() as u64,
            items.len() as u64,
            convs.len() as u64,
            mine.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
            mine.iter().map(|r| u64::from(r.completion_tokens)).sum(),
        ];
        assert_eq!(s.counts, want, "{name}");
        let mut finish = BTreeMap::new();
        for r in &mine {
            *finish.entry(r.finish_reason.clone()).or_default() += 1;
        }
        assert_eq!(s.finish, finish, "{name}");
        assert_eq!(
            s.stop,
            BTreeMap::from([("unknown".to_string(), mine.len() as u64)])
        );
        for &(lo, hi, n) in &s.lengths {
            let got = mine
                .iter()
                .filter(|r| (lo..=hi).contains(&u64::from(r.completion_tokens)))
                .count() as u64;
            assert_eq!(n, got, "{name}: completion length {lo}–{hi}");
        }
        assert_eq!(
            s.lengths.iter().map(|b| b.2).sum::<u64>(),
            mine.len() as u64
        );
        for &(lo, hi, n) in &s.turns {
            let got = convs.values().filter(|&&t| (lo..=hi).contains(&t)).count() as u64;
            assert_eq!(n, got, "{name}: turns {lo}–{hi}");
        }
        assert_eq!(s.turns.iter().map(|b| b.2).sum::<u64>(), convs.len() as u64);
        for pic in ["completion-tokens", "turns"] {
            let p = hf.join(format!("images/{name}-{pic}.svg"));
            let svg = std::fs::read_to_string(&p).unwrap();
            assert!(svg.starts_with("<svg"), "{}", p.display());
            assert!(card.contains(&format!("](images/{name}-{pic}.svg)")));
        }
    }
    assert!(
        splits["conv"].turns.iter().any(|b| b.0 == 3 && b.2 == 80),
        "{:?}",
        splits["conv"].turns
    );

    // The report page: the same counts, and the pictures inline.
    let page = dir.path().join("report.html");
    export(&cfg, Format::Report, &page, None);
    let html = std::fs::read_to_string(&page).unwrap();
    assert_eq!(html.matches("<svg").count(), 4, "two pictures per dataset");
    for (name, s) in &splits {
        let c = &s.counts;
        let row = format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            c[0], c[1], c[2], c[3], c[4]
        );
        assert!(
            html.contains(&format!("<h2>{name}</h2>\n<table>")),
            "{name}"
        );
        assert!(html.contains(&row), "{name}: {row}");
    }
    // The hf folder with pictures is still an export a new one may replace.
    export(&cfg, Format::Hf, &hf, None);
}
