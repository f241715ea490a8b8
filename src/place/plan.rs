//! What each layout puts where: the files to exist on each root, with
//! their size, header and where their bytes come from. Pure planning, no
//! I/O beyond what the source scan read.
//!
//! - `mirror`: every shard on every root, byte for byte.
//! - `split`: every shard on one root, largest first onto the root with the
//!   fewest bytes so far (ties: the lower root).
//! - `layers`: one file per decoder layer (the tensors named
//!   `*.layers.N.*`), layer N on root `N mod roots`; the tensors of no
//!   layer (embeddings, head, final norm) in one file on root 0. Each file
//!   in the reference format: 8-byte little-endian header length, a
//!   compact JSON header (`__metadata__` first, then the tensors in data
//!   order: by element size, largest first, then by name, as the reference
//!   writer orders them), padded with spaces to a multiple of 8, then the
//!   payloads, contiguous. Every header is validated by
//!   [`ShardHeader::parse`] before anything is written.
//!
//! In every layout root 0 (the primary) also keeps the source's extra files
//! (config, tokenizer, `model.safetensors.index.json`; regenerated for
//! `layers`, whose shard files differ from the source's).

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::Path;

use super::source::Source;
use crate::error::{escape, Error, Result};
use crate::format::catalog::{TensorRef, INDEX_FILE as HF_INDEX};
use crate::format::container::ShardHeader;
use crate::model::placed::{sha256_hex, FileKind, LayoutKind};

/// Where a planned file's bytes come from.
#[derive(Debug, Clone)]
pub(crate) enum Content {
    /// Source shard `shard` (index into [`Source::shards`]), byte for byte.
    Copy { shard: usize },
    /// A new shard: `raw` (length prefix + header), then the payloads of
    /// these catalog tensors, in this order.
    Build { tensors: Vec<usize> },
    /// Source extra file `extra` (index into [`Source::extras`]).
    Extra { extra: usize },
    /// Bytes made here (a regenerated `model.safetensors.index.json`).
    Bytes(Vec<u8>),
}

/// One tensor's bytes in a planned file: absolute `[begin, end)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Range {
    pub name: String,
    pub begin: u64,
    pub end: u64,
}

/// One file of the layout.
#[derive(Debug, Clone)]
pub(crate) struct Output {
    pub name: OsString,
    pub root: usize,
    pub size: u64,
    /// `None` for an extra (non-shard) file.
    pub kind: Option<FileKind>,
    pub layer: Option<u64>,
    /// Length prefix + header (empty for extras).
    pub raw: Vec<u8>,
    /// sha256 of `raw` (of the whole file for an extra made here).
    pub header_sha256: String,
    /// Tensor ranges in the file, in file order.
    pub ranges: Vec<Range>,
    pub content: Content,
}

/// A layout, planned.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The safetensors files, by root then name.
    pub files: Vec<Output>,
    /// The extra files of the primary.
    pub extras: Vec<Output>,
    /// What the planner decided that a user should know (metadata merges).
    pub notes: Vec<String>,
}

fn ranges_of(h: &ShardHeader) -> Vec<Range> {
    h.tensors
        .iter()
        .map(|t| Range {
            name: t.name.clone(),
            begin: h.data_start + t.begin,
            end: h.data_start + t.end,
        })
        .collect()
}

/// Plans `layout` of `source` over `n` roots.
pub(crate) fn plan(source: &Source, layout: LayoutKind, n: usize) -> Result<Plan> {
    let mut notes = Vec::new();
    let shard_output = |i: usize, root: usize| {
        let s = &source.shards[i];
        Output {
            name: s.info.name.clone(),
            root,
            size: s.size,
            kind: Some(FileKind::Shard),
            layer: None,
            raw: s.info.header.raw.clone(),
            header_sha256: sha256_hex(&s.info.header.raw),
            ranges: ranges_of(&s.info.header),
            content: Content::Copy { shard: i },
        }
    };
    for s in &source.shards {
        if crate::model::placed::is_reserved(&s.info.name) {
            return Err(Error::catalog(
                &s.info.listed,
                "has a name weightstream keeps for its temporary files: rename it",
            ));
        }
    }
    let mut files = Vec::new();
    match layout {
        LayoutKind::Mirror => {
            for root in 0..n {
                for i in 0..source.shards.len() {
                    files.push(shard_output(i, root));
                }
            }
        }
        LayoutKind::Split => {
            let mut order: Vec<usize> = (0..source.shards.len()).collect();
            order.sort_by(|&a, &b| {
                let (sa, sb) = (&source.shards[a], &source.shards[b]);
                sb.size.cmp(&sa.size).then_with(|| sa.info.name.cmp(&sb.info.name))
            });
            let mut load = vec![0u64; n];
            for i in order {
                let root = (0..n).min_by_key(|&k| (load[k], k)).expect("at least one root");
                load[root] += source.shards[i].size;
                files.push(shard_output(i, root));
            }
        }
        LayoutKind::Layers => files = plan_layers(source, n, &mut notes)?,
    }
    files.sort_by(|a, b| (a.root, &a.name).cmp(&(b.root, &b.name)));
    let mut extras = Vec::new();
    for (i, e) in source.extras.iter().enumerate() {
        if layout == LayoutKind::Layers && e.name == HF_INDEX {
            continue;
        }
        extras.push(Output {
            name: e.name.clone(),
            root: 0,
            size: e.size,
            kind: None,
            layer: None,
            raw: Vec::new(),
            header_sha256: String::new(),
            ranges: Vec::new(),
            content: Content::Extra { extra: i },
        });
    }
    if layout == LayoutKind::Layers {
        let bytes = hf_index(source, &files);
        extras.push(Output {
            name: OsString::from(HF_INDEX),
            root: 0,
            size: bytes.len() as u64,
            kind: None,
            layer: None,
            raw: Vec::new(),
            header_sha256: sha256_hex(&bytes),
            ranges: Vec::new(),
            content: Content::Bytes(bytes),
        });
    }
    extras.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Plan { files, extras, notes })
}

/// The file name of layer `l`'s shard.
pub fn layer_file(l: u64) -> OsString {
    OsString::from(format!("model-layer-{l:05}.safetensors"))
}

/// The file name of the shard holding the tensors of no layer.
pub const EXTRAS_FILE: &str = "model-extras.safetensors";

fn plan_layers(source: &Source, n: usize, notes: &mut Vec<String>) -> Result<Vec<Output>> {
    let cat = &source.catalog;
    let mut groups: BTreeMap<Option<u64>, Vec<usize>> = BTreeMap::new();
    for t in cat.tensors() {
        groups
            .entry(crate::layer_placement::layer_of(&t.name).map(|l| l as u64))
            .or_default()
            .push(t.index);
    }
    if !groups.keys().any(Option::is_some) {
        return Err(Error::catalog(
            &source.real,
            "no tensor is named *.layers.N.*: there are no decoder layers to stripe; use --layout split or mirror",
        ));
    }
    let mut out = Vec::new();
    for (layer, tensors) in groups {
        let (name, root, kind) = match layer {
            Some(l) => (layer_file(l), (l % n as u64) as usize, FileKind::Layer),
            None => (OsString::from(EXTRAS_FILE), 0, FileKind::Extras),
        };
        out.push(build_output(source, name, root, kind, layer, tensors, notes)?);
    }
    Ok(out)
}

/// A re-sharded file holding `tensors` (catalog indices), its header made
/// and validated.
fn build_output(
    source: &Source,
    name: OsString,
    root: usize,
    kind: FileKind,
    layer: Option<u64>,
    mut tensors: Vec<usize>,
    notes: &mut Vec<String>,
) -> Result<Output> {
    let all = source.catalog.tensors();
    // The reference writer's order: largest element first (keeps each
    // payload aligned to its element size), then by name.
    tensors.sort_by(|&a, &b| {
        let (ta, tb) = (&all[a], &all[b]);
        tb.dtype
            .bits()
            .cmp(&ta.dtype.bits())
            .then_with(|| ta.name.cmp(&tb.name))
    });
    let refs: Vec<&TensorRef> = tensors.iter().map(|&i| &all[i]).collect();
    let metadata = merged_metadata(source, &refs, &name, notes);
    let raw = header_bytes(&refs, &metadata)?;
    let data: u64 = refs.iter().map(|t| t.len).sum();
    let size = raw.len() as u64 + data;
    let shown = source.real.join(&name);
    let parsed = ShardHeader::parse(Path::new(&shown), raw.clone(), size)?;
    let mut ranges = Vec::with_capacity(refs.len());
    for (p, t) in parsed.tensors.iter().zip(&refs) {
        if p.name != t.name || p.dtype != t.dtype || p.shape != t.shape || p.len() != t.len {
            return Err(Error::catalog(
                &shown,
                format!(
                    "the header made for tensor {:?} reads back as {:?} {} {:?}: refused (a bug in weightstream)",
                    t.name, p.name, p.dtype, p.shape
                ),
            ));
        }
        ranges.push(Range {
            name: p.name.clone(),
            begin: parsed.data_start + p.begin,
            end: parsed.data_start + p.end,
        });
    }
    if parsed.tensors.len() != refs.len() {
        return Err(Error::catalog(
            &shown,
            format!(
                "the header made holds {} tensors, not {}: refused",
                parsed.tensors.len(),
                refs.len()
            ),
        ));
    }
    Ok(Output {
        name,
        root,
        size,
        kind: Some(kind),
        layer,
        header_sha256: sha256_hex(&raw),
        raw,
        ranges,
        content: Content::Build { tensors },
    })
}

/// The `__metadata__` of the source shards the tensors come from, merged in
/// source order; a key with different values keeps the first (noted).
fn merged_metadata(
    source: &Source,
    refs: &[&TensorRef],
    name: &OsStr,
    notes: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let mut shards: Vec<usize> = refs.iter().map(|t| t.shard).collect();
    shards.sort_unstable();
    shards.dedup();
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut from: BTreeMap<String, usize> = BTreeMap::new();
    for s in shards {
        let Some(meta) = &source.catalog.shards()[s].header.metadata else {
            continue;
        };
        let mut keys: Vec<(&String, &String)> = meta.iter().collect();
        keys.sort();
        for (k, v) in keys {
            match out.get(k) {
                None => {
                    out.insert(k.clone(), v.clone());
                    from.insert(k.clone(), s);
                }
                Some(old) if old == v => {}
                Some(_) => notes.push(format!(
                    "{}: __metadata__ key {k:?} differs between source shards {} and {}; kept the first",
                    escape(name),
                    escape(&source.catalog.shards()[from[k]].name),
                    escape(&source.catalog.shards()[s].name)
                )),
            }
        }
    }
    out
}

/// Length prefix + compact JSON header for `refs` in this order, padded
/// with spaces so the data section starts at a multiple of 8.
fn header_bytes(refs: &[&TensorRef], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let js = |s: &str| serde_json::to_string(s).expect("a string serialises");
    let mut body = String::from("{");
    if !metadata.is_empty() {
        let items: Vec<String> = metadata.iter().map(|(k, v)| format!("{}:{}", js(k), js(v))).collect();
        body.push_str(&format!("\"__metadata__\":{{{}}}", items.join(",")));
    }
    let mut at = 0u64;
    for t in refs {
        if body.len() > 1 {
            body.push(',');
        }
        let shape: Vec<String> = t.shape.iter().map(ToString::to_string).collect();
        body.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            js(&t.name),
            t.dtype.name(),
            shape.join(","),
            at,
            at + t.len
        ));
        at += t.len;
    }
    body.push('}');
    while body.len() % 8 != 0 {
        body.push(' ');
    }
    let mut raw = (body.len() as u64).to_le_bytes().to_vec();
    raw.extend_from_slice(body.as_bytes());
    Ok(raw)
}

/// A `model.safetensors.index.json` for the layer files.
fn hf_index(source: &Source, files: &[Output]) -> Vec<u8> {
    let all = source.catalog.tensors();
    let mut map = BTreeMap::new();
    for f in files {
        if let Content::Build { tensors } = &f.content {
            for &t in tensors {
                map.insert(all[t].name.clone(), f.name.to_string_lossy().into_owned());
            }
        }
    }
    let v = serde_json::json!({
        "metadata": {"total_size": source.catalog.total_bytes(), "generator": "weightstream place --layout layers"},
        "weight_map": map,
    });
    let mut b = serde_json::to_vec_pretty(&v).expect("json");
    b.push(b'\n');
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::Dtype;

    fn t(name: &str, dtype: Dtype, shape: &[usize]) -> TensorRef {
        let len = shape.iter().product::<usize>() as u64 * dtype.bits() as u64 / 8;
        TensorRef {
            name: name.into(),
            shard: 0,
            offset: 0,
            len,
            dtype,
            shape: shape.to_vec(),
            index: 0,
        }
    }

    #[test]
    fn headers_are_padded_valid_and_in_reference_order() {
        let a = t("b.x", Dtype::F32, &[3, 5]);
        let b = t("a \"q\"", Dtype::Bf16, &[7]);
        let c = t("c", Dtype::U8, &[0]);
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let raw = header_bytes(&[&a, &b, &c], &meta).unwrap();
        assert_eq!(raw.len() % 8, 0);
        let size = raw.len() as u64 + a.len + b.len;
        let h = ShardHeader::parse(Path::new("x"), raw.clone(), size).unwrap();
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b.x", "a \"q\"", "c"]);
        assert_eq!(h.metadata.unwrap()["format"], "pt");
        let text = std::str::from_utf8(&raw[8..]).unwrap();
        assert!(
            text.starts_with("{\"__metadata__\":{\"format\":\"pt\"},\"b.x\":"),
            "{text}"
        );
        // Without metadata: no key at all.
        let raw = header_bytes(&[&c], &BTreeMap::new()).unwrap();
        assert!(std::str::from_utf8(&raw[8..]).unwrap().starts_with("{\"c\":"));
    }

    #[test]
    fn layer_files_sort_by_number() {
        assert!(layer_file(9) < layer_file(10));
        assert_eq!(layer_file(3), "model-layer-00003.safetensors");
    }
}
