use super::*;
use crate::cluster::partition::{self, Partition};
use crate::output::bucket::{Bucket, BucketOptions};
use std::sync::Arc;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Ids of `dataset` that partition `index` of `count` owns.
fn owned(dataset: &str, index: u32, count: u32, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("id{i}"))
        .filter(|id| partition::owner(dataset, id, count) == index)
        .take(n)
        .collect()
}

fn record(p: Partition, seq: u64, ids: Vec<String>) -> Commit {
    let sha = "ab".repeat(32);
    Commit {
        format: FORMAT,
        partition: p.index,
        partitions: p.count,
        seq,
        writer: "0123456789abcdef".into(),
        dataset: "d".into(),
        local_index: seq,
        key: Some(shard_key(p.index, "0123456789abcdef", "d", seq, &sha)),
        rows: ids.len() as u64 * 2,
        completion_tokens: 10,
        bytes: 100,
        sha256: sha,
        dropped: 0,
        over_share: 0,
        ids,
        spool_version: "0".into(),
    }
}

fn memory() -> Arc<Bucket> {
    Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap())
}

/// A record as a worker writes it passes; each way a record can be one no worker of
/// this job wrote is refused by name — partition, count, sequence number, dataset name,
/// writer, items without a shard, a shard at another key or with a bad checksum, too
/// few rows, an item twice, an item of another partition.
#[test]
fn only_records_a_worker_could_write_pass() {
    let p = Partition { index: 1, count: 2 };
    let good = record(p, 3, owned("d", 1, 2, 4));
    let key = commit_key(1, 3);
    check(&key, &Record::Shard(good.clone()), p, 3).unwrap();
    let foreign = owned("d", 0, 2, 1);
    type Edit = Box<dyn Fn(&mut Commit)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("partition", Box::new(|c| c.partition = 0)),
        ("partitions", Box::new(|c| c.partitions = 3)),
        ("seq", Box::new(|c| c.seq = 4)),
        ("dataset", Box::new(|c| c.dataset = "../x".into())),
        ("dataset", Box::new(|c| c.dataset = "_spool".into())),
        ("dataset", Box::new(|c| c.dataset = "/abs".into())),
        ("writer", Box::new(|c| c.writer = "a/b".into())),
        ("no shard", Box::new(|c| c.key = None)),
        (
            "shard key",
            Box::new(|c| c.key = Some("_manifest.json".into())),
        ),
        ("sha256", Box::new(|c| c.sha256 = "AB".repeat(32))),
        ("cannot hold", Box::new(|c| c.rows = 1)),
        ("twice", Box::new(|c| c.ids.push(c.ids[0].clone()))),
        ("belongs to partition 0", {
            let f = foreign.clone();
            Box::new(move |c| c.ids.push(f[0].clone()))
        }),
    ];
    for (word, edit) in cases {
        let mut c = good.clone();
        edit(&mut c);
        let e = check(&key, &Record::Shard(c), p, 3).unwrap_err();
        let said = e.to_string();
        assert!(
            matches!(e, CommitError::Untrusted { .. })
                && said.contains(&key)
                && said.contains(word),
            "{word}: {said}"
        );
    }
    // A record of no items and no shard is what a worker writes when others had them all.
    let mut none = good.clone();
    none.key = None;
    none.ids.clear();
    none.rows = 0;
    none.completion_tokens = 0;
    check(&key, &Record::Shard(none), p, 3).unwrap();
    // The other kinds: items of another partition, a dataset that is a path, nothing.
    let head = |kind: &str| {
        let mut h = Head::new(kind, p, "w");
        h.seq = 3;
        h
    };
    let bad: Vec<(&str, Record)> = vec![
        (
            "belongs to partition 0",
            Record::Failed(Failed {
                head: head("failed"),
                dataset: "d".into(),
                items: vec![FailedItem {
                    id: foreign[0].clone(),
                    reason: "x".into(),
                }],
            }),
        ),
        (
            "longer than",
            Record::Failed(Failed {
                head: head("failed"),
                dataset: "d".into(),
                items: vec![FailedItem {
                    id: good.ids[0].clone(),
                    reason: "x".repeat(REASON_CHARS + 1),
                }],
            }),
        ),
        (
            "dataset",
            Record::Retry(Retry {
                head: head("retry"),
                dataset: "../../etc".into(),
                ids: vec![],
            }),
        ),
        (
            "0 tokens",
            Record::Claim(Claim {
                head: head("claim"),
                dataset: "d".into(),
                ticket: 0,
                tokens: 0,
            }),
        ),
    ];
    for (word, r) in bad {
        let said = check(&key, &r, p, 3).unwrap_err().to_string();
        assert!(said.contains(&key) && said.contains(word), "{word}: {said}");
    }
}

/// The log refuses, by name, a record holding an item an earlier one holds, any object
/// among the records that is not a record, and a record larger than any spool writes;
/// a done marker of another partition is refused.
#[test]
fn the_log_refuses_overlaps_strays_and_giants() {
    rt().block_on(async {
        let b = memory();
        let p = Partition { index: 0, count: 1 };
        let ids = owned("d", 0, 1, 3);
        let put = |seq: u64, c: &Commit| {
            let b = b.clone();
            let body = serde_json::to_vec(c).unwrap();
            async move { b.put(&commit_key(0, seq), body.into()).await.unwrap() }
        };
        put(0, &record(p, 0, ids.clone())).await;
        put(1, &record(p, 1, vec![ids[1].clone()])).await;
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert_eq!(e.key(), Some(commit_key(0, 1).as_str()), "{e}");
        assert!(e.to_string().contains("earlier record"), "{e}");

        b.delete(&commit_key(0, 1)).await.unwrap();
        b.put("_spool/p0000/commits/x.json", "{}".into())
            .await
            .unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert_eq!(e.key(), Some("_spool/p0000/commits/x.json"), "{e}");
        b.delete("_spool/p0000/commits/x.json").await.unwrap();

        let giant = vec![b' '; RECORD_BYTES as usize + 1];
        b.put(&commit_key(0, 1), giant.into()).await.unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("more than"), "{e}");
        b.delete(&commit_key(0, 1)).await.unwrap();
        assert_eq!(
            CommitLog::load(b.clone(), p, LoadOptions::READER)
                .await
                .unwrap()
                .commits()
                .len(),
            1
        );

        let done = Done {
            partition: 2,
            partitions: 1,
            writer: "w".into(),
            commits: 1,
            failed: 0,
            twin_settles: false,
            spool_version: "0".into(),
        };
        b.put(&done_key(0), serde_json::to_vec(&done).unwrap().into())
            .await
            .unwrap();
        let e = read_done(&b, p).await.unwrap_err();
        assert!(matches!(e, CommitError::Untrusted { .. }), "{e}");
        assert_eq!(
            rejected_dataset(0, "_spool/p0000/rejected/a.b-c.jsonl"),
            Some("a.b-c")
        );
        assert_eq!(
            rejected_dataset(0, "_spool/p0000/rejected/x/../y.jsonl"),
            None
        );
        assert_eq!(
            rejected_dataset(0, "_spool/p0000/rejected/_spool.jsonl"),
            None
        );
    });
}

/// 250 records are read back the same from their checkpoints as one by one, in far
/// fewer requests; the worker that appended them wrote a checkpoint per hundred, and a
/// reader writes a missing one. A checkpoint that packs other records than its name
/// says, and a stray object among the checkpoints, are refused by name.
#[test]
fn checkpoints_pack_a_hundred_records_and_are_checked_like_them() {
    rt().block_on(async {
        let b = memory();
        let p = Partition { index: 0, count: 1 };
        let mut log = CommitLog::load(b.clone(), p, LoadOptions::WORKER)
            .await
            .unwrap();
        let ids = owned("d", 0, 1, 250);
        for (i, id) in ids.iter().enumerate() {
            let r = record(p, 0, vec![id.clone()]);
            let r = Commit {
                local_index: i as u64,
                key: Some(shard_key(0, &r.writer, "d", i as u64, &r.sha256)),
                ..r
            };
            assert_eq!(
                log.append(Record::Shard(r)).await.unwrap(),
                Appended::Committed(i as u64)
            );
        }
        let packs: Vec<String> = b
            .list("_spool/p0000/checkpoints/")
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(packs, [checkpoint_key(0, 0), checkpoint_key(0, 100)]);
        let before = b.requests();
        let packed = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .unwrap();
        let packed_requests = b.requests() - before;
        let before = b.requests();
        let one_by_one = CommitLog::load(b.clone(), p, LoadOptions::RECORDS)
            .await
            .unwrap();
        let record_requests = b.requests() - before;
        assert_eq!(packed.commits(), one_by_one.commits());
        assert_eq!(packed.len(), 250);
        assert!(
            packed_requests * 4 < record_requests,
            "{packed_requests} requests with checkpoints, {record_requests} without"
        );
        // A missing checkpoint is written by the next worker that reads the records.
        b.delete(&checkpoint_key(0, 100)).await.unwrap();
        CommitLog::load(b.clone(), p, LoadOptions::WORKER)
            .await
            .unwrap();
        assert!(b.get(&checkpoint_key(0, 100)).await.unwrap().is_some());
        // A checkpoint holding other records than its name says is refused by name.
        let first = b.get(&checkpoint_key(0, 0)).await.unwrap().unwrap();
        b.put(&checkpoint_key(0, 100), first).await.unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert_eq!(e.key(), Some(checkpoint_key(0, 100).as_str()), "{e}");
        b.delete(&checkpoint_key(0, 100)).await.unwrap();
        b.put("_spool/p0000/checkpoints/x.zst", "x".into())
            .await
            .unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert_eq!(e.key(), Some("_spool/p0000/checkpoints/x.zst"), "{e}");
    });
}

/// A seal stops every later append but a retry, which reopens the log; failures, retries,
/// claims and releases add up as the kinds say; a release of more than the partition
/// holds is refused; a record after a seal that is not a retry is refused when read.
#[test]
fn seals_failures_retries_and_budget_records_add_up() {
    rt().block_on(async {
        let b = memory();
        let p = Partition { index: 0, count: 1 };
        let mut log = CommitLog::load(b.clone(), p, LoadOptions::WORKER)
            .await
            .unwrap();
        let ids = owned("d", 0, 1, 4);
        let h = |kind: &str| Head::new(kind, p, "w");
        log.append_anyway(Record::Claim(Claim {
            head: h("claim"),
            dataset: "d".into(),
            ticket: 7,
            tokens: 100,
        }))
        .await
        .unwrap();
        log.append_anyway(Record::Failed(Failed {
            head: h("failed"),
            dataset: "d".into(),
            items: ids[..2]
                .iter()
                .map(|id| FailedItem {
                    id: id.clone(),
                    reason: "HTTP 400".into(),
                })
                .collect(),
        }))
        .await
        .unwrap();
        log.append_anyway(Record::Release(Release {
            head: h("release"),
            dataset: "d".into(),
            tokens: 30,
        }))
        .await
        .unwrap();
        assert_eq!(log.dataset("d").allowance(), 70);
        assert_eq!(log.dataset("d").failed.len(), 2);
        assert_eq!(log.settled("d").len(), 2);
        log.append_anyway(Record::Seal(Seal {
            head: h("seal"),
            sealed_unix: 1,
            partial: false,
        }))
        .await
        .unwrap();
        let e = log
            .append(Record::Shard(record(p, 0, vec![ids[3].clone()])))
            .await
            .unwrap_err();
        assert!(matches!(e, CommitError::Sealed { .. }), "{e}");
        log.append_anyway(Record::Retry(Retry {
            head: h("retry"),
            dataset: "d".into(),
            ids: vec![ids[0].clone()],
        }))
        .await
        .unwrap();
        assert!(log.sealed().is_none(), "a retry reopens the log");
        let d = log.dataset("d");
        assert_eq!(d.failed.len(), 1);
        assert!(d.retried.contains(&ids[0]));
        // Read back the same; then a forged record after a new seal is refused.
        let again = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .unwrap();
        assert_eq!(again.dataset("d").allowance(), 70);
        assert!(again.dataset("d").retried.contains(&ids[0]));
        let mut seal = Head::new("seal", p, "w");
        seal.seq = 5;
        let body = serde_json::to_vec(&Seal {
            head: seal,
            sealed_unix: 2,
            partial: false,
        })
        .unwrap();
        b.put(&commit_key(0, 5), body.into()).await.unwrap();
        let mut late = record(p, 6, vec![ids[3].clone()]);
        late.seq = 6;
        b.put(&commit_key(0, 6), serde_json::to_vec(&late).unwrap().into())
            .await
            .unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert!(
            e.key() == Some(commit_key(0, 6).as_str()) && e.to_string().contains("seal"),
            "{e}"
        );
        // Giving back more than is held is no worker's record.
        b.delete(&commit_key(0, 6)).await.unwrap();
        b.delete(&commit_key(0, 5)).await.unwrap();
        let mut rel = Head::new("release", p, "w");
        rel.seq = 5;
        let body = serde_json::to_vec(&Release {
            head: rel,
            dataset: "d".into(),
            tokens: 71,
        })
        .unwrap();
        b.put(&commit_key(0, 5), body.into()).await.unwrap();
        let e = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("holds 70"), "{e}");
    });
}

/// A record made before a twin's commit was read is not written when it no longer fits:
/// a shard holding an item the twin committed, and a release of more than the partition
/// holds, come back `Outdated` with nothing at their sequence number, so the log stays
/// one every reader accepts (written, either would make every reader refuse it).
#[test]
fn a_record_the_log_outgrew_is_not_written() {
    rt().block_on(async {
        let b = memory();
        let p = Partition { index: 0, count: 1 };
        let mut mine = CommitLog::load(b.clone(), p, LoadOptions::WORKER)
            .await
            .unwrap();
        let mut twin = CommitLog::load(b.clone(), p, LoadOptions::WORKER)
            .await
            .unwrap();
        let ids = owned("d", 0, 1, 2);
        let made = Record::Shard(record(p, 0, ids.clone()));
        let theirs = record(p, 0, vec![ids[0].clone()]);
        let theirs = Commit {
            writer: "fedcba9876543210".into(),
            key: Some(shard_key(0, "fedcba9876543210", "d", 0, &theirs.sha256)),
            ..theirs
        };
        assert_eq!(
            twin.append(Record::Shard(theirs)).await.unwrap(),
            Appended::Committed(0)
        );
        mine.catch_up().await.unwrap();
        match mine.append(made).await.unwrap() {
            Appended::Outdated(why) => assert!(why.contains(&ids[0]), "{why}"),
            other => panic!("{other:?}"),
        }
        let release = Record::Release(Release {
            head: Head::new("release", p, "0123456789abcdef"),
            dataset: "d".into(),
            tokens: 1,
        });
        assert!(matches!(
            mine.append(release).await.unwrap(),
            Appended::Outdated(_)
        ));
        assert_eq!(b.get(&commit_key(0, 1)).await.unwrap(), None);
        let reread = CommitLog::load(b.clone(), p, LoadOptions::READER)
            .await
            .unwrap();
        assert_eq!(reread.len(), 1);
    });
}
