//! Device names resolved through sysfs (a partition to its disk, a stacked
//! device to its members), member localities combined, and hwloc's list
//! syntax for CPU and node sets.

use std::collections::BTreeMap;

use super::Locality;

/// The whole-disk name of `dev` (`nvme0n1p2` -> `nvme0n1`), through sysfs;
/// `dev` itself when sysfs does not know it.
pub(crate) fn disk_of(dev: &str) -> String {
    let dev = dev.strip_prefix("/dev/").unwrap_or(dev);
    let Ok(real) = std::fs::canonicalize(format!("/sys/class/block/{dev}")) else {
        return dev.to_string();
    };
    let disk = if real.join("partition").exists() {
        real.parent().map(|p| p.to_path_buf()).unwrap_or(real)
    } else {
        real
    };
    disk.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dev.to_string())
}

/// The members of a stacked device (device-mapper, md): the disks behind
/// `/sys/block/X/slaves`, resolved recursively to whole disks. Empty for a
/// plain disk.
pub(crate) fn members_of(disk: &str) -> Vec<String> {
    fn walk(disk: &str, depth: usize, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(format!("/sys/block/{disk}/slaves")) else {
            if depth > 0 {
                out.push(disk.to_string());
            }
            return;
        };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        if names.is_empty() {
            if depth > 0 {
                out.push(disk.to_string());
            }
            return;
        }
        for n in names {
            let d = disk_of(&n);
            if depth < 8 && !out.contains(&d) {
                walk(&d, depth + 1, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(disk, 0, &mut out);
    out.dedup();
    out
}

/// Combines member localities: the majority node wins (ties: the lowest
/// node); a split is noted and logged.
pub(crate) fn majority(device: &str, members: &[(String, Locality)], source: &'static str) -> Locality {
    let mut votes: BTreeMap<usize, usize> = BTreeMap::new();
    for (_, l) in members {
        if let Some(n) = l.node {
            *votes.entry(n).or_default() += 1;
        }
    }
    let Some((&node, _)) = votes.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) else {
        let why: Vec<String> = members
            .iter()
            .map(|(m, l)| format!("{m}: {}", l.note.as_deref().unwrap_or("unknown")))
            .collect();
        return Locality::unknown(
            source,
            format!("{device}: no member with a known node ({})", why.join("; ")),
        );
    };
    let mut loc = members
        .iter()
        .find(|(_, l)| l.node == Some(node))
        .map(|(_, l)| l.clone())
        .expect("a member voted for this node");
    let placed: Vec<String> = members
        .iter()
        .map(|(m, l)| {
            format!(
                "{m} on {}",
                l.node.map_or("unknown".to_string(), |n| format!("node {n}"))
            )
        })
        .collect();
    if votes.len() > 1 || members.iter().any(|(_, l)| l.node.is_none()) {
        let note = format!(
            "{device}: members on different nodes ({}); placed on node {node} by majority",
            placed.join(", ")
        );
        tracing::warn!("{note}");
        loc.note = Some(note);
    } else {
        loc.note = Some(format!("{device}: members {}", placed.join(", ")));
    }
    loc
}

/// `0-3,8,10-11` from sorted indices.
pub(crate) fn list_string(idx: impl IntoIterator<Item = usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let flush = |run: (usize, usize), out: &mut Vec<String>| {
        out.push(if run.0 == run.1 {
            run.0.to_string()
        } else {
            format!("{}-{}", run.0, run.1)
        })
    };
    for i in idx {
        run = match run {
            Some((a, b)) if i == b + 1 => Some((a, i)),
            Some(r) => {
                flush(r, &mut out);
                Some((i, i))
            }
            None => Some((i, i)),
        };
    }
    if let Some(r) = run {
        flush(r, &mut out);
    }
    out.join(",")
}

/// Indices of a list string (`0-3,8`); `None` when malformed.
pub(crate) fn parse_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a || b - a > 1 << 20 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}
