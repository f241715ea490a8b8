//! `weightstream gen`: a synthetic MoE model.

use std::path::PathBuf;
use std::time::Instant;

use weightstream_synth::{self as synth, SynthSpec};

use crate::commands::CliResult;

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
    let mut spec = SynthSpec::sized(size, expert_bytes as usize, layers.max(1), shards.max(1));
    if let Some(e) = experts {
        spec.experts = e.max(1);
    }
    spec.seed = seed;
    let t0 = Instant::now();
    let paths = synth::write_model(&dir, &spec)?;
    println!(
        "wrote {}: {} layers x {} experts x 3 projections of {} bytes, {} shard(s), {:.3} GB of tensors in {:.1}s",
        dir.display(),
        spec.layers,
        spec.experts,
        spec.tensors()
            .iter()
            .find(|t| t.name.contains(".experts."))
            .map_or(0, |t| t.len()),
        paths.len(),
        spec.total_bytes() as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
