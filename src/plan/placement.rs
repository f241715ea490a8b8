//! Where payloads land in memory a caller lends, so that every read of
//! them is in place and O_DIRECT (pure arithmetic, no I/O).
//!
//! O_DIRECT reads whole blocks of the file into an aligned address. A
//! payload at file offset `off` can be read in place only at an address
//! whose offset within a block equals `off`'s (its *phase*): the block
//! holding its first byte then starts `off % align` bytes before it, on an
//! aligned address. A placement gives each payload the whole blocks its
//! window covers, back to back from the first aligned address of the
//! memory:
//!
//! ```text
//! memory: |head|..pad0..=payload 0=..tail|..pad1..=payload 1=....|...
//!              ^ aligned                 ^ aligned
//! ```
//!
//! Reads into it with `Scratch::Blocks` write only those blocks: the pad
//! before and the rest of the last block after each payload are that
//! payload's own scratch.

use crate::error::{Error, Result};
use crate::format::catalog::TensorRef;

/// Where each payload of a set of tensors lands in memory lent by the
/// caller so that every read is in place and O_DIRECT
/// ([`Engine::placement`](crate::Engine::placement),
/// [`Lent::placement`](crate::Lent::placement)).
///
/// Offsets are from the start of the memory; the payload of tensor `i`
/// lands at `offsets()[i]`, and `bytes()` bytes of the memory are used.
/// Read each with [`Scratch::Blocks`](crate::Scratch::Blocks) (or
/// `Scratch::Before`, which reads the last partial block buffered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    offsets: Vec<usize>,
    bytes: usize,
    align: usize,
}

impl Placement {
    /// Places payloads `(file offset, length)` for `align`-byte blocks (a
    /// power of two) in memory whose first byte is at address `base`.
    ///
    /// Each payload gets `round_up(off % align + max(len, 1), align)`
    /// bytes starting on an aligned address; the first starts at the first
    /// aligned address at or after `base`. Errors when a sum overflows.
    pub fn plan(payloads: impl IntoIterator<Item = (u64, u64)>, base: usize, align: usize) -> Result<Self> {
        if !align.is_power_of_two() {
            return Err(Error::Config(format!(
                "placement: alignment {align} is not a power of two"
            )));
        }
        let overflow = || Error::Config("placement: the payloads' blocks do not fit in the address space".into());
        let mut cursor = base.wrapping_neg() & (align - 1);
        let mut offsets = Vec::new();
        for (off, len) in payloads {
            let pad = (off % align as u64) as usize;
            let window = window_bytes(pad, len, align).ok_or_else(overflow)?;
            offsets.push(cursor.checked_add(pad).ok_or_else(overflow)?);
            cursor = cursor.checked_add(window).ok_or_else(overflow)?;
        }
        Ok(Placement {
            offsets,
            bytes: cursor,
            align,
        })
    }

    /// [`Placement::plan`] of `tensors` (whole tensors or parts of them).
    pub fn of_tensors(tensors: &[&TensorRef], base: usize, align: usize) -> Result<Self> {
        Placement::plan(tensors.iter().map(|t| (t.offset, t.len)), base, align)
    }

    /// The bytes memory at any address needs to hold `payloads` placed:
    /// their blocks, plus `align - 1` for a base that is not aligned.
    pub fn bytes_for(payloads: impl IntoIterator<Item = (u64, u64)>, align: usize) -> Result<usize> {
        // A base of 1 needs the most head room: align - 1 bytes.
        let p = Placement::plan(payloads, 1, align)?;
        Ok(p.bytes)
    }

    /// The same placement in memory that starts `by` bytes earlier.
    pub(crate) fn shifted(mut self, by: usize) -> Result<Self> {
        let overflow = || Error::Config("placement: offsets do not fit usize".into());
        for o in &mut self.offsets {
            *o = o.checked_add(by).ok_or_else(overflow)?;
        }
        self.bytes = self.bytes.checked_add(by).ok_or_else(overflow)?;
        Ok(self)
    }

    /// Offset of each payload from the start of the memory, in order.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Offset of payload `i`.
    pub fn at(&self, i: usize) -> usize {
        self.offsets[i]
    }

    /// Number of payloads placed.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether nothing was placed.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Bytes of the memory the placement uses, from its start (head room
    /// to the first aligned address included).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The block size it was planned for.
    pub fn align(&self) -> usize {
        self.align
    }
}

/// Bytes of the whole blocks a payload of `len` bytes at phase `pad`
/// covers (at least one block).
pub(crate) fn window_bytes(pad: usize, len: u64, align: usize) -> Option<usize> {
    let len = usize::try_from(len.max(1)).ok()?;
    pad.checked_add(len)?.checked_add(align - 1).map(|w| w & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every placed payload sits at its file phase on an aligned block,
        /// the blocks of two payloads never overlap, every window lies in
        /// `bytes()`, and `bytes_for` covers any base.
        #[test]
        fn placed_windows_are_aligned_disjoint_and_inside(
            payloads in prop::collection::vec((0u64..1 << 40, 0u64..3 << 20), 0..40),
            base in any::<usize>().prop_map(|b| b % (1 << 47)),
            shift in 9u32..=16,
        ) {
            let align = 1usize << shift;
            let p = Placement::plan(payloads.iter().copied(), base, align).unwrap();
            prop_assert_eq!(p.len(), payloads.len());
            let mut prev_end = 0usize;
            for (i, &(off, len)) in payloads.iter().enumerate() {
                let at = p.at(i);
                let pad = (off % align as u64) as usize;
                prop_assert_eq!((base + at) % align, pad, "phase of payload {}", i);
                let start = at - pad;
                prop_assert!(start >= prev_end, "payload {} overlaps the one before", i);
                let end = start + window_bytes(pad, len, align).unwrap();
                prop_assert!(end <= p.bytes());
                prop_assert!(at + len as usize <= end);
                prev_end = end;
            }
            let worst = Placement::bytes_for(payloads.iter().copied(), align).unwrap();
            prop_assert!(p.bytes() <= worst, "{} > {}", p.bytes(), worst);
        }
    }

    #[test]
    fn refuses_a_bad_alignment_and_overflow() {
        assert!(Placement::plan([(0, 1)], 0, 3000).is_err());
        let e = Placement::plan([(0, u64::MAX / 2), (0, u64::MAX / 2)], 0, 4096).unwrap_err();
        assert!(e.to_string().contains("address space"), "{e}");
    }

    #[test]
    fn reference_layout_example() {
        // Data of a reference-written file starts at 8 + header length:
        // offsets such as 8 + 120 = 128 are off every block.
        let p = Placement::plan([(128, 10_000), (10_128, 4096)], 4096 * 7 + 16, 4096).unwrap();
        // First aligned address: 4080 bytes in; payload 0 at 128 past it.
        assert_eq!(p.offsets(), &[4080 + 128, 4080 + 3 * 4096 + (10_128 % 4096)]);
        assert_eq!(p.bytes(), 4080 + 3 * 4096 + 2 * 4096);
    }
}
