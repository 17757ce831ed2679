//! SVG plot of one or more runs: throughput (top) and p90/p99 latency (bottom) against seconds;
//! with the servers' per-worker load (`mbal load`) a panel per run of requests/s per worker with
//! the balancer's moves marked (the runs overlaid above, their workers one panel each below). A `--rate-sweep` report is drawn as throughput and p99 against
//! the offered rate instead.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::BenchReport;

/// Runs whose per-worker load gets a panel of its own.
const MAX_WORKER_PANELS: usize = 4;

/// Draw `reports` (label, report) into an SVG at `out`: two stacked panels sharing x = seconds;
/// top: ops/s, bottom: p99 (solid) and p90 (thin) latency in µs, one colour per run.
pub fn plot(reports: &[(String, BenchReport)], out: &Path) -> Result<()> {
    if reports.is_empty() {
        return Err(anyhow!("nothing to plot"));
    }
    if reports.iter().all(|(_, r)| r.sweep.is_some()) {
        return plot_sweep(reports, out);
    }
    // A per-worker panel for each run that has the servers' load (at most MAX_WORKER_PANELS:
    // e.g. the balancer off and on of the main job, one above the other).
    let workers: Vec<(&String, &crate::ServerLoad)> = reports
        .iter()
        .filter_map(|(label, r)| r.server_load.as_ref().filter(|l| !l.epochs.is_empty()).map(|l| (label, l)))
        .take(MAX_WORKER_PANELS)
        .collect();
    let height = 700 + 350 * workers.len() as u32;
    let root = SVGBackend::new(out, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let (top, rest) = root.split_vertically(350);
    let (bottom, mut rest) = rest.split_vertically(350);
    for (label, load) in &workers {
        let (panel, below) = rest.split_vertically(350);
        plot_workers(label, load, &panel)?;
        rest = below;
    }
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

/// Requests/s per worker, from the servers' epochs (one line per worker), moves as vertical
/// lines labelled with the cachelet.
fn plot_workers<DB: DrawingBackend>(
    label: &str,
    load: &crate::ServerLoad,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let mut series: std::collections::BTreeMap<(u16, u16), Vec<(f64, f64)>> = Default::default();
    for e in &load.epochs {
        for w in &e.workers {
            series.entry((w.server, w.worker)).or_default().push((e.t_end, w.ops_per_sec));
        }
    }
    let max_t = load.epochs.iter().map(|e| e.t_end).fold(1.0f64, f64::max);
    let max_y = load.epochs.iter().flat_map(|e| e.workers.iter().map(|w| w.ops_per_sec)).fold(1.0f64, f64::max);
    let mut c = ChartBuilder::on(area)
        .caption(
            format!("{label}: requests/s per worker (servers' epochs), moves marked; max/avg {:.2}", load.max_over_avg),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_t * 1.02, 0f64..max_y * 1.15)
        .map_err(|e| anyhow!("{e:?}"))?;
    c.configure_mesh()
        .x_desc("seconds")
        .y_desc("req/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    // Moves in red, labelled with the cachelet (several at one time stack downwards); the
    // balancer's requests for Phase 3 in blue.
    let mut stacked: Vec<(f64, usize)> = Vec::new();
    for ev in &load.events {
        let (color, text) = match ev.kind.as_str() {
            "move" => (RED, format!("c{} w{}>w{}", ev.cachelet, ev.from_worker, ev.to_worker)),
            "escalate" => (BLUE, format!("Phase 3 wanted ({})", ev.why)),
            _ => continue,
        };
        let n = match stacked.iter_mut().find(|s| (s.0 - ev.t).abs() < 1e-6) {
            Some(s) => {
                s.1 += 1;
                s.1
            }
            None => {
                stacked.push((ev.t, 0));
                0
            }
        };
        c.draw_series(LineSeries::new(vec![(ev.t, 0.0), (ev.t, max_y * 1.15)], color.mix(0.5).stroke_width(1)))
            .map_err(|e| anyhow!("{e:?}"))?;
        c.draw_series(std::iter::once(Text::new(
            text,
            (ev.t, max_y * (1.1 - 0.05 * n as f64)),
            ("sans-serif", 11).into_font().color(&color),
        )))
        .map_err(|e| anyhow!("{e:?}"))?;
    }
    for (i, ((s, w), pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(format!("s{s}/w{w}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}

/// Sweep reports: achieved throughput (top) and p99 (bottom, log scale) against the offered
/// rate, one line per report; the p99 target as a dashed line.
fn plot_sweep(reports: &[(String, BenchReport)], out: &Path) -> Result<()> {
    let root = SVGBackend::new(out, (1000, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e:?}"))?;
    let (top, bottom) = root.split_vertically(350);
    let steps = |r: &BenchReport| r.sweep.as_ref().map(|s| s.steps.clone()).unwrap_or_default();
    let max_x = reports.iter().flat_map(|(_, r)| steps(r)).map(|s| s.offered_ops_per_sec).fold(1.0f64, f64::max);
    let max_y = reports.iter().flat_map(|(_, r)| steps(r)).map(|s| s.ops_per_sec).fold(1.0f64, f64::max).max(max_x);
    let lat: Vec<f64> = reports.iter().flat_map(|(_, r)| steps(r)).map(|s| s.p99_us).filter(|v| *v > 0.0).collect();
    let target = reports.iter().find_map(|(_, r)| r.sweep.as_ref().and_then(|s| s.p99_target_us));
    let min_lat = lat.iter().copied().fold(f64::MAX, f64::min).min(target.unwrap_or(f64::MAX)).clamp(1.0, 1e9);
    let max_lat = lat.iter().copied().fold(1.0, f64::max).max(target.unwrap_or(1.0)).max(min_lat * 2.0);

    let mut c = ChartBuilder::on(&top)
        .caption("throughput against offered load", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_x * 1.05, 0f64..max_y * 1.1)
        .map_err(|e| anyhow!("{e:?}"))?;
    c.configure_mesh()
        .x_desc("offered ops/s")
        .y_desc("ops/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    c.draw_series(LineSeries::new(vec![(0.0, 0.0), (max_x, max_x)], BLACK.mix(0.3).stroke_width(1)))
        .map_err(|e| anyhow!("{e:?}"))?;
    for (i, (label, r)) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = steps(r).iter().map(|s| (s.offered_ops_per_sec, s.ops_per_sec)).collect();
        c.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|e| anyhow!("{e:?}"))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;

    let mut c = ChartBuilder::on(&bottom)
        .caption("p99 latency against offered load, log scale", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_x * 1.05, (min_lat * 0.8..max_lat * 1.25).log_scale())
        .map_err(|e| anyhow!("{e:?}"))?;
    c.configure_mesh()
        .x_desc("offered ops/s")
        .y_desc("µs")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    if let Some(t) = target {
        c.draw_series(LineSeries::new(vec![(0.0, t), (max_x * 1.05, t)], RED.mix(0.6).stroke_width(1)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(format!("p99 target {t:.0} µs"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.mix(0.6).stroke_width(1)));
    }
    for (i, (label, r)) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> =
            steps(r).iter().filter(|s| s.p99_us > 0.0).map(|s| (s.offered_ops_per_sec, s.p99_us)).collect();
        c.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow!("{e:?}"))?
            .label(format!("{label} p99"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|e| anyhow!("{e:?}"))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}
