//! SVG plots of a run (plotters' SVG backend): latency distributions as cumulative curves,
//! throughput against workers, and the cost curve.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

const COLORS: [RGBColor; 5] = [BLUE, RED, GREEN, MAGENTA, BLACK];

/// One named series of points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// The empirical cumulative distribution of `samples` (x: value, y: fraction at or below).
    pub fn cdf(name: &str, samples: &[f64]) -> Series {
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len() as f64;
        let points = s.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect();
        Series { name: name.to_owned(), points }
    }
}

/// A line chart of `series` into `path`; `log_x` for values spanning decades.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
) -> Result<()> {
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    if all.is_empty() {
        return Ok(());
    }
    let floor = floor_of(&all);
    let clamped;
    let series = if log_x {
        clamped = clamp_to_floor(series, floor);
        &clamped[..]
    } else {
        series
    };
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    let fold =
        |f: fn(f64, f64) -> f64, init: f64, sel: fn(&(f64, f64)) -> f64| all.iter().map(sel).fold(init, f);
    let (x0, x1) = (fold(f64::min, f64::INFINITY, |p| p.0), fold(f64::max, f64::NEG_INFINITY, |p| p.0));
    let y1 = fold(f64::max, f64::NEG_INFINITY, |p| p.1);
    let y1 = if y1 <= 0.0 { 1.0 } else { y1 * 1.05 };
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("plotting {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.caption(title, ("sans-serif", 18)).margin(12).x_label_area_size(40).y_label_area_size(60);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    if log_x {
        let lo = x0.min(floor);
        draw!(builder.build_cartesian_2d((lo..x1 * 1.1).log_scale(), 0.0..y1).map_err(|e| err(&e))?);
    } else {
        let lo = x0.min(0.0);
        let hi = if x1 > lo { x1 * 1.05 } else { lo + 1.0 };
        draw!(builder.build_cartesian_2d(lo..hi, 0.0..y1).map_err(|e| err(&e))?);
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Where a log axis starts: a little below the smallest positive x. A log axis cannot show
/// zero or negative values (a handover measured from two processes' clocks can come out a hair
/// below zero): they are drawn at the axis' left end.
fn floor_of(points: &[(f64, f64)]) -> f64 {
    let floor = points.iter().map(|p| p.0).filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
    if floor.is_finite() { floor * 0.9 } else { 0.1 }
}

/// `series` with every x below `floor` raised to it.
fn clamp_to_floor(series: &[Series], floor: f64) -> Vec<Series> {
    series
        .iter()
        .map(|s| Series {
            name: s.name.clone(),
            points: s.points.iter().map(|&(x, y)| (x.max(floor), y)).collect(),
        })
        .collect()
}
