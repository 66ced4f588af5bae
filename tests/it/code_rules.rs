//! The code's own rules, read from the source: which folder of `src/` may import which
//! (ARCHITECTURE.md, "Dependency rules"), how long a module may grow, and that nothing but
//! `config` writes into a loaded `Config` (what a run learns rides in `run::plan::JobPlan`).
//! What does not keep them yet is listed below with its reason; the lists may only shrink
//! (a debt that is paid must leave the list, or the test fails).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// ARCHITECTURE.md's table: each folder (or top-level module) and what it may import.
/// `None`: may import anything (`error` names every boundary's error).
fn allowed(from: &str) -> Option<&'static [&'static str]> {
    const BASE: &[&str] = &[
        "config", "prompt", "store", "estimate", "knobs", "secrets", "crypto",
    ];
    Some(match from {
        "knobs" | "secrets" | "crypto" => &[],
        "config" => &["knobs", "secrets"],
        "prompt" | "estimate" => &["config", "knobs"],
        "upstream" => &["config", "prompt", "knobs", "secrets", "crypto"],
        "store" | "input" => &["config", "prompt", "knobs"],
        "output" => BASE,
        "observe" => &[
            "config", "prompt", "store", "estimate", "knobs", "secrets", "crypto", "upstream",
            "output", "run",
        ],
        "run" => &[
            "config", "prompt", "store", "estimate", "knobs", "secrets", "crypto", "upstream",
            "output", "input", "observe", "error",
        ],
        "cluster" => &[
            "config", "prompt", "store", "estimate", "knobs", "secrets", "crypto", "upstream",
            "output", "input", "observe", "error", "run",
        ],
        "mock" => &["config", "prompt", "knobs"],
        _ => return None,
    })
}

/// Imports the rules forbid that are still there: (from, to, file under `src/`), why.
const IMPORT_DEBTS: &[(&str, &str, &str, &str)] = &[];

/// Modules longer than [`MAX_LINES`] before their tests, to be split.
const SIZE_DEBTS: &[&str] = &[];

/// The most lines a module may have before its `#[cfg(test)]` part.
const MAX_LINES: usize = 800;

fn sources() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// `src/`-relative name with `/` separators.
fn rel(p: &Path) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    p.strip_prefix(src)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

/// The folder (or top-level module) a file belongs to: `run/job.rs` → `run`.
fn owner(rel: &str) -> String {
    rel.split('/')
        .next()
        .unwrap()
        .trim_end_matches(".rs")
        .to_string()
}

/// The code of a file before its tests, without `//` comments.
fn code(text: &str) -> String {
    let before_tests = text.split("#[cfg(test)]").next().unwrap_or("");
    before_tests
        .lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every top-level module named as `crate::<name>` in `code`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[i + 7..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// The imports the rules forbid: (from, to, file).
fn forbidden(files: &[(String, String)]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for (rel, text) in files {
        let from = owner(rel);
        if matches!(from.as_str(), "main" | "lib" | "cli") {
            continue;
        }
        let Some(ok) = allowed(&from) else { continue };
        for to in crate_refs(&code(text)) {
            if to != from && !ok.contains(&to.as_str()) {
                out.insert((from.clone(), to, rel.clone()));
            }
        }
    }
    out
}

/// No folder imports one the rules put above it, beyond the listed debts; a debt paid
/// leaves the list.
#[test]
fn imports_keep_the_dependency_rules() {
    let files: Vec<(String, String)> = sources()
        .iter()
        .map(|p| (rel(p), std::fs::read_to_string(p).unwrap()))
        .collect();
    assert!(files.len() > 100, "the source tree was read");
    let found = forbidden(&files);
    let debts: BTreeMap<(String, String, String), &str> = IMPORT_DEBTS
        .iter()
        .map(|(f, t, file, why)| ((f.to_string(), t.to_string(), file.to_string()), *why))
        .collect();
    let new: Vec<_> = found.iter().filter(|k| !debts.contains_key(*k)).collect();
    assert!(
        new.is_empty(),
        "imports the rules forbid (ARCHITECTURE.md, Dependency rules): {new:?}"
    );
    let paid: Vec<_> = debts.keys().filter(|k| !found.contains(*k)).collect();
    assert!(paid.is_empty(), "paid debts still listed: {paid:?}");
}

/// No module is longer than 800 lines before its tests, beyond the listed ones; a listed
/// one that is now short enough leaves the list.
#[test]
fn modules_stay_under_800_lines() {
    let mut long = BTreeSet::new();
    for p in sources() {
        let text = std::fs::read_to_string(&p).unwrap();
        let n = text
            .split("#[cfg(test)]")
            .next()
            .unwrap_or("")
            .lines()
            .count();
        if n > MAX_LINES {
            long.insert(rel(&p));
        }
    }
    let listed: BTreeSet<String> = SIZE_DEBTS.iter().map(|s| s.to_string()).collect();
    let new: Vec<_> = long.difference(&listed).collect();
    assert!(new.is_empty(), "modules over {MAX_LINES} lines: {new:?}");
    let paid: Vec<_> = listed.difference(&long).collect();
    assert!(paid.is_empty(), "short enough now, still listed: {paid:?}");
}

/// The checker sees an import the rules forbid, through `use`, a path in an expression and
/// a nested module, and ignores comments, tests and names that only end in `crate`.
#[test]
fn the_checker_finds_what_it_should() {
    let files = vec![
        (
            "store/x.rs".to_string(),
            "use crate::config::Config;\nfn f() { crate::run::job::go(); }\n// crate::cluster::x\nlet my_crate::observe = 1;\n#[cfg(test)]\nmod tests { use crate::mock::M; }\n".to_string(),
        ),
        ("config.rs".to_string(), "use crate::knobs::Knobs;".to_string()),
        ("error.rs".to_string(), "use crate::run::X;".to_string()),
    ];
    let found = forbidden(&files);
    let want: BTreeSet<_> = [(
        "store".to_string(),
        "run".to_string(),
        "store/x.rs".to_string(),
    )]
    .into_iter()
    .collect();
    assert_eq!(found, want);
}

/// `DatasetConfig`'s fields (`src/config/dataset.rs`).
const DATASET_FIELDS: &str = "name|path|token_budget|max_prompts|sampling|reasoning|turns|\
                              history_reasoning|samples|chat_template_kwargs|on_length|prompt_format";

/// Where `code` writes into a loaded config: (line, what), for an assignment to a field of
/// the config (`cfg.x = `, `self.cfg.x.y += `) or of a dataset's (`d.path = `,
/// `cfg.datasets[0].token_budget = `), a mutable binding of one (`mut cfg: Config`, `&mut
/// Config`, `let mut cfg`, `&mut cfg.datasets`, `cfg.datasets.iter_mut()`). Comparisons
/// (`==`, `<=`, `=>`) are not writes.
fn config_writes(code: &str) -> Vec<(usize, String)> {
    let assign = r"(?:\.\w+|\[[^\]]*\])*\s*[-+*/|&^]?=(?:[^=>]|$)";
    let patterns = [
        format!(r"(?m)(?:^|[^\w.])(?:(?:self|job|ctx)\.)?(?:cfg|config)\.\w+{assign}"),
        format!(
            r"(?m)(?:^|[^\w.])(?:d|ds|dataset|\w*datasets\[[^\]]*\])\.(?:{}){assign}",
            DATASET_FIELDS
        ),
        r"\bmut\s+\w+\s*:\s*(?:Arc<\s*)?(?:Config|DatasetConfig)\b|&\s*mut\s+(?:Config|DatasetConfig)\b|&\s*mut\s+(?:(?:self|job|ctx)\.)?(?:cfg|config)\b|\b(?:cfg|config)\.datasets\s*\.\s*iter_mut\b|\blet\s+mut\s+(?:cfg|config)\b"
            .to_string(),
    ];
    let mut out = Vec::new();
    for p in patterns {
        for m in regex::Regex::new(&p).unwrap().find_iter(code) {
            let line = code[..m.start()].matches('\n').count() + 1;
            out.push((line, m.as_str().trim().to_string()));
        }
    }
    out.sort();
    out
}

/// Nothing outside `config` writes into a loaded `Config`: the partition, a staging
/// folder, fetched inputs and a partition's budgets are the run's plan.
#[test]
fn a_loaded_config_is_never_written() {
    let mut found = Vec::new();
    for p in sources() {
        let rel = rel(&p);
        if rel == "config.rs" || rel.starts_with("config/") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        for (line, what) in config_writes(&code(&text)) {
            found.push(format!("src/{rel}:{line}: {what}"));
        }
    }
    assert!(
        found.is_empty(),
        "writes into a loaded Config (put what the run learns in run::plan::JobPlan): {found:#?}"
    );
}

/// The write checker sees each way the code once changed a loaded config, and none of
/// the reads, comparisons or other structs' fields that look alike.
#[test]
fn the_write_checker_finds_what_it_should() {
    let writes = [
        "cfg.partition = Some(partition);",
        "    cfg.output_dir = cfg.data_dir.join(\"out\");",
        "self.cfg.run.concurrency = c;",
        "d.token_budget = Some(granted);",
        "        d.path = local;",
        "cfg.datasets[0].path = p;",
        "pub async fn run(\n    mut cfg: Config,\n) {}",
        "pub async fn fetch_inputs(cfg: &mut Config) {}",
        "for d in &mut cfg.datasets {}",
        "let mut cfg = Config::load(&p, &o)?;",
        "cfg.datasets.iter_mut().for_each(|d| ());",
    ];
    for w in writes {
        assert_eq!(config_writes(w).len(), 1, "missed: {w}");
    }
    let reads = [
        "let out = cfg.output_dir.clone();",
        "if cfg.partition == Some(p) {}",
        "let ok = cfg.shards.max_rows <= 10 && cfg.shards.max_rows >= 1 && d.samples != None;",
        "match x { y if y == cfg.run.budget_policy => 1, _ => 2 }",
        "plan.output_dir = Some(staging);",
        "report.datasets.iter_mut().for_each(|d| d.pending -= 1);",
        "state.partition = 3; lane.budget = None; s.path = p;",
        "let mut cfg_path = dir.join(\"spool.toml\");",
        "fn f(cfg: &Config, plan: &mut JobPlan) {}",
    ];
    for r in reads {
        assert_eq!(config_writes(r), Vec::new(), "not a write: {r}");
    }
}
