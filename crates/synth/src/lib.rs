//! Synthetic MoE models for weightstream's demo, tests and benchmarks, written
//! with the `safetensors` crate's own serializer (the reference writer).
//!
//! Names follow the common layout
//! `model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight`; sizes are
//! deliberately irregular (a hidden size of 2880 makes every tensor end off
//! a 4096 boundary) and each shard carries `__metadata__` of a different
//! length, so header lengths and payload offsets are never block-aligned.
//! Content is a deterministic function of (seed, tensor name, byte index),
//! so a reader can verify every byte without keeping a copy.
//!
//! A crate of its own, independent of the library: the library's tests use
//! it as a dev-dependency, the `weightstream` command as a dependency, and
//! the library itself never links the writer.

#![warn(missing_docs)]

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, View};

/// The file name of a sharded model's index (the Hugging Face convention,
/// which weightstream's catalog reads).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Writing a synthetic model failed: the file, the operation and the cause.
#[derive(Debug)]
pub struct Error {
    /// The file or directory.
    pub path: PathBuf,
    /// What was being done.
    pub op: &'static str,
    /// Why it failed.
    pub source: std::io::Error,
}

impl Error {
    fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        Error {
            path: path.to_path_buf(),
            op,
            source,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.path.display(), self.op, self.source)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Result of writing a synthetic model.
pub type Result<T> = std::result::Result<T, Error>;

/// Shape of a synthetic model.
#[derive(Debug, Clone)]
pub struct SynthSpec {
    /// Decoder layers.
    pub layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Approximate bytes of each expert projection tensor.
    pub expert_bytes: usize,
    /// Shard files (layers are spread over them in order).
    pub shards: usize,
    /// Hidden size (2880: every tensor ends off a 4096 boundary).
    pub hidden: usize,
    /// Content seed.
    pub seed: u64,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            layers: 4,
            experts: 16,
            expert_bytes: 19 << 20,
            shards: 4,
            hidden: 2880,
            seed: 0x5eed,
        }
    }
}

/// One tensor the generator writes.
#[derive(Debug, Clone)]
pub struct SynthTensor {
    /// Tensor name.
    pub name: String,
    /// Shape (BF16 elements).
    pub shape: Vec<usize>,
    /// The shard it is written to.
    pub shard: usize,
}

impl SynthTensor {
    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.shape.iter().product::<usize>() * 2
    }

    /// No payload bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SynthSpec {
    /// A spec of about `total` bytes with experts of about `expert_bytes`.
    pub fn sized(total: u64, expert_bytes: usize, layers: usize, shards: usize) -> Self {
        let per_layer = total / layers.max(1) as u64;
        let experts = ((per_layer / (3 * expert_bytes.max(1)) as u64).max(1)) as usize;
        SynthSpec {
            layers,
            experts,
            expert_bytes,
            shards: shards.max(1),
            ..SynthSpec::default()
        }
    }

    /// Every tensor, in write order.
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let h = self.hidden;
        let inter = (self.expert_bytes / (2 * h)).max(1);
        let shard_of = |l: usize| l * self.shards / self.layers.max(1);
        let mut out = vec![SynthTensor {
            name: "model.embed_tokens.weight".into(),
            shape: vec![37, h],
            shard: 0,
        }];
        for l in 0..self.layers {
            let s = shard_of(l);
            out.push(SynthTensor {
                name: format!("model.layers.{l}.input_layernorm.weight"),
                shape: vec![h],
                shard: s,
            });
            out.push(SynthTensor {
                name: format!("model.layers.{l}.mlp.router.weight"),
                shape: vec![self.experts, h],
                shard: s,
            });
            for e in 0..self.experts {
                for (p, shape) in [
                    ("gate_proj", [inter, h]),
                    ("up_proj", [inter, h]),
                    ("down_proj", [h, inter]),
                ] {
                    out.push(SynthTensor {
                        name: format!("model.layers.{l}.mlp.experts.{e}.{p}.weight"),
                        shape: shape.to_vec(),
                        shard: s,
                    });
                }
            }
        }
        out
    }

    /// File name of shard `i`.
    pub fn shard_name(&self, i: usize) -> String {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, self.shards)
    }

    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors().iter().map(|t| t.len() as u64).sum()
    }
}

struct Lazy<'a> {
    seed: u64,
    t: &'a SynthTensor,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.t.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut v = vec![0u8; self.t.len()];
        fill(self.seed, &self.t.name, 0, &mut v);
        Cow::Owned(v)
    }
    fn data_len(&self) -> usize {
        self.t.len()
    }
}

/// Writes the model into `dir` (created if missing): shards, the index and a
/// small `config.json`. Returns the shard paths.
pub fn write_model(dir: &Path, spec: &SynthSpec) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create model directory", e))?;
    let tensors = spec.tensors();
    let mut weight_map = serde_json::Map::new();
    let mut paths = Vec::new();
    for s in 0..spec.shards {
        let path = dir.join(spec.shard_name(s));
        let mine: Vec<(String, Lazy)> = tensors
            .iter()
            .filter(|t| t.shard == s)
            .map(|t| (t.name.clone(), Lazy { seed: spec.seed, t }))
            .collect();
        for (n, _) in &mine {
            weight_map.insert(n.clone(), spec.shard_name(s).into());
        }
        // A different metadata length per shard: header lengths vary. One
        // key only: a map's order is random, and the same spec must give the
        // same header bytes (a regenerated copy is then a provable mirror).
        let meta = HashMap::from([(
            "generator".to_string(),
            format!(
                "weightstream synth seed={} {}",
                spec.seed,
                "~".repeat((s * 37 + 5) % 61)
            ),
        )]);
        safetensors::serialize_to_file(mine, Some(meta), &path)
            .map_err(|e| Error::io(&path, "write synthetic shard", std::io::Error::other(e.to_string())))?;
        paths.push(path);
    }
    let index = serde_json::json!({
        "metadata": {"total_size": spec.total_bytes()},
        "weight_map": weight_map,
    });
    let ipath = dir.join(INDEX_FILE);
    std::fs::write(&ipath, serde_json::to_vec_pretty(&index).expect("json"))
        .map_err(|e| Error::io(&ipath, "write index", e))?;
    let cpath = dir.join("config.json");
    let config = serde_json::json!({
        "model_type": "weightstream-synthetic",
        "num_hidden_layers": spec.layers,
        "num_local_experts": spec.experts,
        "hidden_size": spec.hidden,
    });
    std::fs::write(&cpath, serde_json::to_vec_pretty(&config).expect("json"))
        .map_err(|e| Error::io(&cpath, "write config", e))?;
    Ok(paths)
}

fn name_hash(name: &str) -> u64 {
    // FNV-1a: stable across runs and platforms.
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// splitmix64: a small seeded generator for traces and test schedules
/// (the same sequence on every platform and run).
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// A number in `0..n` (`n` > 0; modulo bias is of no concern here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A number in `[0, 1)`, from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    // splitmix64 finaliser.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the content of tensor `name` starting at byte `from`.
pub fn fill(seed: u64, name: &str, from: usize, buf: &mut [u8]) {
    let key = seed ^ name_hash(name);
    let mut i = 0;
    while i < buf.len() {
        let pos = from + i;
        let word = mix(key.wrapping_add(((pos / 8) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes();
        let k = pos % 8;
        let n = (8 - k).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&word[k..k + n]);
        i += n;
    }
}

/// Whether `bytes` is exactly the content of tensor `name`.
pub fn verify(seed: u64, name: &str, bytes: &[u8]) -> bool {
    let mut want = [0u8; 4096];
    bytes.chunks(4096).enumerate().all(|(i, chunk)| {
        let w = &mut want[..chunk.len()];
        fill(seed, name, i * 4096, w);
        w == chunk
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_position_consistent() {
        let mut all = vec![0u8; 1000];
        fill(1, "x", 0, &mut all);
        let mut part = vec![0u8; 333];
        fill(1, "x", 123, &mut part);
        assert_eq!(&all[123..456], &part[..]);
        assert!(verify(1, "x", &all));
        all[999] ^= 1;
        assert!(!verify(1, "x", &all));
        assert!(!verify(2, "x", &all[..10]));
    }

    #[test]
    fn sizes_are_irregular() {
        let spec = SynthSpec::default();
        let t = spec.tensors();
        assert!(t.iter().any(|t| t.len() % 4096 != 0));
        assert_eq!(t.len(), 1 + spec.layers * (2 + 3 * spec.experts));
    }
}
