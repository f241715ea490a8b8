//! The engine's warnings: what of its setup fell back (the backend, fixed
//! files, fixed buffers, ring flags, io-wq's bound, NUMA placement and
//! binding) and what stopped, on top of the model's (O_DIRECT fallbacks,
//! failovers, mirrors, arena mappings). Each is decided here from what the
//! engine holds; the text is `stats::warning`'s.

use crate::engine::backend::ring;
use crate::engine::{Backend, Engine};
use crate::stats::warning::{self, Warning};
use crate::stats::Stats;
use crate::storage::numa::{binding_failed, online_nodes};

/// What the registry says about fixed buffers: the reason they are off,
/// the arenas refused, and the last refused arena (bytes, RLIMIT_MEMLOCK).
pub(crate) struct Registration {
    pub(crate) unregistered: Option<String>,
    pub(crate) refused_arenas: u64,
    pub(crate) last_refused: Option<(u64, bool)>,
}

impl Engine {
    /// Every fallback that costs speed, worst first: the model's
    /// ([`Model::warnings`](crate::Model::warnings): reads buffered instead
    /// of O_DIRECT by drive and cause, failovers, refused mirrors, arena
    /// mappings) and the engine's own: the pread backend instead of
    /// io_uring, arenas not registered as fixed buffers (`RLIMIT_MEMLOCK`,
    /// naming the `ulimit -l` to set), fixed files off, a plain ring, NUMA
    /// placement or binding lost, a stopped drive. Each has where, how many
    /// times, the fix and the cost. Empty when nothing fell back.
    ///
    /// These reach a user who installed no `tracing` subscriber (the log
    /// says each once, to a subscriber only). The same list leads
    /// [`Engine::stats`] (`stats().warnings`, and its `{}` display).
    pub fn warnings(&self) -> Vec<Warning> {
        self.stats().warnings
    }

    /// The engine's own warnings from its snapshot `s`; `reg` is `None` in
    /// a forked child (the registry's lock is not taken there).
    pub(crate) fn engine_warnings(&self, s: &Stats, reg: Option<&Registration>) -> Vec<Warning> {
        let mut out = Vec::new();
        for d in &s.drives {
            if let Some(why) = &d.stopped {
                out.push(warning::drive_stopped(&d.device, why, d.chunks_abandoned));
            }
        }
        if s.staged.reads > 0 {
            out.push(warning::staged(s.staged.reads, s.staged.bytes, s.staged.copy_cpu_ns));
        }
        let Some(reg) = reg else {
            return out; // a forked child: the drives are stopped, nothing else is known
        };
        let uring = matches!(self.backend, Backend::Uring);
        if !uring && self.pread_fallback {
            let why = self.backend_reason.as_deref().unwrap_or("io_uring unavailable");
            out.push(warning::pread_backend(why));
        }
        if uring {
            // Chunks into arenas nobody asked to register are a choice.
            // (Two counters read one after the other: saturating, as a
            // chunk counted between the two loads may show in the second.)
            let fallback =
                |d: &crate::stats::DriveStats| d.chunks_unregistered.saturating_sub(d.chunks_unregistered_arena);
            let chunks: u64 = s.drives.iter().map(fallback).sum();
            match &reg.unregistered {
                Some(why) => {
                    let (bytes, memlock) = reg.last_refused.map_or((None, false), |(b, m)| (Some(b), m));
                    out.push(warning::buffers_unregistered(
                        why,
                        memlock,
                        reg.refused_arenas.max(1),
                        bytes,
                        chunks,
                    ));
                }
                // Registered arenas, but slots across two pieces.
                None => out.extend(
                    s.drives
                        .iter()
                        .filter(|d| fallback(d) > 0)
                        .map(|d| warning::slots_unregistered(&d.device, fallback(d))),
                ),
            }
            if let Some(ff) = s.fixed_files.as_ref().filter(|f| !f.enabled) {
                out.push(warning::fixed_files_off(ff.reason.as_deref().unwrap_or("refused")));
            }
        }
        let nodes = online_nodes();
        for ((d, io), l) in s.drives.iter().zip(&self.drives).zip(&self.localities) {
            if let Some(r) = io.ring.as_deref().filter(|r| r.starts_with(ring::PLAIN)) {
                out.push(warning::ring_flags_refused(&d.device, r));
            }
            if io
                .submit
                .as_ref()
                .is_some_and(|(plan, iowq)| plan.punt && iowq.is_none())
            {
                out.push(warning::iowq_limit_unset(&d.device));
            }
            if self.numa_wanted && nodes > 1 && l.node.is_none() {
                out.push(warning::numa_unknown(&d.device, l.note.as_deref(), nodes));
            }
            if binding_failed(&io.binding) {
                out.push(warning::numa_binding_failed(&d.device, &io.binding));
            }
        }
        out
    }
}
