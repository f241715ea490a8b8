//! `weightstream verify`: every copy re-checked; exit 0 nothing changed, 1 changed, 2 the check could not run.

use std::io::Write;
use std::path::Path;

use weightstream::{escape, Model};

use crate::cli::LayoutArgs;

/// `weightstream verify`: Ok(true) when nothing changed.
pub(crate) fn verify(
    dir: &Path,
    digest: bool,
    against: Option<&Path>,
    layout: &LayoutArgs,
    json: bool,
) -> Result<bool, Box<dyn std::error::Error>> {
    let earlier: Option<weightstream::VerifyReport> = match against {
        Some(p) => {
            let text = std::fs::read(p).map_err(|e| format!("{}: read the record: {e}", escape(p)))?;
            Some(
                serde_json::from_slice(&text)
                    .map_err(|e| format!("{}: not a `weightstream verify --json` report: {e}", escape(p)))?,
            )
        }
        None => None,
    };
    let model = Model::open(layout.config(dir, None)?)?;
    let mut report = model.verify(digest)?;
    if let Some(e) = &earlier {
        report.compare_with(e);
    }
    let clean = report.is_clean();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(clean);
    }
    let mut out = std::io::stdout().lock();
    for f in report.changed() {
        let what: Vec<String> = f.changes.iter().map(ToString::to_string).collect();
        writeln!(out, "CHANGED {} (copy rank {}): {}", f.path, f.rank, what.join("; "))?;
    }
    let digests: usize = report.files.iter().map(|f| f.tensors.len()).sum();
    let changed = report.changed().count();
    writeln!(
        out,
        "{}: {} file(s) checked{}{}: {}",
        escape(dir),
        report.files.len(),
        if digest {
            format!(", {digests} tensor digest(s)")
        } else {
            String::new()
        },
        match against {
            Some(p) => format!(", against {}", escape(p)),
            None => String::new(),
        },
        if clean {
            "nothing changed".to_string()
        } else {
            format!("{changed} changed")
        }
    )?;
    Ok(clean)
}
