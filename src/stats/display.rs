//! `Stats` for a person: the warnings first (worst first, each with its fix
//! and its cost), then the backend, the totals and one block per drive.
//! `Debug` and serde keep every field; this is the readable summary.

use std::fmt;

use super::{DriveStats, Feature, Stats};
use crate::error::escape;

/// `512 B`, `12.6 MB`, `1.41 GB` (GB = 10^9 bytes).
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1000.0;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    // Three significant figures.
    let digits = if v < 10.0 {
        2
    } else if v < 100.0 {
        1
    } else {
        0
    };
    format!("{v:.digits$} {}", UNITS[u])
}

fn feature(name: &str, f: &Option<Feature>) -> String {
    match f {
        None => String::new(),
        Some(Feature { enabled: true, .. }) => format!("; {name} on"),
        Some(Feature {
            enabled: false,
            reason: Some(why),
        }) => format!("; {name} off ({why})"),
        Some(Feature { enabled: false, .. }) => format!("; {name} off"),
    }
}

fn drive(f: &mut fmt::Formatter<'_>, d: &DriveStats) -> fmt::Result {
    write!(
        f,
        "drive {} ({} at {}): {} read ({} O_DIRECT, {} buffered), {:.0}% of the bytes",
        d.device,
        d.fs_type,
        escape(&d.mount),
        bytes(d.bytes),
        bytes(d.bytes_direct),
        bytes(d.bytes_buffered),
        d.share * 100.0
    )?;
    if let Some(t) = d.throughput_gbps {
        write!(f, ", {t:.2} GB/s")?;
    }
    if !d.direct_open {
        write!(f, ", O_DIRECT refused on some file")?;
    }
    writeln!(f)?;
    write!(
        f,
        "  reads {} O_DIRECT, {} buffered; chunks {} ({} unregistered, {} failed over",
        d.reads_direct, d.reads_buffered, d.chunks, d.chunks_unregistered, d.failovers
    )?;
    if d.chunks_abandoned > 0 {
        write!(f, ", {} abandoned", d.chunks_abandoned)?;
    }
    write!(f, "); most in flight {}", d.inflight_max)?;
    if let Some(n) = d.in_flight {
        write!(f, ", now {n}")?;
    }
    if d.cross_node_bytes > 0 {
        write!(f, "; {} landed on another NUMA node", bytes(d.cross_node_bytes))?;
    }
    if !d.fallbacks.is_empty() {
        let f_: Vec<String> = d.fallbacks.iter().map(|(k, n)| format!("{k} {n}")).collect();
        write!(f, "\n  fallbacks: {}", f_.join(", "))?;
    }
    if let Some(ring) = &d.ring {
        write!(f, "\n  ring {ring}")?;
        if let (Some(submit), Some(rings)) = (d.submit, d.rings) {
            write!(f, "; submit {submit} on {rings} ring(s)")?;
        }
        if let Some(n) = d.iowq_max_workers {
            write!(f, ", io-wq workers at most {n}")?;
        }
    } else if let Some(n) = d.pread_workers {
        write!(f, "\n  {n} pread workers (the drive completes reads inline)")?;
    }
    if let Some(b) = &d.thread_binding {
        let node = match (d.numa_node, &d.numa_note) {
            (Some(n), _) => format!("NUMA node {n}"),
            (None, Some(why)) => format!("NUMA node unknown ({why})"),
            (None, None) => "NUMA node unknown".to_string(),
        };
        write!(f, "\n  {node}; I/O threads: {b}")?;
    }
    if let Some(why) = &d.stopped {
        write!(f, "\n  stopped: {why}")?;
    }
    Ok(())
}

impl fmt::Display for Stats {
    /// Several lines: the warnings first (or `warnings: none`), then the
    /// backend and its features, the totals, and each drive (bytes O_DIRECT
    /// and buffered, throughput, chunks, fallbacks by cause, ring, NUMA).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.warnings.is_empty() {
            writeln!(f, "warnings: none")?;
        } else {
            writeln!(f, "warnings ({}, worst first):", self.warnings.len())?;
            for w in &self.warnings {
                writeln!(f, "  warning: {w}")?;
            }
        }
        let why = self
            .backend_reason
            .as_ref()
            .map_or(String::new(), |r| format!(" ({r})"));
        writeln!(
            f,
            "backend {}{why}{}{}",
            self.backend,
            feature("fixed files", &self.fixed_files),
            feature("registered buffers", &self.registered_buffers)
        )?;
        let direct: u64 = self.drives.iter().map(|d| d.bytes_direct).sum();
        let buffered: u64 = self.drives.iter().map(|d| d.bytes_buffered).sum();
        write!(
            f,
            "read {} ({} O_DIRECT, {} buffered); reads {} O_DIRECT, {} buffered; {} fallback(s)",
            bytes(self.bytes),
            bytes(direct),
            bytes(buffered),
            self.reads_direct(),
            self.reads_buffered(),
            self.fallbacks_total()
        )?;
        if self.rank_weights.len() > 1 {
            write!(f, "; copy weights {:?}", self.rank_weights)?;
        }
        let st = &self.staged;
        if st.reads > 0 {
            write!(
                f,
                "\nstaged {} reads into caller memory ({} copied, {:.3} CPU s per GB; {} of staging)",
                st.reads,
                bytes(st.bytes),
                st.copy_cpu_s_per_gb().unwrap_or(0.0),
                bytes(st.staging_bytes)
            )?;
        }
        let sl = &self.slices;
        if sl.reads > 0 {
            write!(
                f,
                "\nslices: {} read as {} pieces ({} runs); {} wanted, {} read ({:.3}x)",
                sl.reads,
                sl.pieces,
                sl.runs,
                bytes(sl.bytes_wanted),
                bytes(sl.bytes_read),
                sl.read_amplification().unwrap_or(0.0)
            )?;
        }
        for d in &self.drives {
            writeln!(f)?;
            drive(f, d)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::warning;

    fn drive_stats(device: &str) -> DriveStats {
        DriveStats {
            device: device.into(),
            mount: "/data".into(),
            fs_type: "ext4".into(),
            dio_align: 512,
            direct_open: true,
            bytes: 12_600_000,
            bytes_direct: 12_000_000,
            bytes_buffered: 600_000,
            reads_direct: 3,
            reads_buffered: 1,
            fallbacks: [("no_bulk", 1)].into_iter().collect(),
            inflight_max: 4,
            chunks_unregistered: 12,
            chunks_unregistered_arena: 0,
            chunks: 12,
            failovers: 0,
            share: 1.0,
            throughput_gbps: Some(1.5),
            ring: Some("single_issuer+defer_taskrun, fixed files".into()),
            numa_node: None,
            cpuset: None,
            numa_source: Some("single-node"),
            numa_note: Some("built without the `numa` feature".into()),
            thread_binding: Some("not bound: NUMA locality unknown".into()),
            cross_node_bytes: 0,
            chunks_abandoned: 0,
            in_flight: Some(0),
            submit: Some("inline"),
            rings: Some(1),
            pread_workers: None,
            submit_reason: None,
            iowq_max_workers: None,
            stopped: None,
        }
    }

    fn stats(warnings: Vec<crate::stats::Warning>) -> Stats {
        Stats {
            backend: "uring",
            rank_weights: vec![1.0],
            weights_note: None,
            arena_dontfork_failures: 0,
            backend_reason: None,
            bytes: 12_600_000,
            fixed_files: Some(Feature {
                enabled: true,
                reason: None,
            }),
            registered_buffers: Some(Feature {
                enabled: false,
                reason: Some("RLIMIT_MEMLOCK".into()),
            }),
            drives: vec![drive_stats("vda")],
            arena_hugepage_refusals: 0,
            arena_inherit_failures: 0,
            arena_reprotect_leaks: 0,
            staged: Default::default(),
            slices: Default::default(),
            warnings,
        }
    }

    #[test]
    fn warnings_come_first_then_the_backend_then_each_drive() {
        let w = warning::buffers_unregistered(
            "RLIMIT_MEMLOCK is 65536 bytes; `ulimit -l 8256`",
            true,
            1,
            Some(8 << 20),
            12,
        );
        let text = stats(vec![w.clone()]).to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "warnings (1, worst first):", "{text}");
        assert_eq!(lines[1], format!("  warning: {w}"), "{text}");
        assert!(lines[1].contains("ulimit -l 8256"), "{text}");
        assert!(
            lines[2].starts_with("backend uring; fixed files on; registered buffers off (RLIMIT_MEMLOCK)"),
            "{text}"
        );
        assert!(
            lines[3].starts_with("read 12.6 MB (12.0 MB O_DIRECT, 600 kB buffered)"),
            "{text}"
        );
        assert!(lines[4].starts_with("drive vda (ext4 at /data): 12.6 MB read (12.0 MB O_DIRECT, 600 kB buffered), 100% of the bytes, 1.50 GB/s"), "{text}");
        assert!(text.contains("\n  fallbacks: no_bulk 1\n"), "{text}");
        assert!(!text.ends_with('\n'), "println! adds the last newline");
        assert_eq!(stats(Vec::new()).to_string().lines().next(), Some("warnings: none"));
    }

    #[test]
    fn bytes_read_as_people_do() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1000), "1.00 kB");
        assert_eq!(bytes(12_600_000), "12.6 MB");
        assert_eq!(bytes(1_410_000_000), "1.41 GB");
        assert_eq!(bytes(999_999), "1000 kB");
        assert_eq!(bytes(u64::MAX), "18447 PB");
    }
}
