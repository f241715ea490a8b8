//! What one ceiling configuration is ([`ReadConfig`]: block size, reads in
//! flight, readers, submission, buffers) and the sweep over them
//! ([`SweepConfig`]: the configurations, and the byte and time caps of each).

use serde::{Deserialize, Serialize};

use super::MIB;
use crate::error::{Error, Result};

/// How a reader submits its reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Submit {
    /// As the kernel chooses: a device that completes in the submitter's
    /// context (zram, brd, pmem) does the work inside `io_uring_enter`.
    Inline,
    /// `IOSQE_ASYNC` on every SQE: each read goes to io-wq workers (fio
    /// `--force_async=1`).
    Async,
}

/// Which buffers a reader reads into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Buffers {
    /// `IORING_OP_READ` into plain memory.
    Plain,
    /// `IORING_OP_READ_FIXED` into registered (pinned) buffers (fio
    /// `--fixedbufs=1`).
    #[value(alias = "registered")]
    Fixed,
}

impl Submit {
    pub fn name(self) -> &'static str {
        match self {
            Submit::Inline => "inline",
            Submit::Async => "async",
        }
    }
}

impl Buffers {
    pub fn name(self) -> &'static str {
        match self {
            Buffers::Plain => "plain",
            Buffers::Fixed => "fixed",
        }
    }
}

/// One way of reading a drive: one point of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReadConfig {
    /// Bytes per read (a multiple of 4096).
    pub bs: usize,
    /// Reads in flight per reader.
    pub qd: usize,
    /// Reader threads per drive, each with its own ring.
    pub readers: usize,
    pub submit: Submit,
    pub buffers: Buffers,
}

impl ReadConfig {
    /// fio's default job: 1 MiB blocks, 16 in flight, one reader, inline,
    /// plain buffers (what `ceiling` measured before the sweep).
    #[cfg(test)]
    pub const BASELINE: ReadConfig = ReadConfig {
        bs: MIB,
        qd: 16,
        readers: 1,
        submit: Submit::Inline,
        buffers: Buffers::Plain,
    };

    /// Bytes in flight over all readers.
    pub fn window(&self) -> u64 {
        self.bs as u64 * self.qd as u64 * self.readers as u64
    }

    /// `bs=1MiB qd=16 readers=1 submit=inline buffers=plain`.
    pub fn label(&self) -> String {
        format!(
            "bs={} qd={} readers={} submit={} buffers={}",
            size_label(self.bs as u64),
            self.qd,
            self.readers,
            self.submit.name(),
            self.buffers.name()
        )
    }

    /// Refuses what cannot be run: a block size that is not a non-zero
    /// multiple of 4096 (or above 1 GiB), a zero or huge depth or reader
    /// count.
    pub fn validate(&self) -> Result<()> {
        if self.bs == 0 || !self.bs.is_multiple_of(4096) || self.bs > 1 << 30 {
            return Err(Error::Config(format!(
                "block size {} must be a non-zero multiple of 4096, at most 1 GiB",
                self.bs
            )));
        }
        if self.qd == 0 || self.qd > 4096 {
            return Err(Error::Config(format!(
                "queue depth {} must be between 1 and 4096",
                self.qd
            )));
        }
        if self.readers == 0 || self.readers > 64 {
            return Err(Error::Config(format!(
                "readers {} must be between 1 and 64",
                self.readers
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for ReadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// `4MiB`, `64KiB`, `1000B`; sizes that are not whole units with one
/// decimal (`17.3GiB`).
pub fn size_label(b: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift {
            return if b.is_multiple_of(1 << shift) {
                format!("{}{unit}", b >> shift)
            } else {
                format!("{:.1}{unit}", b as f64 / (1u64 << shift) as f64)
            };
        }
    }
    format!("{b}B")
}

/// What [`sweep`] tries, and its bounds per configuration.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// Tried in this order on each drive (smaller windows first, so the skip
    /// rule has a rate to go by).
    pub configs: Vec<ReadConfig>,
    /// Byte cap per configuration and drive (the files are read round again
    /// if they hold fewer bytes).
    pub bytes: u64,
    /// Time cap per configuration: no read is issued after it (the reads in
    /// flight then complete and count).
    pub seconds: f64,
    /// `full`, `quick`, or `custom`, for the report.
    pub name: String,
    /// Read into buffers on transparent huge pages (`MADV_HUGEPAGE`, 2 MiB
    /// aligned). Default: a device whose requests are capped in segments
    /// (virtio) takes 4 MiB of physically contiguous memory in one request
    /// instead of 1 MiB of 4 KiB pages; nothing reads slower for it. False:
    /// 4 KiB pages, as fio's default buffers (`--mem=malloc`).
    pub huge_pages: bool,
}

impl SweepConfig {
    /// Every combination of 1 and 4 MiB blocks, depth 16 and 64, 1 and 2
    /// readers, inline and async, plain and registered buffers: 32
    /// configurations, each up to 2 GiB or 0.5 s.
    pub fn full() -> Self {
        SweepConfig {
            configs: Self::product(
                &[MIB, 4 * MIB],
                &[16, 64],
                &[1, 2],
                &[Submit::Inline, Submit::Async],
                &[Buffers::Plain, Buffers::Fixed],
            ),
            bytes: 2 << 30,
            seconds: 0.5,
            name: "full".into(),
            huge_pages: true,
        }
    }

    /// Eight configurations, each up to 1 GiB or 0.25 s: the baseline, a
    /// deep queue, two readers, async punt with registered buffers, and the
    /// large windows (4 MiB x 64) that won the full sweep on the virtio disk
    /// (async + registered 4 MiB blocks won on zram; docs/contracts.md).
    pub fn quick() -> Self {
        let c = |bs: usize, qd: usize, readers: usize, submit: Submit, buffers: Buffers| ReadConfig {
            bs,
            qd,
            readers,
            submit,
            buffers,
        };
        use Buffers::{Fixed, Plain};
        use Submit::{Async, Inline};
        let mut configs = vec![
            c(MIB, 16, 1, Inline, Plain),
            c(MIB, 16, 1, Async, Fixed),
            c(MIB, 16, 2, Inline, Fixed),
            c(MIB, 64, 1, Inline, Plain),
            c(4 * MIB, 16, 1, Async, Fixed),
            c(4 * MIB, 16, 2, Async, Fixed),
            c(4 * MIB, 64, 1, Async, Fixed),
            c(4 * MIB, 64, 2, Inline, Fixed),
        ];
        configs.sort_by_key(ReadConfig::window);
        SweepConfig {
            configs,
            bytes: 1 << 30,
            seconds: 0.25,
            name: "quick".into(),
            huge_pages: true,
        }
    }

    /// Every combination of the given values, smaller windows first.
    pub fn product(
        bs: &[usize],
        qd: &[usize],
        readers: &[usize],
        submit: &[Submit],
        buffers: &[Buffers],
    ) -> Vec<ReadConfig> {
        let mut v = Vec::new();
        for &bs in bs {
            for &qd in qd {
                for &readers in readers {
                    for &submit in submit {
                        for &buffers in buffers {
                            v.push(ReadConfig {
                                bs,
                                qd,
                                readers,
                                submit,
                                buffers,
                            });
                        }
                    }
                }
            }
        }
        // Stable: equal windows keep the order above.
        v.sort_by_key(ReadConfig::window);
        v.dedup();
        v
    }

    /// The same bounds with `config` alone: the rerun of a sweep's best
    /// configuration (`bench`'s figure, [`crate::bench::SweepFigure`]).
    pub fn only(&self, config: ReadConfig) -> Self {
        SweepConfig {
            configs: vec![config],
            name: format!("{} (best rerun)", self.name),
            ..self.clone()
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.configs.is_empty() {
            return Err(Error::Config("ceiling sweep: no configuration to try".into()));
        }
        for c in &self.configs {
            c.validate()?;
        }
        if self.bytes == 0 {
            return Err(Error::Config(
                "ceiling sweep: the byte cap per configuration is 0".into(),
            ));
        }
        if !(self.seconds.is_finite() && self.seconds > 0.0 && self.seconds <= 3600.0) {
            return Err(Error::Config(format!(
                "ceiling sweep: the time cap per configuration ({} s) must be above 0 and at most 3600",
                self.seconds
            )));
        }
        Ok(())
    }
}
