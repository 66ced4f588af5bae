//! How figures are written for a person: durations (`2h41m`), large counts (`1.2M`) and
//! grouped thousands (`10,000`), shared by the status table, the progress lines, the bars
//! and the resume line so one quantity reads the same everywhere.
//!
//! Invariant: every function is total — any input, including a non-finite duration, gives
//! a printable string.

/// Formats seconds as `2h41m`, `3m05s`, `12s`; `?` when not finite (an ETA that cannot be
/// computed is shown, not hidden).
pub fn format_duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "?".into();
    }
    let s = secs.max(0.0).round() as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// 1234567 → "1.2M", 12345 → "12.3k": short enough for a table column.
pub fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}G", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 10_000 => format!("{:.1}k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// 10_000 → "10,000": exact, for the resume line where every item counts.
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

    /// Counts are grouped by thousands exactly, and shortened with one decimal.
    #[test]
    fn numbers_format() {
        assert_eq!(grouped(9_998_988), "9,998,988");
        assert_eq!(grouped(12), "12");
        assert_eq!(human(1_234_567), "1.2M");
    }

    /// Durations show the two largest units, zero-padded, and seconds alone under a minute.
    #[test]
    fn durations_format() {
        assert_eq!(format_duration(9660.0), "2h41m");
        assert_eq!(format_duration(185.0), "3m05s");
        assert_eq!(format_duration(12.4), "12s");
    }
}
