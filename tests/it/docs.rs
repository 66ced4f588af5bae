//! The guide is part of the contract, so it is tested as code is: every relative link and
//! `#anchor` of README.md, docs/, ARCHITECTURE.md, RELIABILITY.md, BENCHMARKS.md,
//! CHANGELOG.md and the folders' READMEs resolves, and every fenced block of README.md and
//! docs/ is either run or marked as not meant to run. The info-string convention
//! (docs/development.md):
//!
//! - `toml`: a `spool.toml` or a fragment of one, merged over a minimal config and read by
//!   the real loader ([`spool::config::Config::load`]);
//! - `json` (one row, may span lines) / `jsonl` (a row per line): input rows, parsed by the
//!   real row parser ([`spool::input::row::parse_row`]);
//! - `sh`: every `spool …` line is parsed by the real binary's command line (a test build's
//!   `SPOOL_PARSE_ONLY`); other lines (`make`, `cargo`, `kubectl`) are not run;
//! - `python`: parsed by Python's own `ast.parse`, then run in a folder holding a real run's
//!   shards and exports under the names the examples use (see
//!   [`python_examples_run_against_real_exports`]);
//! - `text`, or any language followed by the word `output` (```` ```json output ````): a
//!   sample of what spool prints or writes, a file tree or a usage synopsis; not run;
//! - the README's blocks marked `quickstart` are also run end to end against the mock server,
//!   `file=NAME` naming the file a block is saved as.
//!
//! A block of any other kind (a bare ```` ``` ```` included) fails the test, so an example
//! cannot slip in untested.

use crate::support::*;
use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};
use spool::mock::MockConfig;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};

// ---------------------------------------------------------------------------------------
// Reading Markdown

/// A fenced code block: where it opens, its info string and its text.
#[derive(Debug, Clone)]
struct Block {
    line: usize,
    info: String,
    text: String,
}

/// A link or image destination, with the line it is on.
#[derive(Debug, Clone)]
struct Link {
    line: usize,
    dest: String,
}

/// What the checks need of one Markdown file.
#[derive(Debug, Default)]
struct Page {
    /// The GitHub anchors of its headings (`#slug`, duplicates numbered as GitHub does).
    anchors: BTreeSet<String>,
    links: Vec<Link>,
    blocks: Vec<Block>,
}

/// The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Parses `text` as GitHub does (CommonMark with tables).
fn read_page(text: &str) -> Page {
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut page = Page::default();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut heading: Option<String> = None;
    let mut block: Option<Block> = None;
    for (event, range) in Parser::new_ext(text, Options::ENABLE_TABLES).into_offset_iter() {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let n = seen.entry(base.clone()).or_insert(0);
                page.anchors
                    .insert(if *n == 0 { base } else { format!("{base}-{n}") });
                *n += 1;
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = &mut heading {
                    h.push_str(&t);
                }
                if let Some(b) = &mut block {
                    b.text.push_str(&t);
                }
            }
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => page.links.push(Link {
                line: line_of(range.start),
                dest: dest_url.to_string(),
            }),
            Event::Start(Tag::CodeBlock(kind)) => {
                let info = match kind {
                    CodeBlockKind::Fenced(i) => i.to_string(),
                    CodeBlockKind::Indented => "(indented)".to_string(),
                };
                block = Some(Block {
                    line: line_of(range.start),
                    info,
                    text: String::new(),
                });
            }
            Event::End(TagEnd::CodeBlock) => page.blocks.extend(block.take()),
            _ => {}
        }
    }
    page
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.md` file under `dir`, sorted.
fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The guide: README.md and docs/**/*.md, relative to `root`.
fn guide(root: &Path) -> Vec<PathBuf> {
    let mut v = vec![root.join("README.md")];
    v.extend(markdown_under(&root.join("docs")));
    v
}

/// The documents whose links are checked, relative to `root`.
fn linked_documents(root: &Path) -> Vec<PathBuf> {
    let mut v = guide(root);
    for f in [
        "ARCHITECTURE.md",
        "RELIABILITY.md",
        "BENCHMARKS.md",
        "CHANGELOG.md",
        "grafana/README.md",
        "schemas/README.md",
    ] {
        v.push(root.join(f));
    }
    v
}

// ---------------------------------------------------------------------------------------
// Links

/// `path` with `.` and `..` folded, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Every link of `files` that does not resolve inside `root`: a file or folder that does
/// not exist, a path out of the repository, or an `#anchor` no heading of the target has.
/// Links with a scheme (`https:`, `mailto:`) are not followed.
fn broken_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let root = normalize(root);
    let mut pages: BTreeMap<PathBuf, Page> = BTreeMap::new();
    let mut page_of = |p: &Path| -> Option<BTreeSet<String>> {
        if !pages.contains_key(p) {
            let text = std::fs::read_to_string(p).ok()?;
            pages.insert(p.to_path_buf(), read_page(&text));
        }
        Some(pages[p].anchors.clone())
    };
    let mut broken = Vec::new();
    for file in files {
        let file = normalize(file);
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let links = read_page(&text).links;
        for Link { line, dest } in links {
            let at = format!("{}:{line}: `{dest}`", file.display());
            if dest.contains(':') && !dest.starts_with('#') {
                let scheme = dest.split(':').next().unwrap_or_default();
                if scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '+')
                {
                    continue;
                }
            }
            let (path, anchor) = match dest.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (dest.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                normalize(&file.parent().unwrap().join(path))
            };
            if !target.starts_with(&root) {
                broken.push(format!("{at}: leaves the repository"));
                continue;
            }
            if !target.exists() {
                broken.push(format!("{at}: no such file"));
                continue;
            }
            if let Some(a) = anchor {
                if target.extension().is_none_or(|x| x != "md") {
                    broken.push(format!("{at}: an anchor into a file that is not Markdown"));
                    continue;
                }
                let anchors = page_of(&target).unwrap_or_default();
                if !anchors.contains(a) {
                    broken.push(format!(
                        "{at}: no heading `#{a}` in {} (it has {anchors:?})",
                        target.display()
                    ));
                }
            }
        }
    }
    broken
}

/// Every relative link and anchor of README.md, docs/, ARCHITECTURE.md, RELIABILITY.md,
/// BENCHMARKS.md, CHANGELOG.md, grafana/README.md and schemas/README.md resolves.
#[test]
fn links_in_the_documents_resolve() {
    let files = linked_documents(&repo());
    let pages = files.len();
    let links: usize = files
        .iter()
        .map(|f| read_page(&std::fs::read_to_string(f).unwrap()).links.len())
        .sum();
    assert!(pages > 20 && links > 30, "{pages} pages, {links} links");
    let broken = broken_links(&repo(), &files);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The checker finds what it must: a missing file, a missing anchor (here and in another
/// page), a path out of the repository; it accepts GitHub's anchors for headings with
/// code, punctuation and duplicates, and leaves URLs alone.
#[test]
fn link_checker_finds_missing_files_and_anchors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("docs/export")).unwrap();
    std::fs::write(root.join("docs/pic.png"), b"png").unwrap();
    std::fs::write(
        root.join("docs/export/b.md"),
        "# `token-freq`, `draft-vocab`\n\n## Notes\n\n## Notes\n\n## Configuration (`spool.toml`)\n\n![p](../pic.png)\n",
    )
    .unwrap();
    std::fs::write(
        root.join("README.md"),
        "# Top\n\n[ok](docs/export/b.md#token-freq-draft-vocab) [dup](docs/export/b.md#notes-1) \
         [code](docs/export/b.md#configuration-spooltoml) [self](#top) [web](https://example.com/x#y)\n\n\
         [gone](docs/missing.md) [bad](docs/export/b.md#nope) [here](#nowhere)\n\n\
         [out](../outside.md) [pic](docs/pic.png#frag)\n\n```text\n[not a link](nowhere.md)\n```\n",
    )
    .unwrap();
    let files = [root.join("README.md"), root.join("docs/export/b.md")];
    let broken = broken_links(root, &files);
    let got: Vec<&str> = broken
        .iter()
        .map(|b| b.split('`').nth(1).unwrap())
        .collect();
    assert_eq!(
        got,
        [
            "docs/missing.md",
            "docs/export/b.md#nope",
            "#nowhere",
            "../outside.md",
            "docs/pic.png#frag"
        ],
        "{broken:#?}"
    );
    assert!(broken[0].contains("README.md:5:"), "{}", broken[0]);
}

/// Lays out `dst` as the repository at `src`/`rel`: the files in `docs` are copied, every
/// other entry is a symbolic link to the real one, and the folders holding a document are
/// real folders — so nothing written into the copy can reach the repository.
fn mirror(src: &Path, dst: &Path, rel: &Path, docs: &BTreeSet<PathBuf>) {
    for e in std::fs::read_dir(src.join(rel)).unwrap() {
        let name = e.unwrap().file_name();
        if rel.as_os_str().is_empty() && (name == "target" || name == ".git") {
            continue;
        }
        let r = rel.join(&name);
        let to = dst.join(&r);
        assert!(std::fs::symlink_metadata(&to).is_err(), "{}", to.display());
        if docs.contains(&r) {
            std::fs::copy(src.join(&r), &to).unwrap();
        } else if docs.iter().any(|d| d.starts_with(&r)) {
            std::fs::create_dir(&to).unwrap();
            mirror(src, dst, &r, docs);
        } else {
            std::os::unix::fs::symlink(src.join(&r), &to).unwrap();
        }
    }
}

/// A copy of the real documents with one link broken fails the check, naming the link; the
/// same copy without the break passes.
#[test]
fn a_broken_link_in_a_copy_of_the_guide_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path();
    let rel: Vec<PathBuf> = linked_documents(&repo())
        .iter()
        .map(|p| p.strip_prefix(repo()).unwrap().to_path_buf())
        .collect();
    // The documents copied, everything else (what they link to) linked to the real files.
    let docs: BTreeSet<PathBuf> = rel.iter().cloned().collect();
    mirror(&repo(), copy, Path::new(""), &docs);
    let files: Vec<PathBuf> = rel.iter().map(|r| copy.join(r)).collect();
    let clean = broken_links(copy, &files);
    assert!(clean.is_empty(), "the copy itself: {clean:#?}");

    let page = copy.join("docs/cluster.md");
    let text = std::fs::read_to_string(&page).unwrap();
    let text = text.replacen(
        "# Running on a cluster",
        "# Running on a cluster\n\nSee [the metrics](metrics.md#no-such-heading).",
        1,
    );
    std::fs::write(&page, text).unwrap();
    let broken = broken_links(copy, &files);
    assert_eq!(broken.len(), 1, "{broken:#?}");
    assert!(
        broken[0].contains("docs/cluster.md:3: `metrics.md#no-such-heading`"),
        "{}",
        broken[0]
    );
}

// ---------------------------------------------------------------------------------------
// Examples

/// What a block is, by its info string.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// Not run: an output sample, a file tree, a usage synopsis.
    Shown,
    Toml,
    /// One input row (may span lines).
    Row,
    /// An input row per line.
    Rows,
    Shell,
    Python,
}

/// The block's kind and its attributes (the words after the language), or why it cannot
/// be classified.
fn classify(info: &str) -> Result<(Kind, Vec<&str>), String> {
    let mut words = info.split_whitespace();
    let lang = words.next().unwrap_or("");
    let attrs: Vec<&str> = words.collect();
    if attrs.contains(&"output") || lang == "text" {
        return Ok((Kind::Shown, attrs));
    }
    let kind = match lang {
        "toml" => Kind::Toml,
        "json" => Kind::Row,
        "jsonl" => Kind::Rows,
        "sh" => Kind::Shell,
        "python" => Kind::Python,
        "" => {
            return Err(
                "a bare ``` block: give it a kind (```text if it is not meant to run)".into(),
            )
        }
        other => return Err(format!("```{other} is not a kind the doc test knows")),
    };
    Ok((kind, attrs))
}

/// The smallest config a fragment is merged over.
const BASE_CONFIG: &str = r#"
data_dir = "data"
output_dir = "out"

[server]
api = "chat"
urls = ["http://127.0.0.1:30000"]

[[dataset]]
name = "base"
path = "prompts.jsonl"
"#;

/// `over` merged into `base`, table by table; anything else (the `[[dataset]]` list
/// included) replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Loads a `toml` block with the real loader, merged over [`BASE_CONFIG`].
fn check_toml(dir: &Path, text: &str) -> Result<(), String> {
    let fragment: toml::Table = toml::from_str(text).map_err(|e| format!("not TOML: {e}"))?;
    let mut cfg: toml::Table = toml::from_str(BASE_CONFIG).unwrap();
    merge(&mut cfg, fragment);
    let path = dir.join("spool.toml");
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    spool::config::Config::load(&path, &Default::default())
        .map(|_| ())
        .map_err(|e| format!("the config loader refuses it: {e}"))
}

/// Parses a row (or a row per line) with the real row parser.
fn check_rows(text: &str, per_line: bool) -> Result<usize, String> {
    let rows: Vec<&str> = if per_line {
        text.lines().filter(|l| !l.trim().is_empty()).collect()
    } else {
        vec![text]
    };
    for (i, r) in rows.iter().enumerate() {
        spool::input::row::parse_row("docs", i as u64, r)
            .map_err(|e| format!("row {} refused: {e}", i + 1))?;
    }
    Ok(rows.len())
}

/// A shell line's words up to a comment, pipe, redirection or `&`/`;`, with quotes
/// removed; expansions (`$`, backquotes) are refused (the example would not be checkable).
fn shell_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                let w = cur.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some('$' | '`') if c == '"' => {
                            return Err(format!("an expansion in `{line}`"))
                        }
                        Some(x) => w.push(x),
                        None => return Err(format!("an unclosed quote in `{line}`")),
                    }
                }
            }
            '$' | '`' => return Err(format!("an expansion in `{line}`")),
            '#' if cur.is_none() => break,
            '|' | '&' | ';' | '>' | '<' => break,
            c if c.is_whitespace() => words.extend(cur.take()),
            '\\' => cur.get_or_insert_with(String::new).extend(chars.next()),
            c => cur.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(cur);
    Ok(words)
}

/// The logical lines of a shell block (`\` continuations joined).
fn shell_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for l in text.lines() {
        if let Some(head) = l.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(l);
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The `spool` arguments of a shell line, if it runs spool (after `VAR=value` words).
fn spool_args(line: &str) -> Result<Option<Vec<String>>, String> {
    let line = line.trim().trim_start_matches("$ ");
    let runs_spool = regex::Regex::new(r"^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)*spool(\s|$)").unwrap();
    if !runs_spool.is_match(line) {
        return Ok(None);
    }
    let words = shell_words(line)?;
    let mut w = words.into_iter().skip_while(|w| {
        w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    });
    Ok(match w.next() {
        Some(cmd) if cmd == "spool" => Some(w.collect()),
        _ => None,
    })
}

/// Parses every `spool …` line of a shell block with the real binary's command line.
fn check_shell(dir: &Path, text: &str) -> Result<usize, String> {
    let mut n = 0;
    for line in shell_lines(text) {
        let Some(args) = spool_args(&line)? else {
            continue;
        };
        let out = Command::new(spool_bin())
            .args(&args)
            .env("SPOOL_PARSE_ONLY", "1")
            .current_dir(dir)
            .output()
            .unwrap();
        if !out.status.success() {
            return Err(format!(
                "`{}` does not parse: {}",
                line.trim(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        n += 1;
    }
    Ok(n)
}

/// Parses a Python block with Python's own parser.
fn check_python(text: &str) -> Result<(), String> {
    let mut child = Command::new("python3")
        .args(["-c", "import ast, sys; ast.parse(sys.stdin.read())"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("python3: {e}"))?;
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "Python does not parse it: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Every fenced block of README.md and docs/ is classified by its info string and checked
/// by the real part it shows: configs by the config loader, input rows by the row parser,
/// `spool` command lines by the binary's argument parser, Python by Python's parser. An
/// unclassified block fails.
#[test]
fn every_example_in_the_guide_is_checked() {
    let mut failures = Vec::new();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for file in guide(&repo()) {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(repo()).unwrap().display().to_string();
        for b in read_page(&text).blocks {
            let dir = tempfile::tempdir().unwrap();
            let result = classify(&b.info).and_then(|(kind, _)| match kind {
                Kind::Shown => {
                    *counts.entry("shown").or_default() += 1;
                    Ok(())
                }
                Kind::Toml => {
                    *counts.entry("toml").or_default() += 1;
                    check_toml(dir.path(), &b.text)
                }
                Kind::Row | Kind::Rows => {
                    *counts.entry("rows").or_default() += check_rows(&b.text, kind == Kind::Rows)?;
                    Ok(())
                }
                Kind::Shell => {
                    *counts.entry("spool lines").or_default() += check_shell(dir.path(), &b.text)?;
                    Ok(())
                }
                Kind::Python => {
                    *counts.entry("python").or_default() += 1;
                    check_python(&b.text)
                }
            });
            if let Err(e) = result {
                failures.push(format!("{name}:{} (```{}): {e}", b.line, b.info));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("checked: {counts:?}");
    for kind in ["toml", "rows", "spool lines", "python", "shown"] {
        assert!(
            counts.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} checked: {counts:?}"
        );
    }
}

/// The checks themselves refuse what they must: a config key spool does not know, a row
/// with neither prompt nor messages, a command line spool refuses, Python that does not
/// parse, and a block without a kind.
#[test]
fn the_example_checks_refuse_wrong_examples() {
    let dir = tempfile::tempdir().unwrap();
    assert!(check_toml(dir.path(), "[server]\napi = \"chat\"\n").is_ok());
    let e = check_toml(dir.path(), "[server]\napi_typo = 1\n").unwrap_err();
    assert!(e.contains("api_typo"), "{e}");
    assert!(check_rows("{\"prompt\": \"hi\"}", false).is_ok());
    assert!(check_rows("{\"text\": \"hi\"}", false).is_err());
    assert!(check_rows("{\"prompt\": \"a\"}\n{\"prompt\": 3}\n", true).is_err());
    assert_eq!(
        check_shell(dir.path(), "make demo\nspool status -c x.toml --json\n"),
        Ok(1)
    );
    let e = check_shell(dir.path(), "spool export --format nonsense --out x\n").unwrap_err();
    assert!(e.contains("nonsense"), "{e}");
    assert!(check_shell(dir.path(), "spool run --partition $I\n").is_err());
    assert!(check_python("import x\nx.y(").is_err());
    assert!(classify("").is_err());
    assert!(classify("yaml").is_err());
    assert_eq!(classify("json output").unwrap().0, Kind::Shown);
}

// ---------------------------------------------------------------------------------------
// The README's quick start

/// Starts `spool mock-server` with the README's arguments on a free loopback port; returns
/// the child and its URL.
fn start_mock(dir: &Path, args: &[String]) -> (ChildGuard, String) {
    let mut child = Command::new(spool_bin())
        .args(args)
        .args(["--addr", "127.0.0.1:0"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let guard = ChildGuard(child);
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("mock-server said {line:?}"))
        .to_string();
    (guard, url)
}

/// Kills the child when dropped, so a failed assertion leaves no server behind.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The README's quick start, as written, against the mock server: its config saved as it
/// names it (the repository's `tests/` and `examples/` beside it), the mock server started
/// with its arguments (on a free port, which the config is pointed at), then its `spool`
/// lines run with the real binary (`run` with its metrics on a free port). Its SpecForge
/// export holds a line per generated turn and sample, and each line's ids decode with the
/// Qwen3 tokenizer to the conversation's rendered prompt and a generated think block and
/// answer, the loss mask covering exactly the completion.
#[test]
fn the_readme_quick_start_runs_end_to_end() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let blocks: Vec<Block> = read_page(&readme)
        .blocks
        .into_iter()
        .filter(|b| b.info.split_whitespace().any(|w| w == "quickstart"))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for sub in ["tests", "examples"] {
        std::os::unix::fs::symlink(repo().join(sub), dir.path().join(sub)).unwrap();
    }
    let mut config = None;
    let mut script = None;
    for b in &blocks {
        let file = b
            .info
            .split_whitespace()
            .find_map(|w| w.strip_prefix("file="));
        match (classify(&b.info).unwrap().0, file) {
            (_, Some(f)) => {
                std::fs::write(dir.path().join(f), &b.text).unwrap();
                if f.ends_with(".toml") {
                    config = Some(dir.path().join(f));
                }
            }
            (Kind::Shell, None) => script = Some(b.text.clone()),
            other => panic!("a quickstart block of no use: {other:?}"),
        }
    }
    let config = config.expect("a quickstart block file=….toml");
    let script = script.expect("a quickstart ```sh block");
    let mut mock = None;
    let mut ran = Vec::new();
    let mut export = None;
    for line in shell_lines(&script) {
        let Some(args) = spool_args(&line).unwrap() else {
            continue;
        };
        match args.first().map(String::as_str) {
            Some("mock-server") => {
                assert!(!args.iter().any(|a| a == "--addr"), "{line}");
                let (child, url) = start_mock(dir.path(), &args);
                // The config names the mock server's default address; point it at the port.
                let text = std::fs::read_to_string(&config).unwrap();
                assert!(text.contains("\"http://127.0.0.1:30000\""), "{text}");
                std::fs::write(&config, text.replace("http://127.0.0.1:30000", &url)).unwrap();
                mock = Some(child);
            }
            Some(cmd) => {
                assert!(mock.is_some(), "`{line}` before the mock server");
                let mut c = Command::new(spool_bin());
                c.args(&args).current_dir(dir.path());
                if cmd == "run" {
                    c.args(["--metrics-addr", "127.0.0.1:0"]);
                }
                if cmd == "export" {
                    let at = args.iter().position(|a| a == "--out").unwrap();
                    export = Some(dir.path().join(&args[at + 1]));
                }
                let out = c.output().unwrap();
                assert!(
                    out.status.success(),
                    "`{line}`: {:?}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
                ran.push(cmd.to_string());
            }
            None => panic!("`{line}`"),
        }
    }
    drop(mock);
    assert!(
        ran.contains(&"run".to_string()) && ran.contains(&"export".to_string()),
        "{ran:?}"
    );

    // The export, read back.
    let cfg = spool::config::Config::load(&config, &Default::default()).unwrap();
    let ds = &cfg.datasets[0];
    let spec = cfg.generation_of(ds);
    assert!(spec.samples > 1, "the quick start shows samples");
    assert_eq!(spec.turns, spool::config::Turns::All);
    assert_eq!(spec.reasoning, spool::config::Reasoning::Save);
    let convs: Vec<serde_json::Value> = read_jsonl(&ds.path);
    let tok =
        spool::prompt::Tokenizer::from_file(&fixtures().join("tokenizers/qwen3/tokenizer.json"))
            .unwrap();
    let lines = read_jsonl(&export.expect("an export line"));
    let user_turns: usize = convs
        .iter()
        .map(|c| {
            c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "user")
                .count()
        })
        .sum();
    assert_eq!(
        lines.len(),
        user_turns * spec.samples as usize,
        "a line per turn and sample"
    );
    for l in &lines {
        let ids: Vec<u32> = serde_json::from_value(l["input_ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(l["loss_mask"].clone()).unwrap();
        assert_eq!(ids.len(), mask.len());
        let prompt_len = mask.iter().take_while(|m| **m == 0).count();
        assert!(prompt_len > 0 && prompt_len < ids.len(), "{l}");
        assert!(mask[prompt_len..].iter().all(|m| *m == 1), "{l}");
        let prompt = tok.decode(&ids[..prompt_len]).unwrap();
        let completion = tok.decode(&ids[prompt_len..]).unwrap();
        assert!(prompt.starts_with("<|im_start|>system\n"), "{prompt}");
        assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
        assert!(completion.starts_with("<think>\n"), "{completion}");
        assert!(completion.contains("</think>\n\n"), "{completion}");
    }
}

// ---------------------------------------------------------------------------------------
// Python examples, run

/// Runs `spool export` with `args` in `dir`; it must succeed.
fn export(dir: &Path, cfg: &Path, args: &[&str]) {
    let out = Command::new(spool_bin())
        .arg("export")
        .arg("-c")
        .arg(cfg)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "export {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every `python` block of README.md and docs/ runs (the project's Python, as the tests
/// use it) in a folder laid out under the names the examples use, from a real run against
/// a mock thinking in Qwen3's tokens: `spool-out/` holding the shards of datasets
/// `B3_magicoder` (prompts) and `chat` (conversations), `DIR` the `hf` export,
/// `token_freq.safetensors` the `token-freq` export, `draft_32000.safetensors` (with its
/// `.npy` files beside it) the `draft-vocab --draft-vocab 32000` export, and an empty
/// `DATA_DIR/`. An example naming anything else fails here until this layout has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_examples_run_against_real_exports() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let qwen = fixtures().join("tokenizers/qwen3");
    let mock = Mock::start(MockConfig {
        think: true,
        tokenizer: Some(qwen.join("tokenizer.json")),
        ..fast_mock()
    })
    .await;
    write_prompts(&d.join("p.jsonl"), "p", 8);
    write_chats(&d.join("c.jsonl"), "c", 8);
    let cfg = write_config(
        d,
        &mock.url,
        "sglang",
        true,
        &[
            Ds {
                name: "B3_magicoder",
                file: "p.jsonl",
                budget: None,
            },
            Ds {
                name: "chat",
                file: "c.jsonl",
                budget: None,
            },
        ],
        &qwen_table(),
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("output_dir = \"out\"", "output_dir = \"spool-out\""),
    )
    .unwrap();
    run_to_end(&cfg).await;
    mock.stop().await;
    export(d, &cfg, &["--format", "hf", "--out", "DIR"]);
    export(
        d,
        &cfg,
        &[
            "--format",
            "token-freq",
            "--target-vocab",
            "151936",
            "--out",
            "token_freq.safetensors",
        ],
    );
    export(
        d,
        &cfg,
        &[
            "--format",
            "draft-vocab",
            "--draft-vocab",
            "32000",
            "--target-vocab",
            "151936",
            "--out",
            "draft_32000.safetensors",
        ],
    );
    std::fs::create_dir(d.join("DATA_DIR")).unwrap();

    let mut ran = 0;
    for file in guide(&repo()) {
        let text = std::fs::read_to_string(&file).unwrap();
        for b in read_page(&text).blocks {
            if !matches!(classify(&b.info), Ok((Kind::Python, _))) {
                continue;
            }
            let out = Command::new("python3")
                .args(["-c", &b.text])
                .current_dir(d)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}:{}: the Python example fails:\n{}",
                file.display(),
                b.line,
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    assert!(ran >= 3, "{ran} Python examples");
    // What the examples write is there: the conversions they show ran on real data.
    for f in ["DATA_DIR/token_freq.pt", "vocab_mapping.pt"] {
        assert!(d.join(f).metadata().unwrap().len() > 0, "{f}");
    }
}
