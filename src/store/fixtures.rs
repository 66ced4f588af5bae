//! Test fixtures shared by the store's unit tests: items, results, a small queue, and
//! copies of the queues older formats wrote (`tests/fixtures/queue-v*`).

use crate::store::keys::FORMAT_VERSION;
use crate::store::queue::Queue;
use crate::store::records::{Item, Outcome};
use crate::store::row::ShardRow;
use std::path::Path;

/// An item whose every field follows from `id`.
pub(crate) fn item(id: &str) -> Item {
    Item {
        id: id.into(),
        hash: [1; 16],
        prompt: format!("p {id}"),
        messages: None,
        prompt_ids: Some(vec![1, 2]),
        extra: None,
    }
}

/// A result of dataset `ds_name`'s row `row` with `tokens` completion tokens.
pub(crate) fn result(ds_name: &str, row: u64, tokens: u32) -> Box<ShardRow> {
    Box::new(ShardRow {
        completion_tokens: tokens,
        ..ShardRow::for_tests(format!("id{row}"), ds_name, row)
    })
}

/// Row `row` of dataset 0 (named `a`) done with `tokens` completion tokens.
pub(crate) fn done(row: u64, tokens: u32) -> Outcome {
    Outcome::Done {
        ds: 0,
        result: result("a", row, tokens),
    }
}

/// A queue with six items: rows 0 and 1 in shard 0, row 2 done and waiting for a shard.
pub(crate) fn six_items(dir: &Path) -> Queue {
    let q = Queue::open(dir).unwrap();
    q.open_dataset("a").unwrap();
    let items: Vec<_> = (0..6).map(|r| (r, item(&format!("id{r}")))).collect();
    q.enqueue(0, &items, 6, 0).unwrap();
    q.commit(&[done(0, 10), done(1, 20), done(2, 30)]).unwrap();
    q.mark_sharded(0, 0, &[0, 1]).unwrap();
    q
}

/// (items, pending, unsharded, sharded, failed) of a dataset whose every item has a state.
pub(crate) fn audit_counts(q: &Queue, ds: u16) -> (u64, u64, u64, u64, u64) {
    let a = q.audit(ds).unwrap();
    assert!(a.stateless.is_empty(), "stateless rows {:?}", a.stateless);
    (a.items, a.pending, a.unsharded, a.sharded, a.failed)
}

/// A copy of a fixture queue, opened (and so migrated) by this code, in the current format.
pub(crate) fn open_fixture(name: &str) -> (tempfile::TempDir, Queue) {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    copy_dir(&fixture, dir.path());
    let q = Queue::open(dir.path()).unwrap();
    assert_eq!(
        q.tree.get(b"v").unwrap().unwrap().as_ref(),
        &FORMAT_VERSION.to_be_bytes()
    );
    (dir, q)
}

/// Copies a folder tree.
pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
