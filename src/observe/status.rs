//! `spool status` and `/status`: the report ([`crate::store::report`], its JSON shape in
//! docs/metrics.md) fetched from a running process, bounded whatever answers, and drawn
//! as the human table.

use crate::observe::figures::{format_duration, human};
use crate::observe::printable::escape;

/// Most bytes of a `/status` answer read: a report of a thousand datasets is well under
/// it; a server that sends more is not a spool endpoint.
pub const MAX_STATUS_BYTES: usize = 4 << 20;

/// A running process's `/status` (`url` is its endpoint, `http://HOST:PORT`, with or
/// without `/status`): for `spool status --url` and for a cluster worker copying its own
/// to the store. The error names the endpoint. Bounded whatever answers: `timeout` for the
/// whole exchange, [`MAX_STATUS_BYTES`] of body, redirects followed only to the same
/// origin (scheme, host and port).
pub async fn fetch(url: &str, timeout: std::time::Duration) -> Result<StatusReport, String> {
    let endpoint = status_url(url)?;
    let (_, report) = get_report(&endpoint, timeout, None, None).await?;
    Ok(report)
}

/// The `/status` of the run that owns `data_dir`'s queue, from the address it wrote there,
/// only if the endpoint proves it holds the token the run wrote beside it
/// ([`crate::observe::http::proof`]); then asked again with the token, so the failures
/// carry their reasons. `Err` says why there is no trusted report: `Untrusted` when
/// something answered without the proof (another process on the port).
pub async fn fetch_own(
    addr: &str,
    token: &str,
    timeout: std::time::Duration,
) -> Result<StatusReport, OwnStatusError> {
    use crate::observe::http::{proof, PROOF_HEADER};
    let endpoint = status_url(&format!("http://{addr}")).map_err(OwnStatusError::NoAnswer)?;
    let challenge: String = (0..16)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let (headers, _) = get_report(&endpoint, timeout, Some(&challenge), None)
        .await
        .map_err(OwnStatusError::NoAnswer)?;
    let answered = headers
        .get(PROOF_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if answered != proof(token, &challenge) {
        return Err(OwnStatusError::Untrusted(format!(
            "{endpoint} answers, but cannot prove it is the run of this queue (no token \
             proof): another process holds the port; its report is ignored"
        )));
    }
    let (_, report) = get_report(&endpoint, timeout, None, Some(token))
        .await
        .map_err(OwnStatusError::NoAnswer)?;
    Ok(report)
}

/// Why [`fetch_own`] has no report.
#[derive(Debug, thiserror::Error)]
pub enum OwnStatusError {
    /// Nothing usable answered (no process, or not a spool endpoint).
    #[error("{0}")]
    NoAnswer(String),
    /// Something answered without proving it holds the run's token.
    #[error("{0}")]
    Untrusted(String),
}

/// `url`'s `/status`; a URL without `http://` or `https://` is refused with what to add.
pub fn status_url(url: &str) -> Result<reqwest::Url, String> {
    let base = url.trim_end_matches('/');
    let base = base.strip_suffix("/status").unwrap_or(base);
    let safe = crate::observe::printable::escape(base);
    if !base.contains("://") {
        return Err(format!(
            "`{safe}` has no scheme: add `http://` (e.g. `http://{safe}`)"
        ));
    }
    let u = reqwest::Url::parse(&format!("{base}/status"))
        .map_err(|e| format!("`{safe}` is not a URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!(
            "`{safe}`: only http:// and https:// endpoints are read"
        ));
    }
    Ok(u)
}

/// One bounded GET of a `/status`: its headers and report.
async fn get_report(
    endpoint: &reqwest::Url,
    timeout: std::time::Duration,
    challenge: Option<&str>,
    token: Option<&str>,
) -> Result<(reqwest::header::HeaderMap, StatusReport), String> {
    let origin = endpoint.origin();
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout)
        .redirect(reqwest::redirect::Policy::custom(move |a| {
            if a.previous().len() >= 3 {
                a.error("too many redirects")
            } else if a.url().origin() != origin {
                a.error("redirect to another origin refused")
            } else {
                a.follow()
            }
        }))
        .build()
        .map_err(|e| format!("{endpoint}: {e}"))?;
    let mut url = endpoint.clone();
    if let Some(c) = challenge {
        url.query_pairs_mut().append_pair("challenge", c);
    }
    let mut req = client.get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let mut r = req
        .send()
        .await
        .map_err(|e| format!("{endpoint}: no answer: {}", error_chain(&e)))?;
    if !r.status().is_success() {
        return Err(format!("{endpoint}: answered {}", r.status()));
    }
    if r.content_length()
        .is_some_and(|n| n > MAX_STATUS_BYTES as u64)
    {
        return Err(format!(
            "{endpoint}: answer larger than {} MiB: not a spool status report",
            MAX_STATUS_BYTES >> 20
        ));
    }
    let headers = r.headers().clone();
    let mut body = Vec::new();
    while let Some(chunk) = r
        .chunk()
        .await
        .map_err(|e| format!("{endpoint}: {}", error_chain(&e)))?
    {
        if body.len() + chunk.len() > MAX_STATUS_BYTES {
            return Err(format!(
                "{endpoint}: answer larger than {} MiB: not a spool status report",
                MAX_STATUS_BYTES >> 20
            ));
        }
        body.extend_from_slice(&chunk);
    }
    let report = serde_json::from_slice(&body)
        .map_err(|e| format!("{endpoint}: not a spool status report: {e}"))?;
    Ok((headers, report))
}

/// An error and its causes on one line (reqwest's own says only "error sending request").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cause = c.source();
    }
    out
}

pub use crate::store::report::{DatasetPhase, DatasetStatus, ServerStatus, StatusReport};

impl StatusReport {
    /// The human table: where the figures come from, one row per dataset, then the first
    /// permanent failures. Names and reasons come from outside (a remote endpoint, a
    /// server's message): their control characters are escaped. The rate and ETA columns
    /// appear only in a live report.
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
                escape(&d.name).into_owned(),
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
            row.push(d.state.to_string());
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
        for s in &self.servers {
            let limit = s.limit.map(|l| format!("/{l} (limit)")).unwrap_or_default();
            let rate = s
                .tokens_per_s
                .map(|t| format!(", {} tok/s", human(t.round() as u64)))
                .unwrap_or_default();
            out.push_str(&format!(
                "server {} {}: {}{limit} in flight{rate}\n",
                s.url,
                if s.up { "up" } else { "DOWN" },
                s.inflight
            ));
        }
        for d in &self.datasets {
            for (line, reason) in &d.failures {
                out.push_str(&format!(
                    "{}: failed at line {line}: {}\n",
                    escape(&d.name),
                    escape(reason)
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every state's name is the snake_case form serde writes in the JSON, and the table
    /// shows the same name.
    #[test]
    fn state_names_are_one_vocabulary() {
        for st in [
            DatasetPhase::NotStarted,
            DatasetPhase::Pending,
            DatasetPhase::Running,
            DatasetPhase::Done,
            DatasetPhase::BudgetMet,
            DatasetPhase::FailedItems,
        ] {
            assert_eq!(
                serde_json::to_string(&st).unwrap(),
                format!("\"{}\"", st.as_str())
            );
            assert_eq!(st.to_string(), st.as_str());
            assert_eq!(
                serde_json::from_str::<DatasetPhase>(&format!("\"{st}\"")).unwrap(),
                st
            );
        }
    }

    fn report(running: bool) -> StatusReport {
        StatusReport {
            running,
            servers: Vec::new(),
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
                state: if running {
                    DatasetPhase::Running
                } else {
                    DatasetPhase::BudgetMet
                },
                tokens_per_s: running.then_some(1234.4),
                requests_per_s: running.then_some(0.25),
                eta_s: running.then_some(125.0),
                failures: vec![(12, "HTTP 400: too long".into())],
                ..Default::default()
            }],
        }
    }

    /// A report read from the queue alone has no rate, req/s or ETA column.
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

    /// A dataset name and a failure reason with terminal escapes and line breaks are
    /// printed escaped: one table line each, no control character.
    #[test]
    fn table_escapes_text_from_outside() {
        let mut r = report(false);
        r.datasets[0].name = "ma\u{1b}[2Jth".into();
        r.datasets[0].failures = vec![(3, "HTTP 500: \u{1b}]0;owned\u{7}\nfake line\r".into())];
        let t = r.render_table();
        assert!(!t.chars().any(|c| c.is_control() && c != '\n'), "{t:?}");
        assert_eq!(t.lines().count(), 4, "{t}");
        assert!(
            t.contains(
                "ma\\u{1b}[2Jth: failed at line 3: HTTP 500: \\u{1b}]0;owned\\u{7}\\nfake line\\r"
            ),
            "{t}"
        );
    }

    /// A report from a running process adds tok/s, req/s and the ETA before the state.
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

    /// A live report's servers are a line each under the table: up or down, in flight,
    /// the limit when each server has its own, tokens/s.
    #[test]
    fn live_table_lists_the_servers_and_their_limits() {
        let mut r = report(true);
        r.servers = vec![
            ServerStatus {
                url: "http://a:1".into(),
                up: true,
                inflight: 30,
                limit: Some(32),
                tokens_per_s: Some(1500.0),
            },
            ServerStatus {
                url: "http://b:2".into(),
                up: false,
                inflight: 0,
                limit: None,
                tokens_per_s: None,
            },
        ];
        let t = r.render_table();
        assert!(
            t.contains("server http://a:1 up: 30/32 (limit) in flight, 1500 tok/s\n"),
            "{t}"
        );
        assert!(t.contains("server http://b:2 DOWN: 0 in flight\n"), "{t}");
    }
}
