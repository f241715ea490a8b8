//! Streams decoder layers from striped roots, the way a trainer does:
//! layer i lives on root i mod N, and N + 1 layers are in flight.
//!
//! cargo run --release --example stream_layers -- [ROOT...]
//!
//! With no roots it uses two temporary directories, one under the system
//! temporary directory and one under /dev/shm (two volumes). Each root gets
//! the shard of the layers placed on it; the model is opened with the first
//! root as primary and the others as split directories; every byte is
//! verified; the per-drive share of bytes is printed.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;

use safetensors::tensor::{Dtype, View};
use weightstream::layer_placement;
use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth as synth;

const SEED: u64 = 7;

struct Layer(Vec<usize>, String);

impl View for &Layer {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.0
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut v = vec![0u8; self.data_len()];
        synth::fill(SEED, &self.1, 0, &mut v);
        v.into()
    }
    fn data_len(&self) -> usize {
        self.0.iter().product::<usize>() * 2
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<PathBuf> = std::env::args().skip(1).map(PathBuf::from).collect();
    let mut _temps = Vec::new();
    let roots: Vec<PathBuf> = if args.is_empty() {
        for base in [std::env::temp_dir(), PathBuf::from("/dev/shm")] {
            let t = tempfile::Builder::new().prefix("ws-layers-").tempdir_in(base)?;
            _temps.push(t);
        }
        _temps.iter().map(|t| t.path().to_path_buf()).collect()
    } else {
        args
    };
    let layers = 8;
    let place = layer_placement::placement(layers, &roots);
    // Write each layer's tensors into a shard on the root it is placed on.
    for (i, root) in place.iter().enumerate() {
        let tensors: Vec<(String, Layer)> = ["self_attn.qkv_proj", "mlp.up_proj", "mlp.down_proj"]
            .iter()
            .map(|p| {
                let name = format!("model.layers.{i}.{p}.weight");
                (name.clone(), Layer(vec![1000 + i, 1536], name))
            })
            .collect();
        let refs: Vec<(String, &Layer)> = tensors.iter().map(|(n, l)| (n.clone(), l)).collect();
        safetensors::serialize_to_file(refs, None, &root.join(format!("layer-{i:03}.safetensors")))?;
    }
    let config = ModelConfig::new(&roots[0]).dirs(roots[1..].to_vec());
    let model = Model::open(config)?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;
    // Tensors grouped by layer, in layer order.
    let mut by_layer: BTreeMap<usize, Vec<_>> = BTreeMap::new();
    for t in model.catalog().tensors() {
        if let Some(l) = layer_placement::layer_of(&t.name) {
            by_layer.entry(l).or_default().push(t);
        }
    }
    // N + 1 whole layers in flight.
    let ahead = layer_placement::readahead_default(roots.len());
    let per_layer = by_layer.values().map(Vec::len).max().unwrap_or(1);
    let arena = engine.arena(model.slot_spec_for_largest("")?, ahead * per_layer)?;
    let order: Vec<_> = by_layer.values().flatten().collect();
    let mut pending = VecDeque::new();
    let (mut bytes, mut bad) = (0u64, 0usize);
    let t0 = std::time::Instant::now();
    for t in &order {
        let slot = loop {
            if let Ok(s) = arena.take() {
                break s;
            }
            let (name, ticket): (&String, weightstream::Ticket) = pending.pop_front().expect("a read is pending");
            let loaded = ticket.wait()?;
            bytes += loaded.len() as u64;
            bad += usize::from(!synth::verify(SEED, name, &loaded));
        };
        pending.push_back((&t.name, engine.read(t, slot)?));
    }
    for (name, ticket) in pending {
        let loaded = ticket.wait()?;
        bytes += loaded.len() as u64;
        bad += usize::from(!synth::verify(SEED, name, &loaded));
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{layers} layers over {} root(s), {ahead} layers in flight: {:.1} MB in {:.2}s, {}",
        roots.len(),
        bytes as f64 / 1e6,
        secs,
        if bad == 0 {
            "every byte verified".to_string()
        } else {
            format!("{bad} tensors MISMATCHED")
        }
    );
    for d in engine.stats().drives {
        println!(
            "  drive {} ({}): {:.1} MB, share {:.2}",
            d.device,
            d.fs_type,
            d.bytes as f64 / 1e6,
            d.share
        );
    }
    if bad > 0 {
        return Err("mismatched bytes".into());
    }
    Ok(())
}
