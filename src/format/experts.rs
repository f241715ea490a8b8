//! The experts of a mixture-of-experts model, recognised from tensor names:
//! per layer, per expert, its projections and their companions.
//!
//! Conventions recognised (`L` a layer number, `E` an expert number, the
//! block between them any parts: `mlp`, `block_sparse_moe`, `feed_forward`,
//! `ffn`, ...):
//!
//! - `*.layers.L.<block>.experts.E.<projection>.<part>`: one tensor per
//!   expert and projection (Qwen, DeepSeek, Mixtral in Hugging Face form:
//!   `mlp.experts.E.gate_proj.weight`; Mixtral:
//!   `block_sparse_moe.experts.E.w1.weight`);
//! - `*.layers.L.<block>.shared_expert.<projection>.<part>` and
//!   `shared_experts` (Qwen2-MoE, DeepSeek; `shared_experts.N.` numbered
//!   too): the layer's shared experts;
//! - `*.layers.L.<block>.experts.<projection>[_<part>]`: fused, one tensor
//!   per projection whose first dimension is the expert
//!   (`mlp.experts.gate_up_proj` `[E, ...]`, `down_proj_bias`, GPT-OSS,
//!   Llama 4); expert `e` is rows `e..e + 1` ([`TensorRef::rows`]).
//!
//! The part is the name's last component (`weight`, `bias`, `weight_scale`,
//! `weight_scale_inv`, `scales`, `qweight`, ...; for a fused name, a known
//! suffix such as `_bias`, `_scales` or `_blocks`, else `weight`), so
//! quantization companions stay with their projection. Tensors of a
//! layer's expert block that belong to no expert (the router `gate.weight`,
//! `shared_expert_gate.weight`, a fused tensor that is not per expert) are
//! the layer's [`ExpertLayer::other_tensors`].
//!
//! Recognition is pure and total: any name is either recognised or left
//! out; numbers are parsed as `u32` and kept in maps, never used to size a
//! vector, so a hostile name cannot make the view large.

use std::collections::BTreeMap;

use crate::error::{ExpertsError, Result};
use crate::format::catalog::TensorRef;

/// Parts that are a projection's weight, in the order [`Projection::weight`]
/// prefers them.
const WEIGHT_PARTS: [&str; 4] = ["weight", "qweight", "weight_packed", "blocks"];

/// Suffixes of a fused tensor's one-part name that name its part
/// (`gate_up_proj_bias` is part `bias` of `gate_up_proj`), longest first.
const FUSED_SUFFIXES: [&str; 14] = [
    "_weight_scale_inv",
    "_weight_scale_2",
    "_weight_packed",
    "_weight_scale",
    "_input_scale",
    "_qweight",
    "_weight",
    "_qzeros",
    "_scales",
    "_blocks",
    "_scale",
    "_zeros",
    "_g_idx",
    "_bias",
];

/// The most experts a fused tensor is split into: a first dimension larger
/// than this is not an expert count (real models have at most a few
/// thousand experts a layer), and the tensor stays whole, in
/// [`ExpertLayer::other_tensors`].
pub const MAX_FUSED_EXPERTS: usize = 1 << 16;

/// Which expert a recognised name belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    /// Routed expert `E`, one tensor per projection.
    Routed(usize),
    /// Every routed expert at once: the first dimension is the expert.
    Fused,
    /// A shared expert (`shared_experts.N.` numbered, or not).
    Shared(Option<usize>),
}

/// What one tensor name says about experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parsed<'a> {
    /// The layer number.
    pub(crate) layer: usize,
    /// The name up to the expert part, with its dot (`model.layers.3.mlp.`).
    pub(crate) block: &'a str,
    /// Which expert.
    pub(crate) role: Role,
    /// The projection (`gate_proj`, `w1`, `gate_up_proj`).
    pub(crate) projection: String,
    /// The part of the projection (`weight`, `bias`, `weight_scale`).
    pub(crate) part: String,
}

/// A name part that is a number: ASCII digits only, at most `u32::MAX`.
fn number(part: &str) -> Option<usize> {
    if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    part.parse::<u32>().ok().map(|n| n as usize)
}

/// Recognises one tensor name, or `None` for a name of no known
/// convention (see the module's documentation).
pub(crate) fn parse(name: &str) -> Option<Parsed<'_>> {
    let parts: Vec<&str> = name.split('.').collect();
    let k = parts
        .iter()
        .position(|p| matches!(*p, "experts" | "shared_expert" | "shared_experts"))?;
    // The nearest `layers.L` before the expert part.
    let layer_at = (0..k.saturating_sub(1))
        .rev()
        .find(|&i| parts[i] == "layers" && number(parts[i + 1]).is_some())?;
    let layer = number(parts[layer_at + 1])?;
    let block_len: usize = parts[..k].iter().map(|p| p.len() + 1).sum();
    let block = &name[..block_len];
    let mut rest = &parts[k + 1..];
    let index = rest.first().and_then(|p| number(p));
    if index.is_some() {
        rest = &rest[1..];
    }
    let role = match (parts[k], index) {
        ("experts", Some(e)) => Role::Routed(e),
        ("experts", None) => Role::Fused,
        (_, n) => Role::Shared(n),
    };
    if rest.is_empty() || rest.iter().any(|p| p.is_empty()) {
        return None;
    }
    let (projection, part) = match rest {
        [one] => split_suffix(one),
        [proj @ .., part] => (proj.join("."), part.to_string()),
        [] => return None,
    };
    Some(Parsed {
        layer,
        block,
        role,
        projection,
        part,
    })
}

/// A one-part projection name and its part: `gate_up_proj_bias` ->
/// (`gate_up_proj`, `bias`); no known suffix: the part is `weight`.
fn split_suffix(one: &str) -> (String, String) {
    for suffix in FUSED_SUFFIXES {
        if let Some(proj) = one.strip_suffix(suffix).filter(|p| !p.is_empty()) {
            return (proj.to_string(), suffix[1..].to_string());
        }
    }
    (one.to_string(), "weight".to_string())
}

/// One projection of an expert (`gate_proj`, `w1`, `gate_up_proj`): its
/// weight and the companions stored beside it (`bias`, `weight_scale`,
/// `scales`, ...), each a tensor reference an engine reads like any other
/// (for a fused tensor, the expert's rows of it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    name: String,
    parts: BTreeMap<String, TensorRef>,
}

impl Projection {
    /// The projection's name as the model spells it (`gate_proj`, `w1`,
    /// `gate_up_proj`): not renamed across conventions.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The weight: the part named `weight`, else `qweight`,
    /// `weight_packed` or `blocks` (quantized layouts); `None` when the
    /// projection has only companions.
    pub fn weight(&self) -> Option<&TensorRef> {
        WEIGHT_PARTS.iter().find_map(|p| self.parts.get(*p))
    }

    /// The part named `part` (`weight`, `bias`, `weight_scale`, ...).
    pub fn part(&self, part: &str) -> Option<&TensorRef> {
        self.parts.get(part)
    }

    /// Every part, by name: the weight and its companions.
    pub fn parts(&self) -> impl Iterator<Item = (&str, &TensorRef)> + '_ {
        self.parts.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The parts other than [`Projection::weight`].
    pub fn companions(&self) -> impl Iterator<Item = (&str, &TensorRef)> + '_ {
        let weight = self.weight().map(|w| w.name.as_str());
        self.parts
            .iter()
            .filter(move |(_, t)| Some(t.name.as_str()) != weight)
            .map(|(k, v)| (k.as_str(), v))
    }

    /// Payload bytes of every part.
    pub fn bytes(&self) -> u64 {
        self.parts.values().map(|t| t.len).sum()
    }
}

/// One expert of one layer: a routed expert (numbered) or a shared one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expert {
    layer: usize,
    index: Option<usize>,
    shared: bool,
    projections: BTreeMap<String, Projection>,
}

impl Expert {
    fn new(layer: usize, index: Option<usize>, shared: bool) -> Self {
        Expert {
            layer,
            index,
            shared,
            projections: BTreeMap::new(),
        }
    }

    /// The layer it belongs to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Its number: the routed expert's, a numbered shared expert's
    /// (`shared_experts.N.`), `None` for an unnumbered shared expert.
    pub fn index(&self) -> Option<usize> {
        self.index
    }

    /// Whether it is one of the layer's shared experts (always active).
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// The projection named `name`, or an error naming those it has.
    pub fn projection(&self, name: &str) -> Result<&Projection> {
        self.projections.get(name).ok_or_else(|| {
            ExpertsError::NoSuchProjection {
                expert: self.describe(),
                projection: name.to_string(),
                have: self.projections.keys().cloned().collect(),
            }
            .into()
        })
    }

    /// Its projections, by name.
    pub fn projections(&self) -> impl Iterator<Item = (&str, &Projection)> + '_ {
        self.projections.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Every tensor to read for this expert (every part of every
    /// projection, in name order); for fused tensors, its rows.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorRef> + '_ {
        self.projections.values().flat_map(|p| p.parts.values())
    }

    /// Payload bytes of the whole expert.
    pub fn bytes(&self) -> u64 {
        self.projections.values().map(Projection::bytes).sum()
    }

    /// `layer 3 expert 17`, `layer 3 shared expert`.
    pub fn describe(&self) -> String {
        match (self.shared, self.index) {
            (false, Some(e)) => format!("layer {} expert {e}", self.layer),
            (true, Some(e)) => format!("layer {} shared expert {e}", self.layer),
            (_, None) => format!("layer {} shared expert", self.layer),
        }
    }

    /// Adds a part; the first tensor for a (projection, part) stays.
    fn add(&mut self, projection: &str, part: &str, t: TensorRef) {
        self.projections
            .entry(projection.to_string())
            .or_insert_with(|| Projection {
                name: projection.to_string(),
                parts: BTreeMap::new(),
            })
            .parts
            .entry(part.to_string())
            .or_insert(t);
    }
}

/// One layer's experts: routed (by number), shared, and the block's other
/// tensors (the router).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayer {
    index: usize,
    block: String,
    experts: BTreeMap<usize, Expert>,
    shared: Vec<Expert>,
    others: BTreeMap<String, TensorRef>,
    fused: bool,
}

impl ExpertLayer {
    /// The layer number.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The name prefix of the layer's expert block, with its dot
    /// (`model.layers.3.mlp.`).
    pub fn block(&self) -> &str {
        &self.block
    }

    /// Routed expert `expert`, or an error naming how many the layer has.
    pub fn expert(&self, expert: usize) -> Result<&Expert> {
        self.experts.get(&expert).ok_or_else(|| {
            ExpertsError::NoSuchExpert {
                layer: self.index,
                expert,
                count: self.experts.len(),
                highest: self.experts.keys().next_back().copied().unwrap_or(0),
            }
            .into()
        })
    }

    /// The routed experts, by number.
    pub fn experts(&self) -> impl Iterator<Item = &Expert> + '_ {
        self.experts.values()
    }

    /// How many routed experts the layer has (numbered `0..count` unless
    /// the model skips numbers).
    pub fn expert_count(&self) -> usize {
        self.experts.len()
    }

    /// The shared experts (usually none or one), unnumbered first.
    pub fn shared(&self) -> &[Expert] {
        &self.shared
    }

    /// Whether the routed experts come from fused tensors (one `[E, ...]`
    /// tensor per projection, each expert a row range of it).
    pub fn is_fused(&self) -> bool {
        self.fused
    }

    /// The expert block's tensors that belong to no expert, by the name
    /// after [`ExpertLayer::block`]: the router (`gate.weight`,
    /// `router.weight`), `shared_expert_gate.weight`, a fused tensor that
    /// is not per expert.
    pub fn other_tensors(&self) -> impl Iterator<Item = (&str, &TensorRef)> + '_ {
        self.others.iter().map(|(k, v)| (k.as_str(), v))
    }
}

/// The experts of a model, by layer ([`Model::experts`](crate::Model::experts)):
/// `model.experts()?.layer(3)?.expert(17)?` is one expert, whose
/// [`Expert::tensors`] are exactly the bytes to read for it.
///
/// Conventions recognised: `layers.L.<block>.experts.E.<projection>.<part>`
/// (Qwen, DeepSeek, Mixtral in Hugging Face form, Mixtral's
/// `block_sparse_moe.experts.E.w1.weight`), `shared_expert` /
/// `shared_experts` (a layer's shared experts), and fused
/// `layers.L.<block>.experts.<projection>` tensors of shape `[E, ...]`
/// (GPT-OSS, Llama 4: expert `e` is rows `e..e + 1`). A layer's experts
/// are those of one block (the first in name order); a second expert block
/// under the same layer number is left out. Projection names are the
/// model's own (`w1` stays `w1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Experts {
    layers: BTreeMap<usize, ExpertLayer>,
}

impl Experts {
    /// The view of `tensors` (any order; a name of no known convention is
    /// left out).
    pub(crate) fn from_tensors(tensors: &[TensorRef]) -> Experts {
        let mut layers: BTreeMap<usize, ExpertLayer> = BTreeMap::new();
        // Fused parts per layer, until the expert count is known.
        let mut fused: BTreeMap<usize, Vec<(String, String, &TensorRef)>> = BTreeMap::new();
        let mut shared: BTreeMap<usize, BTreeMap<Option<usize>, Expert>> = BTreeMap::new();
        let mut sorted: Vec<&TensorRef> = tensors.iter().collect();
        sorted.sort_by(|a, b| a.name.cmp(&b.name));
        let mut taken = vec![false; sorted.len()];
        for (i, t) in sorted.iter().enumerate() {
            let Some(p) = parse(&t.name) else { continue };
            let layer = layers.entry(p.layer).or_insert_with(|| ExpertLayer {
                index: p.layer,
                block: p.block.to_string(),
                experts: BTreeMap::new(),
                shared: Vec::new(),
                others: BTreeMap::new(),
                fused: false,
            });
            if layer.block != p.block {
                continue;
            }
            taken[i] = true;
            match p.role {
                Role::Routed(e) => layer
                    .experts
                    .entry(e)
                    .or_insert_with(|| Expert::new(p.layer, Some(e), false))
                    .add(&p.projection, &p.part, (*t).clone()),
                Role::Fused => fused.entry(p.layer).or_default().push((p.projection, p.part, t)),
                Role::Shared(n) => shared
                    .entry(p.layer)
                    .or_default()
                    .entry(n)
                    .or_insert_with(|| Expert::new(p.layer, n, true))
                    .add(&p.projection, &p.part, (*t).clone()),
            }
        }
        for (l, parts) in fused {
            let layer = layers.get_mut(&l).expect("a fused part's layer was made with it");
            split_fused(layer, parts);
        }
        for (l, by_index) in shared {
            if let Some(layer) = layers.get_mut(&l) {
                layer.shared = by_index.into_values().collect();
            }
        }
        // The block's other tensors: names under a layer's block that are
        // no expert's.
        for (i, t) in sorted.iter().enumerate() {
            if taken[i] {
                continue;
            }
            let parts: Vec<&str> = t.name.split('.').collect();
            let at = parts
                .windows(2)
                .filter(|w| w[0] == "layers")
                .filter_map(|w| number(w[1]))
                .find(|l| {
                    layers
                        .get(l)
                        .is_some_and(|layer| t.name.starts_with(layer.block.as_str()))
                });
            if let Some(layer) = at.and_then(|l| layers.get_mut(&l)) {
                let key = t.name[layer.block.len()..].to_string();
                layer.others.entry(key).or_insert_with(|| (*t).clone());
            }
        }
        layers.retain(|_, l| !l.experts.is_empty() || !l.shared.is_empty());
        Experts { layers }
    }

    /// Whether no expert was recognised.
    pub(crate) fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// One past the highest layer number that has experts.
    pub fn layer_count(&self) -> usize {
        self.layers.keys().next_back().map_or(0, |l| l + 1)
    }

    /// Layer `layer`'s experts; an error when it is past the last layer
    /// with experts (naming the count) or has none (a dense layer, naming
    /// the layers that have them).
    pub fn layer(&self, layer: usize) -> Result<&ExpertLayer> {
        let layers = self.layer_count();
        if layer >= layers {
            return Err(ExpertsError::LayerOutOfRange { layer, layers }.into());
        }
        self.layers.get(&layer).ok_or_else(|| {
            ExpertsError::LayerWithoutExperts {
                layer,
                layers,
                with: self.layers.len(),
                list: ranges(self.layers.keys().copied()),
            }
            .into()
        })
    }

    /// The layers that have experts, by number.
    pub fn layers(&self) -> impl Iterator<Item = &ExpertLayer> + '_ {
        self.layers.values()
    }

    /// Routed expert `expert` of layer `layer`: `self.layer(layer)?.expert(expert)`.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<&Expert> {
        self.layer(layer)?.expert(expert)
    }
}

/// A layer's fused parts split into its experts: the expert count is the
/// first dimension of the fused weights (the first in name order, else of
/// any part); a part of another first dimension, a scalar, one whose rows
/// are not whole bytes or empty, or a count over [`MAX_FUSED_EXPERTS`]
/// stays whole in the layer's other tensors.
fn split_fused(layer: &mut ExpertLayer, parts: Vec<(String, String, &TensorRef)>) {
    let first_dim = |t: &TensorRef| t.shape.first().copied();
    let count = parts
        .iter()
        .find(|(_, part, _)| WEIGHT_PARTS.contains(&part.as_str()))
        .or(parts.first())
        .and_then(|(_, _, t)| first_dim(t))
        .filter(|&n| n > 0 && n <= MAX_FUSED_EXPERTS);
    for (projection, part, t) in parts {
        let splits = count.filter(|&n| first_dim(t) == Some(n) && t.rows(0..1).is_ok_and(|r| r.len > 0));
        let Some(n) = splits else {
            let key = t.name[layer.block.len()..].to_string();
            layer.others.entry(key).or_insert_with(|| t.clone());
            continue;
        };
        layer.fused = true;
        for e in 0..n {
            let Ok(rows) = t.rows(e..e + 1) else { continue };
            layer
                .experts
                .entry(e)
                .or_insert_with(|| Expert::new(layer.index, Some(e), false))
                .add(&projection, &part, rows);
        }
    }
}

/// Sorted numbers as ranges: `0, 3-60`.
fn ranges(numbers: impl Iterator<Item = usize>) -> String {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for n in numbers {
        match out.last_mut() {
            Some((_, hi)) if hi.checked_add(1) == Some(n) => *hi = n,
            _ => out.push((n, n)),
        }
    }
    out.iter()
        .map(|&(lo, hi)| if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::Dtype;
    #[cfg(not(miri))]
    use proptest::strategy::Strategy as _;

    fn p(name: &str) -> Option<(usize, Role, String, String)> {
        parse(name).map(|p| (p.layer, p.role, p.projection, p.part))
    }

    fn some(layer: usize, role: Role, proj: &str, part: &str) -> Option<(usize, Role, String, String)> {
        Some((layer, role, proj.to_string(), part.to_string()))
    }

    /// A reference with `shape` of BF16 at a made-up offset.
    fn t(name: &str, shape: &[usize]) -> TensorRef {
        let len = shape.iter().product::<usize>() as u64 * 2;
        TensorRef {
            name: name.to_string(),
            shard: 0,
            offset: 4096,
            len,
            dtype: Dtype::Bf16,
            shape: shape.to_vec(),
            index: 0,
        }
    }

    #[test]
    fn qwen_deepseek_mixtral_hf_names() {
        assert_eq!(
            p("model.layers.3.mlp.experts.17.gate_proj.weight"),
            some(3, Role::Routed(17), "gate_proj", "weight")
        );
        assert_eq!(
            p("model.layers.0.mlp.experts.255.down_proj.weight_scale_inv"),
            some(0, Role::Routed(255), "down_proj", "weight_scale_inv")
        );
        assert_eq!(
            p("model.layers.12.mlp.experts.3.up_proj.qweight"),
            some(12, Role::Routed(3), "up_proj", "qweight")
        );
        // The block and the prefix before `layers` are free.
        assert_eq!(
            p("model.language_model.layers.1.feed_forward.experts.2.w2.weight"),
            some(1, Role::Routed(2), "w2", "weight")
        );
        assert_eq!(
            p("layers.4.ffn.experts.9.w1.weight"),
            some(4, Role::Routed(9), "w1", "weight")
        );
        assert_eq!(
            parse("model.layers.3.mlp.experts.17.gate_proj.weight").unwrap().block,
            "model.layers.3.mlp."
        );
    }

    #[test]
    fn mixtral_names() {
        for (w, part) in [("w1", "weight"), ("w2", "weight"), ("w3", "bias")] {
            assert_eq!(
                p(&format!("model.layers.31.block_sparse_moe.experts.7.{w}.{part}")),
                some(31, Role::Routed(7), w, part)
            );
        }
    }

    #[test]
    fn shared_expert_names() {
        assert_eq!(
            p("model.layers.2.mlp.shared_expert.up_proj.weight"),
            some(2, Role::Shared(None), "up_proj", "weight")
        );
        assert_eq!(
            p("model.layers.2.mlp.shared_experts.down_proj.weight"),
            some(2, Role::Shared(None), "down_proj", "weight")
        );
        assert_eq!(
            p("model.layers.2.mlp.shared_experts.1.gate_proj.weight"),
            some(2, Role::Shared(Some(1)), "gate_proj", "weight")
        );
        // The shared expert's gate is not an expert.
        assert_eq!(p("model.layers.2.mlp.shared_expert_gate.weight"), None);
    }

    #[test]
    fn fused_names() {
        assert_eq!(
            p("model.layers.5.mlp.experts.gate_up_proj"),
            some(5, Role::Fused, "gate_up_proj", "weight")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.gate_up_proj_bias"),
            some(5, Role::Fused, "gate_up_proj", "bias")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.down_proj_blocks"),
            some(5, Role::Fused, "down_proj", "blocks")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.down_proj_scales"),
            some(5, Role::Fused, "down_proj", "scales")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.w13_weight_scale"),
            some(5, Role::Fused, "w13", "weight_scale")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.w2_weight"),
            some(5, Role::Fused, "w2", "weight")
        );
        assert_eq!(
            p("model.layers.5.mlp.experts.gate_up_proj.weight"),
            some(5, Role::Fused, "gate_up_proj", "weight")
        );
    }

    #[test]
    fn other_names_are_not_experts() {
        for name in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.x.mlp.experts.0.w1.weight",
            "model.layers.-1.mlp.experts.0.w1.weight",
            "model.layers.99999999999.mlp.experts.0.w1.weight",
            "model.layers.0.mlp.experts",
            "model.layers.0.mlp.experts.3",
            "model.layers.0.mlp.experts.3.",
            "model.layers.0.mlp.experts..w1",
            "experts.3.w1.weight",
            "model.layers.experts.3.w1.weight",
            "",
            ".",
        ] {
            assert_eq!(p(name), None, "{name}");
        }
    }

    #[test]
    fn view_of_unfused_layers_with_companions_shared_and_router() {
        let mut names = vec![
            t("model.embed_tokens.weight", &[8, 4]),
            t("model.layers.0.mlp.gate_proj.weight", &[4, 4]),
        ];
        for l in 1..3 {
            names.push(t(&format!("model.layers.{l}.mlp.gate.weight"), &[3, 4]));
            names.push(t(
                &format!("model.layers.{l}.mlp.shared_expert.up_proj.weight"),
                &[4, 4],
            ));
            names.push(t(&format!("model.layers.{l}.mlp.shared_expert_gate.weight"), &[1, 4]));
            for e in 0..3 {
                for proj in ["gate_proj", "up_proj", "down_proj"] {
                    names.push(t(&format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight"), &[4, 4]));
                    names.push(t(
                        &format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight_scale"),
                        &[1],
                    ));
                }
            }
        }
        let x = Experts::from_tensors(&names);
        assert_eq!(x.layer_count(), 3);
        assert_eq!(x.layers().map(ExpertLayer::index).collect::<Vec<_>>(), [1, 2]);
        let layer = x.layer(2).unwrap();
        assert_eq!((layer.expert_count(), layer.is_fused()), (3, false));
        assert_eq!(layer.block(), "model.layers.2.mlp.");
        let e = layer.expert(1).unwrap();
        assert_eq!((e.layer(), e.index(), e.is_shared()), (2, Some(1), false));
        let names_of = |e: &Expert| e.tensors().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names_of(e).len(), 6);
        assert!(names_of(e)
            .iter()
            .all(|n| n.starts_with("model.layers.2.mlp.experts.1.")));
        let gate = e.projection("gate_proj").unwrap();
        assert_eq!(
            gate.weight().unwrap().name,
            "model.layers.2.mlp.experts.1.gate_proj.weight"
        );
        assert_eq!(gate.companions().map(|(k, _)| k).collect::<Vec<_>>(), ["weight_scale"]);
        assert_eq!(e.bytes(), 3 * (32 + 2));
        let shared = layer.shared();
        assert_eq!(shared.len(), 1);
        assert!(shared[0].is_shared() && shared[0].index().is_none());
        assert_eq!(shared[0].projections().map(|(k, _)| k).collect::<Vec<_>>(), ["up_proj"]);
        assert_eq!(
            layer.other_tensors().map(|(k, _)| k).collect::<Vec<_>>(),
            ["gate.weight", "shared_expert_gate.weight"]
        );
        // Errors name what there is.
        let err = |r: Result<&ExpertLayer>| r.unwrap_err().to_string();
        assert!(err(x.layer(0)).contains("layer 0 has no experts") && err(x.layer(0)).contains("1-2"));
        assert!(err(x.layer(3)).contains("layer 3 is out of range") && err(x.layer(3)).contains("3 layer(s)"));
        let e = x.expert(1, 3).unwrap_err().to_string();
        assert!(
            e.contains("layer 1 has no expert 3") && e.contains("3 routed expert(s), numbered 0 to 2"),
            "{e}"
        );
        let e = x.expert(1, 0).unwrap().projection("w1").unwrap_err().to_string();
        assert!(
            e.contains("layer 1 expert 0 has no projection \"w1\"")
                && e.contains("\"down_proj\", \"gate_proj\", \"up_proj\""),
            "{e}"
        );
    }

    #[test]
    fn view_of_mixtral_layers() {
        let mut names = Vec::new();
        for e in [0usize, 1, 5] {
            for w in ["w1", "w2", "w3"] {
                names.push(t(
                    &format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"),
                    &[2, 2],
                ));
            }
        }
        names.push(t("model.layers.0.block_sparse_moe.gate.weight", &[8, 2]));
        let x = Experts::from_tensors(&names);
        let layer = x.layer(0).unwrap();
        assert_eq!(layer.expert_count(), 3);
        assert_eq!(
            layer
                .expert(5)
                .unwrap()
                .projections()
                .map(|(k, _)| k)
                .collect::<Vec<_>>(),
            ["w1", "w2", "w3"]
        );
        let e = layer.expert(2).unwrap_err().to_string();
        assert!(e.contains("numbered up to 5 with gaps"), "{e}");
        assert_eq!(
            layer.other_tensors().map(|(k, _)| k).collect::<Vec<_>>(),
            ["gate.weight"]
        );
    }

    #[test]
    fn fused_tensors_split_into_row_ranges() {
        // 4 experts; gate_up [4, 6, 2], its bias [4, 6], down [4, 2, 3];
        // a per-tensor scale of another first dimension stays whole.
        let gate_up = t("model.layers.0.mlp.experts.gate_up_proj", &[4, 6, 2]);
        let bias = t("model.layers.0.mlp.experts.gate_up_proj_bias", &[4, 6]);
        let down = t("model.layers.0.mlp.experts.down_proj", &[4, 2, 3]);
        let scale = t("model.layers.0.mlp.experts.down_proj_scale", &[1]);
        let router = t("model.layers.0.mlp.router.weight", &[4, 2]);
        let x = Experts::from_tensors(&[gate_up.clone(), bias.clone(), down.clone(), scale, router]);
        let layer = x.layer(0).unwrap();
        assert!(layer.is_fused());
        assert_eq!(layer.expert_count(), 4);
        let e2 = layer.expert(2).unwrap();
        let gu = e2.projection("gate_up_proj").unwrap();
        assert_eq!(gu.weight().unwrap(), &gate_up.rows(2..3).unwrap());
        assert_eq!(gu.part("bias").unwrap(), &bias.rows(2..3).unwrap());
        assert_eq!(
            e2.projection("down_proj").unwrap().weight().unwrap(),
            &down.rows(2..3).unwrap()
        );
        assert_eq!(e2.bytes(), (12 + 6 + 6) * 2);
        assert_eq!(
            layer.other_tensors().map(|(k, _)| k).collect::<Vec<_>>(),
            ["experts.down_proj_scale", "router.weight"]
        );
        // An expert's rows are disjoint from its neighbours'.
        let e3 = layer
            .expert(3)
            .unwrap()
            .projection("gate_up_proj")
            .unwrap()
            .weight()
            .unwrap()
            .clone();
        assert_eq!(gu.weight().unwrap().offset + gu.weight().unwrap().len, e3.offset);
    }

    #[test]
    fn hostile_numbers_and_shapes_stay_small() {
        let names = [
            t("model.layers.4294967295.mlp.experts.4294967295.w1.weight", &[1]),
            t("model.layers.0.mlp.experts.w1", &[usize::MAX / 2, 0]),
            t("model.layers.1.mlp.experts.w1", &[MAX_FUSED_EXPERTS + 1, 1]),
            t("model.layers.2.mlp.experts.w1", &[]),
        ];
        let x = Experts::from_tensors(&names);
        assert_eq!(x.layer_count(), 4294967296);
        assert_eq!(x.layers().count(), 1, "only the unfused one: the fused ones stay whole");
        assert!(x.layer(0).is_err());
    }

    #[test]
    fn layer_ranges_read_as_ranges() {
        assert_eq!(ranges([0, 3, 4, 5, 7].into_iter()), "0, 3-5, 7");
        assert_eq!(ranges(std::iter::empty()), "");
    }

    // Not under Miri: proptest persists failures relative to the current
    // directory.
    #[cfg(not(miri))]
    proptest::proptest! {
        /// Parsing never panics, whatever the name; recognised names keep
        /// their layer and block.
        #[test]
        fn parsing_any_name_never_panics(name in "\\PC{0,80}") {
            if let Some(p) = parse(&name) {
                proptest::prop_assert!(name.starts_with(p.block));
            }
        }

        /// Names made of the conventions' own parts, any order, any
        /// shapes: parsing and the view never panic, and every expert
        /// tensor is a part of a tensor given.
        #[test]
        fn views_of_convention_like_names_never_panic(
            names in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::prop_oneof![
                        proptest::strategy::Just("model".to_string()),
                        proptest::strategy::Just("layers".to_string()),
                        proptest::strategy::Just("experts".to_string()),
                        proptest::strategy::Just("shared_expert".to_string()),
                        proptest::strategy::Just("shared_experts".to_string()),
                        proptest::strategy::Just("mlp".to_string()),
                        proptest::strategy::Just("gate_up_proj_bias".to_string()),
                        proptest::strategy::Just("weight".to_string()),
                        proptest::strategy::Just(String::new()),
                        "[0-9]{1,12}",
                        "[a-z_]{1,8}",
                    ],
                    0..10,
                ).prop_map(|parts| parts.join(".")),
                0..24,
            ),
            shapes in proptest::collection::vec(proptest::collection::vec(0usize..70_000, 0..4), 24),
        ) {
            let mut seen = std::collections::HashSet::new();
            let tensors: Vec<TensorRef> = names
                .iter()
                .zip(&shapes)
                .filter(|(n, _)| seen.insert(n.as_str()))
                .map(|(n, s)| t(n, s))
                .collect();
            let x = Experts::from_tensors(&tensors);
            for layer in x.layers() {
                for e in layer.experts().chain(layer.shared()) {
                    for part in e.tensors() {
                        let whole = tensors.iter().find(|t| t.name == part.name);
                        proptest::prop_assert!(whole.is_some_and(|w| part.is_part_of(w)), "{}", part.name);
                    }
                }
            }
            let _ = x.layer(usize::MAX);
        }
    }
}
