//! What a reader reads: every block of a drive's files in order ([`Plan`],
//! without listing them), a reader's share of it ([`Part`]), and what the
//! reader did ([`ReaderOutcome`]).

use std::time::Instant;

use super::drives::Drive;
use crate::error::Error;

/// One read: a block of one file.
#[derive(Debug, Clone, Copy)]
pub(super) struct Block {
    pub(super) file: u32,
    pub(super) off: u64,
    pub(super) len: u32,
}

/// Every block of every file of a drive, files one after the other, without
/// listing them (a 4 KiB block size over a large model would be millions).
/// The last block of a file is rounded up to 4096 (O_DIRECT returns the
/// bytes up to end of file).
pub(super) struct Plan {
    pub(super) bs: u64,
    pub(super) sizes: Vec<u64>,
    /// Blocks before each file.
    pub(super) before: Vec<usize>,
    pub(super) len: usize,
}

impl Plan {
    pub(super) fn new(drive: &Drive, bs: usize) -> Self {
        let bs = bs as u64;
        let sizes: Vec<u64> = drive.opened.iter().map(|(_, s)| *s).collect();
        let mut before = Vec::with_capacity(sizes.len());
        let mut len = 0usize;
        for s in &sizes {
            before.push(len);
            len = len.saturating_add(s.div_ceil(bs) as usize);
        }
        Plan { bs, sizes, before, len }
    }

    /// Block `i` (< `len`).
    pub(super) fn get(&self, i: usize) -> Block {
        // The last file whose first block is at or before `i` (files with
        // no block share their `before` with the next one).
        // (`before[0]` is 0, so there is one.) In a run of files with the
        // same `before`, all but the last hold no block.
        let f = self.before.partition_point(|&b| b <= i) - 1;
        let off = (i - self.before[f]) as u64 * self.bs;
        let len = (self.sizes[f] - off).min(self.bs).div_ceil(4096) * 4096;
        Block {
            file: f as u32,
            off,
            len: len as u32,
        }
    }
}

/// Which blocks a reader reads: from `first` on, `count` of them (`None`:
/// round and round until a cap).
#[derive(Debug, Clone, Copy)]
pub(super) struct Part {
    pub(super) first: usize,
    pub(super) count: Option<usize>,
}

pub(super) struct ReaderOutcome {
    pub(super) bytes: u64,
    /// When its last read completed.
    pub(super) end: Instant,
    pub(super) error: Option<Error>,
}
