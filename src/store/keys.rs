//! The queue's key layout and key codec.
//!
//! One sled tree holds the records under one-byte key prefixes, so that every state change
//! is a single atomic `apply_batch`; the prompts themselves are appended to per-dataset
//! block files ([`crate::store::blocks`]) that sled records point into:
//!
//! | key | value | meaning |
//! | --- | --- | --- |
//! | `v` | format (u32 BE) | [`FORMAT_VERSION`] |
//! | `V` | format (u32 BE) | a migration from that format is under way ([`MIGRATING_KEY`]) |
//! | `m` name | [`DatasetState`](crate::store::records::DatasetState) (JSON) | counters of a dataset |
//! | `B` ds first_row | [`BlockRef`](crate::store::blocks::BlockRef) | a block of items in `items/<ds>.blocks`, and which rows they are |
//! | `P` ds first_row | bitmap over the block's rows | which of its items are pending (absent: none) |
//! | `S` ds shard first_row | the shard's rows from `first_row` (varint deltas, ≤ [`SHARD_RECORD_ROWS`]) | done and in shard N |
//! | `f` ds row | [`Failure`](crate::store::records::Failure) (JSON) | failed permanently |
//! | `g` ds row sample turn | the [`ShardRow`](crate::store::row::ShardRow) ([`encode_row`](crate::store::results::encode_row)) | a generation kept while its item is open (pending) |
//!
//! `ds` is the dataset's u16 index (BE), `row` its 0-based line (u64 BE), so scans run in
//! file order; `shard` is u64 BE; `sample` and `turn` u32 BE, so an item's generations scan in
//! (sample, turn) order. Results done but not yet in a shard are in the dataset's
//! results log ([`crate::store::results`], `results/<ds>.log`), between the counters'
//! `results_start` and `results_end`.
//!
//! Invariants: an item is in exactly one of pending (its `P` bit), the results log, an `S`
//! record, `f`. sled applies a batch in key order, and the state records (`B`, `P`, `S`,
//! `f`) sort before the counters (`m`): a batch torn by a full disk keeps states and loses
//! counters, which the repair recounts. Older formats' keys ([`FORMAT_VERSION`]) are read
//! only by the migrations ([`crate::store::migrate`]).

use crate::store::queue::QueueError;
use crate::store::writes::Writes;

/// Version of the record layout above; bump on any incompatible change. The formats, oldest
/// first (a queue in an older one is migrated when it is opened, see
/// [`crate::store::migrate`]):
/// 1. one record per item: `i` ds row → the item (JSON), `p` ds row → pending, `k` ds id →
///    its row;
/// 2. items in blocks (`B`, `P`, `items/<ds>.blocks`); unsharded results in sled (`r` ds row
///    → [`ShardRow`](crate::store::row::ShardRow) as JSON); each sharded item as `s` ds row →
///    its shard;
/// 3. unsharded results in the results log (`results/<ds>.log`); sharded items still as `s`;
/// 4. sharded items as `S` records, one per [`SHARD_RECORD_ROWS`] rows of a shard, so sealing
///    a shard is a few writes rather than one per row;
/// 5. the item record may end with the item's extra (JSON object text), and `g` records
///    keep the generations of open items (a format-4 queue is a valid format-5 one: its
///    migration only rewrites the version, so older spools refuse it).
pub const FORMAT_VERSION: u32 = 5;

/// Present while a migration is under way, holding the format it started from. `v` already
/// says the new format then: every spool refuses a format newer than its own, so a spool
/// older than the migration never reads the half-rewritten records, and this one resumes the
/// migration (each step is resumable) at the next open.
pub const MIGRATING_KEY: &[u8] = b"V";

/// Most rows one `S` record lists (a 10,000-row shard takes three): each value stays a few
/// KiB, far below the size at which sled 0.34 writes a value to a blob file of its own.
pub const SHARD_RECORD_ROWS: usize = 4096;

/// The key of a per-row record: `prefix` ds row.
pub(crate) fn key(prefix: u8, ds: u16, row: u64) -> [u8; 11] {
    let mut k = [0u8; 11];
    k[0] = prefix;
    k[1..3].copy_from_slice(&ds.to_be_bytes());
    k[3..11].copy_from_slice(&row.to_be_bytes());
    k
}

/// Key of the `g` record keeping generation (`sample`, `turn`) of item `row`.
pub(crate) fn gen_key(ds: u16, row: u64, sample: u32, turn: u32) -> [u8; 19] {
    let mut k = [0u8; 19];
    k[..11].copy_from_slice(&key(b'g', ds, row));
    k[11..15].copy_from_slice(&sample.to_be_bytes());
    k[15..19].copy_from_slice(&turn.to_be_bytes());
    k
}

/// Key of the `S` record listing `shard`'s rows from `first_row`.
pub(crate) fn shard_key(ds: u16, shard: u64, first_row: u64) -> [u8; 19] {
    let mut k = [0u8; 19];
    k[0] = b'S';
    k[1..3].copy_from_slice(&ds.to_be_bytes());
    k[3..11].copy_from_slice(&shard.to_be_bytes());
    k[11..19].copy_from_slice(&first_row.to_be_bytes());
    k
}

/// Adds the `S` records of `shard` holding `rows` (any order, no repeats) to `batch`.
pub(crate) fn put_shard_rows(batch: &mut Writes, ds: u16, shard: u64, rows: &[u64]) {
    let mut rows = rows.to_vec();
    rows.sort_unstable();
    for chunk in rows.chunks(SHARD_RECORD_ROWS) {
        let mut v = Vec::with_capacity(chunk.len() * 2);
        for pair in chunk.windows(2) {
            put_varint(&mut v, pair[1] - pair[0]);
        }
        batch.insert(shard_key(ds, shard, chunk[0]), v);
    }
}

/// LEB128: seven bits a byte, low first, the high bit set on every byte but the last.
fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The shard and the rows of an `S` record.
pub(crate) fn decode_shard_record(k: &[u8], v: &[u8]) -> Result<(u64, Vec<u64>), QueueError> {
    if k.len() != 19 {
        return Err(QueueError::Corrupt {
            key: format!("S {k:02x?}"),
            detail: "bad shard record key".into(),
        });
    }
    let shard = u64::from_be_bytes(k[3..11].try_into().expect("8 bytes"));
    let mut row = u64::from_be_bytes(k[11..19].try_into().expect("8 bytes"));
    let bad = |detail: &str| QueueError::Corrupt {
        key: format!("S{}/shard {shard}/row {}", ds_of(k), row_of_bytes(&k[11..])),
        detail: detail.into(),
    };
    let mut rows = vec![row];
    let (mut n, mut shift) = (0u64, 0u32);
    for &b in v {
        if shift > 63 {
            return Err(bad("varint too long"));
        }
        n |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            row = row
                .checked_add(n)
                .filter(|_| n > 0)
                .ok_or_else(|| bad("rows not ascending"))?;
            rows.push(row);
            (n, shift) = (0, 0);
        } else {
            shift += 7;
        }
    }
    if shift != 0 {
        return Err(bad("cut varint"));
    }
    Ok((shard, rows))
}

/// The key prefix of one dataset's records of one kind.
pub(crate) fn prefix(p: u8, ds: u16) -> [u8; 3] {
    let b = ds.to_be_bytes();
    [p, b[0], b[1]]
}

/// The dataset of a per-dataset key.
pub(crate) fn ds_of(k: &[u8]) -> u16 {
    u16::from_be_bytes([k[1], k[2]])
}

/// The row of a per-row key.
pub(crate) fn row_of(k: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&k[3..11]);
    u64::from_be_bytes(b)
}

/// A big-endian integer of up to 8 bytes (an `s` record's shard, a key's row part).
pub(crate) fn row_of_bytes(v: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = v.len().min(8);
    b[8 - n..].copy_from_slice(&v[..n]);
    u64::from_be_bytes(b)
}

/// The key of a dataset's counters: `m` and its name.
pub(crate) fn meta_key(name: &str) -> Vec<u8> {
    let mut k = vec![b'm'];
    k.extend_from_slice(name.as_bytes());
    k
}

/// A format-1 id index key (`k` ds id), which only the migration from format 1 removes.
pub(crate) fn id_key(ds: u16, id: &str) -> Vec<u8> {
    let mut k = prefix(b'k', ds).to_vec();
    k.extend_from_slice(id.as_bytes());
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's rows, in any order and with any gaps, read back from its `S` records
    /// sorted — split every [`SHARD_RECORD_ROWS`] rows — and a damaged record (a cut or
    /// overlong varint, rows not ascending, a short key) is an error, not other rows.
    #[test]
    fn shard_records_round_trip_and_damage_is_refused() {
        let mut rows: Vec<u64> = (0..10_000u64).map(|i| i * 3).collect();
        rows.push(1 << 40);
        rows.push(u64::MAX);
        rows.reverse();
        let mut w = Writes::default();
        put_shard_rows(&mut w, 7, 42, &rows);
        assert_eq!(w.0.len(), rows.len().div_ceil(SHARD_RECORD_ROWS));
        let mut back = Vec::new();
        for (k, v) in &w.0 {
            assert_eq!(ds_of(k), 7);
            let (shard, part) = decode_shard_record(k, v.as_deref().unwrap()).unwrap();
            assert_eq!(shard, 42);
            assert!(part.len() <= SHARD_RECORD_ROWS);
            back.extend(part);
        }
        rows.sort_unstable();
        assert_eq!(back, rows);
        let k = shard_key(0, 1, 10);
        assert_eq!(
            decode_shard_record(&k, &[2, 3]).unwrap(),
            (1, vec![10, 12, 15])
        );
        for bad in [&[2, 0x80][..], &[0][..], &[0xff; 11][..]] {
            assert!(decode_shard_record(&k, bad).is_err(), "{bad:?} accepted");
        }
        assert!(decode_shard_record(&k[..18], &[]).is_err());
    }
}
