//! Histograms drawn as SVG (plotters' SVG backend), for the `report` page and the `hf`
//! card: a picture a browser, GitHub and the HuggingFace Hub show as they are.
//!
//! Invariant: a chart shows exactly the bars it is given, one rectangle per bar with a
//! count, left to right in order, each bar's left edge labelled with its first value.

use super::stats::Bucket;
use crate::output::export::error::{ExportError, Result};
use plotters::prelude::*;

/// Width and height of every chart, in pixels.
pub const SIZE: (u32, u32) = (640, 300);

/// An SVG bar chart of `bars` (a histogram), titled `title`, the x axis named `x_desc` and
/// the y axis `y_desc`. Bars of one value each are labelled at their centre; bars of a
/// range stand side by side on a value axis whose labels are the ranges' edges.
pub fn histogram_svg(title: &str, x_desc: &str, y_desc: &str, bars: &[Bucket]) -> Result<String> {
    let err =
        |e: &dyn std::fmt::Display| ExportError::broken(format!("cannot draw `{title}`: {e}"));
    let single = bars.iter().all(|b| b.lo == b.hi);
    let n = bars.len().max(1) as f64;
    // Bar i spans [left(i), left(i) + 1) on the x axis.
    let (x0, x1, left) = if single {
        (-0.5, n - 0.5, -0.5)
    } else {
        (0.0, n, 0.0)
    };
    let top = bars.iter().map(|b| b.count).max().unwrap_or(0);
    let end = bars.last().map_or(1, |b| b.hi + 1);
    let label = |x: &f64| {
        if x.fract() != 0.0 || *x < 0.0 {
            return String::new();
        }
        let i = *x as usize;
        match bars.get(i) {
            Some(b) => b.lo.to_string(),
            None if !single && i == bars.len() => end.to_string(),
            None => String::new(),
        }
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, 0u64..top + top / 10 + 1)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(bars.len().clamp(2, 12) + 1)
            .x_label_formatter(&label)
            .x_desc(x_desc)
            .y_desc(y_desc)
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(
                bars.iter()
                    .enumerate()
                    .filter(|(_, b)| b.count > 0)
                    .map(|(i, b)| {
                        let x = left + i as f64;
                        Rectangle::new(
                            [(x + 0.04, 0), (x + 0.96, b.count)],
                            BLUE.mix(0.65).filled(),
                        )
                    }),
            )
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SVG is one document with a rectangle per non-empty bar (besides the
    /// background), its title and axis names as text.
    #[test]
    fn a_histogram_is_an_svg_with_its_bars() {
        let bars = [
            Bucket {
                lo: 0,
                hi: 49,
                count: 3,
            },
            Bucket {
                lo: 50,
                hi: 99,
                count: 0,
            },
            Bucket {
                lo: 100,
                hi: 149,
                count: 7,
            },
        ];
        let svg = histogram_svg("Completion length", "tokens", "rows", &bars).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{svg}"
        );
        for t in ["Completion length", "tokens", "rows", "\n100\n"] {
            assert!(svg.contains(t), "{t}: {svg}");
        }
        let blue = svg.matches("fill=\"#0000FF\"").count();
        assert_eq!(blue, 2, "{svg}");
    }
}
