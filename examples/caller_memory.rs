//! Reading into memory the caller owns (a `Vec`, a ggml buffer, pinned
//! host memory for a GPU): lend it to the engine for a scope with the safe
//! `Engine::lend`, let the placement helper lay the payloads out so every
//! read is in place and O_DIRECT, and, where the caller must fix an
//! address itself (a tensor's storage at a page boundary), still read
//! O_DIRECT: through the engine's staging and one copy. Fails if any read
//! went buffered.
//!
//! cargo run --release --example caller_memory

use weightstream::{Engine, EngineConfig, Model, ModelConfig, Scratch, TensorRef};
use weightstream_synth::{self as synth, SynthSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = tempfile::tempdir()?;
    let spec = SynthSpec {
        layers: 2,
        experts: 4,
        expert_bytes: 300_000,
        shards: 1,
        seed: 9,
        ..SynthSpec::default()
    };
    // Written by the reference writer: no payload starts on a block.
    synth::write_model(tmp.path(), &spec)?;
    let model = Model::open(ModelConfig::new(tmp.path()))?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;
    let experts: Vec<&TensorRef> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect();

    // 1. Placed by the helper: in place, O_DIRECT, no copy.
    let mut weights = vec![0u8; engine.placement_bytes(&experts)?];
    let placed = engine.lend(&mut weights, |mem| -> weightstream::Result<_> {
        let p = mem.placement(&experts)?;
        let tickets = experts
            .iter()
            .zip(p.offsets())
            .map(|(t, &at)| mem.read_into(t, at, Scratch::Blocks))
            .collect::<weightstream::Result<Vec<_>>>()?;
        for ticket in tickets {
            ticket.wait()?;
        }
        Ok(p)
    })??;
    // `lend` returned: the Vec is ours again, every payload in it.
    for (t, &at) in experts.iter().zip(placed.offsets()) {
        assert!(synth::verify(spec.seed, &t.name, &weights[at..at + t.len as usize]));
    }
    let in_place = engine.stats();

    // 2. Addresses the caller fixes (page-aligned, out of phase with the
    // file): O_DIRECT into staging, then one copy of exactly the payload.
    let slot = |t: &TensorRef| (t.len as usize).next_multiple_of(4096);
    let mut storage = vec![0u8; experts.iter().map(|t| slot(t)).sum::<usize>() + 4096];
    engine.lend(&mut storage, |mem| -> weightstream::Result<()> {
        let mut at = mem.addr().next_multiple_of(4096) - mem.addr();
        for t in &experts {
            let l = mem.read_into(t, at, Scratch::None)?.wait()?;
            assert!(synth::verify(spec.seed, &t.name, &l));
            at += slot(t);
        }
        Ok(())
    })??;

    let st = engine.stats();
    println!(
        "{} experts placed by the helper: {} reads direct in place, {} staged; at fixed addresses: {} staged (O_DIRECT + one copy, {:.3} CPU s per GB); {} reads buffered, {} fallbacks",
        experts.len(),
        in_place.reads_direct(),
        in_place.staged.reads,
        st.staged.reads - in_place.staged.reads,
        st.staged.copy_cpu_s_per_gb().unwrap_or(0.0),
        st.reads_buffered(),
        st.fallbacks_total(),
    );
    if st.reads_buffered() + st.fallbacks_total() > 0 || in_place.staged.reads > 0 {
        return Err(format!("reads fell back: {st:?}").into());
    }
    Ok(())
}
