//! One budget for the job: each budgeted dataset's budget is a pool in the store, taken
//! by the partitions in tickets as their lanes need it, so no partition sits on a share it
//! cannot use while another stops short.
//!
//! `_spool/budget/<dataset>/<seq>.json` is the dataset's budget log: `claim` tickets (a
//! partition takes tokens) and `return`s (a partition gives tokens back), each created with
//! a conditional create at the next number, so the pool — the job record's budget less
//! claims plus returns — is never handed out twice. A ticket is half an even share of
//! what is left (never less than one request's expected tokens, never more than is
//! left), so tickets shrink as the pool runs out and no partition holds much when it is
//! empty. While more may come, a lane starts a request only with room for it and its
//! margin; short of that with nothing generating, it puts what it holds back in the pool
//! for a partition that can start one with it. Once no partition still running could use
//! or give back budget, the first to see it takes the last of the pool, less what waiting
//! partitions completed past their allowance (their debt, on their waiting marker, which
//! they take to pay for it), and finishes on it as one process does at its budget: the
//! job gambles on one last request, not one per partition. Each claim is also recorded in the claiming partition's log (a `claim` record),
//! where its allowance is claims less releases: a restart, on its volume or an empty one,
//! keeps it. A `release` is written to the partition's log first, ordered with its
//! commits, then returned to the pool. A worker that stops gives back what it did not use,
//! unless a twin of its partition still runs and items are left (the twin may have them
//! in flight and settles when it stops; the done marker says so); a partition whose
//! worker is gone (no heartbeat for [`STALE_AFTER`]) has its unused
//! allowance taken back by a worker that needs it, by a release in the dead partition's
//! log, so a worker that was only slow sees it before it commits again. A worker that
//! finds rows it made committed first by a twin (another worker of its partition) takes
//! no more tickets and finishes on what it holds: what it took would be spent on rows
//! thrown away and come back only when it ends, after the others may have finished.
//!
//! Invariants: the claims of a dataset's budget log, less its returns, never pass its
//! budget; a partition's commits never pass its allowance under `cancel` (the publisher's
//! cap), so the job's committed tokens never pass the budget; a ticket the claimer did not
//! record (a kill in between) is recorded by its partition's next worker, and a release not
//! yet returned is returned by it. Nothing read is trusted: a budget-log entry is used only
//! if filed under its own dataset and number, of this job's partition count, with a writer
//! id, a partition in the job and tokens ≥ 1; a partition's claim must name a ticket of the
//! budget log taken by it, for as many tokens. Anything else is named.

mod agent;

pub use agent::{waiting_key, Agent, Lane};

use crate::cluster::commits::{
    self, untrusted, Appended, Claim, CommitError, CommitLog, Head, Record, Release,
};
use crate::cluster::partition::Partition;
use crate::output::bucket::{Bucket, Created};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// The most bytes of a budget-log entry read.
const ENTRY_BYTES: u64 = 64 << 10;

/// A partition with no heartbeat for this long has its unused allowance taken back.
pub const STALE_AFTER: Duration = Duration::from_secs(600);

/// The folder of `dataset`'s budget log.
pub fn budget_prefix(dataset: &str) -> String {
    format!("_spool/budget/{dataset}/")
}

/// The key of entry `seq` of `dataset`'s budget log.
pub fn entry_key(dataset: &str, seq: u64) -> String {
    format!("{}{seq:010}.json", budget_prefix(dataset))
}

/// One entry of a budget log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub format: u32,
    pub dataset: String,
    pub seq: u64,
    /// `claim` or `return`.
    pub kind: String,
    pub partition: u32,
    pub partitions: u32,
    pub writer: String,
    pub tokens: u64,
    /// A return: the release record of the partition's log it gives back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<u64>,
    pub spool_version: String,
}

/// A dataset's budget log, as read so far.
pub struct BudgetLog {
    bucket: Arc<Bucket>,
    dataset: String,
    partitions: u32,
    len: u64,
    claimed: u64,
    returned: u64,
    /// Per partition: ticket → tokens.
    claims: HashMap<u32, BTreeMap<u64, u64>>,
    /// (partition, release seq) returned.
    returns: HashSet<(u32, u64)>,
}

impl BudgetLog {
    /// Reads `dataset`'s budget log of a job of `partitions`.
    pub async fn load(
        bucket: Arc<Bucket>,
        dataset: &str,
        partitions: u32,
    ) -> Result<BudgetLog, CommitError> {
        let mut log = BudgetLog {
            bucket,
            dataset: dataset.into(),
            partitions,
            len: 0,
            claimed: 0,
            returned: 0,
            claims: HashMap::new(),
            returns: HashSet::new(),
        };
        let listed = log.bucket.list(&budget_prefix(dataset)).await?;
        let mut n = 0u64;
        for (key, _) in &listed {
            if entry_seq(dataset, key).is_none() {
                return Err(untrusted(
                    key,
                    "not a budget-log entry (they are named _spool/budget/<dataset>/NNNNNNNNNN.json)",
                ));
            }
            n += 1;
        }
        let bucket = log.bucket.clone();
        let ds = dataset.to_string();
        let mut reads = futures_util::stream::iter(0..n)
            .map(|seq| {
                let (bucket, ds) = (bucket.clone(), ds.clone());
                async move {
                    let key = entry_key(&ds, seq);
                    let body = bucket.get_capped(&key, ENTRY_BYTES).await?;
                    Ok::<_, CommitError>((key, seq, body))
                }
            })
            .buffered(32);
        while let Some(r) = reads.next().await {
            let (key, seq, body) = r?;
            let Some(body) = body else {
                return Err(untrusted(&key, "listed, then gone (the log has a gap)"));
            };
            log.push(&key, seq, &body)?;
        }
        drop(reads);
        log.catch_up().await?;
        Ok(log)
    }

    /// Reads entries created since.
    pub async fn catch_up(&mut self) -> Result<(), CommitError> {
        loop {
            let key = entry_key(&self.dataset, self.len);
            match self.bucket.get_capped(&key, ENTRY_BYTES).await? {
                Some(body) => self.push(&key, self.len, &body)?,
                None => return Ok(()),
            }
        }
    }

    fn push(&mut self, key: &str, seq: u64, body: &[u8]) -> Result<(), CommitError> {
        let e: Entry = serde_json::from_slice(body).map_err(|e| CommitError::Malformed {
            key: key.into(),
            detail: e.to_string(),
        })?;
        let no = |detail: String| Err(untrusted(key, detail));
        if e.format > commits::FORMAT {
            return Err(CommitError::Newer {
                key: key.into(),
                format: e.format,
            });
        }
        if e.dataset != self.dataset || e.seq != seq {
            return no(format!(
                "it says dataset {:?} entry {}, but is filed as `{}` entry {seq}",
                e.dataset, e.seq, self.dataset
            ));
        }
        if e.partitions != self.partitions || e.partition >= self.partitions {
            return no(format!(
                "it says partition {} of {}, but this job has {} partitions",
                e.partition, e.partitions, self.partitions
            ));
        }
        if !crate::config::valid_name(&e.writer) || e.tokens == 0 {
            return no("no writer id, or 0 tokens".into());
        }
        match (e.kind.as_str(), e.release) {
            ("claim", None) => {
                self.claimed += e.tokens;
                self.claims
                    .entry(e.partition)
                    .or_default()
                    .insert(seq, e.tokens);
            }
            ("return", Some(r)) => {
                if self.returns.insert((e.partition, r)) {
                    self.returned += e.tokens;
                }
            }
            _ => {
                return no(format!(
                    "kind {:?} is not `claim` or a `return` of a release",
                    e.kind
                ))
            }
        }
        self.len = seq + 1;
        Ok(())
    }

    /// Tokens left in the pool of `budget`.
    pub fn pool(&self, budget: u64) -> u64 {
        budget.saturating_sub(self.claimed.saturating_sub(self.returned))
    }

    /// Tokens claimed less tokens returned.
    pub fn out(&self) -> u64 {
        self.claimed.saturating_sub(self.returned)
    }

    /// The tickets partition `p` took: ticket → tokens.
    pub fn claims_of(&self, p: u32) -> BTreeMap<u64, u64> {
        self.claims.get(&p).cloned().unwrap_or_default()
    }

    /// Whether release `seq` of partition `p` is returned.
    pub fn returned(&self, p: u32, seq: u64) -> bool {
        self.returns.contains(&(p, seq))
    }

    async fn create(&mut self, mut e: Entry) -> Result<Option<u64>, CommitError> {
        let seq = self.len;
        e.seq = seq;
        let key = entry_key(&self.dataset, seq);
        let body = serde_json::to_vec_pretty(&e).unwrap_or_default();
        match self.bucket.create(&key, body.clone().into()).await? {
            Created::Mine => {
                self.push(&key, seq, &body)?;
                Ok(Some(seq))
            }
            Created::Theirs(theirs) => {
                self.push(&key, seq, &theirs)?;
                Ok(None)
            }
        }
    }

    /// Takes up to `tokens` from the pool of `budget` for partition `p`: the ticket's
    /// number and size, or `None` when the pool is empty.
    pub async fn claim(
        &mut self,
        budget: u64,
        p: Partition,
        writer: &str,
        tokens: u64,
    ) -> Result<Option<(u64, u64)>, CommitError> {
        loop {
            self.catch_up().await?;
            let size = tokens.min(self.pool(budget));
            if size == 0 {
                return Ok(None);
            }
            let e = entry(&self.dataset, p, writer, "claim", size, None);
            if let Some(seq) = self.create(e).await? {
                return Ok(Some((seq, size)));
            }
        }
    }

    /// Returns release `release` (of `tokens`) of partition `p`'s log to the pool, unless
    /// it is returned already.
    pub async fn give_back(
        &mut self,
        p: Partition,
        writer: &str,
        release: u64,
        tokens: u64,
    ) -> Result<(), CommitError> {
        loop {
            self.catch_up().await?;
            if self.returned(p.index, release) {
                return Ok(());
            }
            let e = entry(&self.dataset, p, writer, "return", tokens, Some(release));
            if self.create(e).await?.is_some() {
                return Ok(());
            }
        }
    }
}

fn entry(
    dataset: &str,
    p: Partition,
    writer: &str,
    kind: &str,
    tokens: u64,
    release: Option<u64>,
) -> Entry {
    Entry {
        format: commits::FORMAT,
        dataset: dataset.into(),
        seq: 0,
        kind: kind.into(),
        partition: p.index,
        partitions: p.count,
        writer: writer.into(),
        tokens,
        release,
        spool_version: env!("CARGO_PKG_VERSION").to_string(),
    }
}

fn entry_seq(dataset: &str, key: &str) -> Option<u64> {
    let digits = key
        .strip_prefix(&budget_prefix(dataset))?
        .strip_suffix(".json")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The size of the next ticket: half an even share of what is left, at least
/// `floor` (one request's expected tokens), at most what is left.
pub fn ticket_size(pool: u64, partitions: u32, floor: u64) -> u64 {
    (pool / (2 * u64::from(partitions.max(1))))
        .max(floor)
        .min(pool)
}

/// Checks partition `log`'s claims against the budget log: each must be a ticket the
/// partition took, for as many tokens.
pub fn check_claims(log: &CommitLog, dataset: &str, budget: &BudgetLog) -> Result<(), CommitError> {
    let p = log.partition().index;
    let taken = budget.claims_of(p);
    for (ticket, tokens) in &log.dataset(dataset).claims {
        if taken.get(ticket) != Some(tokens) {
            return Err(untrusted(
                &commits::partition_prefix(p),
                format!(
                    "its log claims ticket {ticket} of `{dataset}` for {tokens} tokens, which the budget log ({}) does not give it",
                    entry_key(dataset, *ticket)
                ),
            ));
        }
    }
    Ok(())
}

/// Brings partition `log` and the budget log into step after a kill: a ticket the
/// partition took but did not record is recorded, a release not returned is returned.
pub async fn reconcile(
    log: &mut CommitLog,
    budget: &mut BudgetLog,
    dataset: &str,
    writer: &str,
) -> Result<(), CommitError> {
    let p = log.partition();
    let recorded = log.dataset(dataset).claims.clone();
    for (ticket, tokens) in budget.claims_of(p.index) {
        if !recorded.contains_key(&ticket) {
            tracing::info!(
                dataset,
                ticket,
                tokens,
                partition = p.index,
                "recording a budget ticket its claimer did not record"
            );
            log.append_anyway(Record::Claim(Claim {
                head: Head::new("claim", p, writer),
                dataset: dataset.into(),
                ticket,
                tokens,
            }))
            .await?;
        }
    }
    for (seq, tokens) in log.dataset(dataset).releases.clone() {
        budget.give_back(p, writer, seq, tokens).await?;
    }
    // The appends above read the log on: a twin's claims recorded there since are in the
    // budget log too (a ticket is taken before it is recorded), once it is read on as well.
    budget.catch_up().await?;
    check_claims(log, dataset, budget)
}

/// Writes a release of `tokens` to `log` (ordered with its commits) and returns it to the
/// pool.
pub async fn release(
    log: &mut CommitLog,
    budget: &mut BudgetLog,
    dataset: &str,
    writer: &str,
    tokens: u64,
) -> Result<(), CommitError> {
    let p = log.partition();
    loop {
        // A twin's records may come first: give back at most what is still unused.
        let tokens = tokens.min(unused(log, dataset));
        if tokens == 0 {
            return Ok(());
        }
        let appended = log
            .append(Record::Release(Release {
                head: Head::new("release", p, writer),
                dataset: dataset.into(),
                tokens,
            }))
            .await?;
        if let Appended::Committed(seq) = appended {
            return budget.give_back(p, writer, seq, tokens).await;
        }
    }
}

/// Records in the partition's log a ticket its writer took from the budget log.
async fn record_claim(
    log: &mut CommitLog,
    dataset: &str,
    writer: &str,
    ticket: u64,
    tokens: u64,
) -> Result<(), CommitError> {
    let head = Head::new("claim", log.partition(), writer);
    log.append_anyway(Record::Claim(Claim {
        head,
        dataset: dataset.into(),
        ticket,
        tokens,
    }))
    .await?;
    Ok(())
}

/// What a partition holds and has not used: its allowance less its committed tokens.
pub fn unused(log: &CommitLog, dataset: &str) -> u64 {
    let d = log.dataset(dataset);
    d.allowance().saturating_sub(d.tokens)
}

#[cfg(test)]
mod tests {
    use super::agent::{debts, reclaim};
    use super::*;
    use crate::output::bucket::BucketOptions;
    use crate::run::allowance::Allowance;
    use tokio::sync::Mutex;

    /// Runs `f` to its end on a runtime of its own.
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// Partition 0's agent of writer `w0` with one lane of `d` (job budget 1,000).
    fn agent_of(b: &Arc<Bucket>, log: CommitLog, ledger: BudgetLog, a: &Arc<Allowance>) -> Agent {
        Agent {
            log: Arc::new(Mutex::new(log)),
            lanes: vec![Lane::new("d", 1_000, ledger, a.clone())],
            writer: "w0".into(),
            partition: Partition { index: 0, count: 2 },
            bucket: b.clone(),
            stale_after: STALE_AFTER,
        }
    }

    /// Tickets shrink with the pool, never go below one request or above what is left;
    /// claims never pass the budget, returns refill it once each; a partition's ticket it
    /// did not record is recorded by `reconcile`, and a claim the budget log does not
    /// give is refused by name.
    #[test]
    fn the_pool_is_handed_out_once_in_shrinking_tickets() {
        assert_eq!(ticket_size(8_000, 4, 10), 1_000);
        assert_eq!(ticket_size(80, 4, 10), 10);
        assert_eq!(ticket_size(5, 4, 10), 5);
        assert_eq!(ticket_size(0, 4, 10), 0);
        block_on(async {
            let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
            let p0 = Partition { index: 0, count: 2 };
            let p1 = Partition { index: 1, count: 2 };
            let mut a = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
            let mut c = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
            assert_eq!(a.claim(1_000, p0, "w0", 700).await.unwrap(), Some((0, 700)));
            // The other reader learns of it before it claims: only 300 are left.
            assert_eq!(c.claim(1_000, p1, "w1", 700).await.unwrap(), Some((1, 300)));
            assert_eq!(a.claim(1_000, p0, "w0", 1).await.unwrap(), None);
            let mut log = CommitLog::load(b.clone(), p0, commits::LoadOptions::WORKER)
                .await
                .unwrap();
            reconcile(&mut log, &mut a, "d", "w0").await.unwrap();
            assert_eq!(log.dataset("d").allowance(), 700);
            release(&mut log, &mut a, "d", "w0", 200).await.unwrap();
            // Returned once, whoever reconciles again.
            reconcile(&mut log, &mut a, "d", "w0").await.unwrap();
            let fresh = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
            assert_eq!(fresh.pool(1_000), 200);
            assert_eq!(log.dataset("d").allowance(), 500);
            // A claim in the partition's log that the budget log does not give.
            let mut forged = Head::new("claim", p0, "w0");
            forged.seq = log.len();
            let body = serde_json::to_vec(&Claim {
                head: forged,
                dataset: "d".into(),
                ticket: 1,
                tokens: 300,
            })
            .unwrap();
            b.put(&commits::commit_key(0, log.len()), body.into())
                .await
                .unwrap();
            let log = CommitLog::load(b.clone(), p0, commits::LoadOptions::READER)
                .await
                .unwrap();
            let e = check_claims(&log, "d", &fresh).unwrap_err().to_string();
            assert!(
                e.contains("ticket 1") && e.contains("does not give it"),
                "{e}"
            );
        });
    }

    /// A worker whose budget log was read before a twin of its partition took and
    /// recorded a ticket reconciles without calling the twin's record forged (the race a
    /// twin's start-up lost on a slow store).
    #[test]
    fn reconcile_reads_on_past_a_twins_newer_ticket() {
        block_on(async {
            let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
            let p0 = Partition { index: 0, count: 2 };
            let mut twin = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
            let mut twin_log = CommitLog::load(b.clone(), p0, commits::LoadOptions::WORKER)
                .await
                .unwrap();
            // The twin takes ticket 0 and has not recorded it yet.
            let (t0, n0) = twin.claim(1_000, p0, "w1", 300).await.unwrap().unwrap();
            let mut log = CommitLog::load(b.clone(), p0, commits::LoadOptions::WORKER)
                .await
                .unwrap();
            let mut mine = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
            // Then it takes ticket 1 and records both, after this worker read the
            // budget log.
            let (t1, n1) = twin.claim(1_000, p0, "w1", 200).await.unwrap().unwrap();
            for (ticket, tokens) in [(t0, n0), (t1, n1)] {
                twin_log
                    .append_anyway(Record::Claim(Claim {
                        head: Head::new("claim", p0, "w1"),
                        dataset: "d".into(),
                        ticket,
                        tokens,
                    }))
                    .await
                    .unwrap();
            }
            reconcile(&mut log, &mut mine, "d", "w0").await.unwrap();
            assert_eq!(log.dataset("d").allowance(), 500);
            assert_eq!(mine.pool(1_000), 500);
        });
    }

    /// A worker whose rows a twin of its partition committed first takes no more tickets
    /// and finishes on what it holds (what it took would be spent on rows thrown away, and
    /// come back only when it ends); the same lane without a twin takes one.
    #[test]
    fn a_worker_behind_a_twin_takes_no_more_budget() {
        block_on(async {
            for duplicates in [0u64, 120] {
                let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
                let p0 = Partition { index: 0, count: 2 };
                let ledger = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
                let log = CommitLog::load(b.clone(), p0, commits::LoadOptions::WORKER)
                    .await
                    .unwrap();
                let a = Arc::new(Allowance::new(0));
                a.report(500.0, 0, 50.0, true);
                a.add_duplicates(duplicates);
                let mut agent = agent_of(&b, log, ledger, &a);
                agent.tick(0, &mut None).await.unwrap();
                agent.tick(0, &mut None).await.unwrap();
                let taken = BudgetLog::load(b.clone(), "d", 2).await.unwrap().out();
                if duplicates == 0 {
                    assert!(taken > 0 && !a.is_last(), "took {taken}");
                } else {
                    assert_eq!(taken, 0, "a worker behind a twin took budget");
                    assert!(a.is_last(), "it must finish on what it holds");
                }
            }
        });
    }

    /// A worker that stops while a twin of its partition still runs leaves the partition's
    /// unused allowance to it (the twin may have it in flight) and does not mark the
    /// partition stopped; once the twin has stopped, or its heartbeat is stale, the same
    /// settle gives the unused allowance back to the pool. A lane out of rows behind a
    /// twin keeps what it holds too.
    #[test]
    fn a_worker_leaves_its_unused_budget_to_a_live_twin() {
        block_on(async {
            let now = crate::cluster::job::now_unix();
            // (twin says running, its heartbeat's age, this worker's age, this worker
            // made every item, gives back): a worker whose last beat came before this
            // one started was killed before; with every item made, a twin can only
            // make duplicates.
            for (twin_running, twin_age, my_age, made_all, gives_back) in [
                (true, 0, 5, false, false),
                (true, 10, 30, false, false),
                (true, 0, 5, true, true),
                (false, 0, 5, false, true),
                (true, 3_600, 5, false, true),
                (true, 55, 50, false, true),
            ] {
                let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
                let p0 = Partition { index: 0, count: 2 };
                let mut ledger = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
                let mut log = CommitLog::load(b.clone(), p0, commits::LoadOptions::WORKER)
                    .await
                    .unwrap();
                let (ticket, tokens) = ledger.claim(1_000, p0, "w0", 600).await.unwrap().unwrap();
                log.append_anyway(Record::Claim(Claim {
                    head: Head::new("claim", p0, "w0"),
                    dataset: "d".into(),
                    ticket,
                    tokens,
                }))
                .await
                .unwrap();
                let twin = crate::cluster::heartbeat::WorkerStatus {
                    format: commits::FORMAT,
                    partition: 0,
                    partitions: 2,
                    writer: "w1".into(),
                    heartbeat_unix: now - twin_age,
                    running: twin_running,
                    report: None,
                };
                b.put(
                    &crate::cluster::heartbeat::presence_key(0, "w1"),
                    serde_json::to_vec(&twin).unwrap().into(),
                )
                .await
                .unwrap();
                let a = Arc::new(Allowance::new(600));
                a.report(100.0, 100, 50.0, false);
                a.add_duplicates(40);
                let mut agent = agent_of(&b, log, ledger, &a);
                agent.tick(0, &mut None).await.unwrap();
                let pool = BudgetLog::load(b.clone(), "d", 2)
                    .await
                    .unwrap()
                    .pool(1_000);
                assert_eq!(pool, 400, "out of rows behind a twin, it gave budget back");
                let twins = crate::cluster::heartbeat::live_twins(
                    &b,
                    p0,
                    "w0",
                    now - my_age,
                    Duration::ZERO,
                )
                .await
                .unwrap();
                let made: HashSet<String> = made_all.then(|| "d".to_string()).into_iter().collect();
                let left = agent.settle(&twins, &made).await.unwrap();
                assert_eq!(left, !gives_back);
                let pool = BudgetLog::load(b.clone(), "d", 2)
                    .await
                    .unwrap()
                    .pool(1_000);
                let stopped = b.get(&waiting_key("d", 0)).await.unwrap().is_some();
                if gives_back {
                    assert_eq!(pool, 1_000, "twin running={twin_running} age={twin_age}s");
                    assert!(stopped);
                } else {
                    assert_eq!(pool, 400, "gave back what a live twin may have in flight");
                    assert!(
                        !stopped,
                        "marked stopped while its twin may give budget back"
                    );
                    // The twin dies instead: once the partition's heartbeat is stale,
                    // another partition takes the budget back though it is done — only
                    // because the done marker says a twin was to settle it.
                    let status = crate::cluster::heartbeat::WorkerStatus {
                        heartbeat_unix: now - 3_600,
                        ..twin.clone()
                    };
                    b.put(
                        &commits::status_key(0),
                        serde_json::to_vec(&status).unwrap().into(),
                    )
                    .await
                    .unwrap();
                    let p1 = Partition { index: 1, count: 2 };
                    for twin_settles in [false, true] {
                        let done = commits::Done {
                            partition: 0,
                            partitions: 2,
                            writer: "w0".into(),
                            commits: 2,
                            failed: 0,
                            twin_settles,
                            spool_version: "0".into(),
                        };
                        b.put(
                            &commits::done_key(0),
                            serde_json::to_vec(&done).unwrap().into(),
                        )
                        .await
                        .unwrap();
                        let mut other = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
                        reclaim(&b, p1, "w9", "d", &mut other, Duration::from_secs(60))
                            .await
                            .unwrap();
                        let pool = BudgetLog::load(b.clone(), "d", 2)
                            .await
                            .unwrap()
                            .pool(1_000);
                        assert_eq!(pool, if twin_settles { 1_000 } else { 400 });
                    }
                }
            }
        });
    }

    /// A worker of partition `p` (writer `w{p}`) with a lane of `d` (budget 1,000), its
    /// heartbeat fresh so the others count on it.
    async fn worker(b: &Arc<Bucket>, p: u32, a: &Arc<Allowance>) -> Agent {
        let part = Partition { index: p, count: 2 };
        let status = crate::cluster::heartbeat::WorkerStatus {
            format: commits::FORMAT,
            partition: p,
            partitions: 2,
            writer: format!("w{p}"),
            heartbeat_unix: crate::cluster::job::now_unix(),
            running: true,
            report: None,
        };
        b.put(
            &commits::status_key(p),
            serde_json::to_vec(&status).unwrap().into(),
        )
        .await
        .unwrap();
        let log = CommitLog::load(b.clone(), part, commits::LoadOptions::WORKER)
            .await
            .unwrap();
        let ledger = BudgetLog::load(b.clone(), "d", 2).await.unwrap();
        Agent {
            log: Arc::new(Mutex::new(log)),
            lanes: vec![Lane::new("d", 1_000, ledger, a.clone())],
            writer: format!("w{p}"),
            partition: part,
            bucket: b.clone(),
            stale_after: STALE_AFTER,
        }
    }

    /// Partition `p`'s worker takes `tokens` from the pool and records them.
    async fn holding(b: &Arc<Bucket>, p: u32, tokens: u64) -> (Agent, Arc<Allowance>) {
        let a = Arc::new(Allowance::new(0));
        let mut agent = worker(b, p, &a).await;
        let (ticket, got) = agent.lanes[0]
            .ledger
            .claim(1_000, agent.partition, &agent.writer, tokens)
            .await
            .unwrap()
            .unwrap();
        let mut log = agent.log.lock().await;
        record_claim(&mut log, "d", &agent.writer, ticket, got)
            .await
            .unwrap();
        drop(log);
        a.set(tokens, false);
        agent.lanes[0].ledger.catch_up().await.unwrap();
        (agent, a)
    }

    /// A job of two partitions on a budget of 1,000, all taken: 400 by p0, 600 by p1.
    async fn two_holding() -> (
        Arc<Bucket>,
        (Agent, Arc<Allowance>),
        (Agent, Arc<Allowance>),
    ) {
        let b = Arc::new(Bucket::open("memory://", &BucketOptions::default()).unwrap());
        let p0 = holding(&b, 0, 400).await;
        let p1 = holding(&b, 1, 600).await;
        (b, p0, p1)
    }

    /// A lane with rows, `completed` tokens, nothing generating, and needing `need` to
    /// start its next request (300 expected).
    fn idle_short(a: &Allowance, completed: u64, need: u64) {
        a.report(completed as f64, completed, 300.0, true);
        a.report_next(need as f64, true);
    }

    /// Partitions short of one more request with nothing generating put what they hold
    /// back in the pool, and once none still running could use it, one takes all of it
    /// and finishes on it while the other finishes on what it completed: the job gambles
    /// on one last request, not one per partition. Before, each partition started one
    /// with whatever room it had, and 16 partitions ended 0.6-1 % over the budget.
    #[test]
    fn partitions_short_of_a_request_pool_their_room_and_one_takes_the_last() {
        block_on(async {
            let (b, (mut p0, a0), (mut p1, a1)) = two_holding().await;
            // Each has completed most of what it holds; one more request needs 1,300.
            idle_short(&a0, 100, 1_300);
            idle_short(&a1, 200, 1_400);
            p0.tick(0, &mut None).await.unwrap();
            assert_eq!(a0.granted(), 100, "p0 kept only what it completed");
            assert!(!a0.is_last(), "p1 still runs and may leave room");
            let pool = |b: Arc<Bucket>| async move {
                BudgetLog::load(b, "d", 2).await.unwrap().pool(1_000)
            };
            assert_eq!(pool(b.clone()).await, 300);
            p1.tick(0, &mut None).await.unwrap();
            assert!(
                a1.is_last(),
                "p1 sees no one left to give budget back: it takes the last"
            );
            assert_eq!(a1.granted(), 900, "its room and p0's");
            assert_eq!(pool(b.clone()).await, 0);
            // p0 looks again (a new look, past its back-off): nothing left, it finishes.
            let a0b = a0.clone();
            let mut p0 = worker(&b, 0, &a0b).await;
            p0.tick(0, &mut None).await.unwrap();
            assert!(a0.is_last());
            assert_eq!(a0.granted(), 100);
        });
    }

    /// A partition whose requests in flight ran past its allowance says so on its waiting
    /// marker; the partition that takes the last of the pool leaves that much in it, and
    /// the debtor takes it: what the job had left pays for what was made, not for one
    /// more request. A marker that is not a debt (a neighbour's garbage) owes nothing.
    #[test]
    fn the_last_of_the_pool_pays_a_waiting_partitions_overrun_first() {
        block_on(async {
            let (b, (mut p0, a0), (mut p1, a1)) = two_holding().await;
            // p0 completed 700 on 400: 300 over.
            idle_short(&a0, 700, 1_300);
            p0.tick(0, &mut None).await.unwrap();
            assert!(!a0.is_last());
            let marker = b.get(&waiting_key("d", 0)).await.unwrap().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&marker).unwrap();
            assert_eq!(v["debt"], 300);
            // p1 has 400 of room, short of one more request.
            idle_short(&a1, 200, 1_400);
            p1.tick(0, &mut None).await.unwrap();
            assert!(a1.is_last());
            assert_eq!(
                a1.granted(),
                300,
                "it took 100 of the 400 and left p0's 300"
            );
            let mut p0 = worker(&b, 0, &a0).await;
            p0.tick(0, &mut None).await.unwrap();
            assert_eq!(a0.granted(), 700, "p0's overrun is paid");
            let left = BudgetLog::load(b.clone(), "d", 2)
                .await
                .unwrap()
                .pool(1_000);
            assert_eq!(left, 0);
            // Garbage in a marker owes nothing.
            let garbage: [bytes::Bytes; 2] =
                ["{\"debt\": \"lots\"}".into(), vec![b'x'; 10_000].into()];
            for body in garbage {
                b.put(&waiting_key("d", 1), body).await.unwrap();
                let p0 = Partition { index: 0, count: 2 };
                let marked = HashSet::from([0, 1]);
                assert_eq!(debts(&b, p0, "d", &marked).await.unwrap(), 0);
            }
        });
    }
}
