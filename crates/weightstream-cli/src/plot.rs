//! Plain SVG charts for the benchmark records: no font or graphics stack
//! needed, so the bench can always draw its own figure.

use std::fmt::Write;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The frame both charts share: white background, title, four horizontal
/// grid lines labelled from 0 to `top`, and the rotated y label.
#[allow(clippy::too_many_arguments)]
fn frame(
    s: &mut String,
    w: f64,
    h: f64,
    left: f64,
    right_edge: f64,
    title: &str,
    title_x: f64,
    ylabel: &str,
    top: f64,
    y: impl Fn(f64) -> f64,
) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{title_x}" y="20" text-anchor="middle" font-size="13">{}</text>"#,
        esc(title)
    );
    for k in 0..=4 {
        let v = top * k as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{right_edge}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/>"##,
            y(v),
            y(v)
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.2}</text>"#,
            left - 5.0,
            y(v) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{}</text>"#,
        h / 2.0,
        h / 2.0,
        esc(ylabel)
    );
}

/// A bar chart of `(label, value)`, with an optional dashed reference line
/// (the ceiling).
pub fn bars_svg(title: &str, unit: &str, bars: &[(String, f64)], reference: Option<f64>) -> String {
    let (w, h, left, bottom, top) = (640.0, 360.0, 60.0, 40.0, 40.0);
    let max = bars
        .iter()
        .map(|b| b.1)
        .chain(reference)
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let plot_h = h - bottom - top;
    let y = |v: f64| top + plot_h * (1.0 - v / max);
    let mut s = String::new();
    frame(&mut s, w, h, left, w - 10.0, title, w / 2.0, unit, max / 1.15, y);
    let n = bars.len().max(1) as f64;
    let slot = (w - left - 10.0) / n;
    for (i, (label, v)) in bars.iter().enumerate() {
        let x = left + slot * i as f64 + slot * 0.15;
        let _ = writeln!(
            s,
            r##"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#4878a8"/>"##,
            y(*v),
            slot * 0.7,
            (h - bottom - y(*v)).max(0.0)
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{v:.2}</text>"#,
            x + slot * 0.35,
            y(*v) - 4.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x + slot * 0.35,
            h - bottom + 16.0,
            esc(label)
        );
    }
    if let Some(r) = reference {
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#c03030" stroke-dasharray="6 4"/>"##,
            w - 10.0,
            y(r),
            y(r)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A line chart of measured points against an ideal line, e.g. GB/s against
/// number of drives: `series` are (name, points).
pub fn lines_svg(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)]) -> String {
    let (w, h, left, bottom, top, right) = (640.0, 360.0, 60.0, 45.0, 40.0, 130.0);
    let pts = series.iter().flat_map(|s| s.1.iter());
    let xmax = pts.clone().map(|p| p.0).fold(0.0f64, f64::max).max(1e-9);
    let ymax = pts.map(|p| p.1).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let x = |v: f64| left + (w - left - right) * v / xmax;
    let y = |v: f64| top + (h - top - bottom) * (1.0 - v / ymax);
    let colors = ["#4878a8", "#c03030", "#30a050", "#a07020", "#8050a0"];
    let mut s = String::new();
    frame(
        &mut s,
        w,
        h,
        left,
        w - right,
        title,
        (w - right) / 2.0,
        ylabel,
        ymax / 1.1,
        y,
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (w - right + left) / 2.0,
        h - 8.0,
        esc(xlabel)
    );

    for (i, (name, points)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> = points.iter().map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1))).collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for p in points {
            let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, x(p.0), y(p.1));
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                x(p.0),
                h - bottom + 15.0,
                p.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{c}">{}</text>"#,
            w - right + 10.0,
            top + 16.0 * i as f64 + 10.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}
