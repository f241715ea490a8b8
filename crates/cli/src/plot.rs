//! SVG charts of the benchmark records, drawn with plotters (SVG backend
//! only: no font or graphics stack; text is left to the SVG viewer).

use plotters::prelude::*;

/// Colours of the line series, in order.
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The top of the y axis: the largest value (or the reference) plus 10%.
fn top_of(values: impl Iterator<Item = f64>) -> f64 {
    let top = values.filter(|v| v.is_finite()).fold(0.0f64, f64::max);
    if top > 0.0 {
        top * 1.1
    } else {
        1.0
    }
}

/// A bar chart of `(label, value)`, with an optional dashed reference line
/// (the ceiling). An error drawing (none is expected into a string) leaves
/// what was drawn.
pub fn bars_svg(title: &str, unit: &str, bars: &[(String, f64)], reference: Option<f64>) -> String {
    let mut out = String::new();
    let width = (160 + 90 * bars.len().max(1)) as u32;
    {
        let root = SVGBackend::with_string(&mut out, (width, 400)).into_drawing_area();
        let _ = draw_bars(&root, title, unit, bars, reference);
        let _ = root.present();
    }
    out
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    bars: &[(String, f64)],
    reference: Option<f64>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let n = bars.len().max(1);
    let top = top_of(bars.iter().map(|b| b.1).chain(reference));
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 14))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0..n).into_segmented(), 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .y_desc(unit)
        .x_labels(n)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => bars.get(*i).map_or(String::new(), |b| b.0.clone()),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(
        Histogram::vertical(&chart)
            .style(PALETTE[0].filled())
            .margin(12)
            .data(bars.iter().enumerate().map(|(i, b)| (i, b.1))),
    )?;
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        Text::new(
            format!("{:.2}", b.1),
            (SegmentValue::CenterOf(i), b.1),
            ("sans-serif", 11).into_font().color(&BLACK),
        )
    }))?;
    if let Some(r) = reference {
        chart
            .draw_series(DashedLineSeries::new(
                [(SegmentValue::Exact(0), r), (SegmentValue::Exact(n), r)],
                6,
                4,
                RED.stroke_width(1),
            ))?
            .label(format!("reference {r:.2}"));
    }
    Ok(())
}

/// Line series `(name, [(x, y)])` with a legend.
pub fn lines_svg(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)]) -> String {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (720, 420)).into_drawing_area();
        let _ = draw_lines(&root, title, xlabel, ylabel, series);
        let _ = root.present();
    }
    out
}

fn draw_lines<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let points = || series.iter().flat_map(|s| s.1.iter().copied());
    let (x0, x1) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (x0, x1) = if x0 < x1 { (x0, x1) } else { (0.0, 1.0) };
    let top = top_of(points().map(|p| p.1));
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 14))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, 0.0..top)?;
    chart.configure_mesh().x_desc(xlabel).y_desc(ylabel).draw()?;
    for (k, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[k % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)).point_size(3))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    if series.iter().any(|s| !s.0.is_empty()) {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_name_every_arm_and_the_reference() {
        let svg = bars_svg(
            "engine <& ceiling",
            "GB/s",
            &[("ceiling".into(), 3.5), ("engine".into(), 3.2)],
            Some(3.5),
        );
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(
            svg.contains("ceiling") && svg.contains("engine") && svg.contains("3.20"),
            "{svg}"
        );
        assert!(svg.contains("&lt;&amp;"), "the title is escaped: {svg}");
    }

    #[test]
    fn lines_draw_each_series_and_survive_empty_input() {
        let svg = lines_svg(
            "drives",
            "drives",
            "GB/s",
            &[
                ("engine".into(), vec![(1.0, 1.0), (2.0, 1.9)]),
                ("ceiling".into(), vec![(1.0, 1.1), (2.0, 2.0)]),
            ],
        );
        assert!(
            svg.contains("engine") && svg.contains("ceiling") && svg.contains("polyline"),
            "{svg}"
        );
        assert!(lines_svg("t", "x", "y", &[]).starts_with("<svg"));
        assert!(bars_svg("t", "u", &[], None).starts_with("<svg"));
    }
}
