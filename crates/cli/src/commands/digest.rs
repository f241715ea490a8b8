//! `weightstream digest`: sha256 of every tensor through any backend, as `sha256sum` prints.

use std::io::Write;
use std::path::PathBuf;

use sha2::{Digest, Sha256};
use weightstream::{Arena, Engine, Model};

use crate::cli::{DirectArg, EngineArgs, LayoutArgs};
use crate::commands::CliResult;

pub(crate) fn digest(
    dir: PathBuf,
    names: Vec<String>,
    direct: DirectArg,
    args: &EngineArgs,
    layout: &LayoutArgs,
    json: bool,
) -> CliResult {
    let model = Model::open(layout.config(&dir, Some(direct.into()))?)?;
    let _said = crate::warnings::Watch(|| model.warnings());
    let cat = model.catalog();
    let mut chosen = Vec::new();
    if names.is_empty() {
        chosen.extend(cat.tensors().iter());
    } else {
        for n in &names {
            chosen.push(model.tensor(n).map_err(|e| format!("digest: --tensor {n:?}: {e}"))?);
        }
        chosen.sort_by(|a, b| a.name.cmp(&b.name));
        chosen.dedup_by(|a, b| a.name == b.name);
    }
    let cap = chosen.iter().map(|t| t.len).max().unwrap_or(1).max(1) as usize;
    let spec = weightstream::SlotSpec::new(cap).with_align(model.required_align());
    let mut sums = Vec::with_capacity(chosen.len());
    let stats = match args.config()? {
        None => {
            let arena = Arena::new(spec, 1).map_err(|e| {
                crate::args::alloc_flags(
                    e,
                    &format!("one slot sized for the largest tensor chosen ({cap} bytes; --tensor chooses)"),
                )
            })?;
            for t in chosen {
                let slot = arena.take().expect("one slot, returned after each read");
                let loaded = model.read_sync(t, slot)?;
                sums.push((t.name.clone(), hex(&Sha256::digest(&loaded[..]))));
            }
            model.stats()
        }
        Some(cfg) => {
            let engine = Engine::new(&model, cfg)?;
            let _said = crate::warnings::Watch(|| engine.warnings());
            let arena = engine.arena(spec, args.inflight).map_err(|e| {
                crate::args::alloc_flags(
                    e,
                    &format!(
                        "--inflight {} slots, each sized for the largest tensor chosen ({cap} bytes; --tensor chooses)",
                        args.inflight
                    ),
                )
            })?;
            // Keep up to `inflight` reads going; hash in order as each lands.
            let mut pending = std::collections::VecDeque::new();
            let mut next = chosen.iter();
            loop {
                while let Ok(slot) = arena.take() {
                    let Some(t) = next.next() else {
                        drop(slot);
                        break;
                    };
                    pending.push_back((t, engine.read(t, slot)?));
                }
                let Some((t, ticket)) = pending.pop_front() else {
                    break;
                };
                let loaded = ticket.wait()?;
                sums.push((t.name.clone(), hex(&Sha256::digest(&loaded[..]))));
            }
            engine.stats()
        }
    };
    if json {
        let map: serde_json::Map<String, serde_json::Value> = sums.into_iter().map(|(n, h)| (n, h.into())).collect();
        // Serialised first: an error, not a panic inside `json!`.
        let stats = serde_json::to_value(&stats)?;
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"tensors": map, "stats": stats}))?
        );
    } else {
        let mut out = std::io::stdout().lock();
        for (n, h) in sums {
            writeln!(out, "{h}  {n}")?;
        }
    }
    Ok(())
}

/// Lower-case hex of `b` (as sha256sum prints a digest).
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
