//! What `spool status` and `/status` report (the JSON shape is documented in the README).
//!
//! Built from the queue's durable counters alone, plus live rates and ETAs when the report
//! comes from a running process. Invariant: nothing here reads an item; the cost is one
//! small record per dataset.

use crate::config::Config;
use crate::estimate::lengths::format_duration;
use crate::store::queue::{Queue, QueueError};
use serde::{Deserialize, Serialize};

/// One dataset's line.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct DatasetStatus {
    pub name: String,
    pub items: u64,
    pub done: u64,
    pub pending: u64,
    pub inflight: u64,
    pub failed: u64,
    pub rejected: u64,
    pub completion_tokens: u64,
    pub prompt_tokens: u64,
    pub budget: Option<u64>,
    /// Completed tokens past the budget ("finish" policy), 0 when under.
    pub overshoot_tokens: u64,
    /// Tokens thrown away by the "cancel" policy.
    pub wasted_tokens: u64,
    pub shards: u64,
    /// Done items whose rows are in shards (the rest are durable in the queue, waiting).
    pub sharded: u64,
    /// `pending`, `running`, `done`, `budget_met`, `failed_items`.
    pub state: String,
    pub tokens_per_s: Option<f64>,
    pub requests_per_s: Option<f64>,
    pub eta_s: Option<f64>,
    /// First permanent failures: (1-based line, reason).
    pub failures: Vec<(u64, String)>,
}

/// The whole report.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StatusReport {
    /// True when produced by a running `spool run`.
    pub running: bool,
    pub datasets: Vec<DatasetStatus>,
}

impl StatusReport {
    /// From the queue alone (the process may have stopped).
    pub fn from_queue(queue: &Queue, cfg: &Config) -> Result<StatusReport, QueueError> {
        let mut datasets = Vec::new();
        for d in &cfg.datasets {
            let Some(s) = queue.states().into_iter().find(|s| s.name == d.name) else {
                datasets.push(DatasetStatus {
                    name: d.name.clone(),
                    budget: d.token_budget,
                    state: "not_started".into(),
                    ..Default::default()
                });
                continue;
            };
            let failures = queue
                .failures(s.index, 5)?
                .into_iter()
                .map(|(row, f)| (row + 1, f.reason))
                .collect();
            // Met, or (policy "cancel", which never crosses it) closer to it than one
            // average completion: nothing more will fit.
            let avg = s.completion_tokens.checked_div(s.done).unwrap_or(u64::MAX);
            let budget_met = d.token_budget.is_some_and(|b| {
                s.completion_tokens >= b || (s.wasted_tokens > 0 && b - s.completion_tokens < avg)
            });
            let state = if budget_met {
                "budget_met"
            } else if s.pending() == 0 && s.failed > 0 {
                "failed_items"
            } else if s.pending() == 0 && s.items > 0 {
                "done"
            } else {
                "pending"
            };
            datasets.push(DatasetStatus {
                name: s.name.clone(),
                items: s.items,
                done: s.done,
                pending: s.pending(),
                inflight: 0,
                failed: s.failed,
                rejected: s.rejected,
                completion_tokens: s.completion_tokens,
                prompt_tokens: s.prompt_tokens,
                budget: d.token_budget,
                overshoot_tokens: d
                    .token_budget
                    .map(|b| s.completion_tokens.saturating_sub(b))
                    .unwrap_or(0),
                wasted_tokens: s.wasted_tokens,
                shards: s.next_shard,
                sharded: s.sharded,
                state: state.into(),
                tokens_per_s: None,
                requests_per_s: None,
                eta_s: None,
                failures,
            });
        }
        Ok(StatusReport {
            running: false,
            datasets,
        })
    }

    /// Items that failed permanently, over all datasets (exit code 3 when > 0).
    pub fn failed(&self) -> u64 {
        self.datasets.iter().map(|d| d.failed).sum()
    }

    /// The human table: where the figures come from, one row per dataset, then the first
    /// permanent failures. The rate and ETA columns appear only in a live report.
    pub fn render_table(&self) -> String {
        let mut header = vec![
            "dataset",
            "done",
            "pending",
            "inflight",
            "failed",
            "rejected",
            "tokens/budget",
            "overshoot",
            "shards",
        ];
        if self.running {
            header.extend(["tok/s", "req/s", "ETA"]);
        }
        header.push("state");
        let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
        for d in &self.datasets {
            let tokens = match d.budget {
                Some(b) => format!("{}/{}", human(d.completion_tokens), human(b)),
                None => human(d.completion_tokens),
            };
            let mut row = vec![
                d.name.clone(),
                format!("{}/{}", d.done, d.items),
                d.pending.to_string(),
                d.inflight.to_string(),
                d.failed.to_string(),
                d.rejected.to_string(),
                tokens,
                if d.budget.is_some() {
                    d.overshoot_tokens.to_string()
                } else {
                    "-".into()
                },
                d.shards.to_string(),
            ];
            if self.running {
                row.push(
                    d.tokens_per_s
                        .map(|t| human(t.round() as u64))
                        .unwrap_or_else(|| "-".into()),
                );
                row.push(
                    d.requests_per_s
                        .map(|r| format!("{r:.1}"))
                        .unwrap_or_else(|| "-".into()),
                );
                row.push(d.eta_s.map(format_duration).unwrap_or_else(|| "-".into()));
            }
            row.push(d.state.clone());
            rows.push(row);
        }
        let widths: Vec<usize> = (0..header.len())
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        let mut out = String::from(if self.running {
            "live from the running process\n"
        } else {
            "from the queue (no run active)\n"
        });
        for r in &rows {
            let line: Vec<String> = r
                .iter()
                .enumerate()
                .map(|(i, cell)| {
                    if i == 0 {
                        format!("{:<w$}", cell, w = widths[i])
                    } else {
                        format!("{:>w$}", cell, w = widths[i])
                    }
                })
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        for d in &self.datasets {
            for (line, reason) in &d.failures {
                out.push_str(&format!("{}: failed at line {line}: {reason}\n", d.name));
            }
        }
        out
    }
}

/// 1234567 → "1.2M", 1234 → "1.2k".
pub fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}G", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 10_000 => format!("{:.1}k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// 10_000 → "10,000", for the resume line.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_format() {
        assert_eq!(grouped(9_998_988), "9,998,988");
        assert_eq!(grouped(12), "12");
        assert_eq!(human(1_234_567), "1.2M");
    }

    fn report(running: bool) -> StatusReport {
        StatusReport {
            running,
            datasets: vec![DatasetStatus {
                name: "math".into(),
                items: 80,
                done: 28,
                pending: 50,
                inflight: 2,
                failed: 2,
                rejected: 1,
                completion_tokens: 12_203,
                budget: Some(12_000),
                overshoot_tokens: 203,
                shards: 1,
                state: if running { "running" } else { "budget_met" }.into(),
                tokens_per_s: running.then_some(1234.4),
                requests_per_s: running.then_some(0.25),
                eta_s: running.then_some(125.0),
                failures: vec![(12, "HTTP 400: too long".into())],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn table_from_the_queue_has_no_rate_columns() {
        assert_eq!(
            report(false).render_table(),
            "from the queue (no run active)\n\
             dataset   done  pending  inflight  failed  rejected  tokens/budget  overshoot  shards       state\n\
             math     28/80       50         2       2         1    12.2k/12.0k        203       1  budget_met\n\
             math: failed at line 12: HTTP 400: too long\n"
        );
    }

    #[test]
    fn live_table_shows_rates_and_eta() {
        assert_eq!(
            report(true).render_table(),
            "live from the running process\n\
             dataset   done  pending  inflight  failed  rejected  tokens/budget  overshoot  shards  tok/s  req/s    ETA    state\n\
             math     28/80       50         2       2         1    12.2k/12.0k        203       1   1234    0.2  2m05s  running\n\
             math: failed at line 12: HTTP 400: too long\n"
        );
    }
}
