//! One `.safetensors` shard: the header, read and validated without reading
//! the data section.
//!
//! Layout: 8-byte little-endian header length `n`, `n` bytes of JSON, then
//! the data section. Every check of the reference reader (safetensors 0.8)
//! is made here, on the header alone: the JSON table (tensor entries of
//! `dtype`, `shape`, `data_offsets`, and an optional `__metadata__` map of
//! strings, deserialised the way the reference does), dtypes
//! ([`Dtype`]: exactly the reference's list), offsets sorted-contiguous
//! from 0, dtype x shape = byte length (sub-byte dtypes must fill whole
//! bytes; overflow refused), and `8 + n + data == file size`. Stricter than
//! the reference: the header must start with `{`. Only the header has to
//! be in memory.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, HeaderError, Result};
use crate::format::dtype::Dtype;

/// The largest header accepted, as in the reference reader (100 MB).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor of a shard, with its range relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, in elements.
    pub shape: Vec<usize>,
    /// `[begin, end)` relative to the start of the data section.
    pub begin: u64,
    /// End of the payload (exclusive), relative to the data section.
    pub end: u64,
}

impl TensorEntry {
    /// Payload bytes.
    pub fn len(&self) -> u64 {
        self.end - self.begin
    }

    /// A zero-length payload.
    pub fn is_empty(&self) -> bool {
        self.begin == self.end
    }
}

/// A validated shard header.
#[derive(Debug, Clone)]
pub struct ShardHeader {
    /// Length of the JSON header (`n`).
    pub header_len: u64,
    /// File offset of the data section (`8 + n`).
    pub data_start: u64,
    /// File size the header was validated against.
    pub file_size: u64,
    /// Tensors in file order.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` table, if any.
    pub metadata: Option<std::collections::HashMap<String, String>>,
    /// The raw header bytes (length prefix included): mirrors must match them
    /// exactly.
    pub raw: Vec<u8>,
}

impl ShardHeader {
    /// Reads and validates the header of an open shard (the model's
    /// opening does this; for the tests and tools, not a stable API).
    #[doc(hidden)]
    pub fn read(path: &Path, file: &File) -> Result<Self> {
        let size = file.metadata().map_err(|e| Error::io(path, "fstat", e))?.len();
        let header_err = |cause| Error::Header {
            path: path.to_path_buf(),
            cause,
        };
        if size < 8 {
            return Err(header_err(HeaderError::TooSmallForLength { size }));
        }
        let mut len_bytes = [0u8; 8];
        read_exact_at(path, file, &mut len_bytes, 0)?;
        let n = check_length(u64::from_le_bytes(len_bytes), size).map_err(header_err)?;
        let mut raw = vec![0u8; 8 + n as usize];
        raw[..8].copy_from_slice(&len_bytes);
        read_exact_at(path, file, &mut raw[8..], 8)?;
        Self::parse(path, raw, size)
    }

    /// Validates a header already in memory: `raw` is the 8-byte length and
    /// the header bytes, `file_size` the size of the whole file. Pure; the
    /// fuzz target drives it (not a stable API).
    #[doc(hidden)]
    pub fn parse(path: &Path, raw: Vec<u8>, file_size: u64) -> Result<Self> {
        parse_raw(raw, file_size).map_err(|cause| Error::Header {
            path: path.to_path_buf(),
            cause,
        })
    }
}

fn check_length(n: u64, size: u64) -> Result<u64, HeaderError> {
    if n == 0 {
        return Err(HeaderError::LengthZero);
    }
    if n > MAX_HEADER_LEN {
        return Err(HeaderError::LengthTooLarge {
            len: n,
            max: MAX_HEADER_LEN,
        });
    }
    if n > size.saturating_sub(8) {
        return Err(HeaderError::LengthPastEof { len: n, size });
    }
    Ok(n)
}

fn parse_raw(raw: Vec<u8>, size: u64) -> Result<ShardHeader, HeaderError> {
    if raw.len() < 8 || size < 8 {
        return Err(HeaderError::TooSmallForLength {
            size: size.min(raw.len() as u64),
        });
    }
    let n = check_length(u64::from_le_bytes(raw[..8].try_into().expect("8 bytes")), size)?;
    if raw.len() as u64 != 8 + n {
        return Err(HeaderError::LengthPastEof {
            len: n,
            size: raw.len() as u64,
        });
    }
    let body = &raw[8..];
    if body[0] != b'{' {
        return Err(HeaderError::NotAnObject { first: body[0] });
    }
    let text = std::str::from_utf8(body).map_err(|e| HeaderError::Utf8(e.to_string()))?;
    let table: Table = serde_json::from_str(text).map_err(|e| {
        let m = e.to_string();
        // serde says "unknown variant"; the field it is about is a dtype.
        HeaderError::Invalid(if m.starts_with("unknown variant") {
            format!("unknown dtype: {m}")
        } else {
            m
        })
    })?;
    let tensors = validate(table.tensors).map_err(HeaderError::Invalid)?;
    let data_len = tensors.last().map_or(0, |t| t.end);
    let expected = (8 + n).saturating_add(data_len);
    if expected != size {
        return Err(HeaderError::SizeMismatch {
            header_len: n,
            data_len,
            expected,
            size,
        });
    }
    Ok(ShardHeader {
        header_len: n,
        data_start: 8 + n,
        file_size: size,
        tensors,
        metadata: table.metadata,
        raw,
    })
}

/// The JSON table as the reference reader deserialises it (its
/// `HashMetadata`): `__metadata__` (null or a map of strings), every other
/// key a tensor. Deriving the same shapes keeps the same acceptance,
/// quirks included (a later duplicate key replaces an earlier one; a tensor
/// entry may be an object or a 3-element array; unknown fields are
/// ignored).
#[derive(serde::Deserialize)]
struct Table {
    #[serde(rename = "__metadata__")]
    metadata: Option<HashMap<String, String>>,
    #[serde(flatten)]
    tensors: HashMap<String, Info>,
}

#[derive(serde::Deserialize)]
struct Info {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Sorts the tensors by offsets (then name, so the order is deterministic
/// where zero-length tensors share an offset) and checks each: offsets
/// contiguous from 0, `dtype x shape` a whole number of bytes (sub-byte
/// dtypes) equal to the span, no overflow (the reference's arithmetic, in
/// `usize`).
fn validate(table: HashMap<String, Info>) -> Result<Vec<TensorEntry>, String> {
    let mut v: Vec<(String, Info)> = table.into_iter().collect();
    v.sort_by(|(an, a), (bn, b)| a.data_offsets.cmp(&b.data_offsets).then_with(|| an.cmp(bn)));
    let mut at = 0usize;
    let mut out = Vec::with_capacity(v.len());
    for (name, info) in v {
        let (begin, end) = info.data_offsets;
        if begin != at || end < begin {
            return Err(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] do not continue where the previous tensor ends \
                 (byte {at} of the data section): offsets must be contiguous from 0, each end >= its start"
            ));
        }
        at = end;
        let shape = &info.shape;
        let dtype = info.dtype;
        let bits = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .and_then(|elements| elements.checked_mul(dtype.bits() as usize))
            .ok_or_else(|| format!("tensor {name:?}: dtype {dtype} x shape {shape:?} overflows"))?;
        if bits % 8 != 0 {
            return Err(format!(
                "tensor {name:?}: dtype {dtype} x shape {shape:?} = {bits} bits, not a whole number of bytes \
                 (sub-byte dtypes must fill their last byte)"
            ));
        }
        if bits / 8 != end - begin {
            return Err(format!(
                "tensor {name:?}: dtype {dtype} x shape {shape:?} = {} bytes, but data_offsets [{begin}, {end}] span {} bytes",
                bits / 8,
                end - begin
            ));
        }
        out.push(TensorEntry {
            name,
            dtype,
            shape: info.shape,
            begin: begin as u64,
            end: end as u64,
        });
    }
    Ok(out)
}

/// `pread` until `buf` is full; end of file is an error naming the file.
pub(crate) fn read_exact_at(path: &Path, file: &File, buf: &mut [u8], off: u64) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => {
                return Err(Error::UnexpectedEof {
                    path: PathBuf::from(path),
                    op: "read header",
                    start: off,
                    end: off + buf.len() as u64,
                    at: off + done as u64,
                })
            }
            Ok(k) => done += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, "read header", e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(header: &str, data_len: usize) -> (Vec<u8>, u64) {
        let mut raw = (header.len() as u64).to_le_bytes().to_vec();
        raw.extend_from_slice(header.as_bytes());
        let size = raw.len() as u64 + data_len as u64;
        (raw, size)
    }

    fn parse(header: &str, data_len: usize) -> Result<ShardHeader, HeaderError> {
        let (raw, size) = container(header, data_len);
        parse_raw(raw, size)
    }

    #[test]
    fn accepts_a_valid_header_of_odd_length() {
        let h = r#"{"b":{"dtype":"U8","shape":[3],"data_offsets":[4,7]},"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}} "#;
        let s = parse(h, 7).unwrap();
        assert_eq!(s.data_start, 8 + h.len() as u64);
        let names: Vec<_> = s.tensors.iter().map(|t| (t.name.as_str(), t.begin, t.end)).collect();
        assert_eq!(names, [("a", 0, 4), ("b", 4, 7)]);
    }

    #[test]
    fn refusals() {
        let ok = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(ok, 3), Err(HeaderError::SizeMismatch { .. })));
        assert!(matches!(parse(ok, 5), Err(HeaderError::SizeMismatch { .. })));
        assert!(matches!(
            parse(&format!(" {ok}"), 4),
            Err(HeaderError::NotAnObject { first: b' ' })
        ));
        let unknown = r#"{"a":{"dtype":"Q9","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(unknown, 4), Err(HeaderError::Invalid(_))));
        let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        assert!(matches!(parse(overlap, 6), Err(HeaderError::Invalid(_))));
        let gap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}}"#;
        assert!(matches!(parse(gap, 5), Err(HeaderError::Invalid(_))));
        let shape = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(matches!(parse(shape, 4), Err(HeaderError::Invalid(_))));
        assert!(matches!(parse("{not json", 0), Err(HeaderError::Invalid(_))));
        let mut raw = 3u64.to_le_bytes().to_vec();
        raw.extend_from_slice(&[b'{', 0xff, b'}']);
        assert!(matches!(parse_raw(raw, 11), Err(HeaderError::Utf8(_))));
    }

    #[test]
    fn reference_dtypes_and_sub_byte_rules() {
        // Dtypes the 0.6 crate refused and the reference reads.
        for (dt, n, bytes) in [("C64", 2, 16), ("F8_E4M3FNUZ", 3, 3), ("F8_E5M2FNUZ", 3, 3)] {
            let h = format!(r#"{{"a":{{"dtype":"{dt}","shape":[{n}],"data_offsets":[0,{bytes}]}}}}"#);
            let s = parse(&h, bytes).unwrap_or_else(|e| panic!("{dt}: {e}"));
            assert_eq!(s.tensors[0].dtype.name(), dt);
        }
        // F4 x 6 = 3 bytes; F6 x 4 = 3 bytes; F4 x 3 = 12 bits: refused.
        parse(r#"{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}"#, 3).unwrap();
        parse(r#"{"a":{"dtype":"F6_E3M2","shape":[4],"data_offsets":[0,3]}}"#, 3).unwrap();
        let e = parse(r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#, 2).unwrap_err();
        assert!(e.to_string().contains("12 bits, not a whole number of bytes"), "{e}");
        let e = parse(r#"{"a":{"dtype":"C64","shape":[2],"data_offsets":[0,8]}}"#, 8).unwrap_err();
        assert!(
            e.to_string()
                .contains("= 16 bytes, but data_offsets [0, 8] span 8 bytes"),
            "{e}"
        );
        let big = r#"{"a":{"dtype":"U64","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#;
        assert!(parse(big, 0).unwrap_err().to_string().contains("overflows"));
        // Scalars and empty tensors; zero-length tensors sharing an offset
        // come out in name order.
        let h = r#"{"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},"y":{"dtype":"BF16","shape":[0],"data_offsets":[4,4]}}"#;
        let s = parse(h, 4).unwrap();
        let names: Vec<_> = s.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["s", "y", "z"]);
        // __metadata__: strings only; null is none.
        let m = r#"{"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert_eq!(parse(m, 1).unwrap().metadata.unwrap()["k"], "v");
        let m = r#"{"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(parse(m, 1).unwrap().metadata.is_none());
        let m = r#"{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(matches!(parse(m, 1), Err(HeaderError::Invalid(_))));
        // An empty table is a valid (empty) shard.
        assert!(parse("{}", 0).unwrap().tensors.is_empty());
    }

    #[test]
    fn length_bounds() {
        assert_eq!(check_length(0, 100), Err(HeaderError::LengthZero));
        assert_eq!(
            check_length(93, 100),
            Err(HeaderError::LengthPastEof { len: 93, size: 100 })
        );
        assert_eq!(check_length(92, 100), Ok(92));
        assert!(matches!(
            check_length(MAX_HEADER_LEN + 1, u64::MAX),
            Err(HeaderError::LengthTooLarge { .. })
        ));
        assert!(matches!(
            parse_raw(vec![1, 2, 3], 3),
            Err(HeaderError::TooSmallForLength { .. })
        ));
    }
}
