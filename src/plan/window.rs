//! Pure alignment and EOF arithmetic for the in-place read (no I/O).
//!
//! A slot is page-aligned and reserves `align` bytes of scratch before the
//! payload. A payload at file offset `off` is placed at
//! `slot_base + off % align`, so the aligned window that O_DIRECT reads
//! starts exactly at `slot_base` and no byte is ever moved after the read.
//!
//! ```text
//! file:  ... | wstart ............ off ====payload==== off+len ... | size
//! slot:      | base ..pad (scratch).| ====payload====|(tail room)
//!            |<------- direct (multiple of align) ------>|<- tail ->|
//! ```
//!
//! `direct` is the block-aligned bulk read with O_DIRECT into the slot base;
//! `tail` is the rest of the payload, read buffered. The direct part never
//! extends past the payload's last byte unless the slot reserved tail room,
//! and never past the last whole block inside the file (the EOF clamp).

/// Why a window could not be planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    /// `align` must be a non-zero power of two.
    #[error("alignment {0} is not a power of two")]
    BadAlign(u64),
    /// The payload range is not inside the file.
    #[error("range [{start}, {end}) is outside the file ({size} bytes)")]
    OutOfFile {
        /// Start of the range.
        start: u64,
        /// End of the range (exclusive, saturated).
        end: u64,
        /// The file's size.
        size: u64,
    },
    /// The window `[start, end)` (scratch before the payload included) is
    /// larger than this machine's address space: no slot can hold it.
    #[error("window [{start}, {end}) does not fit in the address space")]
    TooLarge {
        /// Start of the window.
        start: u64,
        /// End of the window.
        end: u64,
    },
}

/// How one payload read is split between O_DIRECT and buffered I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// File offset of the aligned window (`off - pad`); the slot base maps to it.
    pub start: u64,
    /// Bytes of scratch before the payload in the slot (`off % align`).
    pub pad: usize,
    /// Payload length.
    pub len: usize,
    /// Bytes read with O_DIRECT from `start` into the slot base; a multiple of
    /// `align`, possibly 0.
    pub direct: usize,
    /// Bytes of payload read buffered after the direct part.
    pub tail: usize,
}

impl Window {
    /// Plans the read of `[off, off + len)` from a file of `size` bytes.
    ///
    /// `tail_room` says the slot reserved room after the payload up to the
    /// next `align` boundary, so the last partial block may also be read with
    /// O_DIRECT when it lies wholly inside the file.
    ///
    /// Every sum is checked: each quantity is bounded by `size - start`, so
    /// none can overflow `u64`, and each is converted to `usize` checked (a
    /// window larger than the address space is [`WindowError::TooLarge`]).
    /// A planned window's [`Window::slot_extent`] is always `Some`.
    pub fn plan(off: u64, len: u64, size: u64, align: u64, tail_room: bool) -> Result<Self, WindowError> {
        if align == 0 || !align.is_power_of_two() {
            return Err(WindowError::BadAlign(align));
        }
        let end = off
            .checked_add(len)
            .filter(|&e| e <= size)
            .ok_or(WindowError::OutOfFile {
                start: off,
                end: off.saturating_add(len),
                size,
            })?;
        let mask = align - 1;
        let pad = off & mask;
        let start = off - pad; // pad <= off
        let too_large = WindowError::TooLarge { start, end };
        // want = end - start <= size - start.
        let want = pad.checked_add(len).ok_or(too_large)?;
        let to_usize = |x: u64| usize::try_from(x).map_err(|_| too_large);
        if len == 0 {
            // A 0-byte read is a no-op, whatever room the slot reserves.
            return Ok(Window {
                start,
                pad: to_usize(pad)?,
                len: 0,
                direct: 0,
                tail: 0,
            });
        }
        let wanted_direct = match want.checked_add(mask) {
            // Round up: the slot has room up to the next boundary.
            Some(w) if tail_room => w & !mask,
            // Without room (or when rounding up passes u64::MAX, where the
            // EOF clamp below is the smaller bound anyway): round down.
            _ => want & !mask,
        };
        // EOF clamp: the last whole block inside the file (start <= size).
        let eof_limit = (size - start) & !mask;
        let direct = wanted_direct.min(eof_limit);
        // start + direct <= start + eof_limit <= size.
        let direct_end = start.checked_add(direct).ok_or(too_large)?;
        let tail = end - direct_end.clamp(off, end);
        // The furthest slot byte a read of this window writes must be
        // addressable too (see `slot_extent`).
        to_usize(direct.max(want))?;
        Ok(Window {
            start,
            pad: to_usize(pad)?,
            len: to_usize(len)?,
            direct: to_usize(direct)?,
            tail: to_usize(tail)?,
        })
    }

    /// The same payload placed at the slot's first byte (no scratch before
    /// it), read wholly buffered: a caller-placed slot with no room for an
    /// O_DIRECT window.
    pub fn placed(self) -> Self {
        Window {
            start: self.start + self.pad as u64,
            pad: 0,
            direct: 0,
            tail: self.len,
            ..self
        }
    }

    /// The same payload read wholly buffered (no O_DIRECT part): the fallback.
    pub fn buffered(self) -> Self {
        Window {
            direct: 0,
            tail: self.len,
            ..self
        }
    }

    /// File offset of the payload's first byte.
    ///
    /// Like the other offsets below, exact for a window from
    /// [`Window::plan`] (or its [`Window::buffered`]); for one assembled by
    /// hand, check [`Window::slot_extent`] first (`None`: these overflow).
    pub fn payload_offset(&self) -> u64 {
        self.start + self.pad as u64
    }

    /// File offset where the buffered tail starts.
    pub fn tail_file_offset(&self) -> u64 {
        self.payload_offset() + (self.len - self.tail) as u64
    }

    /// Slot offset where the buffered tail lands.
    pub fn tail_slot_offset(&self) -> usize {
        self.pad + self.len - self.tail
    }

    /// Bytes of the slot, from its base, that a read of this window may
    /// write: the furthest of the direct part's end (whole blocks, so
    /// rounded up over the payload when the slot has tail room) and the
    /// payload's end (`pad + len`, where the buffered tail ends). A read
    /// goes ahead only when this is at most the slot's real length.
    ///
    /// `None` when the fields do not describe a window in the address space
    /// (only possible for a `Window` assembled by hand): `pad + len`
    /// overflows, the tail is longer than the payload, or a file offset of
    /// the window passes `u64::MAX`. `Some` for every planned window.
    pub fn slot_extent(&self) -> Option<usize> {
        let payload_end = self.pad.checked_add(self.len)?;
        if self.tail > self.len {
            return None;
        }
        let file_end = u64::try_from(payload_end.max(self.direct)).ok()?;
        self.start.checked_add(file_end)?;
        Some(payload_end.max(self.direct))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: u64 = 71;
    const SIZE: u64 = 66843;

    fn field(payload_off: u64, len: u64) -> Window {
        Window::plan(DATA + payload_off, len, SIZE, 4096, false).unwrap()
    }

    #[test]
    fn field_examples() {
        // (payload offset, len) -> (window start, direct, tail), from FIELD-NOTES.
        let cases = [
            ((0, 1), (0, 0, 1)),
            ((0, 4096), (0, 4096, 71)),
            ((1000, 10000), (0, 8192, 2879)),
            ((4096, 12365), (4096, 12288, 148)),
            ((33333, 20000), (32768, 20480, 156)),
            ((65772, 1000), (65536, 0, 1000)),
            ((62676, 4096), (61440, 4096, 1307)),
        ];
        for ((o, n), (start, direct, tail)) in cases {
            let w = field(o, n);
            assert_eq!(
                (w.start, w.direct, w.tail),
                (start, direct as usize, tail as usize),
                "case ({o}, {n})"
            );
            assert_eq!(w.start + w.pad as u64, DATA + o);
        }
    }

    #[test]
    fn tail_room_reads_last_block_direct_when_inside_file() {
        // (1000, 10000): want 11071 -> 12288 with tail room, inside the file.
        let w = Window::plan(1071, 10000, SIZE, 4096, true).unwrap();
        assert_eq!((w.direct, w.tail), (12288, 0));
        // Ending at EOF: the clamp still applies.
        let w = Window::plan(62747, 4096, SIZE, 4096, true).unwrap();
        assert_eq!((w.direct, w.tail), (4096, 1307));
    }

    #[test]
    fn out_of_file_and_bad_align() {
        assert_eq!(
            Window::plan(SIZE, 1, SIZE, 4096, false),
            Err(WindowError::OutOfFile {
                start: SIZE,
                end: SIZE + 1,
                size: SIZE
            })
        );
        assert!(Window::plan(u64::MAX, 2, SIZE, 4096, false).is_err());
        assert_eq!(Window::plan(0, 1, SIZE, 3000, false), Err(WindowError::BadAlign(3000)));
        assert_eq!(Window::plan(0, 1, SIZE, 0, false), Err(WindowError::BadAlign(0)));
    }

    #[test]
    fn zero_length_reads_nothing() {
        let w = Window::plan(5000, 0, SIZE, 4096, false).unwrap();
        assert_eq!((w.direct, w.tail, w.len), (0, 0, 0));
    }

    #[test]
    fn buffered_fallback_reads_exactly_the_payload() {
        let w = field(1000, 10000).buffered();
        assert_eq!(
            (w.direct, w.tail, w.tail_file_offset(), w.tail_slot_offset()),
            (0, 10000, 1071, 1071)
        );
    }

    #[test]
    fn slot_extent_counts_direct_part_and_payload() {
        // Without tail room: the payload's end.
        let w = field(1000, 10000);
        assert_eq!(w.slot_extent(), Some(1071 + 10000));
        // With tail room the direct part runs past the payload.
        let w = Window::plan(1071, 10000, SIZE, 4096, true).unwrap();
        assert_eq!(w.slot_extent(), Some(12288));
        assert_eq!(w.buffered().slot_extent(), Some(11071));
        // Offsets near u64::MAX still fit.
        let w = Window::plan(u64::MAX - 5000, 4000, u64::MAX, 4096, true).unwrap();
        assert!(w.slot_extent().is_some());
    }

    #[test]
    fn slot_extent_refuses_windows_that_describe_no_range() {
        let ok = field(1000, 10000);
        let bad = [
            Window { pad: usize::MAX, ..ok },
            Window { len: usize::MAX, ..ok },
            Window { tail: ok.len + 1, ..ok },
            Window { start: u64::MAX, ..ok },
            Window {
                start: u64::MAX - 8191,
                ..ok
            },
        ];
        for w in bad {
            assert_eq!(w.slot_extent(), None, "{w:?}");
        }
    }
}
