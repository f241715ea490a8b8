//! One `.safetensors` shard: the header, read and validated without reading
//! the data section.
//!
//! Layout: 8-byte little-endian header length `n`, `n` bytes of JSON, then
//! the data section. The `safetensors` crate's `Metadata` deserialisation
//! checks dtypes, that offsets are sorted-contiguous from 0, and that
//! dtype x shape equals each byte length; this module adds the checks it
//! leaves to callers that hold the whole file (length bounds against the
//! file size, the leading `{`, and `8 + n + data == size`), so only the
//! header has to be in memory.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata};

use crate::error::{Error, HeaderError, Result};

/// The largest header accepted, as in the reference reader (100 MB).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor of a shard, with its range relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// `[begin, end)` relative to the start of the data section.
    pub begin: u64,
    pub end: u64,
}

impl TensorEntry {
    pub fn len(&self) -> u64 {
        self.end - self.begin
    }

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
    /// Reads and validates the header of an open shard.
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
    /// fuzz target drives it.
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
    let meta: Metadata = serde_json::from_str(text).map_err(|e| HeaderError::Invalid(e.to_string()))?;
    let data_len = meta.data_len() as u64;
    let expected = (8 + n).saturating_add(data_len);
    if expected != size {
        return Err(HeaderError::SizeMismatch {
            header_len: n,
            data_len,
            expected,
            size,
        });
    }
    let tensors = meta
        .offset_keys()
        .into_iter()
        .map(|name| {
            let info = meta.info(&name).expect("offset_keys names come from the table");
            TensorEntry {
                dtype: info.dtype,
                shape: info.shape.clone(),
                begin: info.data_offsets.0 as u64,
                end: info.data_offsets.1 as u64,
                name,
            }
        })
        .collect();
    Ok(ShardHeader {
        header_len: n,
        data_start: 8 + n,
        file_size: size,
        tensors,
        metadata: meta.metadata().clone(),
        raw,
    })
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
