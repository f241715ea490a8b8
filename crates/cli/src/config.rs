//! Configuration building: the library's configurations from the flags,
//! each flag shadowing its `WEIGHTSTREAM_*` variable (names from the
//! library's one table), and the ceiling sweep from its flags.

use std::path::Path;

use weightstream::{env, DirectMode, EngineConfig, ModelConfig};

use crate::ceiling::{Buffers, ReadConfig, Submit, SweepConfig};
use crate::cli::{BackendArg, EngineArgs, LayoutArgs, OnOff};

impl LayoutArgs {
    /// The model configuration: each flag given shadows its variable.
    pub(crate) fn config(&self, dir: &Path, direct: Option<DirectMode>) -> Result<ModelConfig, weightstream::Error> {
        let c = ModelConfig::new(dir).settings(|k| {
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
            flag.clone().or_else(|| env::get(k))
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
        cfg.configs = SweepConfig::product(
            &values(bs, &full, |c| c.bs),
            &values(qd.to_vec(), &full, |c| c.qd),
            &values(readers.to_vec(), &full, |c| c.readers),
            &values(submit.to_vec(), &full, |c| c.submit),
            &values(buffers.to_vec(), &full, |c| c.buffers),
        );
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
