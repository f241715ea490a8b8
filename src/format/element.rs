//! Typed views of a payload: which Rust types may stand for which dtypes.
//! A view is checked for the dtype, the length and the alignment of the
//! bytes; it never copies.

use crate::format::dtype::Dtype;

mod sealed {
    pub trait Sealed {}
}

/// A Rust type a payload can be viewed as ([`Loaded::as_slice`]): plain
/// old data with no invalid bit patterns, of the dtypes listed. `bool` is
/// not one (a byte other than 0 or 1 would be undefined behaviour): view a
/// `BOOL` tensor as `u8`. `f16` and `bf16` come from the `half` crate with
/// the `half` feature.
///
/// [`Loaded::as_slice`]: crate::Loaded::as_slice
pub trait Element: sealed::Sealed + Copy + 'static {
    /// The dtypes whose elements this type holds exactly.
    const DTYPES: &'static [Dtype];
}

macro_rules! element {
    ($t:ty => $($d:ident),+) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPES: &'static [Dtype] = &[$(Dtype::$d),+];
        }
    };
}

// Byte-sized FP8 and boolean data are bytes: viewable as u8.
element!(u8 => U8, Bool, F8E5M2, F8E4M3, F8E8M0, F8E4M3Fnuz, F8E5M2Fnuz);
element!(i8 => I8);
element!(u16 => U16, F16, Bf16);
element!(i16 => I16);
element!(u32 => U32);
element!(i32 => I32);
element!(u64 => U64);
element!(i64 => I64);
element!(f32 => F32);
element!(f64 => F64);
#[cfg(feature = "half")]
element!(half::f16 => F16);
#[cfg(feature = "half")]
element!(half::bf16 => Bf16);
