//! Element types of a `.safetensors` tensor, in step with the reference
//! reader (the `safetensors` package 0.8, Python and Rust): exactly its
//! dtypes, under its names, with its element sizes in bits.
//!
//! weightstream keeps its own enum rather than the `safetensors` crate's so
//! that the dtypes it accepts follow the reference reader, not whichever
//! crate version is pinned (the 0.6 crate refuses C64 and the FNUZ FP8
//! types that the reference reads). `tests/dtypes.rs` checks the list and
//! the bit sizes against the installed reference.

use std::fmt;
use std::str::FromStr;

/// The dtype of a tensor, as named in a safetensors header.
///
/// Sub-byte dtypes (`F4`, `F6_*`) pack elements without padding: a tensor
/// of them is valid only when `bits() x elements` is a whole number of
/// bytes. New dtypes may be added as the reference adds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Dtype {
    /// Boolean, one byte per element.
    #[serde(rename = "BOOL")]
    Bool,
    /// MXFP4 (E2M1), 4 bits.
    #[serde(rename = "F4")]
    F4,
    /// MXFP6 E2M3, 6 bits.
    #[serde(rename = "F6_E2M3")]
    F6E2M3,
    /// MXFP6 E3M2, 6 bits.
    #[serde(rename = "F6_E3M2")]
    F6E3M2,
    #[serde(rename = "U8")]
    /// Unsigned 8-bit integer.
    U8,
    #[serde(rename = "I8")]
    /// Signed 8-bit integer.
    I8,
    /// FP8 E5M2.
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
    /// FP8 E4M3.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// FP8 E8M0 (MX scale).
    #[serde(rename = "F8_E8M0")]
    F8E8M0,
    /// FP8 E4M3, finite, no negative zero (FNUZ).
    #[serde(rename = "F8_E4M3FNUZ")]
    F8E4M3Fnuz,
    /// FP8 E5M2, finite, no negative zero (FNUZ).
    #[serde(rename = "F8_E5M2FNUZ")]
    F8E5M2Fnuz,
    #[serde(rename = "I16")]
    /// Signed 16-bit integer.
    I16,
    #[serde(rename = "U16")]
    /// Unsigned 16-bit integer.
    U16,
    #[serde(rename = "F16")]
    /// IEEE half precision.
    F16,
    /// bfloat16.
    #[serde(rename = "BF16")]
    Bf16,
    #[serde(rename = "I32")]
    /// Signed 32-bit integer.
    I32,
    #[serde(rename = "U32")]
    /// Unsigned 32-bit integer.
    U32,
    #[serde(rename = "F32")]
    /// IEEE single precision.
    F32,
    /// Complex of two F32.
    #[serde(rename = "C64")]
    C64,
    #[serde(rename = "F64")]
    /// IEEE double precision.
    F64,
    #[serde(rename = "I64")]
    /// Signed 64-bit integer.
    I64,
    #[serde(rename = "U64")]
    /// Unsigned 64-bit integer.
    U64,
}

impl Dtype {
    /// Every dtype, in the reference reader's order.
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The name in a safetensors header (`"BF16"`, `"F8_E4M3FNUZ"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Size of one element in bits (4 for `F4`, 6 for `F6_*`, 64 for `C64`).
    pub fn bits(self) -> u32 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E5M2
            | Dtype::F8E4M3
            | Dtype::F8E8M0
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown dtype name (names are case-sensitive, as in the reference).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {name:?}, expected one of {}", Dtype::ALL.map(Dtype::name).join(", "))]
pub struct UnknownDtype {
    pub name: String,
}

impl FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(s: &str) -> Result<Self, UnknownDtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| UnknownDtype { name: s.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_str_and_serde() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>(), Ok(d));
            assert_eq!(d.to_string(), d.name());
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<Dtype>(&json).unwrap(), d);
        }
        let mut names: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Dtype::ALL.len());
    }

    #[test]
    fn unknown_and_misspelt_names_are_refused() {
        for bad in ["Q9", "c64", "bf16", "F8_E4M3FN", "C128", "", " U8"] {
            let e = bad.parse::<Dtype>().unwrap_err();
            assert!(e.to_string().contains("BF16"), "{e}");
            assert!(serde_json::from_str::<Dtype>(&format!("{bad:?}")).is_err(), "{bad}");
        }
    }

    #[test]
    fn bits_match_the_reference() {
        // From the reference reader (safetensors 0.8, Dtype::bitsize).
        let want = [
            8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64,
        ];
        assert_eq!(Dtype::ALL.map(Dtype::bits), want);
    }
}
