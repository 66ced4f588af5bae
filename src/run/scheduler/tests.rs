//! The scheduler's tests: lanes, budgets, open items and their samples.

use super::*;
use crate::estimate::speed::SpeedCurve;
use crate::store::queue::Item;
use std::sync::atomic::Ordering;

fn queue_with(rows: &[u64]) -> (tempfile::TempDir, Arc<Queue>) {
    let dir = tempfile::tempdir().unwrap();
    let q = Queue::open(dir.path()).unwrap();
    for name in ["a", "b"] {
        let s = q.open_dataset(name).unwrap();
        let items: Vec<_> = rows
            .iter()
            .map(|&r| {
                (
                    r,
                    Item {
                        id: format!("{name}{r}"),
                        hash: [0; 16],
                        prompt: "p".into(),
                        messages: None,
                        prompt_ids: None,
                        extra: None,
                    },
                )
            })
            .collect();
        q.enqueue(s.index, &items, rows.len() as u64, 0).unwrap();
    }
    (dir, Arc::new(q))
}

fn spec(ds: u16, budget: Option<u64>) -> LaneSpec {
    LaneSpec {
        ds,
        name: format!("d{ds}"),
        budget,
        max_tokens: 100,
        policy: BudgetPolicy::Finish,
        samples: 1,
        multi: false,
        allowance: None,
    }
}

fn lease(s: &Scheduler) -> Lease {
    match s.next().unwrap() {
        Next::Lease(l) => l,
        other => panic!("expected a lease, got {other:?}"),
    }
}

#[test]
fn the_next_lane_gets_slots_while_the_first_drains() {
    let (_d, q) = queue_with(&[0, 1]);
    let s = Scheduler::new(q, vec![spec(0, None), spec(1, None)], Bench::default());
    let a = [lease(&s), lease(&s)];
    assert!(a.iter().all(|l| l.ds == 0));
    // Lane 0 has no rows left but two in flight: lane 1 is served.
    let b = lease(&s);
    assert_eq!(b.ds, 1);
}

#[test]
fn budget_stops_dispatch_counting_work_in_flight() {
    let (_d, q) = queue_with(&(0..50).collect::<Vec<_>>());
    // max_tokens 100, no samples yet: each lease is expected to make 100 tokens.
    let s = Scheduler::new(q, vec![spec(0, Some(250)), spec(1, None)], Bench::default());
    let l: Vec<_> = (0..3).map(|_| lease(&s)).collect();
    assert!(l.iter().all(|x| x.ds == 0));
    // 3 × 100 ≥ 250: lane 0 stops, lane 1 takes the slot.
    assert_eq!(lease(&s).ds, 1);
    s.completed(&l[0], 100);
    s.completed(&l[1], 100);
    s.completed(&l[2], 60);
    // 260 ≥ 250: budget met, lane 0 never dispatches again.
    for _ in 0..5 {
        assert_eq!(lease(&s).ds, 1);
    }
}

/// Policy "cancel": once what is streaming would take a lane past its budget, every
/// request in flight is cancelled and the lane dispatches no more; the result that would
/// cross the budget is refused.
#[test]
fn cancel_aborts_the_work_in_flight() {
    let (_d, q) = queue_with(&(0..50).collect::<Vec<_>>());
    let mut sp = spec(0, Some(1000));
    sp.policy = BudgetPolicy::Cancel;
    let s = Scheduler::new(q, vec![sp, spec(1, None)], Bench::default());
    let l: Vec<_> = (0..5).map(|_| lease(&s)).collect();
    assert!(l.iter().all(|x| x.ds == 0));
    l[0].streamed.store(600, Ordering::Relaxed);
    s.enforce_cancel();
    assert!(
        !l[0].cancel.is_cancelled(),
        "600 streamed < 1000: nothing to cancel"
    );
    l[1].streamed.store(500, Ordering::Relaxed);
    s.enforce_cancel();
    assert!(
        l.iter().all(|x| x.cancel.is_cancelled()),
        "1100 streamed > 1000"
    );
    assert!(
        !s.admit(&l[0], 600 + 500),
        "a result crossing the budget is refused"
    );
    for x in &l {
        s.release(x);
    }
    // Lane 0 is closed for this run: the next lease is lane 1's, with a live token.
    let n = lease(&s);
    assert_eq!(n.ds, 1);
    assert!(!n.cancel.is_cancelled());
}

/// A dataset that has no completions yet is estimated with the lengths an earlier one
/// has learned, not with `max_tokens` for every request (which, for a budgeted dataset,
/// also meant too few, too long requests and a batch that emptied too early).
#[test]
fn a_fresh_dataset_borrows_the_learned_lengths_for_its_eta() {
    let (_d, q) = queue_with(&(0..50).collect::<Vec<_>>());
    let s = Scheduler::new(q, vec![spec(0, None), spec(1, None)], Bench::default());
    s.seed_lengths(0, (0..40u32).map(|i| 15 + i % 20));
    let views = s.views();
    assert!(views[0].work.lengths.fitted().is_some());
    assert!(views[1].work.lengths.fitted().is_none());
    let curve = SpeedCurve {
        capacity_tps: 1000.0,
        per_request_cap_tps: None,
    };
    let etas = lane_etas(&views, Some(&curve), 10);
    // 100 prompts of about 25 tokens at 1000 tok/s: about 2.5 s plus a short tail; with
    // max_tokens (100) for the second dataset's 50 it would be over 6 s.
    let second = etas[1].unwrap();
    assert!(second > 2.0 && second < 4.0, "{second}");
    assert!(etas[0].unwrap() < second);
    assert_eq!(run_eta(&etas), Some(second));
}

fn multi(ds: u16, budget: Option<u64>, samples: u32) -> LaneSpec {
    LaneSpec {
        samples,
        multi: true,
        ..spec(ds, budget)
    }
}

/// An item with three samples is leased as three (row, sample) leases before the next
/// row starts; it is to be closed only when its last sample ends, with the reasons of
/// those that ended early.
#[test]
fn samples_of_an_item_are_leased_together_and_closed_once() {
    let (_d, q) = queue_with(&[0, 1]);
    let s = Scheduler::new(q, vec![multi(0, None, 3)], Bench::default());
    let l: Vec<_> = (0..3).map(|_| lease(&s)).collect();
    let got: Vec<_> = l.iter().map(|x| (x.row, x.sample, x.multi)).collect();
    assert_eq!(got, [(0, 0, true), (0, 1, true), (0, 2, true)]);
    assert_eq!((lease(&s).row, 0), (1, 0));
    assert!(s
        .end_sample(&l[1], Some("tool_mismatch: x".into()))
        .is_none());
    // A given-back sample comes back first, and the item is still open.
    s.release(&l[0]);
    let again = lease(&s);
    assert_eq!((again.row, again.sample), (0, 0));
    assert!(s.end_sample(&again, None).is_none());
    let closed = s
        .end_sample(&l[2], None)
        .expect("the last sample closes the item");
    assert_eq!(closed, vec![(1, "tool_mismatch: x".to_string())]);
}

/// Once the budget is met, an open item with kept generations and nothing leased is
/// handed out to be closed, its unfinished samples marked `budget`; the lane is not
/// finished until the committer has closed it. An open item with nothing kept is only
/// forgotten (it stays pending).
#[test]
fn the_budget_closes_open_conversations_between_turns() {
    let (_d, q) = queue_with(&(0..10).collect::<Vec<_>>());
    let s = Scheduler::new(q, vec![multi(0, Some(250), 2)], Bench::default());
    let a = [lease(&s), lease(&s)];
    let b = lease(&s);
    assert_eq!((a[0].row, a[1].row, b.row), (0, 0, 1));
    s.turn_completed(&a[0], 150);
    s.turn_completed(&a[1], 120);
    // 270 ≥ 250: no more turns, and no new item.
    assert_eq!(s.may_continue(&a[0]), Some(false));
    assert!(s.end_sample(&a[0], Some("budget".into())).is_none());
    s.release(&a[1]);
    s.release(&b);
    match s.next().unwrap() {
        Next::Close { row, partial, .. } => {
            assert_eq!(row, 0);
            assert_eq!(
                partial,
                vec![(0, "budget".to_string()), (1, "budget".to_string())]
            );
            assert!(!s.views()[0].finished, "not finished while closing");
            s.closed(0, row);
        }
        other => panic!("expected a close, got {other:?}"),
    }
    assert!(matches!(s.next().unwrap(), Next::Done));
    assert!(s.views()[0].finished);
}

/// Conversations waiting between turns hold new items back (they go first), but not
/// each other: with every lease waiting, the next turn may go.
#[test]
fn waiting_conversations_go_before_new_items_and_never_wait_on_each_other() {
    let (_d, q) = queue_with(&(0..10).collect::<Vec<_>>());
    // max_tokens 100: each request is expected to make 100 tokens.
    let s = Scheduler::new(q, vec![multi(0, Some(250), 1)], Bench::default());
    let l = [lease(&s), lease(&s), lease(&s)];
    assert!(matches!(s.next().unwrap(), Next::Wait), "3 × 100 ≥ 250");
    for x in &l {
        x.waiting.store(true, Ordering::Relaxed);
    }
    assert!(
        matches!(s.next().unwrap(), Next::Wait),
        "waiting turns count for new items"
    );
    assert_eq!(s.may_continue(&l[0]), Some(true), "no one generating: go");
    l[0].waiting.store(false, Ordering::Relaxed);
    l[0].streamed.store(90, Ordering::Relaxed);
    s.turn_completed(&l[1], 160);
    assert_eq!(
        s.may_continue(&l[2]),
        None,
        "160 completed + one generating (~100) ≥ 250"
    );
}

#[test]
fn released_rows_come_back_first_and_done_is_reported() {
    let (_d, q) = queue_with(&[0]);
    let s = Scheduler::new(q, vec![spec(0, None)], Bench::default());
    let a = lease(&s);
    assert!(matches!(s.next().unwrap(), Next::Wait));
    s.release(&a);
    let b = lease(&s);
    assert_eq!(b.row, a.row);
    s.failed(&b);
    assert!(matches!(s.next().unwrap(), Next::Done));
}

/// A growing allowance (a cluster partition's budget): with nothing granted and more to
/// come the lane waits instead of finishing, and reports what it wants; a grant lets it
/// dispatch at once; under "cancel" what streams past a budget that may still grow is not
/// cancelled; once the allowance is the last and used up, the lane finishes.
#[test]
fn a_growing_allowance_waits_for_more_and_finishes_on_the_last() {
    let (_d, q) = queue_with(&(0..10).collect::<Vec<_>>());
    let a = Arc::new(Allowance::new(0));
    let mut sp = spec(0, Some(0));
    sp.policy = BudgetPolicy::Cancel;
    sp.allowance = Some(a.clone());
    let s = Scheduler::new(q, vec![sp], Bench::default());
    assert!(matches!(s.next().unwrap(), Next::Wait));
    assert!(a.wants_more());
    assert_eq!(a.demand(), 0);
    a.set(250, false);
    let l: Vec<_> = (0..2).map(|_| lease(&s)).collect();
    // A third request (100 expected, the prior) does not fit in 250: the gate shuts, and
    // the lane waits for more.
    assert!(matches!(s.next().unwrap(), Next::Wait));
    assert_eq!(a.demand(), 200);
    assert_eq!(a.next_need(), 300);
    assert!(!a.idle());
    l[0].streamed.store(400, Ordering::Relaxed);
    s.enforce_cancel();
    assert!(!l[0].cancel.is_cancelled(), "more may come: not cancelled");
    assert!(s.admit(&l[0], 400), "more may come: admitted");
    s.completed(&l[0], 400);
    s.completed(&l[1], 20);
    a.set(420, true);
    // 420 completed ≥ the last allowance: finished, nothing more dispatched.
    assert!(matches!(s.next().unwrap(), Next::Done));
}

/// The gate holds back a margin for how far the requests in flight may run past their
/// expected lengths (heavy tails: an overrun cannot be undone once the gate shuts), fewer
/// requests start than the expectation alone allows; as they finish the margin shrinks and
/// the lane fills to its budget, one request at a time at the end, ending within half a
/// request of it.
#[test]
fn the_gate_holds_a_margin_for_the_spread_in_flight() {
    let (_d, q) = queue_with(&(0..200).collect::<Vec<_>>());
    let s = Scheduler::new(q, vec![spec(0, Some(1000))], Bench::default());
    let seen = [5u32, 10, 20, 40, 80, 15, 30, 60, 25, 50];
    s.seed_lengths(0, seen.iter().cycle().take(100).copied());
    let mut first = Vec::new();
    while let Next::Lease(l) = s.next().unwrap() {
        first.push(l);
    }
    let (expected, margin) = {
        let lanes = s.lock();
        (lanes[0].lengths.expected_new(), lanes[0].margin())
    };
    let without_margin = (1000.0 / expected).ceil() as usize;
    assert!(
        margin > 0.0 && first.len() + 3 <= without_margin,
        "{} leases with the margin, {without_margin} on the expectation alone",
        first.len()
    );
    // A partition's agent is told what the lane holds, margin included.
    let a = Arc::new(Allowance::new(1000));
    let mut sp = spec(1, Some(0));
    sp.allowance = Some(a.clone());
    // Each finishes at its expected length: the lane fills the room the margin kept.
    let mut done = 0u64;
    let mut started = first.len();
    let mut flight: std::collections::VecDeque<_> = first.into();
    while let Some(l) = flight.pop_front() {
        s.completed(&l, expected.round() as u32);
        done += expected.round() as u64;
        while let Next::Lease(l) = s.next().unwrap() {
            started += 1;
            flight.push_back(l);
        }
    }
    // It ends within half a request of the budget, either side.
    assert!(
        started >= without_margin - 1 && (done as f64 - 1000.0).abs() <= expected / 2.0 + 1.0,
        "{started} started, {done} tokens of 1000 ({expected} expected each)"
    );
    let s2 = Scheduler::new(queue_with(&[0, 1]).1, vec![sp], Bench::default());
    s2.seed_lengths(0, seen.iter().cycle().take(100).copied());
    let _l = lease(&s2);
    a.set(0, false);
    assert!(matches!(s2.next().unwrap(), Next::Wait));
    let lanes = s2.lock();
    assert!(a.demand() as f64 >= lanes[0].committed_estimate(true) + lanes[0].margin() - 1.0);
    assert!(lanes[0].margin() > 0.0);
}

/// On a budget that may still grow (a cluster partition's), a request starts only with
/// room for it and its margin, and the lane reports what it needs and that it is idle;
/// once its allowance is the last of the job's pool it starts one that may not fit, as one
/// process does at its budget: the job gambles once, not once per partition.
#[test]
fn a_growing_allowance_starts_only_what_fits_until_it_holds_the_last() {
    let (_d, q) = queue_with(&(0..10).collect::<Vec<_>>());
    let a = Arc::new(Allowance::new(0));
    let mut sp = spec(0, Some(0));
    sp.max_tokens = 1000;
    sp.allowance = Some(a.clone());
    let s = Scheduler::new(q, vec![sp], Bench::default());
    let seen = [5u32, 10, 20, 40, 80, 15, 30, 60, 25, 50];
    s.seed_lengths(0, seen.iter().cycle().take(100).copied());
    assert!(matches!(s.next().unwrap(), Next::Wait));
    let (expected, need) = {
        let lanes = s.lock();
        (lanes[0].lengths.expected_new(), lanes[0].next_need(true))
    };
    assert!(a.idle());
    assert_eq!(a.next_need(), need.ceil() as u64);
    assert!(
        need > 2.0 * expected,
        "the margin of one request: {need} for {expected}"
    );
    // Room for the expectation and more than half a request, not for the margin: wait.
    a.set((expected * 1.5) as u64, false);
    assert!(matches!(s.next().unwrap(), Next::Wait));
    // The last of the pool: the same room starts a request.
    a.set((expected * 1.5) as u64, true);
    let l = lease(&s);
    assert!(!a.idle(), "a request is generating");
    s.completed(&l, 1);
    // Room for what one request needs with its margin: it starts without being the last.
    a.set(1 + need.ceil() as u64, false);
    let _l = lease(&s);
}
