//! The ceiling's drives: the given files grouped by the device that holds
//! them (`st_dev`), each group read alone and then all at once.

use std::fs::File;
use std::path::PathBuf;

use weightstream::__internal::open_direct;

use crate::error::{Error, Result};

/// A drive: its files, opened O_DIRECT once for every reader.
pub(super) struct Drive {
    pub(super) device: String,
    pub(super) files: Vec<PathBuf>,
    pub(super) opened: Vec<(File, u64)>,
}

/// Opens `paths` O_DIRECT, flushes their dirty pages, and groups them by
/// drive (`st_dev`), in order of first appearance.
pub(super) fn group(paths: &[PathBuf]) -> Result<Vec<Drive>> {
    if paths.is_empty() {
        return Err(Error::Config("ceiling: no file to read".into()));
    }
    let mut drives: Vec<(u64, Drive)> = Vec::new();
    for p in paths {
        let f = open_direct(p).map_err(|e| Error::io(p, "open(O_DIRECT)", e))?;
        let t = weightstream::__internal::FileTopology::probe(p, &f).map_err(|e| Error::io(p, "statx", e))?;
        let size = f.metadata().map_err(|e| Error::io(p, "fstat", e))?.len();
        // A file just written may still have dirty pages; the first O_DIRECT
        // read of them would write them back inside the timed region (seen:
        // 2.6 GB/s instead of 5.8 right after `weightstream gen`). Flushed
        // here, untimed; a file that cannot be synced is read as it is.
        let _ = rustix::fs::fdatasync(&f);
        let d = match drives.iter_mut().find(|g| g.0 == t.dev) {
            Some(g) => &mut g.1,
            None => {
                drives.push((
                    t.dev,
                    Drive {
                        device: t.device.clone(),
                        files: Vec::new(),
                        opened: Vec::new(),
                    },
                ));
                &mut drives.last_mut().expect("just pushed").1
            }
        };
        d.files.push(p.clone());
        d.opened.push((f, size));
    }
    let drives: Vec<Drive> = drives.into_iter().map(|(_, d)| d).collect();
    if let Some(d) = drives.iter().find(|d| d.opened.iter().all(|(_, size)| *size == 0)) {
        return Err(Error::Config(format!(
            "ceiling: drive {}: its files hold no byte to read ({})",
            d.device,
            d.files
                .iter()
                .map(weightstream::__internal::escape)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(drives)
}

/// `paths` grouped by drive (`st_dev`): (device name, files), in order of
/// first appearance. Each file must open O_DIRECT.
pub fn drives_of(paths: &[PathBuf]) -> Result<Vec<(String, Vec<PathBuf>)>> {
    Ok(group(paths)?.into_iter().map(|d| (d.device, d.files)).collect())
}
