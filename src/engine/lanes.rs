//! How many lanes (ring threads) a drive gets and how they issue reads,
//! or whether pread workers read it instead, decided per drive at
//! `Engine::new`: pure, from the configuration and the drive's submit probe.

use crate::config::SubmitMode;
use crate::engine::backend::ring;

/// How one drive's reads are issued, decided at `Engine::new`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SubmitPlan {
    /// Ring threads (lanes) for the drive.
    pub(crate) rings: usize,
    /// Reads flagged `IOSQE_ASYNC`.
    pub(crate) punt: bool,
    /// Pread workers instead of rings (one lane they share): the drive
    /// completes reads inline and the backend is `auto`.
    pub(crate) pread: Option<usize>,
    pub(crate) why: String,
}

/// The plan for a drive from the configuration and, for `Auto`, its probe
/// (`None`: no probe ran). `pread_workers` is `Some(n)` when the backend is
/// `auto`, so a drive may be read by n pread workers instead of rings.
///
/// A drive that completes reads inline (zram, brd, pmem: the copy runs in
/// the submitting call) is read fastest by pread workers taking chunks
/// from one shared queue: on one zram drive, 2 vCPUs, a 1 GiB synthetic
/// MoE, 10 alternating invocations of `bench --arms fio,engine,pread`, one
/// ring per CPU reached 0.923 of the pread backend at concurrency 1 and
/// 0.978 at 8 (docs/benchmarks/2026-12-04-expert-reads); whole-model loads
/// were level. With rings forced (`backend uring`), such a drive gets one
/// ring per CPU it may use, even when other such drives use the same CPUs
/// (two zram drives, mirrored, concurrency 8: one ring each 12.4 GB/s, two
/// each 14.1). Pure: unit-tested with made-up probes.
pub(crate) fn plan_submit(
    mode: SubmitMode,
    probe: Option<&std::io::Result<ring::SubmitProbe>>,
    cpus: usize,
    pread_workers: Option<usize>,
) -> SubmitPlan {
    let plan = |rings: usize, punt: bool, why: String| SubmitPlan {
        rings,
        punt,
        pread: None,
        why,
    };
    match mode {
        SubmitMode::Inline => plan(1, false, "inline (by configuration)".into()),
        SubmitMode::Async => plan(1, true, "async: punted to io-wq (by configuration)".into()),
        SubmitMode::Rings(n) => plan(n as usize, false, format!("{n} rings (by configuration)")),
        SubmitMode::Auto => match probe {
            None => plan(1, false, "inline (no probe: a polled ring)".into()),
            Some(Err(e)) => plan(1, false, format!("inline (the submit probe failed: {e})")),
            Some(Ok(p)) => match (ring::completes_inline(p), pread_workers) {
                ((true, seen), Some(w)) => SubmitPlan {
                    rings: 1,
                    punt: false,
                    pread: Some(w.max(1)),
                    why: format!("{} pread workers sharing one queue: {seen}", w.max(1)),
                },
                ((true, seen), None) if cpus > 1 => {
                    let n = cpus.min(MAX_RINGS_PER_DRIVE);
                    plan(n, false, format!("{n} rings, one per CPU: {seen}"))
                }
                ((_, seen), _) => plan(1, false, format!("inline: {seen}")),
            },
        },
    }
}

/// Most ring threads one drive gets under `SubmitMode::Auto`.
const MAX_RINGS_PER_DRIVE: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(submit_us: u64, total_us: u64) -> Option<std::io::Result<ring::SubmitProbe>> {
        Some(Ok(ring::SubmitProbe {
            k: 8,
            bytes: 8 << 16,
            // The made-up probes say inline exactly when the call took most
            // of the time.
            done_at_submit: if submit_us * 2 > total_us { 8 } else { 0 },
            submit: std::time::Duration::from_micros(submit_us),
            total: std::time::Duration::from_micros(total_us),
            passes: 1,
            clean: 1,
        }))
    }

    #[test]
    fn an_inline_drive_gets_pread_workers_and_others_one_ring() {
        let p = plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 2, Some(8));
        assert_eq!((p.rings, p.pread), (1, Some(8)), "{p:?}");
        assert!(
            p.why.contains("8 pread workers") && p.why.contains("inline"),
            "{}",
            p.why
        );
        let p = plan_submit(SubmitMode::Auto, probe(10, 400).as_ref(), 2, Some(8));
        assert_eq!((p.rings, p.pread, p.punt), (1, None, false), "{p:?}");
        // Asked for rings: never pread workers.
        for mode in [SubmitMode::Inline, SubmitMode::Async, SubmitMode::Rings(2)] {
            assert_eq!(plan_submit(mode, probe(190, 200).as_ref(), 2, Some(8)).pread, None);
        }
    }

    #[test]
    fn with_rings_forced_an_inline_drive_gets_one_ring_per_cpu_and_others_one_ring() {
        let p = plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 2, None);
        assert_eq!((p.rings, p.punt), (2, false), "{p:?}");
        assert!(p.why.contains("inline") && p.why.contains("2 rings"), "{}", p.why);
        let p = plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 64, None);
        assert_eq!(p.rings, MAX_RINGS_PER_DRIVE, "capped: {p:?}");
        // One CPU: more rings would only take turns on it.
        assert_eq!(
            plan_submit(SubmitMode::Auto, probe(190, 200).as_ref(), 1, None).rings,
            1
        );
        let p = plan_submit(SubmitMode::Auto, probe(10, 400).as_ref(), 8, None);
        assert_eq!((p.rings, p.punt), (1, false), "{p:?}");
        assert!(p.why.contains("asynchronously"), "{}", p.why);
    }

    #[test]
    fn configuration_wins_and_a_failed_probe_is_said() {
        assert_eq!(
            plan_submit(SubmitMode::Inline, probe(190, 200).as_ref(), 4, None).rings,
            1
        );
        assert_eq!(plan_submit(SubmitMode::Rings(3), None, 4, None).rings, 3);
        let a = plan_submit(SubmitMode::Async, None, 4, None);
        assert_eq!((a.rings, a.punt), (1, true));
        let failed = Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        let f = plan_submit(SubmitMode::Auto, Some(&failed), 4, None);
        assert_eq!(f.rings, 1);
        assert!(
            f.why.contains("probe failed") && f.why.contains("Invalid argument"),
            "{}",
            f.why
        );
        assert!(plan_submit(SubmitMode::Auto, None, 4, None).why.contains("polled"));
        assert_eq!("rings:4".parse::<SubmitMode>().unwrap(), SubmitMode::Rings(4));
        assert!("rings:0".parse::<SubmitMode>().is_err());
        assert!("fast".parse::<SubmitMode>().is_err());
    }
}
