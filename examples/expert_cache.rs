//! A mixture-of-experts decode loop on an expert cache: each step, every
//! layer's router picks its top-k (skewed: a few experts are hot), the
//! cache returns them (misses read O_DIRECT in place, striped over the
//! drives), the next layer's guess is prefetched while this layer
//! "computes", and the handles drop when the layer is done.
//!
//! cargo run --release --example expert_cache -- [MODEL_DIR] [STEPS] [CAPACITY]
//!
//! Without a directory it writes a small synthetic model (8 layers of 16
//! experts) to a temporary directory and checks every byte it gets.

use weightstream::{CacheConfig, Capacity, ExpertCache, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

/// Experts the router picks per layer and step.
const TOP_K: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (dir, _tmp, spec) = match args.next() {
        Some(d) => (std::path::PathBuf::from(d), None, None),
        None => {
            let tmp = tempfile::tempdir()?;
            let spec = SynthSpec {
                layers: 8,
                experts: 16,
                expert_bytes: 256 << 10,
                shards: 2,
                seed: 21,
                ..SynthSpec::default()
            };
            synth::write_model(tmp.path(), &spec)?;
            (tmp.path().to_path_buf(), Some(tmp), Some(spec))
        }
    };
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16);
    let capacity: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(24);
    let model = Model::open(ModelConfig::new(&dir))?;
    let cache = ExpertCache::new(&model, CacheConfig::new(Capacity::Experts(capacity)))?;
    let layers: Vec<(usize, usize)> = model
        .experts()?
        .layers()
        .map(|l| (l.index(), l.expert_count()))
        .filter(|&(_, n)| n > 0)
        .collect();

    // The router: expert e with weight about 1/(e+1).
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut pick = |n: usize| loop {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let e = (rng % n as u64) as usize;
        if (rng >> 32).is_multiple_of(e as u64 + 1) {
            return e;
        }
    };
    for _ in 0..steps {
        for (i, &(layer, n)) in layers.iter().enumerate() {
            let mut top = Vec::new();
            while top.len() < TOP_K.min(n) {
                let e = pick(n);
                if !top.contains(&e) {
                    top.push(e);
                }
            }
            let experts = cache.get_many(layer, &top)?;
            // While this layer computes, the next one's likely experts load.
            if let Some(&(next, m)) = layers.get(i + 1) {
                let guess: Vec<(usize, usize)> = (0..TOP_K.min(m)).map(|_| (next, pick(m))).collect();
                cache.prefetch(&guess)?;
            }
            for e in &experts {
                for (_projection, _part, bytes) in e.parts() {
                    if let Some(s) = &spec {
                        assert!(synth::verify(s.seed, bytes.name(), bytes), "{}", bytes.name());
                    }
                    // ... the expert's matmuls on &bytes[..] ...
                }
            }
            // `experts` drops here: the entries are unpinned, evictable again.
        }
    }
    let s = cache.stats();
    println!(
        "{steps} steps x {} layers, top-{TOP_K}, cache of {}: hits {}, misses {}, prefetched {} (used {}, wasted {}), \
         {:.1} MB read, waited {:.3} s{}",
        layers.len(),
        s.capacity,
        s.hits,
        s.misses,
        s.prefetched,
        s.prefetch_used,
        s.prefetch_wasted,
        s.bytes_read as f64 / 1e6,
        s.wait_seconds,
        if spec.is_some() { ", every byte verified" } else { "" }
    );
    Ok(())
}
