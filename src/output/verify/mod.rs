//! `spool verify`: checks the output folders against the queue.
//!
//! For every dataset (those of the config, then any other the queue knows) it lists
//! `output_dir/<dataset>/` and checks:
//!
//! - the folder holds only `part-NNNNNN.parquet` shards and `_rejected.jsonl`: a writer's
//!   temporary file (`.part-NNNNNN.parquet.tmp`, left by a crash) or anything else is a
//!   [`Problem::StrayFile`];
//! - every shard opens, has exactly the shard schema, the required key-value metadata
//!   ([`REQUIRED_METADATA_KEYS`]) and zstd column chunks, and decodes to the end
//!   (every column is decoded, not only the ones checked below);
//! - every row: its `dataset` column names the folder's dataset, its `id` is the one the
//!   queue enqueued at that `row`, and when `completion_token_ids` is present its length
//!   equals `completion_tokens` (the pair the budget counts; `prompt_token_ids` may
//!   legitimately differ from a server-counted `prompt_tokens`, so it is not checked);
//! - exactly-once: every item the queue records as sharded (`S` records) is in exactly one
//!   shard, the one the queue names, all its rows there and each (sample, turn) once (an
//!   item has several rows with `samples > 1` or `turns = "all"`); no shard row is an item the queue
//!   does not have as sharded (except in a shard the next `spool run` would adopt);
//! - shard indices ≥ the dataset's `next_shard` (a crash between the rename and the queue
//!   update) are reported, with whether `spool run` can adopt them;
//! - the durable counters `done`, `sharded` (items) and `completion_tokens` (rows) equal
//!   what the scan counts (shards plus results waiting in the queue's results log); tokens
//!   of generations kept for items still open count too.
//!
//! Done items whose result is durable in the queue but not yet in a shard (the results log,
//! normal after a kill: the next run writes them) are not problems; they are counted in
//! [`VerifyReport::waiting_for_shard`].
//!
//! Invariants relied on (see `archive.rs` and `queue.rs`): an item is in exactly one of the
//! queue's states (pending, unsharded, sharded, failed); an `S` record names the shard file
//! holding its rows; a
//! `part-*.parquet` name is only ever given to a complete file; shards of a dataset are
//! numbered below its `next_shard` once the queue has recorded them.
//!
//! Memory: shards are read one at a time, record batch by record batch, keeping only each
//! row's (row, id, completion tokens) for the shard being read. Per dataset it keeps the
//! queue's (row, shard) list and the shard each row was found in (three u64 per sharded
//! item), plus the rows of the `r` records (bounded by the open shards' size).
//! The verifier only reads: it never repairs (that is `spool run`'s recovery).

use crate::config::Config;
use crate::output::reader::{self, ShardReader};
use crate::output::schema::REQUIRED_METADATA_KEYS;
use crate::output::shard::{self, ShardError};
use crate::store::queue::{DatasetState, Queue, QueueError};
use arrow_array::{Array, ListArray, RecordBatch, StringArray, UInt32Array, UInt64Array};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

mod problem;
pub use problem::Problem;

/// The one non-shard file a dataset folder may hold (written by intake).
pub const REJECTED_FILE: &str = "_rejected.jsonl";

/// Marks a sharded item not (yet) found in any shard.
const NOT_FOUND: u64 = u64::MAX;

/// Why verification could not be carried out at all (as opposed to a [`Problem`] found):
/// the queue could not be read, or a folder could not be listed. Exit 1.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("cannot list {}: {source}", path.display())]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What was checked for one dataset.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DatasetReport {
    pub name: String,
    /// Shard files read (readable or not).
    pub shards: usize,
    /// Shard rows read.
    pub rows: u64,
    /// Done items the queue knows (its `done` counter; 0 when the queue lacks the dataset).
    pub done: u64,
    /// Done items durable in the queue, waiting for the next run to shard them.
    pub waiting_for_shard: u64,
}

/// The outcome of a verification: clean when `problems` is empty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VerifyReport {
    /// Everything found wrong, file-level problems first, then rows, then counters.
    pub problems: Vec<Problem>,
    /// Shard files read, over all datasets.
    pub shards: usize,
    /// Shard rows read, over all datasets.
    pub rows: u64,
    /// Done items waiting for a shard, over all datasets (not a problem).
    pub waiting_for_shard: u64,
    /// Per dataset, in config order, then datasets only the queue knows.
    pub datasets: Vec<DatasetReport>,
}

impl VerifyReport {
    /// Whether nothing is wrong (exit 0).
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    /// The human summary: one line overall, one per dataset (without the problems).
    pub fn render_summary(&self) -> String {
        let mut out = format!(
            "verified {} dataset(s): {} shard(s), {} row(s) checked, {} done item(s) waiting for a shard\n",
            self.datasets.len(),
            self.shards,
            self.rows,
            self.waiting_for_shard
        );
        for d in &self.datasets {
            out.push_str(&format!(
                "  {}: {} shard(s), {} row(s), {} done, {} waiting for a shard\n",
                d.name, d.shards, d.rows, d.done, d.waiting_for_shard
            ));
        }
        out
    }
}

/// Checks the output folders of `cfg` against the queue; see the module documentation for
/// what is checked. `Err` only when the check itself cannot proceed.
pub fn verify(queue: &Queue, cfg: &Config) -> Result<VerifyReport, VerifyError> {
    let names: Vec<String> = cfg.datasets.iter().map(|d| d.name.clone()).collect();
    verify_output(queue, &cfg.output_dir, &names)
}

/// [`verify`] for explicit dataset names (the queue's other datasets are added).
fn verify_output(
    queue: &Queue,
    output_dir: &Path,
    names: &[String],
) -> Result<VerifyReport, VerifyError> {
    let states = queue.states();
    let mut names: Vec<String> = names.to_vec();
    for s in &states {
        if !names.contains(&s.name) {
            names.push(s.name.clone());
        }
    }
    let mut report = VerifyReport::default();
    if queue.needs_repair() {
        report.problems.push(Problem::NeedsRepair {
            path: queue.path().join(crate::store::queue::REPAIR_MARKER),
        });
    }
    for name in &names {
        let state = states.iter().find(|s| &s.name == name);
        let d = verify_dataset(queue, output_dir, name, state, &mut report.problems)?;
        report.shards += d.shards;
        report.rows += d.rows;
        report.waiting_for_shard += d.waiting_for_shard;
        report.datasets.push(d);
    }
    Ok(report)
}

/// One row of a shard, as much as the cross-checks need; after [`by_item`], one item
/// (its rows' tokens summed).
struct Key {
    row: u64,
    id: String,
    completion_tokens: u64,
    sample: u32,
    turn: u32,
}

/// A shard read to the end: its items' keys (one per item, in the order they first
/// appear), its row count and the problems found inside it.
struct ShardScan {
    keys: Vec<Key>,
    rows: u64,
    problems: Vec<Problem>,
}

/// Collapses a shard's row keys to one per item, summing tokens; a (sample, turn) an item
/// has twice in the shard is a duplicate.
fn by_item(path: &Path, dataset: &str, keys: Vec<Key>, problems: &mut Vec<Problem>) -> Vec<Key> {
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    let mut seen: HashSet<(u64, u32, u32)> = HashSet::new();
    let mut out: Vec<Key> = Vec::new();
    for k in keys {
        if !seen.insert((k.row, k.sample, k.turn)) {
            problems.push(Problem::Duplicate {
                dataset: dataset.to_string(),
                row: k.row,
                id: format!("{} (sample {}, turn {})", k.id, k.sample, k.turn),
                places: vec![path.to_path_buf(), path.to_path_buf()],
            });
            continue;
        }
        match at.get(&k.row) {
            Some(&i) => out[i].completion_tokens += k.completion_tokens,
            None => {
                at.insert(k.row, out.len());
                out.push(k);
            }
        }
    }
    out
}

/// A shard row whose item the queue does not record as sharded.
struct Extra {
    id: String,
    shards: Vec<u64>,
}

fn verify_dataset(
    queue: &Queue,
    output_dir: &Path,
    name: &str,
    state: Option<&DatasetState>,
    problems: &mut Vec<Problem>,
) -> Result<DatasetReport, VerifyError> {
    let dir = output_dir.join(name);
    let mut rep = DatasetReport {
        name: name.to_string(),
        done: state.map_or(0, |s| s.done),
        ..Default::default()
    };
    let ds = state.map(|s| s.index);
    let next_shard = state.map_or(0, |s| s.next_shard);
    let shard_path = |i: u64| dir.join(shard::shard_file_name(i));

    let files = list_shards(&dir, problems)?;

    // The queue's view: (row, shard) of every sharded item, sorted by row.
    let expected = match ds {
        Some(ds) => queue.sharded_rows(ds)?,
        None => Vec::new(),
    };
    let mut found = vec![NOT_FOUND; expected.len()];
    let mut more_places: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
    let mut extras: BTreeMap<u64, Extra> = BTreeMap::new();
    let mut unrecorded: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut counted_tokens = 0u64;
    let mut row_problems = Vec::new();

    for &index in &files {
        let path = shard_path(index);
        rep.shards += 1;
        let scan = match scan_shard(&path, name) {
            Ok(s) => s,
            Err(p) => {
                problems.push(p);
                if index >= next_shard {
                    problems.push(Problem::UnrecordedShard {
                        path,
                        next_shard,
                        adoptable: false,
                    });
                }
                continue;
            }
        };
        problems.extend(scan.problems);
        rep.rows += scan.rows;
        let mut rows_here = Vec::new();
        for key in scan.keys {
            if let Some(ds) = ds {
                let queue_id = queue.item_id(ds, key.row)?;
                if queue_id.as_deref() != Some(key.id.as_str()) {
                    row_problems.push(Problem::IdMismatch {
                        path: path.clone(),
                        row: key.row,
                        id: key.id.clone(),
                        queue_id,
                    });
                }
            }
            if index >= next_shard {
                rows_here.push(key.row);
            }
            match expected.binary_search_by_key(&key.row, |e| e.0) {
                Ok(i) if found[i] == NOT_FOUND => {
                    found[i] = index;
                    counted_tokens += key.completion_tokens;
                }
                Ok(i) => more_places.entry(i).or_default().push(index),
                Err(_) => extras
                    .entry(key.row)
                    .or_insert_with(|| Extra {
                        id: key.id,
                        shards: Vec::new(),
                    })
                    .shards
                    .push(index),
            }
        }
        if index >= next_shard {
            unrecorded.push((index, rows_here));
        }
    }

    // Results durable in the queue, waiting for a shard.
    // One entry per item, its rows' tokens summed (an item's rows are together in the log).
    let mut waiting: Vec<(u64, u64)> = Vec::new();
    if let Some(ds) = ds {
        for r in queue.unsharded(ds)? {
            match waiting.last_mut() {
                Some(w) if w.0 == r.row => w.1 += u64::from(r.completion_tokens),
                _ => waiting.push((r.row, u64::from(r.completion_tokens))),
            }
        }
        // Generations kept for open items were counted when kept.
        for row in queue.open_items(ds)? {
            for g in queue.generations(ds, row)? {
                counted_tokens += u64::from(g.completion_tokens);
            }
        }
    }
    let waiting_rows: HashSet<u64> = waiting.iter().map(|w| w.0).collect();
    counted_tokens += waiting.iter().map(|w| w.1).sum::<u64>();
    rep.waiting_for_shard = waiting
        .iter()
        .filter(|w| !extras.contains_key(&w.0))
        .count() as u64;

    for (index, rows) in unrecorded {
        let adoptable = rows.iter().all(|r| {
            waiting_rows.contains(r) && extras.get(r).is_some_and(|e| e.shards.len() == 1)
        });
        problems.push(Problem::UnrecordedShard {
            path: shard_path(index),
            next_shard,
            adoptable,
        });
    }

    // Every sharded item: in exactly one shard, the recorded one.
    let mut missing_by_shard: BTreeMap<u64, u64> = BTreeMap::new();
    let mut missing = Vec::new();
    for (i, &(row, recorded)) in expected.iter().enumerate() {
        let mut places: Vec<u64> = Vec::new();
        if found[i] != NOT_FOUND {
            places.push(found[i]);
        }
        if let Some(more) = more_places.remove(&i) {
            places.extend(more);
        }
        let id = || -> Result<String, VerifyError> { item_id(queue, ds, row) };
        match places.as_slice() {
            [] => {
                *missing_by_shard.entry(recorded).or_default() += 1;
                missing.push(Problem::DoneButInNoShard {
                    dataset: name.to_string(),
                    row,
                    id: id()?,
                    recorded: shard_path(recorded),
                });
            }
            [one] if *one == recorded => {}
            [one] => row_problems.push(Problem::WrongShard {
                dataset: name.to_string(),
                row,
                id: id()?,
                recorded: shard_path(recorded),
                found: shard_path(*one),
            }),
            many => row_problems.push(Problem::Duplicate {
                dataset: name.to_string(),
                row,
                id: id()?,
                places: many.iter().map(|&s| shard_path(s)).collect(),
            }),
        }
    }
    for (&recorded, &rows) in &missing_by_shard {
        if !files.contains(&recorded) {
            problems.push(Problem::MissingShard {
                path: shard_path(recorded),
                rows,
            });
        }
    }

    // Shard rows the queue does not record as sharded.
    for (row, extra) in &extras {
        if extra.shards.len() > 1 {
            row_problems.push(Problem::Duplicate {
                dataset: name.to_string(),
                row: *row,
                id: extra.id.clone(),
                places: extra.shards.iter().map(|&s| shard_path(s)).collect(),
            });
        }
        let queue_state = match ds {
            None => "not at all (the queue does not know this dataset)",
            Some(ds) if queue.is_unsharded(ds, *row)? => {
                "waiting for a shard (the next `spool run` would write it again)"
            }
            Some(ds) if queue.is_pending(ds, *row)? => "pending",
            Some(ds) if queue.item(ds, *row)?.is_some() => "failed",
            Some(_) => "not enqueued",
        };
        let waiting_here = waiting_rows.contains(row);
        for &s in &extra.shards {
            // A waiting row in an unrecorded shard is what recovery adopts: reported once,
            // as the shard's UnrecordedShard.
            if waiting_here && s >= next_shard && extra.shards.len() == 1 {
                continue;
            }
            row_problems.push(Problem::NotInQueue {
                path: shard_path(s),
                row: *row,
                id: extra.id.clone(),
                queue_state,
            });
        }
    }
    problems.extend(missing);
    problems.extend(row_problems);

    // Durable counters against the scan.
    if let Some(s) = state {
        let sharded = expected.len() as u64;
        let mut check = |what: &'static str, counter: u64, counted: u64| {
            if counter != counted {
                problems.push(Problem::CounterMismatch {
                    dataset: name.to_string(),
                    what,
                    counter,
                    counted,
                });
            }
        };
        check("sharded", s.sharded, sharded);
        check("done", s.done, sharded + waiting.len() as u64);
        let audit = queue.audit(s.index)?;
        check("items", s.items, audit.items);
        check("failed", s.failed, audit.failed);
        let stateless = audit.stateless;
        // Tokens of rows no shard holds cannot be counted: the rows are reported already.
        if missing_by_shard.is_empty() {
            check("completion_tokens", s.completion_tokens, counted_tokens);
        }
        if let Some(max) = expected.iter().map(|e| e.1).max() {
            if max >= s.next_shard {
                check("next_shard", s.next_shard, max + 1);
            }
        }
        for row in stateless {
            problems.push(Problem::Stateless {
                dataset: name.to_string(),
                row,
                id: item_id(queue, Some(s.index), row)?,
            });
        }
    }
    Ok(rep)
}

/// The id the queue enqueued at `row` (for messages), or `?` when it has none.
fn item_id(queue: &Queue, ds: Option<u16>, row: u64) -> Result<String, VerifyError> {
    Ok(match ds {
        Some(ds) => queue.item(ds, row)?.map(|i| i.id),
        None => None,
    }
    .unwrap_or_else(|| "?".into()))
}

/// Shard indices in `dir`, sorted; every other entry is reported as a stray file. A
/// missing folder holds no shards.
fn list_shards(dir: &Path, problems: &mut Vec<Problem>) -> Result<Vec<u64>, VerifyError> {
    let list_err = |source| VerifyError::List {
        path: dir.to_path_buf(),
        source,
    };
    let entries = shard::folder_entries(dir).map_err(list_err)?;
    let mut shards = Vec::new();
    let mut strays = Vec::new();
    for e in entries {
        let is_file = e.file_type().map_err(list_err)?.is_file();
        let name = e.file_name().to_string_lossy().into_owned();
        match shard::parse_shard_index(&name) {
            Some(i) if is_file => shards.push(i),
            _ if is_file && name == REJECTED_FILE => {}
            _ => strays.push(e.path()),
        }
    }
    shards.sort_unstable();
    strays.sort();
    problems.extend(strays.into_iter().map(|path| Problem::StrayFile { path }));
    Ok(shards)
}

/// Reads one shard to the end, checking its footer and every row. `Err`: the shard as a
/// whole is unusable (none of its rows count as found).
fn scan_shard(path: &Path, dataset: &str) -> Result<ShardScan, Problem> {
    let unreadable = |error: String| Problem::UnreadableShard {
        path: path.to_path_buf(),
        error,
    };
    let shard = match ShardReader::open_checked(path) {
        Ok(r) => r,
        Err(ShardError::Schema { detail, .. }) => {
            return Err(Problem::SchemaDrift {
                path: path.to_path_buf(),
                detail,
            })
        }
        Err(e) => return Err(unreadable(e.detail())),
    };
    let info = shard.info();
    let mut problems = Vec::new();
    for key in REQUIRED_METADATA_KEYS {
        if !info.metadata.iter().any(|(k, _)| k == key) {
            problems.push(Problem::MissingMetadata {
                path: path.to_path_buf(),
                key: (*key).to_string(),
            });
        }
    }
    if !info.all_zstd {
        problems.push(Problem::NotZstd {
            path: path.to_path_buf(),
        });
    }

    // Every column is decoded, so a damaged page anywhere makes the shard unreadable.
    let mut keys = Vec::new();
    for batch in shard.batches(None).map_err(|e| unreadable(e.detail()))? {
        let batch = batch.map_err(|e| unreadable(e.detail()))?;
        scan_batch(path, dataset, &batch, &mut keys, &mut problems)
            .map_err(|e| unreadable(e.detail()))?;
    }
    if keys.len() as u64 != info.rows {
        return Err(unreadable(format!(
            "the footer says {} rows but {} were read",
            info.rows,
            keys.len()
        )));
    }
    let rows = keys.len() as u64;
    let keys = by_item(path, dataset, keys, &mut problems);
    Ok(ShardScan {
        keys,
        rows,
        problems,
    })
}

/// Checks one decoded batch's rows and appends their keys.
fn scan_batch(
    path: &Path,
    dataset: &str,
    batch: &RecordBatch,
    keys: &mut Vec<Key>,
    problems: &mut Vec<Problem>,
) -> Result<(), ShardError> {
    let ids = reader::column::<StringArray>(path, batch, "id")?;
    let datasets = reader::column::<StringArray>(path, batch, "dataset")?;
    let rows = reader::column::<UInt64Array>(path, batch, "row")?;
    let tokens = reader::column::<UInt32Array>(path, batch, "completion_tokens")?;
    let token_ids = reader::column::<ListArray>(path, batch, "completion_token_ids")?;
    let samples = reader::opt_column::<UInt32Array>(path, batch, "sample")?;
    let turns = reader::opt_column::<UInt32Array>(path, batch, "turn")?;
    for i in 0..batch.num_rows() {
        let key = Key {
            row: rows.value(i),
            id: ids.value(i).to_owned(),
            completion_tokens: u64::from(tokens.value(i)),
            sample: samples.map_or(0, |a| a.value(i)),
            turn: turns.map_or(0, |a| a.value(i)),
        };
        if datasets.value(i) != dataset {
            problems.push(Problem::WrongDataset {
                path: path.to_path_buf(),
                row: key.row,
                id: key.id.clone(),
                found: datasets.value(i).to_owned(),
            });
        }
        if token_ids.is_valid(i) {
            let ids_len = usize::try_from(token_ids.value_length(i)).unwrap_or_default();
            if ids_len != key.completion_tokens as usize {
                problems.push(Problem::TokenCountMismatch {
                    path: path.to_path_buf(),
                    row: key.row,
                    id: key.id.clone(),
                    completion_tokens: tokens.value(i),
                    ids_len,
                });
            }
        }
        keys.push(key);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::shard::ShardLimits;
    use crate::output::writer::ShardWriter;
    use crate::store::queue::{Item, Outcome};
    use crate::store::row::ShardRow;

    fn item(id: &str) -> (u64, Item) {
        let row: u64 = id[1..].parse().unwrap();
        (
            row,
            Item {
                id: id.into(),
                hash: [0; 16],
                prompt: format!("p {id}"),
                messages: None,
                prompt_ids: None,
                extra: None,
            },
        )
    }

    fn result(row: u64) -> ShardRow {
        ShardRow {
            completion_token_ids: Some(vec![7; 3]),
            completion_tokens: 3,
            ..ShardRow::for_tests(format!("x{row}"), "a", row)
        }
    }

    fn metadata() -> Vec<(String, String)> {
        REQUIRED_METADATA_KEYS
            .iter()
            .map(|k| (k.to_string(), "x".to_string()))
            .collect()
    }

    fn write_shard(dir: &Path, index: u64, rows: &[ShardRow]) {
        let mut w = ShardWriter::create(
            &dir.join("a"),
            index,
            &ShardLimits::default(),
            metadata(),
            &crate::knobs::Faults::default(),
        )
        .unwrap();
        w.append(rows).unwrap();
        w.finish().unwrap();
    }

    /// A queue with 6 items of dataset `a`, rows 0..4 done; `sharded` of them in shard 0.
    fn setup(out: &Path, data: &Path, sharded: &[u64]) -> Queue {
        let q = Queue::open(data).unwrap();
        let s = q.open_dataset("a").unwrap();
        let items: Vec<_> = (0..6).map(|i| item(&format!("x{i}"))).collect();
        q.enqueue(s.index, &items, 6, 0).unwrap();
        let outcomes: Vec<_> = (0..4)
            .map(|r| Outcome::Done {
                ds: s.index,
                result: Box::new(result(r)),
            })
            .collect();
        q.commit(&outcomes).unwrap();
        if !sharded.is_empty() {
            let rows: Vec<_> = sharded.iter().map(|&r| result(r)).collect();
            write_shard(out, 0, &rows);
            q.mark_sharded(s.index, 0, sharded).unwrap();
        }
        q
    }

    fn names() -> Vec<String> {
        vec!["a".to_string()]
    }

    /// A generation of item `row`: result(row) with its (sample, turn), 3 tokens.
    fn generation(row: u64, sample: u32, turn: u32) -> ShardRow {
        ShardRow {
            sample,
            turn,
            ..result(row)
        }
    }

    /// A queue whose items 0 and 1 are closed with two generations each and sharded
    /// together in shard 0 (written as `shard0`), and item 4 open with one kept.
    fn generations_setup(out: &Path, data: &Path, shard0: &[ShardRow]) -> Queue {
        let q = Queue::open(data).unwrap();
        let ds = q.open_dataset("a").unwrap().index;
        let items: Vec<_> = (0..6).map(|i| item(&format!("x{i}"))).collect();
        q.enqueue(ds, &items, 6, 0).unwrap();
        let generated = |row, sample, turn| Outcome::Generated {
            ds,
            result: Box::new(generation(row, sample, turn)),
        };
        let applied = q
            .commit(&[
                generated(0, 0, 0),
                generated(1, 0, 0),
                generated(1, 1, 0),
                generated(4, 0, 0),
            ])
            .unwrap();
        assert_eq!(applied, vec![true; 4]);
        let closes = [
            Outcome::Closed {
                ds,
                row: 0,
                result: Some(Box::new(generation(0, 0, 1))),
                partial: Vec::new(),
            },
            Outcome::Closed {
                ds,
                row: 1,
                result: None,
                partial: Vec::new(),
            },
        ];
        assert_eq!(q.commit(&closes).unwrap(), vec![true; 2]);
        write_shard(out, 0, shard0);
        q.mark_sharded(ds, 0, &[0, 1]).unwrap();
        q
    }

    /// Items with several rows verify clean when each is whole in its recorded shard, each
    /// (sample, turn) once: `done` counts items, rows are more, and the tokens of a
    /// generation kept for an open item count; a (sample, turn) twice is a duplicate.
    #[test]
    fn items_of_several_generations_verify_per_item() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let rows = [
            generation(0, 0, 0),
            generation(0, 0, 1),
            generation(1, 0, 0),
            generation(1, 1, 0),
        ];
        let q = generations_setup(&out, &t.path().join("data"), &rows);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert!(r.is_clean(), "{:?}", r.problems);
        assert_eq!((r.shards, r.rows, r.waiting_for_shard), (1, 4, 0));
        assert_eq!(r.datasets[0].done, 2);
        assert_eq!(q.state(0).unwrap().completion_tokens, 5 * 3);
        drop(q);

        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let twice = [
            generation(0, 0, 0),
            generation(0, 0, 1),
            generation(1, 0, 0),
            generation(1, 0, 0),
        ];
        let q = generations_setup(&out, &t.path().join("data"), &twice);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert!(
            r.problems
                .iter()
                .any(|p| matches!(p, Problem::Duplicate { row: 1, .. })),
            "{:?}",
            r.problems
        );
    }

    /// An item's rows split between two shards are reported: the item is in more than one
    /// shard.
    #[test]
    fn an_item_split_between_shards_is_reported() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let rows = [
            generation(0, 0, 0),
            generation(0, 0, 1),
            generation(1, 0, 0),
        ];
        let q = generations_setup(&out, &t.path().join("data"), &rows);
        write_shard(&out, 1, &[generation(1, 1, 0)]);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert!(
            r.problems.iter().any(|p| matches!(
                p,
                Problem::Duplicate { row: 1, places, .. } if places.len() == 2
            )),
            "{:?}",
            r.problems
        );
    }

    /// Results waiting in the queue are counted, not reported; the counters check out.
    #[test]
    fn waiting_results_are_not_problems() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let q = setup(&out, &t.path().join("data"), &[0, 1]);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert!(r.is_clean(), "{:?}", r.problems);
        assert_eq!((r.shards, r.rows, r.waiting_for_shard), (1, 2, 2));
        assert_eq!(r.datasets[0].done, 4);
    }

    /// A shard renamed but not recorded (crash before the queue update) is reported as
    /// adoptable, and its rows are neither waiting nor "not in queue".
    #[test]
    fn an_unrecorded_shard_of_waiting_rows_is_adoptable() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let q = setup(&out, &t.path().join("data"), &[0, 1]);
        write_shard(&out, 1, &[result(2), result(3)]);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert_eq!(r.waiting_for_shard, 0);
        assert_eq!(
            r.problems,
            vec![Problem::UnrecordedShard {
                path: out.join("a/part-000001.parquet"),
                next_shard: 1,
                adoptable: true
            }]
        );
        assert!(r.problems[0].to_string().contains("adopts it"));
    }

    /// Rows in a recorded shard that the queue does not have as sharded, rows in the wrong
    /// shard and wrong ids are each named.
    #[test]
    fn foreign_and_misplaced_rows_are_named() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let q = setup(&out, &t.path().join("data"), &[0]);
        // Recorded: row 1 in shard 1. Written: shard 1 holds row 2 (waiting) and row 5
        // (pending) with a wrong id; shard 2 holds row 1 but is never recorded.
        let s = q.state(0).unwrap();
        write_shard(
            &out,
            1,
            &[result(2), {
                let mut r = result(5);
                r.id = "x4".into();
                r
            }],
        );
        q.mark_sharded(s.index, 1, &[1]).unwrap();
        write_shard(&out, 2, &[result(1)]);
        let r = verify_output(&q, &out, &names()).unwrap();
        let text: Vec<String> = r.problems.iter().map(|p| p.to_string()).collect();
        let has = |f: &dyn Fn(&Problem) -> bool| r.problems.iter().any(f);
        assert!(
            has(&|p| matches!(p, Problem::WrongShard { row: 1, .. })),
            "{text:#?}"
        );
        assert!(
            has(
                &|p| matches!(p, Problem::NotInQueue { row: 2, queue_state, .. } if queue_state.starts_with("waiting"))
            ),
            "{text:#?}"
        );
        assert!(
            has(&|p| matches!(
                p,
                Problem::NotInQueue {
                    row: 5,
                    queue_state: "pending",
                    ..
                }
            )),
            "{text:#?}"
        );
        assert!(
            has(&|p| matches!(
                p,
                Problem::IdMismatch {
                    row: 5,
                    queue_id: Some(q),
                    ..
                } if q == "x5"
            )),
            "{text:#?}"
        );
        assert!(
            has(&|p| matches!(
                p,
                Problem::UnrecordedShard {
                    adoptable: false,
                    ..
                }
            )),
            "{text:#?}"
        );
    }

    /// A counter that disagrees with the records is reported with both numbers.
    #[test]
    fn counters_are_checked_against_the_scan() {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("out");
        let q = setup(&out, &t.path().join("data"), &[0, 1]);
        // Rewrite shard 0 with a different completion token count for row 0.
        std::fs::remove_file(out.join("a/part-000000.parquet")).unwrap();
        let mut r0 = result(0);
        r0.completion_tokens = 5;
        r0.completion_token_ids = None;
        write_shard(&out, 0, &[r0, result(1)]);
        let r = verify_output(&q, &out, &names()).unwrap();
        assert_eq!(
            r.problems,
            vec![Problem::CounterMismatch {
                dataset: "a".into(),
                what: "completion_tokens",
                counter: 12,
                counted: 14
            }]
        );
    }
}
