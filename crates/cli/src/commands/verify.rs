//! `weightstream verify`: a placed model against its layout index, then every copy re-checked; exit 0 nothing changed, 1 changed, 2 the check could not run.

use std::io::Write;
use std::path::Path;

use weightstream::__internal::escape;
use weightstream::Model;

use crate::cli::LayoutArgs;

/// The largest `--against` record read (a `verify --json --digest` report
/// of a model of a million tensors is about 200 MB).
pub(crate) const MAX_RECORD_LEN: u64 = 256 << 20;

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
            let text = crate::args::read_bounded(p, MAX_RECORD_LEN, "the --against record")?;
            Some(
                serde_json::from_slice(&text)
                    .map_err(|e| format!("{}: not a `weightstream verify --json` report: {e}", escape(p)))?,
            )
        }
        None => None,
    };
    let config = layout.config(dir, None)?;
    // A placed model (a folder, not one file of it): every file against
    // its layout index first.
    let placed = if config.only.is_empty() {
        weightstream::place::verify(&config.primary, digest)?
    } else {
        None
    };
    if let Some(p) = placed.as_ref().filter(|p| !p.is_clean()) {
        if json {
            println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "placed": p }))?);
        } else {
            print_placed_verify(p)?;
        }
        return Ok(false);
    }
    let model = Model::open(config)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let mut report = model.verify(digest)?;
    if let Some(e) = &earlier {
        report.compare_with(e);
    }
    let clean = report.is_clean();
    if json {
        match &placed {
            Some(p) => println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "placed": p, "model": report }))?
            ),
            None => println!("{}", serde_json::to_string_pretty(&report)?),
        }
        return Ok(clean);
    }
    if let Some(p) = &placed {
        print_placed_verify(p)?;
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

/// The placed-model half of `verify`: each file that differs from the
/// layout index, the orphans, one summary line.
fn print_placed_verify(p: &weightstream::place::PlacedVerify) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    for why in &p.problems {
        writeln!(out, "PLACEMENT {}: {why}", escape(&p.dir))?;
    }
    for f in p.files.iter().filter(|f| !f.problems.is_empty()) {
        writeln!(out, "DIFFERS {f}")?;
    }
    for o in &p.orphans {
        writeln!(
            out,
            "ORPHAN {} ({} bytes): no layout index names it (weightstream never deletes it)",
            escape(&o.path),
            o.size
        )?;
    }
    let bad = p.files.iter().filter(|f| !f.problems.is_empty()).count();
    writeln!(
        out,
        "{}: placed model ({}, {} root(s)): {} file(s) checked against the layout index{}: {}",
        escape(&p.dir),
        p.layout.map_or("?", |l| l.name()),
        p.roots,
        p.files.len(),
        if p.digest {
            format!(
                ", {} tensor digest(s)",
                p.files.iter().map(|f| f.tensors).sum::<usize>()
            )
        } else {
            String::new()
        },
        if p.is_clean() {
            "as the index says".to_string()
        } else {
            format!("{bad} differ")
        }
    )
}
