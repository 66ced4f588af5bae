//! Tests of the queue's API: enqueue across blocks and in row order only, damaged blocks,
//! outcomes applied once, and the whole queue against a model across restarts.

use super::*;
use crate::store::fixtures::{audit_counts, done, item, result, six_items};
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

/// A generation of dataset `a`'s row `row`: (sample, turn), `tokens` completion tokens.
fn generation(row: u64, sample: u32, turn: u32, tokens: u32) -> Box<ShardRow> {
    Box::new(ShardRow {
        sample,
        turn,
        completion: format!("s{sample} t{turn}"),
        ..*result("a", row, tokens)
    })
}

fn generated(row: u64, sample: u32, turn: u32, tokens: u32) -> Outcome {
    Outcome::Generated {
        ds: 0,
        result: generation(row, sample, turn, tokens),
    }
}

/// A generation is kept exactly once per (row, sample, turn) — again later or twice in
/// one batch it is not applied — while its item stays pending and not done; its tokens
/// count at once; it reads back in (sample, turn) order after a reopen, and the item is
/// listed as open. An item that is not pending keeps nothing.
#[test]
fn a_generation_is_kept_exactly_once_while_its_item_stays_pending() {
    let dir = tempfile::tempdir().unwrap();
    {
        let q = six_items(dir.path());
        let applied = q
            .commit(&[
                generated(3, 1, 0, 5),
                generated(3, 0, 1, 6),
                generated(3, 1, 0, 50),
                generated(4, 0, 0, 7),
            ])
            .unwrap();
        assert_eq!(applied, vec![true, true, false, true]);
        assert_eq!(
            q.commit(&[generated(3, 0, 1, 60), generated(0, 0, 0, 1)])
                .unwrap(),
            vec![false, false],
            "kept already; row 0 is done"
        );
        q.flush().unwrap();
    }
    let q = Queue::open(dir.path()).unwrap();
    let s = q.state(0).unwrap();
    assert_eq!((s.done, s.completion_tokens), (3, 60 + 5 + 6 + 7));
    assert!(q.is_pending(0, 3).unwrap() && q.is_pending(0, 4).unwrap());
    let got: Vec<(u32, u32, u32)> = q
        .generations(0, 3)
        .unwrap()
        .iter()
        .map(|r| (r.sample, r.turn, r.completion_tokens))
        .collect();
    assert_eq!(got, vec![(0, 1, 6), (1, 0, 5)]);
    assert_eq!(q.open_items(0).unwrap(), vec![3, 4]);
    assert!(q.generations(0, 5).unwrap().is_empty());
}

/// Closing an item gathers its kept generations, those kept earlier in the same batch and
/// its last result into one record in (sample, turn) order, marks the rows of a partial
/// sample with the reason, removes the kept generations, and the item is done once (a
/// second close, or a generation after it, is not applied); its last result's tokens
/// count, the kept ones are not counted twice.
#[test]
fn a_close_gathers_the_generations_in_order_and_marks_partial_samples() {
    let dir = tempfile::tempdir().unwrap();
    let q = six_items(dir.path());
    q.commit(&[generated(3, 1, 0, 5), generated(3, 0, 1, 6)])
        .unwrap();
    let close = Outcome::Closed {
        ds: 0,
        row: 3,
        result: Some(generation(3, 1, 1, 8)),
        partial: vec![(1, "budget".into())],
    };
    let applied = q
        .commit(&[generated(3, 0, 0, 4), close.clone(), generated(3, 2, 0, 9)])
        .unwrap();
    assert_eq!(applied, vec![true, true, false]);
    assert_eq!(q.commit(&[close]).unwrap(), vec![false]);
    let s = q.state(0).unwrap();
    assert_eq!((s.done, s.completion_tokens), (4, 60 + 5 + 6 + 4 + 8));
    assert!(!q.is_pending(0, 3).unwrap());
    assert!(q.generations(0, 3).unwrap().is_empty());
    assert!(q.open_items(0).unwrap().is_empty());
    let rows: Vec<(u64, u32, u32, Option<String>)> = q
        .unsharded(0)
        .unwrap()
        .into_iter()
        .map(|r| (r.row, r.sample, r.turn, r.partial))
        .collect();
    let budget = Some("budget".to_string());
    assert_eq!(
        rows,
        vec![
            (2, 0, 0, None),
            (3, 0, 0, None),
            (3, 0, 1, None),
            (3, 1, 0, budget.clone()),
            (3, 1, 1, budget)
        ]
    );
    // One record per item: the log indexes row 3 once, and sharding it takes all its rows.
    assert_eq!(q.lock_results().get(&0).unwrap().len(), 2);
    let closed: Vec<(u32, u32)> = q
        .unsharded_item(0, 3)
        .unwrap()
        .iter()
        .map(|r| (r.sample, r.turn))
        .collect();
    assert_eq!(closed, vec![(0, 0), (0, 1), (1, 0), (1, 1)]);
    q.mark_sharded(0, 1, &[2, 3]).unwrap();
    assert!(q.unsharded(0).unwrap().is_empty());
    assert_eq!(q.state(0).unwrap().sharded, 4);
}

/// A close with no row at all (nothing kept, no last result) fails the item for the first
/// partial reason; a plain failure drops the generations kept for its item.
#[test]
fn a_close_without_rows_fails_the_item() {
    let dir = tempfile::tempdir().unwrap();
    let q = six_items(dir.path());
    let close = Outcome::Closed {
        ds: 0,
        row: 4,
        result: None,
        partial: vec![(0, "tool_mismatch: turn 0".into()), (1, "budget".into())],
    };
    q.commit(&[generated(5, 0, 0, 3)]).unwrap();
    let failed = Outcome::Failed {
        ds: 0,
        row: 5,
        failure: Failure {
            reason: "x".into(),
            attempts: 2,
        },
    };
    assert_eq!(q.commit(&[close, failed]).unwrap(), vec![true, true]);
    let s = q.state(0).unwrap();
    assert_eq!((s.done, s.failed), (3, 2));
    let f = q.failures(0, 10).unwrap();
    assert_eq!(
        (f[0].0, f[0].1.reason.as_str()),
        (4, "tool_mismatch: turn 0")
    );
    assert!(q.generations(0, 5).unwrap().is_empty());
    assert!(q.open_items(0).unwrap().is_empty());
    assert_eq!(audit_counts(&q, 0), (6, 1, 1, 2, 2));
}

#[derive(Debug, Clone)]
enum Op {
    Enqueue(u8),
    Done(u8, u16),
    Fail(u8),
    /// Row, sample, turn, tokens.
    Generate(u8, u8, u8, u16),
    /// Row, a last result's sample and tokens (if any), whether sample 0 is partial.
    Close(u8, Option<(u8, u16)>, bool),
    Shard,
    Retry,
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u8..5).prop_map(Op::Enqueue),
        (any::<u8>(), 1u16..500).prop_map(|(r, t)| Op::Done(r, t)),
        any::<u8>().prop_map(Op::Fail),
        (any::<u8>(), 0u8..2, 0u8..3, 1u16..500).prop_map(|(r, s, t, n)| Op::Generate(r, s, t, n)),
        (
            any::<u8>(),
            proptest::option::of((0u8..2, 1u16..500)),
            any::<bool>()
        )
            .prop_map(|(r, last, p)| Op::Close(r, last, p)),
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
    /// Done, with this many rows.
    Result(usize),
    Sharded(usize),
    Failed,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    /// Generations and closes included: each generation kept once, an item's rows together,
    /// tokens counted once each, whatever the restarts.
    #[test]
    fn queue_matches_model_across_restarts(ops in proptest::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let mut q = Some(Queue::open(dir.path()).unwrap());
        q.as_ref().unwrap().open_dataset("a").unwrap();
        let mut model: Vec<M> = Vec::new();
        let mut gens: Vec<BTreeMap<(u32, u32), u32>> = Vec::new();
        let mut tokens = 0u64;
        for o in ops {
            let qq = q.as_ref().unwrap();
            match o {
                Op::Enqueue(n) => {
                    let start = model.len() as u64;
                    let items: Vec<_> = (start..start + n as u64).map(|r| (r, item(&format!("i{r}")))).collect();
                    qq.enqueue(0, &items, start + n as u64, 0).unwrap();
                    model.extend(std::iter::repeat_n(M::Pending, n as usize));
                    gens.extend(std::iter::repeat_n(BTreeMap::new(), n as usize));
                }
                Op::Done(r, t) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    let applied = qq.commit(&[Outcome::Done { ds: 0, result: result("a", r as u64, t as u32) }]).unwrap();
                    prop_assert_eq!(applied[0], model[r] == M::Pending);
                    if model[r] == M::Pending {
                        model[r] = M::Result(1);
                        tokens += u64::from(t);
                        gens[r].clear();
                    }
                }
                Op::Fail(r) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    qq.commit(&[Outcome::Failed { ds: 0, row: r as u64, failure: Failure { reason: "x".into(), attempts: 1 } }]).unwrap();
                    if model[r] == M::Pending { model[r] = M::Failed; gens[r].clear(); }
                }
                Op::Generate(r, sample, turn, t) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    let (sample, turn) = (u32::from(sample), u32::from(turn));
                    let applied = qq.commit(&[generated(r as u64, sample, turn, u32::from(t))]).unwrap();
                    let want = model[r] == M::Pending && !gens[r].contains_key(&(sample, turn));
                    prop_assert_eq!(applied[0], want);
                    if want {
                        gens[r].insert((sample, turn), u32::from(t));
                        tokens += u64::from(t);
                    }
                }
                Op::Close(r, last, partial) if !model.is_empty() => {
                    let r = r as usize % model.len();
                    // The last result is a turn past every kept one.
                    let last = last.map(|(s, t)| generation(r as u64, u32::from(s), 9, u32::from(t)));
                    let partial = if partial { vec![(0, "budget".to_string())] } else { Vec::new() };
                    let close = Outcome::Closed { ds: 0, row: r as u64, result: last.clone(), partial };
                    let applied = qq.commit(&[close]).unwrap();
                    prop_assert_eq!(applied[0], model[r] == M::Pending);
                    if model[r] == M::Pending {
                        let n = gens[r].len() + usize::from(last.is_some());
                        model[r] = if n == 0 { M::Failed } else { M::Result(n) };
                        tokens += last.map_or(0, |l| u64::from(l.completion_tokens));
                        gens[r].clear();
                    }
                }
                Op::Shard => {
                    let mut rows: Vec<u64> = qq.unsharded(0).unwrap().iter().map(|r| r.row).collect();
                    rows.dedup();
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
        let failed = model.iter().filter(|m| **m == M::Failed).count() as u64;
        prop_assert_eq!(s.items, model.len() as u64);
        prop_assert_eq!(s.done, done);
        prop_assert_eq!(s.failed, failed);
        prop_assert_eq!(s.completion_tokens, tokens);
        let pending: Vec<u64> = model.iter().enumerate().filter(|(_, m)| **m == M::Pending).map(|(i, _)| i as u64).collect();
        prop_assert_eq!(qq.pending_rows(0, None, usize::MAX).unwrap(), pending);
        prop_assert_eq!(s.sharded, model.iter().filter(|m| matches!(m, M::Sharded(_))).count() as u64);
        let unsharded_rows: usize = model.iter().map(|m| match m { M::Result(n) => *n, _ => 0 }).sum();
        prop_assert_eq!(qq.unsharded(0).unwrap().len(), unsharded_rows);
        let open: Vec<u64> = gens.iter().enumerate().filter(|(_, g)| !g.is_empty()).map(|(i, _)| i as u64).collect();
        prop_assert_eq!(qq.open_items(0).unwrap(), open);
        for (r, g) in gens.iter().enumerate() {
            let kept: Vec<(u32, u32)> = qq.generations(0, r as u64).unwrap().iter().map(|x| (x.sample, x.turn)).collect();
            prop_assert_eq!(kept, g.keys().copied().collect::<Vec<_>>());
        }
    }
}
