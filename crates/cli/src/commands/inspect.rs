//! `weightstream inspect`: shards, tensors, a placed model's layout, and per file and drive what the kernel and the topology say.

use std::io::Write;
use std::path::PathBuf;

use weightstream::__internal::escape;
use weightstream::{Engine, EngineConfig, Model};

use crate::cli::{LayoutArgs, OnOff};
use crate::commands::CliResult;

pub(crate) fn inspect(dir: PathBuf, layout: &LayoutArgs, numa: Option<OnOff>, json: bool) -> CliResult {
    let config = layout.config(&dir, None)?;
    let (primary, one_file) = (config.primary.clone(), !config.only.is_empty());
    let model = Model::open(config)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let engine = placing_engine(&model, numa)?;
    let _said_engine = crate::warnings::Watch(|| engine.as_ref().map_or_else(Vec::new, Engine::warnings));
    let drive_stats = engine
        .as_ref()
        .map_or_else(|| model.stats().drives, |e| e.stats().drives);
    let provider = engine.as_ref().map(|e| e.numa_provider().name());
    let refused: Vec<_> = model.copy_report().iter().filter(|c| !c.accepted).collect();
    // A placed model: its layout and each file's root.
    let placed = if one_file {
        None
    } else {
        weightstream::__internal::place::Placed::read(&primary)?
    };
    if json {
        let cat = model.catalog();
        let placement = placed.as_ref().map(|p| {
            let i = &p.index;
            serde_json::json!({
                "layout": i.layout,
                "source": i.source,
                "source_fingerprint": i.source_fingerprint,
                "roots": i.roots,
                "files": i.files,
                "extras": i.extras,
            })
        });
        // Serialised first: an error (not a panic in `json!`) if a field
        // cannot be.
        let refused = serde_json::to_value(&refused)?;
        let drives = serde_json::to_value(&drive_stats)?;
        let v = serde_json::json!({
            "dir": escape(cat.dir()),
            "shards": shards_json(&model),
            "tensors": cat.tensors().len(),
            "bytes": cat.total_bytes(),
            "route": model.route().name(),
            "weights": model.rank_weights(),
            "refused_copies": refused,
            "placement": placement,
            "numa_provider": provider,
            "drives": drives,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    let cat = model.catalog();
    writeln!(
        out,
        "model {}: {} shard(s), {} tensor(s), {} bytes; route {}, weights per copy rank {:?}",
        escape(cat.dir()),
        cat.shards().len(),
        cat.tensors().len(),
        cat.total_bytes(),
        model.route().name(),
        model.rank_weights()
    )?;
    if let Some(p) = &placed {
        print_placement(&mut out, &p.index)?;
    }
    print_shards(&mut out, &model)?;
    for c in &refused {
        writeln!(
            out,
            "  refused copy {} ({}): {}",
            escape(&c.path),
            escape(&c.shard),
            c.reason.as_deref().unwrap_or("?")
        )?;
    }
    print_drives(&mut out, &model, &drive_stats, provider.as_deref())?;
    Ok(())
}

/// `weightstream inspect MODEL --tensors`: every tensor in name order,
/// with its dtype, shape, payload bytes, file, payload offset in that file
/// and the drive of its primary copy; opens the model only (no engine).
pub(crate) fn tensors(dir: PathBuf, layout: &LayoutArgs, json: bool) -> CliResult {
    let model = Model::open(layout.config(&dir, None)?)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let cat = model.catalog();
    let file = |t: &weightstream::TensorRef| escape(&cat.shards()[t.shard].name);
    let drive = |t: &weightstream::TensorRef| model.drives()[model.files()[t.shard].drive].device.clone();
    if json {
        let list: Vec<serde_json::Value> = cat
            .tensors()
            .iter()
            .map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "bytes": t.len,
                    "file": file(t),
                    "offset": t.offset,
                    "drive": drive(t),
                })
            })
            .collect();
        let v = serde_json::json!({
            "dir": escape(cat.dir()),
            "bytes": cat.total_bytes(),
            "tensors": list,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let rows: Vec<[String; 7]> = cat
        .tensors()
        .iter()
        .map(|t| {
            let shape: Vec<String> = t.shape.iter().map(ToString::to_string).collect();
            [
                t.name.clone(),
                t.dtype.name().to_string(),
                format!("[{}]", shape.join(", ")),
                t.len.to_string(),
                file(t),
                t.offset.to_string(),
                drive(t),
            ]
        })
        .collect();
    let head = ["name", "dtype", "shape", "bytes", "file", "offset", "drive"];
    let mut width = head.map(str::len);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = std::io::stdout().lock();
    let line = |out: &mut std::io::StdoutLock<'_>, cells: &[&str]| -> std::io::Result<()> {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            // Numbers right-aligned (bytes, offset), the rest left.
            let pad = w.saturating_sub(c.chars().count());
            if i == 3 || i == 5 {
                s.extend(std::iter::repeat_n(' ', pad));
                s.push_str(c);
            } else {
                s.push_str(c);
                if i + 1 < cells.len() {
                    s.extend(std::iter::repeat_n(' ', pad));
                }
            }
            if i + 1 < cells.len() {
                s.push_str("  ");
            }
        }
        writeln!(out, "{s}")
    };
    line(&mut out, &head)?;
    for r in &rows {
        line(&mut out, &r.each_ref().map(String::as_str))?;
    }
    writeln!(
        out,
        "{} tensor(s), {} bytes, in {} file(s)",
        rows.len(),
        cat.total_bytes(),
        cat.shards().len()
    )?;
    Ok(())
}

/// A short-lived engine places the drives exactly as a reading engine
/// would (its ring threads bind themselves), and reports it; `None` (said)
/// when none starts.
fn placing_engine(model: &Model, numa: Option<OnOff>) -> Result<Option<Engine>, weightstream::Error> {
    let mut ec = EngineConfig::from_env()?;
    if let Some(v) = numa {
        ec = ec.numa(v == OnOff::On);
    }
    Ok(match Engine::new(model, ec) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!("no engine to show NUMA placement: {e}");
            None
        }
    })
}

/// Every shard: the primary copy's fields at the top level, every copy
/// under "copies".
fn shards_json(model: &Model) -> Vec<serde_json::Value> {
    let cat = model.catalog();
    let copy_json = |f: &weightstream::__internal::ShardFile| {
        serde_json::json!({
            "path": escape(&f.path),
            "rank": f.rank,
            "drive": model.drives()[f.drive].device,
            "fs_type": f.topo.fs_type,
            "mount": escape(&f.topo.mount),
            "dio_offset_align": f.topo.dio_offset_align,
            "dio_mem_align": f.topo.dio_mem_align,
            "align_source": f.topo.align_source,
            "direct_opens": f.direct().is_some(),
            "direct_refused": f.direct_refused,
        })
    };
    cat.shards()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // The primary copy's fields at the top level, every copy under "copies".
            let mut v = copy_json(&model.files()[i]);
            let o = v.as_object_mut().expect("an object");
            o.insert("name".into(), escape(&s.name).into());
            o.insert("size".into(), model.files()[i].size.into());
            o.insert("header_len".into(), s.header.header_len.into());
            o.insert("data_start".into(), s.header.data_start.into());
            o.insert("tensors".into(), s.header.tensors.len().into());
            o.insert("device".into(), model.files()[i].topo.device.clone().into());
            let copies: Vec<_> = model.copies(i).iter().map(|&c| copy_json(&model.files()[c])).collect();
            o.insert("copies".into(), copies.into());
            v
        })
        .collect()
}

/// A placed model's layout: each root and the files on it.
fn print_placement(out: &mut impl Write, i: &weightstream::__internal::place::LayoutIndex) -> std::io::Result<()> {
    writeln!(
        out,
        "placed: {} layout over {} root(s), from {} (fingerprint {}...)",
        i.layout,
        i.roots.len(),
        i.source,
        &i.source_fingerprint[..12.min(i.source_fingerprint.len())]
    )?;
    for (k, r) in i.roots.iter().enumerate() {
        let mine: Vec<_> = i.files.iter().filter(|f| f.root == k).collect();
        writeln!(
            out,
            "  root {k} {}: {} file(s), {} bytes{}",
            r.folder,
            mine.len(),
            mine.iter().map(|f| f.size).sum::<u64>(),
            if k == 0 { " (primary: layout index, extras)" } else { "" }
        )?;
        for f in mine {
            writeln!(
                out,
                "    {}  {} bytes{}",
                f.name,
                f.size,
                f.layer.map_or(String::new(), |l| format!(", layer {l}"))
            )?;
        }
    }
    Ok(())
}

/// Every shard and each of its copies: drive, filesystem, O_DIRECT alignment.
fn print_shards(out: &mut impl Write, model: &Model) -> std::io::Result<()> {
    let cat = model.catalog();
    for (i, s) in cat.shards().iter().enumerate() {
        let f = &model.files()[i];
        writeln!(
            out,
            "  {}  {} bytes, header {} bytes (data at {}), {} tensor(s), {} cop{}",
            escape(&s.name),
            f.size,
            s.header.header_len,
            s.header.data_start,
            s.header.tensors.len(),
            model.copies(i).len(),
            if model.copies(i).len() == 1 { "y" } else { "ies" }
        )?;
        for &c in model.copies(i) {
            let f = &model.files()[c];
            writeln!(
                out,
                "    [{}] {}  drive {} ({} at {}), dio align offset {} / memory {} (from {:?}), O_DIRECT: {}",
                f.rank,
                escape(&f.path),
                model.drives()[f.drive].device,
                f.topo.fs_type,
                escape(&f.topo.mount),
                f.topo.dio_offset_align,
                f.topo.dio_mem_align,
                f.topo.align_source,
                match (f.direct(), &f.direct_refused) {
                    (Some(_), _) => "opens".to_string(),
                    (None, Some(why)) => format!("no ({why})"),
                    (None, None) => "no".to_string(),
                }
            )?;
        }
    }
    Ok(())
}

/// Every drive: alignment, O_DIRECT, NUMA placement, how reads are issued.
fn print_drives(
    out: &mut impl Write,
    model: &Model,
    drive_stats: &[weightstream::DriveStats],
    provider: Option<&str>,
) -> std::io::Result<()> {
    for (d, st) in model.drives().iter().zip(drive_stats) {
        writeln!(
            out,
            "drive {} ({}, {}): dio align {}, O_DIRECT on every file: {}",
            d.device,
            d.fs_type,
            escape(&d.mount),
            d.dio_align,
            d.direct_open
        )?;
        let Some(provider) = provider else { continue };
        let node = match (st.numa_node, &st.numa_note) {
            (Some(n), _) => format!("NUMA node {n}"),
            (None, Some(why)) => format!("NUMA node unknown ({why})"),
            (None, None) => "NUMA node unknown".to_string(),
        };
        writeln!(
            out,
            "  {node}, cpuset {} [{provider}]; {} thread: {}",
            st.cpuset.as_deref().unwrap_or("-"),
            if st.ring.is_some() { "ring" } else { "pread" },
            st.thread_binding.as_deref().unwrap_or("-")
        )?;
        if let Some(why) = &st.submit_reason {
            writeln!(
                out,
                "  submit {why}{}",
                st.iowq_max_workers
                    .map_or(String::new(), |n| format!("; io-wq workers at most {n}"))
            )?;
        }
    }
    Ok(())
}
