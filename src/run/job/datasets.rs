//! A run's datasets taken in: each opened in the queue in config order, its new rows
//! enqueued (rendered by spool or the server, filtered to this partition) and its resume
//! line logged, then the queue checkpointed after a big intake.
//!
//! Invariants: a dataset stopped at an input limit keeps what was taken in before it and
//! the other datasets go on; a dataset whose every row was rejected is reported as
//! limited, not left pending; the shutdown signal stops intake between datasets.

use super::Job;
use crate::config::DatasetConfig;
use crate::error::{Context, Error};
use crate::input::dataset::DatasetError;
use crate::input::intake::{IntakeError, IntakeOptions, IntakeReport, ItemFilter};
use crate::observe::figures::grouped;
use crate::observe::metrics::{DatasetMetrics, Metrics};
use crate::prompt::remote::RemoteRenderer;
use crate::prompt::PromptBuilder;
use crate::run::enqueue::intake;
use crate::store::queue::Queue;
use std::collections::HashMap;
use std::sync::Arc;

/// Items enqueued by one run past which the queue is checkpointed before dispatch
/// ([`Queue::checkpoint`]): ~1.7 KB of sled log each, so ~170 MB (a fraction of a second to
/// replay) is the most a later start replays of this run's intake.
const CHECKPOINT_AFTER_ITEMS: u64 = 100_000;

/// The config's datasets as the queue knows them.
pub(super) struct Datasets {
    /// Queue index of each dataset, in config order (a lane is a position here).
    pub(super) ds: Vec<u16>,
    /// Names in config order.
    pub(super) in_order: Vec<String>,
    /// Name of each queue index.
    pub(super) names: HashMap<u16, String>,
}

/// What intake leaves for the rest of the run.
pub(super) struct Intake {
    /// Items enqueued by this run.
    pub(super) added: u64,
    /// Datasets whose intake stopped at an input limit.
    pub(super) limited: Vec<String>,
    /// Per-dataset metrics, in config order.
    pub(super) dmetrics: Vec<DatasetMetrics>,
}

impl Job {
    /// Opens (or creates) each dataset's record in the queue, in config order.
    pub(super) fn open_datasets(&self, queue: &Queue) -> Result<Datasets, Error> {
        let mut ds = Vec::new();
        let mut in_order = Vec::new();
        for d in &self.cfg.datasets {
            ds.push(queue.open_dataset(&d.name)?.index);
            in_order.push(d.name.clone());
        }
        let names = ds.iter().copied().zip(in_order.iter().cloned()).collect();
        Ok(Datasets {
            ds,
            in_order,
            names,
        })
    }

    /// How dataset `d` is taken in.
    pub(super) fn intake_options(
        &self,
        d: &DatasetConfig,
        context_length: Option<u32>,
        server: Option<Arc<dyn RemoteRenderer>>,
    ) -> IntakeOptions {
        let cfg = &self.cfg;
        IntakeOptions {
            server_templates: cfg.server.api == crate::config::Api::Chat,
            context_length,
            max_tokens: cfg.sampling_of(d).max_tokens,
            threads: 0,
            generation: cfg.generation_of(d),
            filter: self.plan.partition.map(|partition| ItemFilter {
                partition,
                committed: self
                    .plan
                    .committed
                    .get(&d.name)
                    .cloned()
                    .unwrap_or_default(),
            }),
            server,
            file: self.plan.inputs.get(&d.name).cloned(),
        }
    }

    /// Enqueues every dataset and logs its resume line; stops early on the shutdown signal.
    pub(super) async fn intake_all(
        &self,
        queue: &Arc<Queue>,
        datasets: &Datasets,
        builder: &Arc<PromptBuilder>,
        context_length: Option<u32>,
        renderer: Option<Arc<dyn RemoteRenderer>>,
        metrics: &Metrics,
    ) -> Result<Intake, Error> {
        let cfg = &self.cfg;
        let mut dmetrics = Vec::new();
        let mut added = 0u64;
        let mut limited = Vec::new();
        for (d, &ds) in cfg.datasets.iter().zip(&datasets.ds) {
            let (q, d2, b, out) = (
                queue.clone(),
                d.clone(),
                builder.clone(),
                self.plan.output_dir(cfg).to_path_buf(),
            );
            let opts = self.intake_options(d, context_length, renderer.clone());
            let o = opts.clone();
            let taken = tokio::task::spawn_blocking(move || intake(&q, ds, &d2, &b, &out, &o))
                .await
                .map_err(Error::runtime)
                .context("intake task panicked")?;
            let rep = match taken {
                Ok(rep) => rep,
                // A file past an input limit: what was taken in before it is generated;
                // the other datasets go on.
                Err(IntakeError::Dataset(DatasetError::Limit(e))) => {
                    tracing::error!(dataset = %d.name, error = %e, "dataset intake stopped at an input limit");
                    limited.push(d.name.clone());
                    IntakeReport::default()
                }
                Err(e) => return Err(e.into()),
            };
            added += rep.added;
            if let Some(p) = self.plan.partition {
                tracing::info!(dataset = %d.name, partition = p.index, partitions = p.count,
                    taken = rep.added, elsewhere = rep.elsewhere, committed = rep.committed,
                    "partition's rows taken in");
            }
            crate::input::intake::log_context_report(
                &d.name,
                &rep,
                context_length,
                &opts,
                cfg.server.clamp_max_tokens,
            );
            let s = queue
                .state(ds)
                .ok_or_else(|| Error::msg("dataset state missing after intake"))?;
            let dm = metrics.dataset(&d.name);
            dm.rejected.inc_by(s.rejected);
            dm.completion_tokens.inc_by(0);
            let budget = self.plan.budget(d);
            if let Some(b) = budget {
                metrics
                    .token_budget
                    .with_label_values(&[&d.name])
                    .set(b as i64);
            }
            dmetrics.push(dm);
            let grows = self.plan.budget_grows(d);
            let budget_left = budget
                .map(|b| {
                    format!(
                        "budget left {}{}",
                        grouped(b.saturating_sub(s.completion_tokens)),
                        if grows {
                            ", more from the job's pool as needed"
                        } else {
                            ""
                        }
                    )
                })
                .unwrap_or_else(|| "no budget".into());
            tracing::info!(
                "{}: {} prompts ({} done, {} tokens; {} to go; {}){}",
                d.name,
                grouped(s.items),
                grouped(s.done),
                grouped(s.completion_tokens),
                grouped(s.pending()),
                budget_left,
                if rep.added > 0 || rep.rejected > 0 {
                    format!("; {} new, {} rejected this run", rep.added, rep.rejected)
                } else {
                    String::new()
                }
            );
            if !grows && budget.is_some_and(|b| s.completion_tokens >= b) {
                tracing::info!(dataset = %d.name, "budget already met: skipping this dataset");
            }
            if s.items == 0 && rep.rejected > 0 {
                // Nothing of it will ever run: as a bad file found at start, not `pending`.
                tracing::error!(dataset = %d.name, rejected = rep.rejected,
                    first = rep.first_rejection.as_deref().unwrap_or(""),
                    "every row of the dataset was rejected; fix what the first rejection names and run again (the other datasets go on)");
                limited.push(d.name.clone());
            }
            if self.stop.stop.is_cancelled() {
                break;
            }
        }
        Ok(Intake {
            added,
            limited,
            dmetrics,
        })
    }
}

/// Checkpoints the queue after a big intake, which leaves sled a long log to replay at the
/// next open (after a SIGKILL too); only possible while this job holds its only handle.
pub(super) async fn checkpoint(queue: Arc<Queue>, added: u64) -> Result<Arc<Queue>, Error> {
    if added < CHECKPOINT_AFTER_ITEMS {
        return Ok(queue);
    }
    match Arc::try_unwrap(queue) {
        Ok(q) => Ok(Arc::new(
            tokio::task::spawn_blocking(move || q.checkpoint())
                .await
                .map_err(Error::runtime)
                .context("queue checkpoint panicked")??,
        )),
        Err(shared) => {
            tracing::debug!("queue still shared after intake: no checkpoint");
            Ok(shared)
        }
    }
}
