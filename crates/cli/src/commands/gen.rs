//! `weightstream gen`: a synthetic MoE model, planned and checked before
//! anything is written: the counts its flags multiply into, the tensors'
//! header, the volume it lands on and the memory the writer holds.

use std::path::{Path, PathBuf};
use std::time::Instant;

use weightstream::__internal::escape;
use weightstream_synth::{self as synth, SynthSpec};

use crate::args::{memory_room, volume_room};
use crate::cli::MAX_EXPERTS;
use crate::commands::CliResult;

/// Tensors in one synthetic model, at most: each is a header entry of about
/// 120 bytes, and one shard's header must stay well inside the library's
/// `weightstream::__internal::MAX_HEADER_LEN`.
pub(crate) const MAX_TENSORS: u64 = 1 << 19;

/// A model's shape, checked: counts within their bounds, every product
/// without overflow.
#[derive(Debug)]
pub(crate) struct GenPlan {
    pub(crate) spec: SynthSpec,
    pub(crate) tensors: u64,
    pub(crate) bytes: u64,
    /// The largest tensor: the writer holds one tensor's bytes at a time.
    pub(crate) largest: u64,
}

/// The flags a plan's errors name (`gen` has them all; `demo` only
/// `--size`).
pub(crate) struct Flags {
    pub(crate) command: &'static str,
    pub(crate) experts_hint: &'static str,
    /// What else than a larger `--size` makes the smallest model smaller.
    pub(crate) smaller_hint: &'static str,
}

/// Plans the model `gen` (or `demo`) would write to `dir`, refusing one
/// whose counts or bytes are out of bounds, or that would not fit on the
/// volume or (its largest tensor) in memory; nothing is written here.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan(
    dir: &Path,
    size: u64,
    layers: usize,
    experts: Option<usize>,
    expert_bytes: u64,
    shards: usize,
    seed: u64,
    flags: &Flags,
) -> Result<GenPlan, String> {
    let cmd = flags.command;
    if shards > layers {
        return Err(format!(
            "{cmd}: --shards {shards} is more than --layers {layers}: a shard holds whole layers (1 to {layers})"
        ));
    }
    let hidden = SynthSpec::default().hidden as u64;
    let experts_given = experts;
    let experts = match experts {
        Some(e) => e as u64,
        None => {
            let per_layer = size / layers as u64;
            let e = (per_layer / (3 * expert_bytes)).max(1);
            if e > MAX_EXPERTS {
                return Err(format!(
                    "{cmd}: --size {size} over {layers} layer(s) with expert projections of {expert_bytes} bytes asks \
                     for {e} experts per layer, more than {MAX_EXPERTS}: {}",
                    flags.experts_hint
                ));
            }
            e
        }
    };
    let layers64 = layers as u64;
    // 1 embedding, then per layer a norm, a router and 3 projections per expert.
    let tensors = 1 + layers64 * (2 + 3 * experts);
    if tensors > MAX_TENSORS {
        return Err(format!(
            "{cmd}: {layers} layer(s) x {experts} experts x 3 projections is {tensors} tensors, more than {MAX_TENSORS} \
             (each is an entry of the shard's header): {}",
            flags.experts_hint
        ));
    }
    // Every product below is bounded: experts <= 4096, layers <= 1024,
    // expert bytes <= 4 GiB; computed in u128 all the same.
    let inter = (expert_bytes / (2 * hidden)).max(1);
    let proj = inter as u128 * hidden as u128 * 2;
    let router = experts as u128 * hidden as u128 * 2;
    let embed = 37 * hidden as u128 * 2;
    let per_layer = hidden as u128 * 2 + router + experts as u128 * 3 * proj;
    let total = embed + layers64 as u128 * per_layer;
    let bytes = u64::try_from(total).map_err(|_| format!("{cmd}: the model's size overflows u64"))?;
    // A size below the smallest model of these layers and projections (one
    // expert a layer) would silently write more than asked: refused.
    if experts_given.is_none() && experts == 1 && bytes > size {
        return Err(format!(
            "{cmd}: --size {size} is smaller than the smallest model of {layers} layer(s) with expert projections of \
             {expert_bytes} bytes (one expert a layer: {bytes} bytes): give --size {bytes} or more{}",
            flags.smaller_hint
        ));
    }
    let largest = u64::try_from(proj.max(router).max(embed)).map_err(|_| format!("{cmd}: a tensor overflows u64"))?;
    // The payload, each shard's header (about 120 bytes a tensor) and the
    // index (about 80 bytes a tensor).
    let on_disk = bytes.saturating_add(tensors * 200);
    if let Some((free, at)) = volume_room(dir) {
        if on_disk > free {
            return Err(format!(
                "{cmd}: {}: the model needs {on_disk} bytes and the volume of {} has {free} bytes free: refused \
                 before anything is written (lower --size)",
                escape(dir),
                escape(&at)
            ));
        }
    }
    // The writer holds one tensor's bytes at a time, the tensor list and
    // the header being serialised (about 400 bytes a tensor).
    let memory = largest.saturating_add(tensors * 400);
    let (room, why) = memory_room();
    if memory > room {
        return Err(format!(
            "{cmd}: writing needs about {memory} bytes of memory (the largest tensor, {largest} bytes, and the tensor \
             list), more than the {room} bytes this process may allocate ({why}): refused before anything is written"
        ));
    }
    let mut spec = SynthSpec::sized(size, expert_bytes as usize, layers, shards);
    spec.experts = experts as usize;
    spec.seed = seed;
    Ok(GenPlan {
        spec,
        tensors,
        bytes,
        largest,
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gen(
    dir: PathBuf,
    size: u64,
    layers: usize,
    experts: Option<usize>,
    expert_bytes: u64,
    shards: usize,
    seed: u64,
) -> CliResult {
    let flags = Flags {
        command: "gen",
        experts_hint: "lower --size, raise --expert-bytes, or give fewer --layers or --experts",
        smaller_hint: ", or fewer --layers or smaller --expert-bytes",
    };
    let plan = plan(&dir, size, layers, experts, expert_bytes, shards, seed, &flags)?;
    let spec = &plan.spec;
    let t0 = Instant::now();
    let paths = synth::write_model(&dir, spec)?;
    let proj = (spec.expert_bytes / (2 * spec.hidden)).max(1) * spec.hidden * 2;
    println!(
        "wrote {}: {} layers x {} experts x 3 projections of {} bytes, {} shard(s), {} tensors (the largest {} bytes), {:.3} GB of tensors in {:.1}s",
        dir.display(),
        spec.layers,
        spec.experts,
        proj,
        paths.len(),
        plan.tensors,
        plan.largest,
        plan.bytes as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGS: Flags = Flags {
        command: "gen",
        experts_hint: "lower --size",
        smaller_hint: "",
    };

    #[test]
    fn the_plan_matches_what_the_writer_writes() {
        let d = tempfile::tempdir().unwrap();
        let p = plan(d.path(), 3 << 20, 2, None, 64 << 10, 2, 7, &FLAGS).unwrap();
        assert_eq!(p.tensors, p.spec.tensors().len() as u64);
        assert_eq!(p.bytes, p.spec.total_bytes());
        let largest = p.spec.tensors().iter().map(|t| t.len() as u64).max().unwrap();
        assert_eq!(p.largest, largest);
    }

    #[test]
    fn absurd_shapes_are_refused_before_anything_is_built() {
        let d = tempfile::tempdir().unwrap();
        // The case: 178 million experts from --expert-bytes 1 (now
        // the smallest accepted projection).
        let e = plan(d.path(), 4 << 30, 8, None, 5760, 4, 1, &FLAGS).unwrap_err();
        assert!(e.contains("experts per layer, more than 4096"), "{e}");
        let e = plan(d.path(), 1 << 50, 8, None, 19 << 20, 4, 1, &FLAGS).unwrap_err();
        assert!(e.contains("experts per layer") || e.contains("volume"), "{e}");
        let e = plan(d.path(), 1, 1024, Some(4096), 5760, 4, 1, &FLAGS).unwrap_err();
        assert!(e.contains("tensors, more than"), "{e}");
        let e = plan(d.path(), 1, 2, None, 5760, 3, 1, &FLAGS).unwrap_err();
        assert!(e.contains("--shards 3 is more than --layers 2"), "{e}");
        let e = plan(d.path(), 1 << 49, 1024, Some(4096), 4 << 30, 4, 1, &FLAGS).unwrap_err();
        assert!(e.contains("tensors") || e.contains("volume"), "{e}");
    }

    /// A size below the smallest model (one expert a layer) is refused
    /// naming that minimum, which is then accepted: never more written
    /// than asked without saying so (before: `--size 1` wrote 0.48 GB).
    #[test]
    fn a_size_below_the_smallest_model_is_refused_naming_the_minimum() {
        let d = tempfile::tempdir().unwrap();
        let e = plan(d.path(), 1, 8, None, 19 << 20, 4, 1, &FLAGS).unwrap_err();
        let min: u64 = e
            .split("give --size ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no minimum in {e:?}"));
        assert!(e.contains("--size 1 is smaller than the smallest model"), "{e}");
        let p = plan(d.path(), min, 8, None, 19 << 20, 4, 1, &FLAGS).unwrap();
        assert_eq!(p.bytes, min);
        assert!(plan(d.path(), min - 1, 8, None, 19 << 20, 4, 1, &FLAGS).is_err());
    }
}
