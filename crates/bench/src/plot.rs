//! SVG plot of one or more runs: throughput (top) and p90/p99 latency (bottom) against seconds.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::BenchReport;

/// Draw `reports` (label, report) into an SVG at `out`: two stacked panels sharing x = seconds;
/// top: ops/s, bottom: p99 (solid) and p90 (thin) latency in µs, one colour per run.
pub fn plot(reports: &[(String, BenchReport)], out: &Path) -> Result<()> {
    if reports.is_empty() {
        return Err(anyhow!("nothing to plot"));
    }
    let root = SVGBackend::new(out, (1000, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let (top, bottom) = root.split_vertically(350);
    let max_t = reports.iter().map(|(_, r)| r.timeline.len()).max().unwrap_or(1).max(1) as f64;
    let max_ops = reports.iter().flat_map(|(_, r)| r.timeline.iter().map(|s| s.ops_per_sec)).fold(1.0f64, f64::max);
    let min_lat = reports
        .iter()
        .flat_map(|(_, r)| r.timeline.iter().map(|s| s.p90_us))
        .filter(|v| *v > 0.0)
        .fold(f64::MAX, f64::min)
        .clamp(1.0, 1e9);
    let max_lat =
        reports.iter().flat_map(|(_, r)| r.timeline.iter().map(|s| s.p99_us)).fold(1.0f64, f64::max).max(min_lat * 2.0);

    let mut c = ChartBuilder::on(&top)
        .caption("throughput", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_t, 0f64..max_ops * 1.1)
        .map_err(|e| anyhow!("{e:?}"))?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("ops/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    // phase boundaries of the first run, labelled
    let phases = &reports[0].1.phases;
    if phases.len() > 1 {
        let mut at = 0.0;
        for p in phases {
            c.draw_series(std::iter::once(Text::new(
                p.workload.name().to_string(),
                (at + 0.1, max_ops * 1.05),
                ("sans-serif", 14).into_font().color(&BLACK.mix(0.7)),
            )))
            .map_err(|e| anyhow!("{e:?}"))?;
            if at > 0.0 {
                c.draw_series(LineSeries::new(vec![(at, 0.0), (at, max_ops * 1.1)], BLACK.mix(0.4).stroke_width(1)))
                    .map_err(|e| anyhow!("{e:?}"))?;
            }
            at += p.secs;
        }
    }
    for (i, (label, r)) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(
            r.timeline.iter().map(|s| (s.t as f64 + 0.5, s.ops_per_sec)),
            color.stroke_width(2),
        ))
        .map_err(|e| anyhow!("{e:?}"))?
        .label(label.clone())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;

    let mut c = ChartBuilder::on(&bottom)
        .caption("latency p99 (thick) / p90 (thin), log scale", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_t, (min_lat * 0.8..max_lat * 1.25).log_scale())
        .map_err(|e| anyhow!("{e:?}"))?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("µs")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    for (i, (label, r)) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(r.timeline.iter().map(|s| (s.t as f64 + 0.5, s.p99_us)), color.stroke_width(2)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(format!("{label} p99"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(LineSeries::new(
            r.timeline.iter().map(|s| (s.t as f64 + 0.5, s.p90_us)),
            color.mix(0.6).stroke_width(1),
        ))
        .map_err(|e| anyhow!("{e:?}"))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}
