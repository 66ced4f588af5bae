//! The results log: each dataset's done results, appended as they complete, until they are
//! in a shard (queue format 3 on).
//!
//! A result is appended to a file rather than written to sled, because a sled record per
//! result would cost two writes through sled's pages per completion (its insert and, when
//! its shard is sealed, its removal), the most expensive part of a commit at thousands of
//! completions per second. The committer appends the batch's results to
//! `data_dir/results/<ds>.log` and syncs it *before* the queue records the batch; the
//! dataset's counters record where the log's recorded part ends (`results_end`) and where
//! its unsharded part starts (`results_start`). Bytes past `results_end` (a kill between
//! the append and the queue's batch) are cut off when the log is opened, and their items
//! are still pending.
//!
//! Record: `len` (u32 LE) · xxHash64 of the payload (u64 LE) · payload: one item's rows —
//! a single [`ShardRow`] in binary ([`encode_row`]: a version byte, then its fields in
//! declaration order, because JSON spends its time escaping text and printing token ids),
//! or a group ([`encode_group_record`]: the rows of an item with several generations, so
//! that the log's index, `forget` and the archive stay per item). Every read checks the
//! checksum; a damaged log is named with its offset.
//!
//! Invariant: one record holds the rows of one item, all with that item's `row`; row
//! layouts only gain versions ([`ROW_V1`] records, written before the generation fields
//! existed, and [`ROW_V2`] ones, before `prompt_ids_source`, still read, their new fields
//! 0 or None).
//!
//! Invariant: the log is only appended to; the part before `results_start` holds only rows
//! already in shards and is given back to the file system (a hole punched) as shards are
//! sealed, so the log's disk use stays about one shard's worth of rows.

use crate::prompt::remote::IdsSource;
use crate::store::blocks::{BlockError, BlockFile, RecordReader};
use crate::store::row::ShardRow;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What [`ResultLog::append`] wrote: each record's (offset, row, length), and the log's new
/// end (the queue records it as `results_end`).
pub struct Appended {
    pub records: Vec<(u64, u64, u32)>,
    pub end: u64,
}

/// Bytes before a record's payload.
const HEADER: usize = 12;

/// One dataset's log and, in memory, where each of its unsharded results is.
pub struct ResultLog {
    file: BlockFile,
    /// Unsharded results: offset → (row, record length).
    by_offset: BTreeMap<u64, (u64, u32)>,
    /// Unsharded results: row → offset (a row completed again, after a repair put it back
    /// to pending, has its newest record here).
    by_row: HashMap<u64, u64>,
    /// Up to here the file's blocks have been given back (hole punched).
    punched: u64,
}

/// Version byte of the first row layout: the fields up to `completed_at_ms` (a change of
/// layout gets a new one; readers refuse versions they do not know).
const ROW_V1: u8 = 1;
/// [`ROW_V1`]'s fields, then `sample`, `turn` (u32 LE) and the optional texts
/// `reasoning`, `tool_calls`, `tools`, `sampling`, `partial`.
const ROW_V2: u8 = 2;
/// A group record: a count (u32 LE), then that many rows, each with its version byte.
const GROUP: u8 = 3;
/// [`ROW_V2`]'s fields, then `prompt_ids_source` as an optional text (`client`,
/// `server`). The byte after 2 is 4: 3 starts a group record.
const ROW_V4: u8 = 4;

/// Frames a result as a log record.
pub fn encode_record(row: &ShardRow) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + 64 + row.prompt.len() + row.completion.len());
    v.extend_from_slice(&[0u8; HEADER]);
    encode_row(row, &mut v);
    frame(v)
}

/// Frames the rows of one item (its generations, in order) as one log record.
pub fn encode_group_record(rows: &[ShardRow]) -> Vec<u8> {
    let text: usize = rows
        .iter()
        .map(|r| 64 + r.prompt.len() + r.completion.len())
        .sum();
    let mut v = Vec::with_capacity(HEADER + 5 + text);
    v.extend_from_slice(&[0u8; HEADER]);
    v.push(GROUP);
    v.extend_from_slice(&(rows.len() as u32).to_le_bytes());
    for r in rows {
        encode_row(r, &mut v);
    }
    frame(v)
}

/// Fills in the header (length, checksum) of a record whose payload follows it.
fn frame(mut v: Vec<u8>) -> Vec<u8> {
    let payload = &v[HEADER..];
    let (n, h) = (
        payload.len() as u32,
        twox_hash::XxHash64::oneshot(0, payload),
    );
    v[0..4].copy_from_slice(&n.to_le_bytes());
    v[4..12].copy_from_slice(&h.to_le_bytes());
    v
}

/// A [`ShardRow`] in binary: [`ROW_V4`], then every field in declaration order — text as
/// u32 LE length and UTF-8, integers little-endian, token ids as a count and u32 LE each;
/// an absent optional text or list is a length of `u32::MAX`, an optional integer a 0/1
/// byte before it.
pub fn encode_row(r: &ShardRow, v: &mut Vec<u8>) {
    v.push(ROW_V4);
    encode_v2_fields(r, v);
    put_text(v, r.prompt_ids_source.map(IdsSource::as_str));
}

/// The fields [`ROW_V2`] has, after the version byte.
fn encode_v2_fields(r: &ShardRow, v: &mut Vec<u8>) {
    encode_v1_fields(r, v);
    v.extend_from_slice(&r.sample.to_le_bytes());
    v.extend_from_slice(&r.turn.to_le_bytes());
    for t in [
        &r.reasoning,
        &r.tool_calls,
        &r.tools,
        &r.sampling,
        &r.partial,
    ] {
        put_text(v, t.as_deref());
    }
}

fn put_text(v: &mut Vec<u8>, t: Option<&str>) {
    match t {
        Some(t) => {
            v.extend_from_slice(&(t.len() as u32).to_le_bytes());
            v.extend_from_slice(t.as_bytes());
        }
        None => v.extend_from_slice(&u32::MAX.to_le_bytes()),
    }
}

/// The fields [`ROW_V1`] has, after the version byte.
fn encode_v1_fields(r: &ShardRow, v: &mut Vec<u8>) {
    let text = put_text;
    fn ids(v: &mut Vec<u8>, ids: Option<&[u32]>) {
        match ids {
            Some(ids) => {
                v.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                for id in ids {
                    v.extend_from_slice(&id.to_le_bytes());
                }
            }
            None => v.extend_from_slice(&u32::MAX.to_le_bytes()),
        }
    }
    text(v, Some(&r.id));
    text(v, Some(&r.dataset));
    v.extend_from_slice(&r.row.to_le_bytes());
    text(v, Some(&r.prompt));
    text(v, r.messages.as_deref());
    ids(v, r.prompt_token_ids.as_deref());
    text(v, Some(&r.completion));
    ids(v, r.completion_token_ids.as_deref());
    v.extend_from_slice(&r.prompt_tokens.to_le_bytes());
    v.extend_from_slice(&r.completion_tokens.to_le_bytes());
    text(v, Some(&r.finish_reason));
    text(v, Some(&r.model));
    v.extend_from_slice(&r.attempts.to_le_bytes());
    v.extend_from_slice(&r.latency_ms.to_le_bytes());
    match r.ttft_ms {
        Some(t) => {
            v.push(1);
            v.extend_from_slice(&t.to_le_bytes());
        }
        None => v.push(0),
    }
    v.extend_from_slice(&r.completed_at_ms.to_le_bytes());
}

/// Reads [`encode_row`]'s bytes back (either row layout); `Err` says what does not add up.
pub fn decode_row(b: &[u8]) -> Result<ShardRow, String> {
    let mut r = RecordReader(b);
    let row = read_row(&mut r)?;
    r.finish()?;
    Ok(row)
}

/// Reads a log record's payload back: the one row of [`encode_record`] or every row of
/// [`encode_group_record`], in order.
pub fn decode_record(b: &[u8]) -> Result<Vec<ShardRow>, String> {
    let mut r = RecordReader(b);
    let rows = if b.first() == Some(&GROUP) {
        r.take(1)?;
        let n = r.u32()?;
        // Each row takes more than 8 bytes: a count beyond that is damage, not a size hint.
        let mut rows = Vec::with_capacity((n as usize).min(b.len() / 8));
        for _ in 0..n {
            rows.push(read_row(&mut r)?);
        }
        rows
    } else {
        vec![read_row(&mut r)?]
    };
    r.finish()?;
    Ok(rows)
}

/// One row, either layout, from where `r` stands.
fn read_row(r: &mut RecordReader<'_>) -> Result<ShardRow, String> {
    let version = r.take(1)?[0];
    if ![ROW_V1, ROW_V2, ROW_V4].contains(&version) {
        return Err(format!("unknown result record version {version}"));
    }
    let mut row = ShardRow {
        id: r.text("id")?,
        dataset: r.text("dataset")?,
        row: r.u64()?,
        prompt: r.text("prompt")?,
        messages: r.opt_text("messages")?,
        prompt_token_ids: r.opt_ids("prompt token ids")?,
        completion: r.text("completion")?,
        completion_token_ids: r.opt_ids("completion token ids")?,
        prompt_tokens: r.u32()?,
        completion_tokens: r.u32()?,
        finish_reason: r.text("finish reason")?,
        model: r.text("model")?,
        attempts: r.u32()?,
        latency_ms: r.u32()?,
        ttft_ms: match r.take(1)?[0] {
            0 => None,
            1 => Some(r.u32()?),
            x => return Err(format!("bad ttft flag {x}")),
        },
        completed_at_ms: r.u64()? as i64,
        sample: 0,
        turn: 0,
        reasoning: None,
        tool_calls: None,
        tools: None,
        sampling: None,
        partial: None,
        prompt_ids_source: None,
    };
    if version != ROW_V1 {
        row.sample = r.u32()?;
        row.turn = r.u32()?;
        row.reasoning = r.opt_text("reasoning")?;
        row.tool_calls = r.opt_text("tool calls")?;
        row.tools = r.opt_text("tools")?;
        row.sampling = r.opt_text("sampling")?;
        row.partial = r.opt_text("partial")?;
    }
    if version == ROW_V4 {
        row.prompt_ids_source = match r.opt_text("prompt ids source")? {
            None => None,
            Some(s) => Some(
                IdsSource::parse(&s).ok_or_else(|| format!("unknown prompt ids source {s:?}"))?,
            ),
        };
    }
    Ok(row)
}

/// The item row of a log record, without decoding the rest (opening the log indexes
/// every unsharded record; the archive decodes them in full once, when it is seeded).
fn peek_row(b: &[u8]) -> Result<u64, String> {
    let mut r = RecordReader(b);
    if b.first() == Some(&GROUP) {
        r.take(1)?;
        if r.u32()? == 0 {
            return Err("a group record without rows".into());
        }
    }
    let version = r.take(1)?[0];
    if ![ROW_V1, ROW_V2, ROW_V4].contains(&version) {
        return Err(format!("unknown result record version {version}"));
    }
    r.skip_text()?;
    r.skip_text()?;
    r.u64()
}

impl ResultLog {
    /// The log of dataset `ds` under `data_dir`.
    pub fn path(data_dir: &Path, ds: u16) -> PathBuf {
        data_dir.join("results").join(format!("{ds}.log"))
    }

    /// Opens (or creates) the log, cutting off bytes past `end`, and indexes the records in
    /// `start..end` (the queue then [forgets](ResultLog::forget) those in another state).
    pub fn open(path: PathBuf, start: u64, end: u64) -> Result<ResultLog, BlockError> {
        let file = BlockFile::open(
            path,
            end,
            "a result append (a kill before the queue recorded it)",
        )?;
        let mut log = ResultLog {
            file,
            by_offset: BTreeMap::new(),
            by_row: HashMap::new(),
            punched: 0,
        };
        let mut found = Vec::new();
        log.scan(start, end, |offset, len, payload| {
            let row = peek_row(payload).map_err(|e| log.bad_record(offset, e))?;
            found.push((offset, row, len));
            Ok(())
        })?;
        log.recorded(found);
        Ok(log)
    }

    fn insert(&mut self, offset: u64, row: u64, len: u32) {
        if let Some(old) = self.by_row.insert(row, offset) {
            self.by_offset.remove(&old);
        }
        self.by_offset.insert(offset, (row, len));
    }

    /// The records in `start..end` in order, each checked against its checksum: (offset,
    /// record length, payload).
    fn scan(
        &self,
        start: u64,
        end: u64,
        mut f: impl FnMut(u64, u32, &[u8]) -> Result<(), BlockError>,
    ) -> Result<(), BlockError> {
        if end <= start {
            return Ok(());
        }
        let bytes = self.read_at(start, (end - start) as usize)?;
        let mut at = 0usize;
        while at < bytes.len() {
            let (payload, len) = self.payload(start + at as u64, &bytes[at..])?;
            f(start + at as u64, len, payload)?;
            at += len as usize;
        }
        Ok(())
    }

    fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, BlockError> {
        let mut bytes = vec![0u8; len];
        self.file
            .raw()
            .read_exact_at(&mut bytes, offset)
            .map_err(|e| self.corrupt(offset, format!("cannot read {len} bytes: {e}")))?;
        Ok(bytes)
    }

    fn corrupt(&self, offset: u64, detail: String) -> BlockError {
        BlockError::Corrupt {
            path: self.file.file_path().to_path_buf(),
            offset,
            detail,
        }
    }

    fn bad_record(&self, offset: u64, e: String) -> BlockError {
        self.corrupt(offset, format!("bad result record: {e}"))
    }

    /// The payload of the record at the start of `b` (which is at `offset` in the file),
    /// checked against its checksum, and the record's length.
    fn payload<'b>(&self, offset: u64, b: &'b [u8]) -> Result<(&'b [u8], u32), BlockError> {
        if b.len() < HEADER {
            return Err(self.corrupt(offset, "a result record is cut short".into()));
        }
        let n = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")) as usize;
        let want = u64::from_le_bytes(b[4..12].try_into().expect("8 bytes"));
        let Some(payload) = b.get(HEADER..HEADER + n) else {
            return Err(self.corrupt(offset, format!("a result record of {n} bytes is cut short")));
        };
        let h = twox_hash::XxHash64::oneshot(0, payload);
        if h != want {
            return Err(self.corrupt(
                offset,
                format!("checksum {h:016x} is not the recorded {want:016x}"),
            ));
        }
        Ok((payload, (HEADER + n) as u32))
    }

    /// Appends the records ([`encode_record`]) of `rows` ((row, record) each) and syncs the
    /// file, in one write; returns (offset, row, length) of each and the new end. Not
    /// indexed until [`ResultLog::recorded`] (once the queue has recorded them).
    pub fn append(&self, rows: &[(u64, Vec<u8>)]) -> Result<Appended, BlockError> {
        let mut all = Vec::with_capacity(rows.iter().map(|(_, r)| r.len()).sum());
        for (_, r) in rows {
            all.extend_from_slice(r);
        }
        let mut at = self.file.append(&[&all])?[0];
        let records = rows
            .iter()
            .map(|(row, r)| {
                let o = at;
                at += r.len() as u64;
                (o, *row, r.len() as u32)
            })
            .collect();
        Ok(Appended { records, end: at })
    }

    /// Indexes appended records once the queue has recorded them.
    pub fn recorded(&mut self, records: impl IntoIterator<Item = (u64, u64, u32)>) {
        for (offset, row, len) in records {
            self.insert(offset, row, len);
        }
    }

    /// Whether `row`'s result is here, unsharded.
    pub fn contains(&self, row: u64) -> bool {
        self.by_row.contains_key(&row)
    }

    /// How many unsharded results there are.
    pub fn len(&self) -> usize {
        self.by_row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_row.is_empty()
    }

    /// Every unsharded row (any order).
    pub fn rows(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_row.keys().copied()
    }

    /// The unsharded results, in the order their items completed (an item's rows together,
    /// in its record's order).
    pub fn read_all(&self) -> Result<Vec<ShardRow>, BlockError> {
        let (Some((&first, _)), Some((&last, &(_, len)))) = (
            self.by_offset.first_key_value(),
            self.by_offset.last_key_value(),
        ) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(self.by_offset.len());
        self.scan(first, last + u64::from(len), |offset, _, payload| {
            if self.by_offset.contains_key(&offset) {
                out.extend(decode_record(payload).map_err(|e| self.bad_record(offset, e))?);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// The rows of one unsharded item (several for an item closed with several
    /// generations), as its record holds them; empty when the item has none here.
    pub fn read_item(&self, row: u64) -> Result<Vec<ShardRow>, BlockError> {
        let Some(&offset) = self.by_row.get(&row) else {
            return Ok(Vec::new());
        };
        let len = self.by_offset.get(&offset).map_or(0, |&(_, len)| len);
        let bytes = self.read_at(offset, len as usize)?;
        let (payload, _) = self.payload(offset, &bytes)?;
        decode_record(payload).map_err(|e| self.bad_record(offset, e))
    }

    /// Forgets rows (now in a shard, or given another state by a repair); returns where the
    /// unsharded part now starts (`end` when none is left).
    pub fn forget(&mut self, rows: impl IntoIterator<Item = u64>, end: u64) -> u64 {
        for row in rows {
            if let Some(o) = self.by_row.remove(&row) {
                self.by_offset.remove(&o);
            }
        }
        self.start(end)
    }

    /// Where the unsharded part starts (`end` when none is left).
    pub fn start(&self, end: u64) -> u64 {
        self.by_offset.first_key_value().map_or(end, |(&o, _)| o)
    }

    /// Gives the file system back the blocks wholly before `start` (best effort: a file
    /// system that cannot punch holes keeps them until the queue is removed).
    pub fn release_before(&mut self, start: u64) {
        // Given back in whole MiB: fewer calls, and never a block still partly unsharded.
        const GRAIN: u64 = 1 << 20;
        let upto = start / GRAIN * GRAIN;
        if upto <= self.punched {
            return;
        }
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on a file descriptor we own; it changes no memory of ours.
        let r = unsafe {
            libc::fallocate(
                self.file.raw().as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                self.punched as libc::off_t,
                (upto - self.punched) as libc::off_t,
            )
        };
        if r != 0 {
            tracing::debug!(path = %self.file.file_path().display(), error = %std::io::Error::last_os_error(),
                "cannot give back the sharded part of the results log");
        }
        // Tried once either way: not again for every shard.
        self.punched = upto;
    }

    /// Cuts the file back to `end` (a repair that put results back to pending).
    pub fn truncate(&self, end: u64) -> Result<(), BlockError> {
        self.file.truncate(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(r: u64, text: &str) -> ShardRow {
        ShardRow {
            completion: text.into(),
            completion_token_ids: Some(vec![1, 2, r as u32]),
            ..ShardRow::for_tests(format!("id{r}"), "a", r)
        }
    }

    /// Appends `rows` and indexes them, as the queue's commit does; returns the new end.
    fn append(log: &mut ResultLog, rows: &[ShardRow]) -> u64 {
        let recs: Vec<(u64, Vec<u8>)> = rows.iter().map(|r| (r.row, encode_record(r))).collect();
        let a = log.append(&recs).unwrap();
        log.recorded(a.records);
        a.end
    }

    /// Results read back in the order they completed, exactly; a row completed again keeps
    /// only its newest result; reopening indexes what lies between start and end, and a
    /// tail past the recorded end (a kill before the queue recorded it) is cut off.
    #[test]
    fn results_read_back_in_order_and_an_unrecorded_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = ResultLog::path(dir.path(), 3);
        let mut log = ResultLog::open(path.clone(), 0, 0).unwrap();
        let end = append(&mut log, &[row(5, "five"), row(2, "two ü")]);
        let end2 = append(&mut log, &[row(9, "nine"), row(5, "five again")]);
        let got: Vec<(u64, String)> = log
            .read_all()
            .unwrap()
            .into_iter()
            .map(|r| (r.row, r.completion))
            .collect();
        assert_eq!(
            got,
            vec![
                (2, "two ü".to_string()),
                (9, "nine".into()),
                (5, "five again".into())
            ]
        );
        assert_eq!(log.read_all().unwrap()[0], row(2, "two ü"));
        assert!(log.contains(9) && !log.contains(1));
        // Row 2 sharded: the unsharded part now starts at row 9's record.
        let start = log.forget([2], end2);
        assert_eq!(start, end);
        drop(log);
        // A kill after the next append, before the queue recorded it.
        let mut log = ResultLog::open(path.clone(), start, end2).unwrap();
        append(&mut log, &[row(11, "never recorded")]);
        drop(log);
        let log = ResultLog::open(path.clone(), start, end2).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), end2);
        let rows: Vec<u64> = log.read_all().unwrap().iter().map(|r| r.row).collect();
        assert_eq!(rows, vec![9, 5]);
        assert_eq!(log.len(), 2);
    }

    /// Results read back exactly in binary — every optional field present and absent,
    /// empty and non-ASCII text, negative times — and a cut, padded or unknown-version
    /// record is an error, not another row.
    #[test]
    fn result_rows_round_trip_and_damage_is_refused() {
        let full = ShardRow {
            messages: Some(r#"[{"role":"user","content":"日本"}]"#.into()),
            prompt_token_ids: Some(vec![0, u32::MAX - 1, 7]),
            completion_token_ids: Some(vec![]),
            ttft_ms: Some(12),
            completed_at_ms: -5,
            finish_reason: "length".into(),
            model: "m/ü".into(),
            attempts: 3,
            latency_ms: 99,
            prompt_tokens: 4,
            completion_tokens: 0,
            ..row(7, "")
        };
        let bare = ShardRow {
            prompt_token_ids: None,
            completion_token_ids: None,
            messages: None,
            ttft_ms: None,
            prompt: String::new(),
            ..row(u64::MAX, "é \"x\"\n")
        };
        for r in [&full, &bare] {
            let mut b = Vec::new();
            encode_row(r, &mut b);
            assert_eq!(&decode_row(&b).unwrap(), r);
            assert!(decode_row(&b[..b.len() - 1]).is_err());
            let mut padded = b.clone();
            padded.push(0);
            assert!(decode_row(&padded)
                .unwrap_err()
                .contains("after the record"));
            b[0] = 9;
            assert!(decode_row(&b).unwrap_err().contains("version 9"));
        }
    }

    /// A row with every generation field set, for the layouts' tests.
    fn generation(r: u64, sample: u32, turn: u32) -> ShardRow {
        ShardRow {
            sample,
            turn,
            reasoning: Some(format!("think {sample}/{turn} ü")),
            tool_calls: Some(r#"[{"id":"c","type":"function"}]"#.into()),
            tools: Some("[]".into()),
            sampling: Some(r#"{"seed":7}"#.into()),
            partial: (sample == 1).then(|| "budget".to_string()),
            prompt_ids_source: Some(if sample == 0 {
                IdsSource::Server
            } else {
                IdsSource::Client
            }),
            ..row(r, "gen")
        }
    }

    /// A record written in the first row layout (before the generation fields) still
    /// reads, the new fields 0 and None, through both the row and the record decoders.
    #[test]
    fn a_version_1_row_record_still_decodes() {
        let full = generation(4, 2, 3);
        let mut b = vec![ROW_V1];
        encode_v1_fields(&full, &mut b);
        let want = ShardRow {
            sample: 0,
            turn: 0,
            reasoning: None,
            tool_calls: None,
            tools: None,
            sampling: None,
            partial: None,
            prompt_ids_source: None,
            ..full.clone()
        };
        assert_eq!(decode_row(&b).unwrap(), want);
        assert_eq!(decode_record(&b).unwrap(), vec![want]);
        assert_eq!(peek_row(&b).unwrap(), 4);
        // The current layout keeps every field.
        let mut v4 = Vec::new();
        encode_row(&full, &mut v4);
        assert_eq!(v4[0], ROW_V4);
        assert_eq!(decode_row(&v4).unwrap(), full);
    }

    /// A record written in the second row layout (before `prompt_ids_source`) still
    /// reads, that field None, alone and inside a group; an unknown source is refused.
    #[test]
    fn a_version_2_row_record_still_decodes() {
        let full = generation(6, 0, 1);
        let mut b = vec![ROW_V2];
        encode_v2_fields(&full, &mut b);
        let want = ShardRow {
            prompt_ids_source: None,
            ..full.clone()
        };
        assert_eq!(decode_row(&b).unwrap(), want);
        assert_eq!(peek_row(&b).unwrap(), 6);
        let mut group = vec![GROUP];
        group.extend_from_slice(&2u32.to_le_bytes());
        group.extend_from_slice(&b);
        encode_row(&full, &mut group);
        assert_eq!(decode_record(&group).unwrap(), vec![want, full.clone()]);
        let mut bad = vec![ROW_V4];
        encode_v2_fields(&full, &mut bad);
        put_text(&mut bad, Some("model"));
        assert!(decode_row(&bad).unwrap_err().contains("\"model\""));
    }

    /// A group record (one item's generations) round-trips every row in order, is indexed
    /// under its item's row, reads back flattened among single-row records, and is
    /// forgotten whole; a cut or miscounted group is refused.
    #[test]
    fn a_group_record_round_trips_and_reads_back_flattened() {
        let rows = vec![
            generation(3, 0, 0),
            generation(3, 0, 1),
            generation(3, 1, 0),
        ];
        let rec = encode_group_record(&rows);
        let payload = &rec[HEADER..];
        assert_eq!(decode_record(payload).unwrap(), rows);
        assert_eq!(peek_row(payload).unwrap(), 3);
        assert!(decode_record(&payload[..payload.len() - 1]).is_err());
        let mut miscounted = payload.to_vec();
        miscounted[1] = 4;
        assert!(decode_record(&miscounted).is_err());
        let mut empty = vec![GROUP];
        empty.extend_from_slice(&0u32.to_le_bytes());
        assert!(peek_row(&empty).is_err());

        let dir = tempfile::tempdir().unwrap();
        let path = ResultLog::path(dir.path(), 0);
        let mut log = ResultLog::open(path.clone(), 0, 0).unwrap();
        let recs = vec![
            (1, encode_record(&row(1, "one"))),
            (3, rec.clone()),
            (5, encode_record(&row(5, "five"))),
        ];
        let a = log.append(&recs).unwrap();
        log.recorded(a.records);
        drop(log);
        let mut log = ResultLog::open(path, 0, a.end).unwrap();
        assert_eq!(log.len(), 3, "one index entry per item");
        let got: Vec<(u64, u32, u32)> = log
            .read_all()
            .unwrap()
            .iter()
            .map(|r| (r.row, r.sample, r.turn))
            .collect();
        assert_eq!(
            got,
            vec![(1, 0, 0), (3, 0, 0), (3, 0, 1), (3, 1, 0), (5, 0, 0)]
        );
        assert_eq!(log.read_item(3).unwrap(), rows);
        assert_eq!(log.read_item(5).unwrap().len(), 1);
        assert!(log.read_item(4).unwrap().is_empty());
        log.forget([3], a.end);
        assert!(log.read_item(3).unwrap().is_empty());
        let rows: Vec<u64> = log.read_all().unwrap().iter().map(|r| r.row).collect();
        assert_eq!(rows, vec![1, 5]);
    }

    /// A damaged or missing record is an error naming the file and the offset, never a
    /// result read wrong.
    #[test]
    fn a_damaged_log_is_named_with_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = ResultLog::path(dir.path(), 0);
        let mut log = ResultLog::open(path.clone(), 0, 0).unwrap();
        let first = append(&mut log, &[row(1, "one")]);
        let end = append(&mut log, &[row(2, "two")]);
        drop(log);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = first as usize + HEADER + 5;
        bytes[at] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap();
        let err = ResultLog::open(path.clone(), 0, end)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&path.display().to_string()) && err.contains(&first.to_string()),
            "{err}"
        );
        assert!(err.contains("checksum"), "{err}");
        // Shorter than the queue records: refused, not read as fewer results.
        std::fs::write(&path, &bytes[..first as usize]).unwrap();
        assert!(ResultLog::open(path, 0, end).is_err());
    }

    /// The sharded part of the log is given back to the file system: the file's allocated
    /// blocks shrink while the unsharded results after it still read back.
    #[test]
    fn the_sharded_part_is_given_back() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = ResultLog::path(dir.path(), 0);
        let mut log = ResultLog::open(path.clone(), 0, 0).unwrap();
        let big = "x".repeat(64 << 10);
        let rows: Vec<ShardRow> = (0..64).map(|r| row(r, &big)).collect();
        let end = append(&mut log, &rows);
        let before = std::fs::metadata(&path).unwrap().blocks();
        let start = log.forget(0..60, end);
        log.release_before(start);
        let after = std::fs::metadata(&path).unwrap().blocks();
        assert!(
            after * 2 < before,
            "allocated 512-byte blocks {before} -> {after}"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), end);
        let left: Vec<u64> = log.read_all().unwrap().iter().map(|r| r.row).collect();
        assert_eq!(left, vec![60, 61, 62, 63]);
    }
}
