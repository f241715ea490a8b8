//! Many shards: tensor name -> (shard, absolute file range, dtype, shape).
//!
//! A tensor name present in two shards is an error naming both files,
//! unless the primary directory's `model.safetensors.index.json` maps the
//! name to one of them. `config.json`, tokenizer files and the index are
//! metadata of the primary directory only; they are never read as shards.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{escape, Error, Result, SUGGESTIONS};
use crate::format::container::ShardHeader;
use crate::format::dtype::Dtype;
use crate::storage::open::{open_regular, OpenRefusal};

/// File name of the sharded-model index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest `model.safetensors.index.json` read (64 MiB). Real indexes
/// are a few MB at most (one line per tensor name); the cap keeps a link
/// to `/dev/zero` or a runaway file from growing memory without bound.
pub const MAX_INDEX_LEN: u64 = 64 << 20;

/// One shard of the catalog.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    /// The file as opened (a symlinked entry is resolved once, then opened
    /// with `O_NOFOLLOW`).
    pub path: PathBuf,
    /// The file name as listed in its directory (any bytes: names are not
    /// required to be UTF-8; [`ShardInfo::describe`] shows them escaped).
    pub name: OsString,
    /// The path as listed (before resolving a link).
    pub listed: PathBuf,
    /// The validated header.
    pub header: ShardHeader,
}

impl ShardInfo {
    /// The shard as the user sees it: the listed path, and the file it
    /// resolves to when that differs.
    pub fn describe(&self) -> String {
        if self.listed == self.path {
            escape(&self.listed)
        } else {
            format!("{} (-> {})", escape(&self.listed), escape(&self.path))
        }
    }
}

/// Where one tensor's payload lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    /// The tensor's name.
    pub name: String,
    /// Index into [`Catalog::shards`].
    pub shard: usize,
    /// Absolute file offset of the payload.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, in elements.
    pub shape: Vec<usize>,
    /// Position in the catalog's name order (a stable small id).
    pub index: usize,
}

impl TensorRef {
    /// Bytes `range` of this tensor's payload (relative to its first byte),
    /// as a reference an engine reads like any other (the same in-place,
    /// EOF and alignment rules). The dtype is kept when the range holds
    /// whole elements (shape: one dimension of that many), else it becomes
    /// `U8` (shape: the byte count). An empty or out-of-payload range is an
    /// error naming the tensor.
    pub fn byte_range(&self, range: std::ops::Range<u64>) -> Result<TensorRef> {
        if range.start >= range.end || range.end > self.len {
            return Err(Error::Config(format!(
                "tensor {}: byte range {}..{} is not inside its {} bytes",
                self.name, range.start, range.end, self.len
            )));
        }
        let len = range.end - range.start;
        let bits = self.dtype.bits() as u64;
        let whole = (range.start * 8).is_multiple_of(bits) && (len * 8).is_multiple_of(bits);
        let (dtype, shape) = if whole {
            (self.dtype, vec![(len * 8 / bits) as usize])
        } else {
            (Dtype::U8, vec![len as usize])
        };
        Ok(TensorRef {
            offset: self.offset + range.start,
            len,
            dtype,
            shape,
            ..self.clone()
        })
    }

    /// Rows `rows` of this tensor (its first dimension), as tensor-parallel
    /// loaders slice a weight: the shape keeps every other dimension. A
    /// scalar, a range outside the first dimension, or a row that is not a
    /// whole number of bytes (sub-byte dtypes) is an error naming the tensor.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Result<TensorRef> {
        let Some((&first, rest)) = self.shape.split_first() else {
            return Err(Error::Config(format!(
                "tensor {} is a scalar: it has no rows",
                self.name
            )));
        };
        if rows.start >= rows.end || rows.end > first {
            return Err(Error::Config(format!(
                "tensor {}: rows {}..{} are not inside its {first} rows",
                self.name, rows.start, rows.end
            )));
        }
        let row_bits = rest
            .iter()
            .try_fold(self.dtype.bits() as u64, |acc, &d| acc.checked_mul(d as u64))
            .filter(|b| b.is_multiple_of(8))
            .ok_or_else(|| {
                Error::Config(format!(
                    "tensor {}: a row of shape {rest:?} of {} is not a whole number of bytes",
                    self.name,
                    self.dtype.name()
                ))
            })?;
        let row = row_bits / 8;
        let mut shape = self.shape.clone();
        shape[0] = rows.end - rows.start;
        Ok(TensorRef {
            offset: self.offset + rows.start as u64 * row,
            len: (rows.end - rows.start) as u64 * row,
            shape,
            ..self.clone()
        })
    }

    /// Whether this reference reads (part of) `whole`'s payload: the same
    /// tensor (name, shard, catalog index), its bytes inside `whole`'s.
    pub(crate) fn is_part_of(&self, whole: &TensorRef) -> bool {
        self.index == whole.index
            && self.shard == whole.shard
            && self.name == whole.name
            && self.offset >= whole.offset
            && self
                .offset
                .checked_add(self.len)
                .is_some_and(|end| end <= whole.offset + whole.len)
    }
}

/// All tensors of a model.
#[derive(Debug, Clone)]
pub struct Catalog {
    dir: PathBuf,
    shards: Vec<ShardInfo>,
    tensors: Vec<TensorRef>,
    by_name: HashMap<String, usize>,
}

impl Catalog {
    /// Builds the catalog of `dir` from already opened and validated shards
    /// ([`Model::open`](crate::Model::open) does; not a stable API).
    #[doc(hidden)]
    pub fn new(dir: &Path, shards: Vec<ShardInfo>) -> Result<Self> {
        let index = read_index(dir)?;
        Self::build(dir, shards, index)
    }

    /// [`Catalog::new`] without the directory's index: some of its shards
    /// opened on their own ([`ModelConfig::only`](crate::ModelConfig::only));
    /// a name held by two of them is then an error (no index to choose).
    #[doc(hidden)]
    pub fn without_index(dir: &Path, shards: Vec<ShardInfo>) -> Result<Self> {
        Self::build(dir, shards, None)
    }

    fn build(dir: &Path, shards: Vec<ShardInfo>, index: Option<HashMap<String, String>>) -> Result<Self> {
        // Every holder of every name first, so the index can pick any of them.
        let mut holders: HashMap<&str, Vec<(usize, &crate::format::container::TensorEntry)>> = HashMap::new();
        for (si, shard) in shards.iter().enumerate() {
            for t in &shard.header.tensors {
                holders.entry(t.name.as_str()).or_default().push((si, t));
            }
        }
        let mut tensors: Vec<TensorRef> = Vec::with_capacity(holders.len());
        for (name, hs) in &holders {
            let (si, t) = if hs.len() == 1 {
                hs[0]
            } else {
                let chosen = index.as_ref().and_then(|m| m.get(*name));
                match chosen.and_then(|f| hs.iter().find(|(si, _)| shards[*si].name == OsStr::new(f))) {
                    Some(&h) => h,
                    None => {
                        let listed: Vec<String> = hs.iter().map(|(si, _)| shards[*si].describe()).collect();
                        return Err(Error::catalog(
                            dir,
                            format!(
                                "tensor {name:?} is in {}{}",
                                listed.join(" and "),
                                match chosen {
                                    Some(f) => format!(", but {INDEX_FILE} maps it to {f:?}, which does not hold it"),
                                    None => format!(", and no {INDEX_FILE} says which to use"),
                                }
                            ),
                        ));
                    }
                }
            };
            let shard = &shards[si];
            tensors.push(TensorRef {
                name: t.name.clone(),
                shard: si,
                offset: shard.header.data_start + t.begin,
                len: t.len(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                index: 0,
            });
        }
        drop(holders);
        if let Some(map) = &index {
            let mut missing: Vec<&String> = map
                .values()
                .filter(|f| !shards.iter().any(|s| s.name == OsStr::new(f.as_str())))
                .collect();
            missing.sort();
            missing.dedup();
            if !missing.is_empty() {
                return Err(Error::catalog(
                    dir.join(INDEX_FILE),
                    missing_shards(dir, &shards, &missing),
                ));
            }
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let mut by_name = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter_mut().enumerate() {
            t.index = i;
            by_name.insert(t.name.clone(), i);
        }
        Ok(Catalog {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            by_name,
        })
    }

    /// The primary directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The shards, in name order (a tensor's `shard` indexes this).
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Tensors sorted by name.
    pub fn tensors(&self) -> &[TensorRef] {
        &self.tensors
    }

    /// Looks a tensor up by name; [`Error::NoSuchTensor`](crate::Error::NoSuchTensor),
    /// with the nearest names ([`Catalog::nearest`]: one pass over the
    /// names), when absent. To ask whether an optional tensor is there (a
    /// bias, a scale), use [`Catalog::get`], which computes no suggestions.
    pub fn tensor(&self, name: &str) -> Result<&TensorRef> {
        self.get(name).ok_or_else(|| self.no_such_tensor(name))
    }

    /// The tensor named `name`, if there is one (a hash lookup, nothing
    /// else: for optional tensors; [`Catalog::tensor`] says what is near).
    pub fn get(&self, name: &str) -> Option<&TensorRef> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// [`Error::NoSuchTensor`] for `name`, with the nearest names of the
    /// catalog ([`Catalog::nearest`]).
    fn no_such_tensor(&self, name: &str) -> Error {
        let (suggestions, more) = self.nearest(name, SUGGESTIONS);
        Error::NoSuchTensor {
            name: name.to_string(),
            suggestions,
            more,
        }
    }

    /// The names nearest `name`, best first (at most `max`), and how many
    /// more near names there are. Near is: `name` with a missing or extra
    /// `model.` prefix; then a name that differs from `name` in exactly one
    /// `.`-separated part (a layer or expert number, a projection); then
    /// one part away from the prefix-toggled name. Among names one part
    /// away, the closer part comes first (numbers by difference, other
    /// parts by edit distance), then the name. No name's edit distance to
    /// the whole of `name` is computed: one pass over the names comparing
    /// bytes (the common prefix and suffix bound the one part that may
    /// differ). A miss in 100 290 names costs about 9 ms optimised and
    /// 70-110 ms in a debug build, measured on a shared 2-core machine
    /// (`nearest_in_a_catalog_of_100k_names` prints it); a hit is the
    /// hash lookup alone.
    pub fn nearest(&self, name: &str, max: usize) -> (Vec<String>, usize) {
        nearest(
            self.tensors.iter().map(|t| t.name.as_str()),
            |n| self.by_name.contains_key(n),
            name,
            max,
        )
    }

    /// Total payload bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }

    /// The largest payload among tensors whose name contains `filter`.
    pub fn largest(&self, filter: &str) -> Option<u64> {
        self.tensors
            .iter()
            .filter(|t| t.name.contains(filter))
            .map(|t| t.len)
            .max()
    }
}

/// What an index naming files that are not there says: the files, the
/// directory (and the split directories) they are missing from, and what
/// was found instead.
fn missing_shards(dir: &Path, shards: &[ShardInfo], missing: &[&String]) -> String {
    let mut dirs: Vec<&Path> = vec![dir];
    for s in shards {
        if let Some(parent) = s.listed.parent().filter(|p| !dirs.contains(p)) {
            dirs.push(parent);
        }
    }
    let files: Vec<String> = missing.iter().map(|f| format!("{f:?}")).collect();
    let place = match &dirs[1..] {
        [] => escape(dir),
        more => format!(
            "{} and the split director{} {}",
            escape(dir),
            if more.len() == 1 { "y" } else { "ies" },
            more.iter().map(escape).collect::<Vec<_>>().join(", ")
        ),
    };
    format!(
        "names {} shard file(s) that are missing from {place}: {} ({} *.safetensors file(s) found there; \
         was a download interrupted, or a shard renamed?)",
        missing.len(),
        files.join(", "),
        shards.len()
    )
}

/// `weight_map` of the primary's index, if there is one. The index is
/// opened like a shard (non-blocking, a regular file or refused; a link is
/// followed, as Hugging Face caches keep it as one) and read from the
/// descriptor with a cap of [`MAX_INDEX_LEN`] bytes.
fn read_index(dir: &Path) -> Result<Option<HashMap<String, String>>> {
    let path = dir.join(INDEX_FILE);
    let (file, st) = match open_regular(&path, false) {
        Ok(f) => f,
        Err(OpenRefusal::Io(_, e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(r) => return Err(r.into_error(&path)),
    };
    let too_big = |what: String| {
        Error::catalog(
            &path,
            format!("{what} the {MAX_INDEX_LEN}-byte limit for an index: refused"),
        )
    };
    if st.st_size as u64 > MAX_INDEX_LEN {
        return Err(too_big(format!("is {} bytes, over", st.st_size)));
    }
    let mut bytes = Vec::with_capacity(st.st_size as usize);
    (&file)
        .take(MAX_INDEX_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(&path, "read index", e))?;
    if bytes.len() as u64 > MAX_INDEX_LEN {
        return Err(too_big("grew while being read, past".to_string()));
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let idx: Index =
        serde_json::from_slice(&bytes).map_err(|e| Error::catalog(&path, format!("invalid index: {e}")))?;
    Ok(Some(idx.weight_map))
}

/// The prefix a suggestion may add to or drop from a name asked for.
const MODEL_PREFIX: &str = "model.";

/// [`Catalog::nearest`] over `names` (`contains`: whether a name is one of
/// them, in O(1)).
fn nearest<'a>(
    names: impl Iterator<Item = &'a str>,
    contains: impl Fn(&str) -> bool,
    name: &str,
    max: usize,
) -> (Vec<String>, usize) {
    let toggled = match name.strip_prefix(MODEL_PREFIX) {
        Some(rest) => rest.to_string(),
        None => format!("{MODEL_PREFIX}{name}"),
    };
    // (tier, distance of the differing part, name): sorted, best first.
    let mut near: Vec<(u8, u64, &str)> = Vec::new();
    let exact = contains(&toggled);
    for n in names {
        if exact && n == toggled {
            continue;
        }
        if let Some(d) = one_part_away(n, name) {
            near.push((1, d, n));
        } else if let Some(d) = one_part_away(n, &toggled) {
            near.push((2, d, n));
        }
    }
    near.sort_unstable();
    let total = near.len() + usize::from(exact);
    let mut out: Vec<String> = Vec::with_capacity(max.min(total));
    if exact && max > 0 {
        out.push(toggled);
    }
    out.extend(
        near.iter()
            .take(max - out.len().min(max))
            .map(|&(_, _, n)| n.to_string()),
    );
    let shown = out.len();
    (out, total - shown)
}

/// When `a` and `b` have as many `.`-separated parts and differ in exactly
/// one: how far apart those parts are (two numbers: their difference;
/// else the edit distance). Bytes, not parts, are compared: the common
/// prefix and suffix bound the one part that may differ, and neither
/// name may hold a `.` between those bounds.
fn one_part_away(a: &str, b: &str) -> Option<u64> {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let short = x.len().min(y.len());
    let mut pre = 0;
    while pre < short && x[pre] == y[pre] {
        pre += 1;
    }
    if pre == x.len() && pre == y.len() {
        return None; // the same name
    }
    let mut suf = 0;
    while suf < short - pre && x[x.len() - 1 - suf] == y[y.len() - 1 - suf] {
        suf += 1;
    }
    // The differing part starts after the common prefix's last dot and
    // ends at the common suffix's first dot (the same bytes in both).
    let start = x[..pre].iter().rposition(|&c| c == b'.').map_or(0, |i| i + 1);
    let into_suffix = x[x.len() - suf..].iter().position(|&c| c == b'.').unwrap_or(suf);
    let (end_a, end_b) = (x.len() - suf + into_suffix, y.len() - suf + into_suffix);
    let (pa, pb) = (&a[start..end_a], &b[start..end_b]);
    if pa.contains('.') || pb.contains('.') {
        return None;
    }
    Some(part_distance(pa, pb))
}

/// How far apart two differing name parts are: numbers by their
/// difference, other parts by edit distance (parts over 64 bytes: their
/// longer length, not computed).
fn part_distance(a: &str, b: &str) -> u64 {
    let number = |s: &str| {
        (!s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    if let (Some(x), Some(y)) = (number(a), number(b)) {
        return x.abs_diff(y);
    }
    if a.len() > 64 || b.len() > 64 {
        return a.len().max(b.len()) as u64;
    }
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()] as u64
}

/// The number right after `key` in a tensor name (`index_after("model.layers.12.mlp", "layers.")`
/// is 12): layer and expert ids for routing keys and layer striping.
pub(crate) fn index_after(name: &str, key: &str) -> Option<u64> {
    let rest = &name[name.find(key)? + key.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn near(names: &[String], query: &str) -> (Vec<String>, usize) {
        let set: HashSet<&str> = names.iter().map(String::as_str).collect();
        nearest(
            names.iter().map(String::as_str),
            |n| set.contains(n),
            query,
            SUGGESTIONS,
        )
    }

    /// `layers` x `experts` x gate/up/down x weight/weight_scale_inv, plus
    /// the embedding and the head: sorted, as a catalog keeps them.
    fn moe_names(layers: usize, experts: usize) -> Vec<String> {
        let mut names = vec!["model.embed_tokens.weight".to_string(), "lm_head.weight".to_string()];
        for l in 0..layers {
            names.push(format!("model.layers.{l}.mlp.gate.weight"));
            for e in 0..experts {
                for p in ["gate_proj", "up_proj", "down_proj"] {
                    for part in ["weight", "weight_scale_inv"] {
                        names.push(format!("model.layers.{l}.mlp.experts.{e}.{p}.{part}"));
                    }
                }
            }
        }
        names.sort();
        names
    }

    #[test]
    fn a_missing_or_extra_model_prefix_comes_first() {
        let names = moe_names(2, 2);
        let (s, _) = near(&names, "layers.1.mlp.experts.0.up_proj.weight");
        assert_eq!(s[0], "model.layers.1.mlp.experts.0.up_proj.weight");
        // The prefix first, then one part away (lm_head / embed_tokens).
        let (s, more) = near(&names, "model.lm_head.weight");
        assert_eq!(
            (&s[..], more),
            (
                &["lm_head.weight".to_string(), "model.embed_tokens.weight".to_string()][..],
                0
            )
        );
    }

    #[test]
    fn one_part_away_nearest_part_first() {
        let names = moe_names(4, 8);
        // Expert 9 of 8: the nearest numbers first, then the rest counted.
        let (s, more) = near(&names, "model.layers.2.mlp.experts.9.down_proj.weight");
        assert_eq!(
            s,
            [
                "model.layers.2.mlp.experts.7.down_proj.weight",
                "model.layers.2.mlp.experts.6.down_proj.weight",
                "model.layers.2.mlp.experts.5.down_proj.weight",
                "model.layers.2.mlp.experts.4.down_proj.weight",
            ]
        );
        // Experts 0 to 7 are one part away; no other layer has an expert 9.
        assert_eq!(more, 8 - 4);
        // A misspelt projection: edit distance picks it.
        let (s, _) = near(&names, "model.layers.0.mlp.experts.1.dwn_proj.weight");
        assert_eq!(s[0], "model.layers.0.mlp.experts.1.down_proj.weight");
        // Prefix missing and a number off: both fixed.
        let (s, _) = near(&names, "layers.3.mlp.experts.8.gate_proj.weight");
        assert_eq!(s[0], "model.layers.3.mlp.experts.7.gate_proj.weight");
        // Nothing near.
        assert_eq!(near(&names, "vision.tower.patch_embed"), (vec![], 0));
        assert_eq!(near(&names, ""), (vec![], 0));
    }

    #[test]
    fn suggestions_are_deterministic() {
        let names = moe_names(3, 3);
        let mut shuffled = names.clone();
        shuffled.reverse();
        for q in [
            "model.layers.1.mlp.experts.1.up_proj.bias",
            "model.layers.9.mlp.gate.weight",
        ] {
            assert_eq!(near(&names, q), near(&shuffled, q), "{q}");
        }
    }

    #[test]
    fn part_distance_numbers_and_words() {
        assert_eq!(part_distance("3", "17"), 14);
        assert_eq!(part_distance("up_proj", "down_proj"), 4);
        assert_eq!(part_distance("dwn_proj", "down_proj"), 1);
        assert_eq!(part_distance("w1", "w3"), 1);
        assert_eq!(part_distance("", "abc"), 3);
        assert_eq!(one_part_away("a.b.c", "a.x.c"), Some(1));
        assert_eq!(one_part_away("a.b.c", "a.x.y"), None);
        assert_eq!(one_part_away("a.b", "a.b.c"), None);
        assert_eq!(one_part_away("a.b", "a.b"), None);
        assert_eq!(one_part_away("a.1.b", "a.11.b"), Some(10));
        assert_eq!(one_part_away("a.1.1", "a.1.1.1"), None);
        assert_eq!(one_part_away("aa", "aaa"), Some(1));
        assert_eq!(one_part_away("x", "y"), Some(1));
        assert_eq!(one_part_away("", "y"), Some(1));
        assert_eq!(one_part_away("a.", "a.b"), Some(1));
        assert_eq!(one_part_away("caf\u{e9}.x", "caf\u{e8}.x"), Some(1));
    }

    /// The cost of a miss in a catalog of 100 000 names (printed; no test
    /// bounds a time): one pass, parts compared.
    #[test]
    fn nearest_in_a_catalog_of_100k_names() {
        let names = moe_names(64, 261);
        assert!(names.len() >= 100_000, "{}", names.len());
        let set: HashSet<&str> = names.iter().map(String::as_str).collect();
        let queries = [
            "model.layers.99.mlp.experts.3.gate_proj.weight",
            "layers.3.mlp.experts.300.gate_proj.weight",
            "model.layers.3.mlp.experts.3.gate.weight",
            "nothing.like.it",
        ];
        let t0 = std::time::Instant::now();
        let mut found = Vec::new();
        for q in queries {
            found.push(nearest(
                names.iter().map(String::as_str),
                |n| set.contains(n),
                q,
                SUGGESTIONS,
            ));
        }
        let each = t0.elapsed() / queries.len() as u32;
        println!("nearest over {} names: {each:?} a miss", names.len());
        assert_eq!(found[0].0[0], "model.layers.63.mlp.experts.3.gate_proj.weight");
        assert_eq!(found[1].0[0], "model.layers.3.mlp.experts.260.gate_proj.weight");
        assert_eq!(found[2].0[0], "model.layers.3.mlp.experts.3.gate_proj.weight");
        assert!(found[3].0.is_empty());
    }
}
