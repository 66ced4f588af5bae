//! Tests of the queue's API: enqueue across blocks and in row order only, damaged blocks,
//! outcomes applied once, and the whole queue against a model across restarts.

use super::*;
use crate::store::fixtures::{done, item, result, six_items};
use proptest::prelude::*;

/// A damaged item block is reported with its file, not decoded as other prompts.
#[test]
fn a_damaged_block_file_is_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    {
        let q = six_items(dir.path());
        q.flush().unwrap();
    }
    let path = BlockFile::path(dir.path(), 0);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let q = Queue::open(dir.path()).unwrap();
    let e = q.item(0, 3).unwrap_err().to_string();
    assert!(e.contains("0.blocks") && e.contains("checksum"), "{e}");
}

/// Rows are enqueued in file order only: a row at or before the last enqueued one is
/// refused (blocks must not overlap), and nothing of that batch is written.
#[test]
fn an_enqueue_out_of_row_order_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let q = six_items(dir.path());
    assert!(matches!(
        q.enqueue(0, &[(7, item("id7")), (5, item("id5b"))], 8, 0),
        Err(QueueError::RowOrder { row: 5, last: 7 })
    ));
    assert_eq!(q.state(0).unwrap().items, 6);
    assert_eq!(q.item(0, 7).unwrap(), None);
}

/// Blocks end at [`BLOCK_ITEMS`] items and [`BLOCK_SPAN`] rows; items, pending rows
/// and commits work across block boundaries and gaps of rejected lines.
#[test]
fn items_spread_over_many_blocks_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let q = Queue::open(dir.path()).unwrap();
    q.open_dataset("a").unwrap();
    // 3,000 items, then one far past the span limit.
    let mut items: Vec<_> = (0..3000u64)
        .map(|r| (r * 2, item(&format!("id{r}"))))
        .collect();
    items.push((20_000, item("far")));
    q.enqueue(0, &items, 20_001, 0).unwrap();
    assert_eq!(q.blocks.blocks(0).len(), 4);
    assert_eq!(q.item(0, 2048 * 2).unwrap().unwrap().id, "id2048");
    assert_eq!(q.item(0, 2049).unwrap(), None);
    assert_eq!(q.item(0, 20_000).unwrap().unwrap().id, "far");
    assert_eq!(q.pending_rows(0, Some(2046), 2).unwrap(), vec![2048, 2050]);
    assert_eq!(q.pending_rows(0, Some(5998), 5).unwrap(), vec![20_000]);
    let all = q.pending_rows(0, None, usize::MAX).unwrap();
    assert_eq!(all.len(), 3001);
    assert_eq!(
        q.commit(&[done(2046, 1), done(2048, 1)]).unwrap(),
        vec![true, true]
    );
    assert_eq!(q.pending_rows(0, Some(2044), 2).unwrap(), vec![2050, 2052]);
    assert!(!q.is_pending(0, 2048).unwrap() && q.is_pending(0, 2050).unwrap());
}

/// An outcome applies once (a second for the same row is ignored), and the counters,
/// pending rows and unsharded results it changed read back after a reopen.
#[test]
fn outcomes_apply_once_and_counters_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let q = Queue::open(dir.path()).unwrap();
        let s = q.open_dataset("a").unwrap();
        q.enqueue(s.index, &[(0, item("x")), (1, item("y"))], 2, 1)
            .unwrap();
        assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![0, 1]);
        let applied = q
            .commit(&[
                Outcome::Done {
                    ds: 0,
                    result: result("a", 0, 7),
                },
                Outcome::Done {
                    ds: 0,
                    result: result("a", 0, 7),
                },
            ])
            .unwrap();
        assert_eq!(applied, vec![true, false]);
        q.flush().unwrap();
    }
    let q = Queue::open(dir.path()).unwrap();
    let s = q.state(0).unwrap();
    assert_eq!(
        (
            s.items,
            s.done,
            s.pending(),
            s.completion_tokens,
            s.rejected
        ),
        (2, 1, 1, 7, 1)
    );
    assert_eq!(q.pending_rows(0, None, 10).unwrap(), vec![1]);
    assert_eq!(q.unsharded(0).unwrap().len(), 1);
    q.mark_sharded(0, 0, &[0]).unwrap();
    assert!(q.unsharded(0).unwrap().is_empty());
    assert_eq!(q.sharded_rows(0).unwrap(), vec![(0, 0)]);
    assert_eq!(q.state(0).unwrap().next_shard, 1);
    assert_eq!(q.item_id(0, 1).unwrap().as_deref(), Some("y"));
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue(u8),
    Done(u8, u16),
    Fail(u8),
    Shard,
    Retry,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u8..5).prop_map(Op::Enqueue),
        (any::<u8>(), 1u16..500).prop_map(|(r, t)| Op::Done(r, t)),
        any::<u8>().prop_map(Op::Fail),
        Just(Op::Shard),
        Just(Op::Retry),
        Just(Op::Reopen),
    ]
}

/// The queue against a model (a map row → state), with restarts in between: counters
/// always equal what a scan of the model gives, and every item is in one state.
#[derive(Clone, Copy, PartialEq, Debug)]
enum M {
    Pending,
    Result(u16),
    Sharded(u16),
    Failed,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn queue_matches_model_across_restarts(ops in proptest::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let mut q = Some(Queue::open(dir.path()).unwrap());
        q.as_ref().unwrap().open_dataset("a").unwrap();
        let mut model: Vec<M> = Vec::new();
        for o in ops {
            let qq = q.as_ref().unwrap();
            match o {
                Op::Enqueue(n) => {
                    let start = model.len() as u64;
                    let items: Vec<_> = (start..start + n as u64).map(|r| (r, item(&format!("i{r}")))).collect();
                    qq.enqueue(0, &items, start + n as u64, 0).unwrap();
                    model.extend(std::iter::repeat_n(M::Pending, n as usize));
                }
                Op::Done(r, t) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    let applied = qq.commit(&[Outcome::Done { ds: 0, result: result("a", r as u64, t as u32) }]).unwrap();
                    prop_assert_eq!(applied[0], model[r] == M::Pending);
                    if model[r] == M::Pending { model[r] = M::Result(t); }
                }
                Op::Fail(r) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    qq.commit(&[Outcome::Failed { ds: 0, row: r as u64, failure: Failure { reason: "x".into(), attempts: 1 } }]).unwrap();
                    if model[r] == M::Pending { model[r] = M::Failed; }
                }
                Op::Shard => {
                    let rows: Vec<u64> = qq.unsharded(0).unwrap().iter().map(|r| r.row).collect();
                    let next = qq.state(0).unwrap().next_shard;
                    qq.mark_sharded(0, next, &rows).unwrap();
                    for r in rows { if let M::Result(t) = model[r as usize] { model[r as usize] = M::Sharded(t); } }
                }
                Op::Retry => {
                    qq.retry_failed(0).unwrap();
                    for m in model.iter_mut() { if *m == M::Failed { *m = M::Pending; } }
                }
                Op::Reopen => {
                    qq.flush().unwrap();
                    drop(q.take());
                    q = Some(Queue::open(dir.path()).unwrap());
                }
                _ => {}
            }
        }
        let qq = q.as_ref().unwrap();
        let s = qq.state(0).unwrap();
        let done = model.iter().filter(|m| matches!(m, M::Result(_) | M::Sharded(_))).count() as u64;
        let tokens: u64 = model.iter().map(|m| match m { M::Result(t) | M::Sharded(t) => *t as u64, _ => 0 }).sum();
        let failed = model.iter().filter(|m| **m == M::Failed).count() as u64;
        prop_assert_eq!(s.items, model.len() as u64);
        prop_assert_eq!(s.done, done);
        prop_assert_eq!(s.failed, failed);
        prop_assert_eq!(s.completion_tokens, tokens);
        let pending: Vec<u64> = model.iter().enumerate().filter(|(_, m)| **m == M::Pending).map(|(i, _)| i as u64).collect();
        prop_assert_eq!(qq.pending_rows(0, None, usize::MAX).unwrap(), pending);
        prop_assert_eq!(s.sharded, model.iter().filter(|m| matches!(m, M::Sharded(_))).count() as u64);
    }
}
