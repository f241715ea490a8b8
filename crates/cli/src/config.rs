//! Configuration building: the library's configurations from the flags,
//! each flag shadowing its `WEIGHTSTREAM_*` variable (names from the
//! library's one table), and the ceiling sweep from its flags.

use std::path::Path;

use weightstream::{env, DirectMode, EngineConfig, ModelConfig};

use crate::ceiling::{Buffers, ReadConfig, Submit, SweepConfig};
use crate::cli::{BackendArg, EngineArgs, LayoutArgs, OnOff};

impl LayoutArgs {
    /// The model configuration of `model` (a directory, its index json or
    /// one `.safetensors` file: `ModelConfig::path`): each flag given
    /// shadows its variable.
    pub(crate) fn config(&self, model: &Path, direct: Option<DirectMode>) -> Result<ModelConfig, weightstream::Error> {
        let c = ModelConfig::path(model)?.settings(|k| {
            let flag = match k {
                env::MODEL_DIRS => &self.dirs,
                env::MIRROR => &self.mirror,
                // Typed flags are applied below.
                env::DISK_WEIGHTS if self.weights.is_some() => return None,
                env::ROUTE if self.route.is_some() => return None,
                // --direct (digest) always says; other commands follow the variable.
                env::DIRECT if direct.is_some() => return None,
                _ => &None,
            };
            flag.clone().or_else(|| weightstream::__internal::env::get(k))
        })?;
        let c = match &self.weights {
            Some(w) => c.weights(w.clone()),
            None => c,
        };
        let c = match self.route {
            Some(r) => c.route(r.into()),
            None => c,
        };
        Ok(match direct {
            Some(d) => c.direct(d),
            None => c,
        })
    }
}

impl EngineArgs {
    /// The engine configuration, or None for the sync reference path.
    pub(crate) fn config(&self) -> Result<Option<EngineConfig>, weightstream::Error> {
        let mut c = EngineConfig::from_env()?;
        match self.backend {
            Some(BackendArg::Sync) => return Ok(None),
            Some(BackendArg::Auto) => c = c.backend(weightstream::BackendChoice::Auto),
            Some(BackendArg::Uring) => c = c.backend(weightstream::BackendChoice::Uring),
            Some(BackendArg::Pread) => c = c.backend(weightstream::BackendChoice::Pread),
            None => {}
        }
        if let Some(q) = self.qd {
            c = c.queue_depth(q);
        }
        if let Some(ch) = self.chunk {
            c = c.chunk(Some(ch as usize));
        }
        if self.sqpoll {
            c = c.sqpoll(true);
        }
        if let Some(p) = self.iopoll {
            c = c.iopoll(p.into());
        }
        if let Some(v) = self.submit {
            c = c.submit(v);
        }
        if let Some(v) = self.numa {
            c = c.numa(v == OnOff::On);
        }
        Ok(Some(c))
    }
}

/// Configurations one `ceiling` run may sweep, at most.
const MAX_CONFIGS: usize = 4096;

/// The sweep the `ceiling` flags ask for: full or quick, with each
/// dimension given replacing that dimension's values (every combination).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sweep_config(
    quick: bool,
    bs: &[u64],
    qd: &[usize],
    readers: &[usize],
    submit: &[Submit],
    buffers: &[Buffers],
    bytes: Option<u64>,
    seconds: Option<f64>,
) -> Result<SweepConfig, Box<dyn std::error::Error>> {
    let mut cfg = if quick {
        SweepConfig::quick()
    } else {
        SweepConfig::full()
    };
    if !(bs.is_empty() && qd.is_empty() && readers.is_empty() && submit.is_empty() && buffers.is_empty()) {
        fn values<T: Copy + PartialEq>(given: Vec<T>, base: &[ReadConfig], f: fn(&ReadConfig) -> T) -> Vec<T> {
            let mut v = if given.is_empty() {
                base.iter().map(f).collect()
            } else {
                given
            };
            let mut seen = Vec::new();
            v.retain(|x| {
                let new = !seen.contains(x);
                seen.push(*x);
                new
            });
            v
        }
        let bs: Vec<usize> = bs
            .iter()
            .map(|&b| usize::try_from(b).map_err(|_| format!("--bs {b}: too large")))
            .collect::<Result<_, _>>()?;
        let full = SweepConfig::full().configs;
        let (bs, qd, readers, submit, buffers) = (
            values(bs, &full, |c| c.bs),
            values(qd.to_vec(), &full, |c| c.qd),
            values(readers.to_vec(), &full, |c| c.readers),
            values(submit.to_vec(), &full, |c| c.submit),
            values(buffers.to_vec(), &full, |c| c.buffers),
        );
        let n = [bs.len(), qd.len(), readers.len(), submit.len(), buffers.len()]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .filter(|&n| n <= MAX_CONFIGS)
            .ok_or_else(|| {
                format!(
                    "ceiling: {} --bs x {} --qd x {} --readers x {} --submit x {} --buffers value(s) is more than \
                     {MAX_CONFIGS} configurations",
                    bs.len(),
                    qd.len(),
                    readers.len(),
                    submit.len(),
                    buffers.len()
                )
            })?;
        debug_assert!(n >= 1);
        // The buffers of one configuration: every reader's reads in flight.
        let (room, why) = crate::args::memory_room();
        let most = (*bs.iter().max().unwrap_or(&0) as u128)
            * (*qd.iter().max().unwrap_or(&0) as u128)
            * (*readers.iter().max().unwrap_or(&0) as u128);
        if most > room as u128 {
            return Err(format!(
                "ceiling: --bs {} x --qd {} x --readers {} is {most} bytes of buffers for one configuration, more than \
                 the {room} bytes this process may allocate ({why})",
                bs.iter().max().unwrap_or(&0),
                qd.iter().max().unwrap_or(&0),
                readers.iter().max().unwrap_or(&0)
            )
            .into());
        }
        cfg.configs = SweepConfig::product(&bs, &qd, &readers, &submit, &buffers);
        cfg.name = "custom".into();
    }
    if let Some(b) = bytes {
        cfg.bytes = b;
    }
    if let Some(s) = seconds {
        cfg.seconds = s;
    }
    cfg.validate()?;
    Ok(cfg)
}
