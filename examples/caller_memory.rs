//! Reading into memory the caller owns (pinned host memory for a GPU, a
//! ggml buffer, a Vec): lend it to the engine with the `unsafe`
//! `register_memory` (its `# Safety` contract: the memory outlives every
//! read and is not touched while one is in flight), then `read_into` lands
//! each payload at the offset the caller chooses, writing nothing around
//! it with `Scratch::None`.
//!
//! cargo run --release --example caller_memory

use std::ptr::NonNull;

use weightstream::{Engine, EngineConfig, Model, ModelConfig, Scratch};
use weightstream_synth::{self as synth, SynthSpec};

/// The caller's buffer: page-aligned (so reads go O_DIRECT into it).
struct Buffer {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl Buffer {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: a valid layout of non-zero size; zeroed memory.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).expect("allocation");
        Buffer { ptr, layout }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is live for `self`'s lifetime; read only
        // after every read into it has completed and its arena is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

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
    synth::write_model(tmp.path(), &spec)?;
    let model = Model::open(ModelConfig::new(tmp.path()))?;
    let engine = Engine::new(&model, EngineConfig::from_env()?)?;

    // The engine's layout of the weights: back to back, each 64-aligned.
    let experts: Vec<_> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .collect();
    let mut at = Vec::new();
    let mut end = 0usize;
    for t in &experts {
        at.push(end);
        end = (end + t.len as usize).next_multiple_of(64);
    }
    let buffer = Buffer::new(end.next_multiple_of(4096));
    {
        // SAFETY: `buffer` outlives `memory` and every ticket and `Loaded`
        // from it (all dropped at the end of this block); nothing reads or
        // writes the buffer until then; it is lent to no other arena.
        let memory = unsafe { engine.register_memory(buffer.ptr, buffer.layout.size())? };
        let tickets: Vec<_> = experts
            .iter()
            .zip(&at)
            .map(|(t, &o)| engine.read_into(t, &memory, o, Scratch::None))
            .collect::<Result<_, _>>()?;
        for ticket in tickets {
            ticket.wait()?;
        }
    }
    for (t, &o) in experts.iter().zip(&at) {
        assert!(synth::verify(
            spec.seed,
            &t.name,
            &buffer.bytes()[o..o + t.len as usize]
        ));
    }
    let placed = engine.stats().fallbacks_total();
    println!(
        "{} experts read into the caller's {} bytes at the caller's offsets, every byte verified ({placed} reads placed buffered: offsets not on the file's block phase)",
        experts.len(),
        buffer.layout.size()
    );
    Ok(())
}
