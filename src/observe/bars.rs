//! Terminal progress bars: one bar per active dataset (items, completion
//! tokens against the budget, tok/s, ETA) and a run line under them, drawn on stderr by
//! indicatif.
//!
//! Mode: bars when stderr is a terminal and the run is not `-q`
//! ([`wanted`]); otherwise the monitor logs the plain progress lines of
//! [`crate::observe::progress::format_line`]. The binary decides once, in its logging set-up, by
//! calling [`install`]; the monitor asks [`active`].
//!
//! Invariant: while bars are installed every log line goes through [`LogWriter`], which
//! writes it inside [`MultiProgress::suspend`] — the bars are cleared, the line is written
//! whole, the bars are redrawn below it — so a log line and a bar never share a screen
//! line.

use crate::observe::figures::{format_duration, human};
use crate::observe::status::DatasetPhase;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};

/// Bar length: positions are in thousandths of the dataset's work.
const SCALE: u64 = 1000;

static BARS: OnceLock<Bars> = OnceLock::new();

/// Whether bars should be drawn: stderr is a terminal and output is not quietened.
pub fn wanted(quiet: bool) -> bool {
    !quiet && std::io::stderr().is_terminal()
}

/// Installs the process's bars on stderr (first call wins) and returns them.
pub fn install() -> &'static Bars {
    BARS.get_or_init(|| {
        let mut b = Bars::new(ProgressDrawTarget::stderr_with_hz(4));
        b.newline_on_finish = true;
        b
    })
}

/// The installed bars, if this process draws them.
pub fn active() -> Option<&'static Bars> {
    BARS.get()
}

/// One dataset's bar.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetBar<'a> {
    pub name: &'a str,
    pub done: u64,
    pub total: u64,
    pub failed: u64,
    pub tokens: u64,
    pub budget: Option<u64>,
    pub tok_per_s: f64,
    pub eta_s: Option<f64>,
    /// Shown after the counts, except `running`, which shows the rate and ETA instead.
    pub state: DatasetPhase,
}

/// The run line.
#[derive(Debug, Clone, PartialEq)]
pub struct RunLine {
    pub done: u64,
    pub total: u64,
    pub tokens: u64,
    pub tok_per_s: f64,
    pub eta_s: Option<f64>,
    pub servers_up: usize,
    pub servers: usize,
    /// Each server's limit with `concurrency = "auto"` (empty otherwise).
    pub limits: Vec<usize>,
    pub elapsed_s: f64,
}

/// The share of a dataset's work done, in `0..=1`: items done over items, or tokens over
/// the budget when that is further along (the budget ends a dataset first).
pub fn fraction(d: &DatasetBar<'_>) -> f64 {
    if d.state.is_finished() {
        return 1.0;
    }
    let by_items = if d.total > 0 {
        (d.done + d.failed) as f64 / d.total as f64
    } else {
        0.0
    };
    let by_tokens = match d.budget {
        Some(b) if b > 0 => d.tokens as f64 / b as f64,
        _ => 0.0,
    };
    by_items.max(by_tokens).clamp(0.0, 1.0)
}

/// The text right of a dataset's bar:
/// `120/1000 items · 1.2M/10.0M tok · 1.1k tok/s · ETA 2h41m`.
pub fn dataset_message(d: &DatasetBar<'_>) -> String {
    let tokens = match d.budget {
        Some(b) => format!("{}/{} tok", human(d.tokens), human(b)),
        None => format!("{} tok", human(d.tokens)),
    };
    let failed = if d.failed > 0 {
        format!(" ({} failed)", d.failed)
    } else {
        String::new()
    };
    let tail = match d.state {
        DatasetPhase::Running => format!(
            "{} tok/s · ETA {}",
            rate(d.tok_per_s),
            d.eta_s.map(format_duration).unwrap_or_else(|| "?".into())
        ),
        other => other.as_str().to_string(),
    };
    format!("{}/{} items{failed} · {tokens} · {tail}", d.done, d.total)
}

/// The run line: `run 12m05s · 1200/20000 items · 1.2M tok · 1.1k tok/s · servers 2/2 up
/// (limits 64+48) · ETA 4h02m` (the limits with `concurrency = "auto"`).
pub fn run_message(r: &RunLine) -> String {
    let limits = if r.limits.is_empty() {
        String::new()
    } else {
        let l: Vec<String> = r.limits.iter().map(|l| l.to_string()).collect();
        format!(" (limits {})", l.join("+"))
    };
    format!(
        "run {} · {}/{} items · {} tok · {} tok/s · servers {}/{} up{limits} · ETA {}",
        format_duration(r.elapsed_s),
        r.done,
        r.total,
        human(r.tokens),
        rate(r.tok_per_s),
        r.servers_up,
        r.servers,
        r.eta_s.map(format_duration).unwrap_or_else(|| "?".into())
    )
}

fn rate(x: f64) -> String {
    if x >= 1000.0 {
        format!("{:.1}k", x / 1000.0)
    } else {
        format!("{x:.0}")
    }
}

/// The bars of one process.
pub struct Bars {
    multi: MultiProgress,
    inner: Mutex<Inner>,
    /// Ends the last bar's line on stderr when finishing (indicatif leaves the cursor at
    /// the end of it, where the next write would be glued on).
    newline_on_finish: bool,
}

#[derive(Default)]
struct Inner {
    run: Option<ProgressBar>,
    datasets: Vec<(String, ProgressBar)>,
    /// Width of the name column.
    width: usize,
    finished: bool,
}

impl Bars {
    /// Bars drawn to `target` (tests pass an in-memory terminal).
    pub fn new(target: ProgressDrawTarget) -> Self {
        Self {
            multi: MultiProgress::with_draw_target(target),
            inner: Mutex::new(Inner::default()),
            newline_on_finish: false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Redraws with the latest figures; a dataset gets its bar the first time it is passed.
    pub fn update(&self, datasets: &[DatasetBar<'_>], run: &RunLine) {
        let mut inner = self.lock();
        if inner.finished {
            return;
        }
        let run_bar = inner
            .run
            .get_or_insert_with(|| {
                let b = ProgressBar::new(1).with_style(
                    ProgressStyle::with_template("{msg}").expect("the run template is valid"),
                );
                self.multi.add(b)
            })
            .clone();
        let width = datasets
            .iter()
            .map(|d| d.name.chars().count())
            .chain(inner.datasets.iter().map(|(n, _)| n.chars().count()))
            .max()
            .unwrap_or(0);
        let style =
            ProgressStyle::with_template("{prefix} [{bar:20.cyan/blue}] {percent:>3}% {msg}")
                .expect("the dataset template is valid")
                .progress_chars("=> ");
        for d in datasets {
            let bar = match inner.datasets.iter().find(|(n, _)| n == d.name) {
                Some((_, b)) => b.clone(),
                None => {
                    let b = self
                        .multi
                        .insert_before(&run_bar, ProgressBar::new(SCALE).with_style(style.clone()));
                    inner.datasets.push((d.name.to_string(), b.clone()));
                    b
                }
            };
            // Message first: the position change draws, with the new message.
            bar.set_message(dataset_message(d));
            bar.set_prefix(format!("{:<width$}", d.name));
            bar.set_position((fraction(d) * SCALE as f64).round() as u64);
        }
        if width != inner.width {
            // A longer name arrived: realign every prefix.
            inner.width = width;
            for (n, b) in &inner.datasets {
                b.set_prefix(format!("{n:<width$}"));
            }
        }
        run_bar.set_message(run_message(run));
    }

    /// Draws the final state once and stops drawing; later output goes below it.
    pub fn finish(&self) {
        let mut inner = self.lock();
        if inner.finished {
            return;
        }
        inner.finished = true;
        // `abandon` keeps each bar where it is (an interrupted run is not 100 %).
        for (_, b) in &inner.datasets {
            b.abandon();
        }
        if let Some(r) = &inner.run {
            r.abandon();
        }
        self.multi.set_draw_target(ProgressDrawTarget::hidden());
        if self.newline_on_finish && (inner.run.is_some() || !inner.datasets.is_empty()) {
            let mut e = std::io::stderr().lock();
            let _ = e.write_all(b"\n");
            let _ = e.flush();
        }
    }

    /// Runs `f` (which writes to the terminal) with the bars cleared, then redraws them.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.multi.suspend(f)
    }
}

/// A `tracing` writer to stderr that never tears the bars: each write happens with the
/// bars suspended when they are installed, plainly otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // The fmt layer writes one whole event per call; write it whole, on one line: a
        // line break or control character from outside (a server's message) is escaped;
        // only the formatter's colours (SGR sequences) are kept.
        let text = String::from_utf8_lossy(buf);
        let body = text.strip_suffix('\n').unwrap_or(&text);
        let safe = crate::observe::printable::escape_keeping_colours(body);
        let write = || {
            let mut e = std::io::stderr().lock();
            e.write_all(safe.as_bytes())?;
            if body.len() < text.len() {
                e.write_all(b"\n")?;
            }
            e.flush()
        };
        match active() {
            Some(b) => b.suspend(write)?,
            None => write()?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        LogWriter
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::TermLike;
    use std::sync::Arc;

    const WIDTH: usize = 160;

    /// A terminal that keeps the screen: writes, cursor moves, line clears, and the
    /// deferred auto-wrap at the right margin that indicatif relies on.
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<Mutex<Grid>>);

    #[derive(Debug, Default)]
    struct Grid {
        rows: Vec<Vec<char>>,
        row: usize,
        col: usize,
        wrap: bool,
    }

    impl Screen {
        fn put(&self, s: &str, newline: bool) {
            let mut g = self.0.lock().unwrap();
            for c in s.chars() {
                if c == '\r' {
                    g.col = 0;
                    g.wrap = false;
                    continue;
                }
                if g.wrap {
                    g.row += 1;
                    g.col = 0;
                    g.wrap = false;
                }
                let (row, col) = (g.row, g.col);
                while g.rows.len() <= row {
                    g.rows.push(vec![' '; WIDTH]);
                }
                g.rows[row][col] = c;
                if col + 1 == WIDTH {
                    g.wrap = true;
                } else {
                    g.col += 1;
                }
            }
            if newline {
                g.row += 1;
                g.col = 0;
                g.wrap = false;
            }
        }
        fn text(&self) -> Vec<String> {
            let g = self.0.lock().unwrap();
            let mut l: Vec<String> = g
                .rows
                .iter()
                .map(|r| r.iter().collect::<String>().trim_end().to_string())
                .collect();
            while l.last().is_some_and(|s| s.is_empty()) {
                l.pop();
            }
            l
        }
    }

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            WIDTH as u16
        }
        fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
            let mut g = self.0.lock().unwrap();
            g.row = g.row.saturating_sub(n);
            g.wrap = false;
            Ok(())
        }
        fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
            let mut g = self.0.lock().unwrap();
            g.row += n;
            g.wrap = false;
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.put(s, true);
            Ok(())
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.put(s, false);
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            let mut g = self.0.lock().unwrap();
            let row = g.row;
            if let Some(r) = g.rows.get_mut(row) {
                r.iter_mut().for_each(|c| *c = ' ');
            }
            g.col = 0;
            g.wrap = false;
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn ds(name: &str, done: u64, tokens: u64, state: DatasetPhase) -> DatasetBar<'_> {
        DatasetBar {
            name,
            done,
            total: 100,
            failed: 0,
            tokens,
            budget: Some(10_000),
            tok_per_s: 1234.0,
            eta_s: Some(125.0),
            state,
        }
    }

    fn run() -> RunLine {
        RunLine {
            done: 30,
            total: 200,
            tokens: 3000,
            tok_per_s: 1234.0,
            eta_s: Some(600.0),
            servers_up: 1,
            servers: 2,
            limits: Vec::new(),
            elapsed_s: 65.0,
        }
    }

    /// A running dataset's bar shows its rate and ETA; a finished one shows its state by
    /// the name `spool status` uses.
    #[test]
    fn messages_show_items_tokens_rate_and_eta() {
        assert_eq!(
            dataset_message(&ds("math", 12, 2500, DatasetPhase::Running)),
            "12/100 items · 2500/10.0k tok · 1.2k tok/s · ETA 2m05s"
        );
        assert_eq!(
            dataset_message(&ds("math", 100, 9000, DatasetPhase::Done)),
            "100/100 items · 9000/10.0k tok · done"
        );
        assert_eq!(
            dataset_message(&ds("math", 40, 10_100, DatasetPhase::BudgetMet)),
            "40/100 items · 10.1k/10.0k tok · budget_met"
        );
        assert_eq!(
            run_message(&run()),
            "run 1m05s · 30/200 items · 3000 tok · 1.2k tok/s · servers 1/2 up · ETA 10m00s"
        );
    }

    /// A bar's fill is the further along of items done and tokens against the budget, and
    /// full once the dataset is finished.
    #[test]
    fn fraction_is_the_further_of_items_and_budget() {
        assert_eq!(fraction(&ds("a", 10, 5_000, DatasetPhase::Running)), 0.5);
        assert_eq!(fraction(&ds("a", 60, 5_000, DatasetPhase::Running)), 0.6);
        assert_eq!(fraction(&ds("a", 1, 50_000, DatasetPhase::Running)), 1.0);
        assert_eq!(fraction(&ds("a", 1, 1, DatasetPhase::BudgetMet)), 1.0);
        let mut nb = ds("a", 25, 5_000, DatasetPhase::Running);
        nb.budget = None;
        assert_eq!(fraction(&nb), 0.25);
    }

    /// Log lines written while bars are drawn land above the bars, whole, and never share a
    /// screen line with one; after `finish` nothing more is drawn.
    #[test]
    fn log_lines_go_above_the_bars_never_into_them() {
        let screen = Screen::default();
        let bars = Bars::new(ProgressDrawTarget::term_like_with_hz(
            Box::new(screen.clone()),
            200,
        ));
        bars.update(&[ds("alpha", 10, 1000, DatasetPhase::Running)], &run());
        bars.update(
            &[
                ds("alpha", 20, 2000, DatasetPhase::Running),
                ds("longer_name", 1, 10, DatasetPhase::Running),
            ],
            &run(),
        );
        bars.suspend(|| screen.put("LOG first line", true));
        bars.update(&[ds("alpha", 30, 3000, DatasetPhase::Running)], &run());
        bars.suspend(|| screen.put("LOG second line", true));
        bars.finish();
        let text = screen.text();
        assert_eq!(text.len(), 5, "{text:#?}");
        assert_eq!(text[0], "LOG first line");
        assert_eq!(text[1], "LOG second line");
        assert!(text[2].starts_with("alpha       ["), "{text:#?}");
        assert!(
            text[2].ends_with("]  30% 30/100 items · 3000/10.0k tok · 1.2k tok/s · ETA 2m05s"),
            "{text:#?}"
        );
        assert!(text[3].starts_with("longer_name ["), "{text:#?}");
        assert!(text[4].starts_with("run 1m05s · 30/200 items"), "{text:#?}");
        // Finished: nothing more is drawn, and suspend still writes.
        bars.update(&[ds("alpha", 99, 3000, DatasetPhase::Running)], &run());
        bars.suspend(|| screen.put("LOG after", true));
        assert!(screen.text().iter().all(|l| !l.contains("99/100")));
    }
}
