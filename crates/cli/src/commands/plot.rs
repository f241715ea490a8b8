//! `weightstream plot`: a chart for a benchmark record from a JSON spec.

use std::path::PathBuf;

use crate::commands::CliResult;
use crate::plot;

/// The largest chart spec read.
const MAX_SPEC_LEN: u64 = 16 << 20;

pub(crate) fn plot(spec: PathBuf, out: PathBuf) -> CliResult {
    let bytes = crate::args::read_bounded(&spec, MAX_SPEC_LEN, "the chart spec")?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: not a JSON chart spec: {e}", spec.display()))?;
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
    let svg = if let Some(series) = v.get("series").and_then(|s| s.as_array()) {
        let series: Vec<(String, Vec<(f64, f64)>)> = series
            .iter()
            .map(|s| {
                let name = s.get("name").and_then(|n| n.as_str()).unwrap_or("").to_string();
                let pts = s
                    .get("points")
                    .and_then(|p| p.as_array())
                    .map(|a| {
                        a.iter()
                            .filter_map(|p| Some((p.get(0)?.as_f64()?, p.get(1)?.as_f64()?)))
                            .collect()
                    })
                    .unwrap_or_default();
                (name, pts)
            })
            .collect();
        plot::lines_svg(&text("title"), &text("xlabel"), &text("ylabel"), &series)
    } else if let Some(bars) = v.get("bars").and_then(|b| b.as_array()) {
        let bars: Vec<(String, f64)> = bars
            .iter()
            .filter_map(|b| Some((b.get(0)?.as_str()?.to_string(), b.get(1)?.as_f64()?)))
            .collect();
        let reference = v.get("reference").and_then(|r| r.as_f64());
        plot::bars_svg(&text("title"), &text("unit"), &bars, reference)
    } else {
        return Err(format!("{}: expected \"series\" or \"bars\"", spec.display()).into());
    };
    std::fs::write(&out, svg)
        .map_err(|e| format!("{}: write the chart: {e}", weightstream::__internal::escape(&out)))?;
    Ok(())
}
