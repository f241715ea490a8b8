//! `weightstream place`: a model written across drives (mirror, split, layers) behind a layout index.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use weightstream::__internal::escape;
use weightstream::__internal::place::Step;
use weightstream::place::{self, LayoutKind, PlaceConfig};

use crate::commands::CliResult;

/// Test-only: `kill -9` of the command at this step of the commit protocol
/// (the crash tests); in the library's one table of variables.
const PLACE_FAULT: &str = weightstream::__internal::env::PLACE_FAULT;

pub(crate) fn place(
    src: PathBuf,
    roots: Vec<PathBuf>,
    layout: LayoutKind,
    digest: bool,
    allow_source_volume: bool,
    json: bool,
) -> CliResult {
    let show = !json && std::io::stderr().is_terminal();
    let mut cfg = PlaceConfig::new(&src, roots, layout)
        .digest(digest)
        .allow_source_volume(allow_source_volume)
        .on_progress(move |p| {
            if show {
                eprint!(
                    "\rplacing: {:.3}/{:.3} GB, {}/{} file(s), {:.3} GB/s   ",
                    p.bytes as f64 / 1e9,
                    p.bytes_total as f64 / 1e9,
                    p.files,
                    p.files_total,
                    p.bytes as f64 / 1e9 / p.elapsed.as_secs_f64().max(1e-9)
                );
                if p.files == p.files_total {
                    eprint!("\r{}\r", " ".repeat(72));
                }
            }
        });
    if let Some(at) = weightstream::__internal::env::get(PLACE_FAULT) {
        let at: Step = at.parse()?;
        cfg = cfg.fault_hook(move |step| {
            if *step == at {
                let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
            }
            false
        });
    }
    let r = place::place(&cfg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    for why in &r.repaired {
        writeln!(out, "repaired: {why}")?;
    }
    if r.no_op {
        writeln!(
            out,
            "{}: nothing to do: {} file(s) of the {} layout proven identical (size, header sha256{}), index unchanged",
            escape(&r.source),
            r.files_reused,
            r.layout,
            if digest { ", tensor sha256" } else { "" }
        )?;
    } else {
        writeln!(
            out,
            "placed {} as {} over {} root(s): wrote {} file(s), {:.3} GB in {:.2}s ({:.3} GB/s), kept {} file(s) \
             proven identical; {} extra file(s) written; page cache {:+.1} MB",
            escape(&r.source),
            r.layout,
            r.roots.len(),
            r.files_written,
            r.bytes_written as f64 / 1e9,
            r.write_seconds,
            r.write_gbps,
            r.files_reused,
            r.extras_written,
            r.cache_growth_bytes as f64 / 1e6
        )?;
    }
    for (k, root) in r.roots.iter().enumerate() {
        writeln!(
            out,
            "  root {k} {}: {} file(s), {:.3} GB ({} written){}",
            escape(&root.folder),
            root.files,
            root.bytes as f64 / 1e9,
            root.written,
            if k == 0 { "; primary: index, config" } else { "" }
        )?;
    }
    for d in &r.deleted {
        writeln!(out, "deleted stale copy {} ({} bytes)", escape(&d.path), d.size)?;
    }
    for o in &r.orphans {
        writeln!(
            out,
            "orphan {} ({} bytes): no index names it; not deleted",
            escape(&o.path),
            o.size
        )?;
    }
    for n in &r.notes {
        writeln!(out, "note: {n}")?;
    }
    for w in &r.warnings {
        writeln!(out, "warning: {w}")?;
    }
    writeln!(out, "open the placed model at: {}", escape(&r.primary))?;
    Ok(())
}
