//! Every argument of every command, hostile (issue 26): the test finds the
//! arguments itself, from clap's own command tree (`weightstream cli-tree`,
//! hidden), so a new flag is covered without anyone adding it here.
//!
//! Each command runs once on a benign baseline (a tiny model; cheap values
//! for the flags that would start long work: see [`baseline`]), then once
//! per argument and hostile value: `0`, `1`, `-1`, the largest u64, empty,
//! `-`, a path with a newline, a directory, a FIFO, `/dev/zero`, a file the
//! process may not read (as root the case runs as `nobody`). A flag without
//! a value runs once, added to the baseline. Every run is under a 2 GiB
//! address-space limit and a watchdog (60 s), in its own working
//! directory. Each must end by itself with an exit status (no signal, no
//! OOM kill, no hang), print no panic and no allocation abort, and either
//! succeed (a legal value: the work it starts is small on the baseline) or
//! fail with a message that names the argument: its flag, its `<NAME>`, or
//! the value itself (a path).
//!
//! Per command, what a legal value does: `inspect`, `digest`, `verify`,
//! `load` read the 2-layer fixture; `place` mirrors it to one root on the
//! source's volume (`--allow-source-volume`); `ceiling` sweeps one
//! configuration (64 KiB, depth 1, one reader, 1 MiB or 0.05 s) of a shard;
//! `bench` runs the engine arm once (its ceiling arm is the quick sweep, 8
//! configurations of at most 0.25 s); `gen` writes a model of about 1 MiB;
//! `demo` writes its smallest model (about 20 MB), reads and benches it;
//! `plot` draws a one-bar chart; `cli-tree` prints the tree.

mod common;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use weightstream_synth::{self as synth, SynthSpec};

/// A run longer than this is a hang (a watchdog, not a timing).
const WATCHDOG: Duration = Duration::from_secs(60);
/// The address space every run gets.
const ADDRESS_SPACE: u64 = 2 << 30;

/// One argument of a command, as `cli-tree` describes it.
#[derive(Debug, Clone)]
struct Arg {
    id: String,
    long: Option<String>,
    positional: bool,
    takes_value: bool,
    value_names: Vec<String>,
}

#[derive(Debug)]
struct Cmd {
    name: String,
    args: Vec<Arg>,
}

fn tree() -> Vec<Cmd> {
    let out = common::run(&[OsStr::new("cli-tree")]);
    assert!(
        out.status.success(),
        "cli-tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cli-tree prints JSON");
    let s = |v: &serde_json::Value| v.as_str().map(String::from);
    v["commands"]
        .as_array()
        .expect("commands")
        .iter()
        .map(|c| Cmd {
            name: s(&c["name"]).expect("a name"),
            args: c["args"]
                .as_array()
                .expect("args")
                .iter()
                .map(|a| Arg {
                    id: s(&a["id"]).expect("an id"),
                    long: s(&a["long"]),
                    positional: a["positional"].as_bool().unwrap(),
                    takes_value: a["takes_value"].as_bool().unwrap(),
                    value_names: a["value_names"]
                        .as_array()
                        .map(|n| n.iter().filter_map(s).collect())
                        .unwrap_or_default(),
                })
                .collect(),
        })
        .collect()
}

/// What the cases share: the fixture model, a shard of it, a chart spec,
/// a FIFO, a file nobody but root may read.
struct Fixture {
    root: PathBuf,
    model: PathBuf,
    shard: PathBuf,
    spec: PathBuf,
    fifo: PathBuf,
    noperm: PathBuf,
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn fixture(root: &Path) -> Fixture {
    chmod(root, 0o755);
    let model = root.join("model");
    let spec = SynthSpec {
        layers: 2,
        experts: 2,
        expert_bytes: 64 << 10,
        shards: 1,
        ..SynthSpec::default()
    };
    let paths = synth::write_model(&model, &spec).unwrap();
    chmod(&model, 0o755);
    for e in std::fs::read_dir(&model).unwrap() {
        chmod(&e.unwrap().path(), 0o644);
    }
    let chart = root.join("chart.json");
    std::fs::write(&chart, br#"{"title": "t", "unit": "GB/s", "bars": [["a", 1.0]]}"#).unwrap();
    chmod(&chart, 0o644);
    let fifo = root.join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o666),
        0,
    )
    .unwrap();
    let noperm = root.join("noperm");
    std::fs::write(&noperm, b"{}").unwrap();
    chmod(&noperm, 0o000);
    std::fs::create_dir(root.join("cases")).unwrap();
    chmod(&root.join("cases"), 0o777);
    Fixture {
        root: root.to_path_buf(),
        shard: paths[0].clone(),
        model,
        spec: chart,
        fifo,
        noperm,
    }
}

/// A hostile value; some are made per case (in the case's directory).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Hostile {
    Text(&'static str),
    NewlinePath,
    EmptyDir,
    Fifo,
    DevZero,
    NoPermission,
}

const HOSTILE: [Hostile; 11] = [
    Hostile::Text("0"),
    Hostile::Text("1"),
    Hostile::Text("-1"),
    Hostile::Text("18446744073709551615"),
    Hostile::Text(""),
    Hostile::Text("-"),
    Hostile::NewlinePath,
    Hostile::EmptyDir,
    Hostile::Fifo,
    Hostile::DevZero,
    Hostile::NoPermission,
];

impl Hostile {
    fn value(self, fx: &Fixture, case: &Path) -> OsString {
        match self {
            Hostile::Text(t) => t.into(),
            Hostile::NewlinePath => case.join("new\nline").into(),
            Hostile::EmptyDir => {
                let d = case.join("empty");
                std::fs::create_dir(&d).unwrap();
                chmod(&d, 0o777);
                d.into()
            }
            Hostile::Fifo => fx.fifo.clone().into(),
            Hostile::DevZero => "/dev/zero".into(),
            Hostile::NoPermission => fx.noperm.clone().into(),
        }
    }
}

/// The benign value of each argument a command needs (positionals, required
/// flags), and the cheap values paired with the flags that would otherwise
/// start long work. Keyed by argument id.
fn baseline(cmd: &str, fx: &Fixture, case: &Path) -> Vec<(&'static str, OsString)> {
    let model: OsString = fx.model.clone().into();
    let p = |s: &str| OsString::from(s);
    match cmd {
        "inspect" | "digest" | "verify" | "load" => vec![("model_dir", model)],
        "place" => {
            let root = case.join("root");
            std::fs::create_dir(&root).unwrap();
            chmod(&root, 0o777);
            vec![
                ("src_dir", model),
                ("to", root.into()),
                ("layout", p("mirror")),
                ("allow_source_volume", p("")),
            ]
        }
        "ceiling" => vec![
            ("paths", fx.shard.clone().into()),
            ("bs", p("64KiB")),
            ("qd", p("1")),
            ("readers", p("1")),
            ("submit", p("inline")),
            ("buffers", p("plain")),
            ("bytes", p("1MiB")),
            ("seconds", p("0.05")),
        ],
        "bench" => vec![
            ("model_dir", model),
            ("arms", p("engine")),
            ("sweep", p("quick")),
            ("runs", p("1")),
        ],
        "gen" => vec![
            ("model_dir", case.join("gen").into()),
            ("size", p("1MiB")),
            ("expert_bytes", p("64KiB")),
            ("layers", p("2")),
            ("shards", p("1")),
        ],
        "plot" => vec![("spec", fx.spec.clone().into()), ("out", case.join("out.svg").into())],
        // The smallest demo model (4 layers, one expert each).
        "demo" => vec![("dir", case.join("demo").into()), ("size", p("20649600"))],
        _ => vec![],
    }
}

/// One run: the command line and what it tests.
struct Case {
    cmd: String,
    /// The argument under test and its value (None: the baseline).
    arg: Option<(Arg, Option<Hostile>)>,
}

struct Outcome {
    label: String,
    code: Option<i32>,
    signal: Option<i32>,
    hung: bool,
    stderr: String,
    stdout: String,
    value: Option<OsString>,
}

fn argv(cmd: &Cmd, values: &[(Arg, Option<OsString>)]) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![cmd.name.clone().into()];
    let mut positional = Vec::new();
    for (a, val) in values {
        if a.positional {
            positional.push((a, val.clone().expect("a positional has a value")));
        } else {
            let long = a.long.as_deref().expect("a flag has a long name");
            match val {
                Some(x) if a.takes_value => {
                    let mut f = OsString::from(format!("--{long}="));
                    f.push(x);
                    v.push(f);
                }
                _ => v.push(format!("--{long}").into()),
            }
        }
    }
    // Positionals in the tree's order, after `--` (so `-1` is a value).
    positional.sort_by_key(|(a, _)| cmd.args.iter().position(|b| b.id == a.id));
    if !positional.is_empty() {
        v.push("--".into());
        v.extend(positional.into_iter().map(|(_, x)| x));
    }
    v
}

fn run_case(fx: &Fixture, cmds: &[Cmd], case: &Case, n: usize) -> Outcome {
    let cmd = cmds.iter().find(|c| c.name == case.cmd).unwrap();
    let dir = fx.root.join("cases").join(n.to_string());
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o777);
    let mut values: Vec<(Arg, Option<OsString>)> = Vec::new();
    let tested = case.arg.as_ref().map(|(a, _)| a.id.clone());
    for (id, val) in baseline(&cmd.name, fx, &dir) {
        if Some(id) == tested.as_deref() {
            continue;
        }
        let a = cmd
            .args
            .iter()
            .find(|a| a.id == id)
            .unwrap_or_else(|| panic!("{}: the baseline names {id}, which the tree lacks", cmd.name));
        values.push((a.clone(), a.takes_value.then_some(val)));
    }
    let mut value = None;
    let mut as_nobody = false;
    if let Some((a, h)) = &case.arg {
        let v = h.map(|h| h.value(fx, &dir));
        as_nobody = *h == Some(Hostile::NoPermission) && rustix::process::geteuid().is_root();
        value = v.clone();
        values.push((a.clone(), v));
    }
    let args = argv(cmd, &values);
    let label = format!(
        "weightstream {}",
        args.iter()
            .map(|a| format!("{:?}", a.to_string_lossy()))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let mut c = common::hermetic(Command::new(common::bin()));
    c.args(&args)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .env("TMPDIR", &dir)
        .env_remove("RUST_BACKTRACE");
    // SAFETY: the closure runs in the child between fork and exec and only
    // makes system calls (setrlimit, setgid, setuid), which are
    // async-signal-safe; it touches no lock and allocates nothing.
    unsafe {
        c.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: ADDRESS_SPACE,
                rlim_max: ADDRESS_SPACE,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if as_nobody && (libc::setgid(65534) != 0 || libc::setuid(65534) != 0) {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = c.spawn().unwrap_or_else(|e| panic!("{label}: spawn: {e}"));
    let t0 = Instant::now();
    let (status, hung) = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break (Some(s), false);
        }
        if t0.elapsed() > WATCHDOG {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Outcome {
        label,
        code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        hung,
        stderr: read(&err_path),
        stdout: read(&out_path),
        value,
    }
}

/// Whether `msg` names the argument `a` (given `value`): its flag, its
/// `<NAME>`, or the value as a token (a path the error names).
fn names_argument(msg: &str, a: &Arg, value: Option<&OsStr>) -> bool {
    if let Some(l) = &a.long {
        if msg.contains(&format!("--{l}")) {
            return true;
        }
    }
    if a.positional
        && a.value_names
            .iter()
            .chain(std::iter::once(&a.id.to_uppercase()))
            .any(|n| msg.contains(&format!("<{n}>")))
    {
        return true;
    }
    let Some(v) = value.filter(|v| !v.is_empty()) else {
        return false;
    };
    let raw = String::from_utf8_lossy(v.as_bytes()).into_owned();
    let escaped = weightstream::__internal::escape(v);
    [raw, escaped].iter().any(|v| {
        [format!("'{v}'"), format!("\"{v}\""), format!("{v:?}")]
            .iter()
            .any(|q| msg.contains(q.as_str()))
            || msg
                .match_indices(&format!("{v}:"))
                .any(|(i, _)| i == 0 || matches!(msg.as_bytes()[i - 1], b' ' | b'\n' | b'(' | b'\'' | b'"'))
            || msg.contains(&format!("{v} is "))
    })
}

#[test]
fn every_argument_of_every_command_survives_hostile_values() {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let fx = fixture(tmp.path());
    let cmds = tree();

    // The tree covers every command and flag `--help` lists.
    let help = String::from_utf8_lossy(&common::run(&[OsStr::new("--help")]).stdout).into_owned();
    let listed: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .expect("a Commands section")
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "help")
        .collect();
    assert!(listed.len() >= 8, "{help}");
    for name in &listed {
        let cmd = cmds.iter().find(|c| c.name == *name);
        let cmd = cmd.unwrap_or_else(|| panic!("`--help` lists {name}, the tree does not"));
        let sub_help = common::run(&[OsStr::new(name), OsStr::new("--help")]);
        let sub_help = String::from_utf8_lossy(&sub_help.stdout).into_owned();
        // Each option line: `  -v, --verbose...` or `      --qd <QD>`.
        for line in sub_help.lines().map(str::trim_start).filter(|l| l.starts_with('-')) {
            let Some(tok) = line.split_whitespace().find(|w| w.starts_with("--")) else {
                continue;
            };
            let flag = tok
                .trim_start_matches("--")
                .split(['=', '<', '[', ',', '.'])
                .next()
                .unwrap();
            assert!(
                cmd.args.iter().any(|a| a.long.as_deref() == Some(flag)),
                "`{name} --help` lists --{flag}, the tree does not"
            );
        }
    }

    let mut cases = Vec::new();
    for c in &cmds {
        cases.push(Case {
            cmd: c.name.clone(),
            arg: None,
        });
        for a in &c.args {
            if a.takes_value {
                for h in HOSTILE {
                    cases.push(Case {
                        cmd: c.name.clone(),
                        arg: Some((a.clone(), Some(h))),
                    });
                }
            } else {
                cases.push(Case {
                    cmd: c.name.clone(),
                    arg: Some((a.clone(), None)),
                });
            }
        }
    }
    // Baselines first (index order), then the rest, over a few threads.
    let next = AtomicUsize::new(0);
    let results: Mutex<BTreeMap<usize, Outcome>> = Mutex::default();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8) * 2;
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let o = run_case(&fx, &cmds, case, i);
                results.lock().unwrap().insert(i, o);
            });
        }
    });
    let results = results.into_inner().unwrap();

    // A command whose baseline this machine refuses (no O_DIRECT on the
    // test's filesystem, say) may refuse its legal values the same way.
    let mut refused_baseline: BTreeMap<&str, String> = BTreeMap::new();
    for (i, case) in cases.iter().enumerate() {
        let o = &results[&i];
        if case.arg.is_none() && o.code != Some(0) && o.code.is_some() {
            eprintln!("note: baseline refused here: {}: {}", o.label, o.stderr.trim());
            refused_baseline.insert(case.cmd.as_str(), o.stderr.clone());
        }
    }
    let mut failures = Vec::new();
    let (mut ok, mut refused) = (0, 0);
    for (i, case) in cases.iter().enumerate() {
        let o = &results[&i];
        let text = format!("{}\n{}", o.stdout, o.stderr);
        let why = if o.hung {
            Some(format!("no exit within {WATCHDOG:?} (killed)"))
        } else if let Some(sig) = o.signal {
            Some(format!("killed by signal {sig}"))
        } else if ["panicked", "memory allocation of", "stack overflow", "RUST_BACKTRACE"]
            .iter()
            .any(|p| text.contains(p))
        {
            Some("a panic or an allocation abort".to_string())
        } else {
            let code = o.code.expect("an exit status");
            // `verify` exits 1 when it found a change: a verdict, not a refusal.
            let verdict = code == 0 || (case.cmd == "verify" && code == 1 && o.stderr.is_empty());
            if verdict {
                ok += 1;
                None
            } else {
                refused += 1;
                match &case.arg {
                    None => {
                        (!refused_baseline.contains_key(case.cmd.as_str())).then(|| "the baseline failed".to_string())
                    }
                    Some((a, _)) => {
                        let env = refused_baseline.contains_key(case.cmd.as_str())
                            && o.stderr.contains("weightstream: error:");
                        (!env && !names_argument(&o.stderr, a, o.value.as_deref()))
                            .then(|| format!("exit {code} without naming the argument {}", a.id))
                    }
                }
            }
        };
        if let Some(why) = why {
            failures.push(format!("{}: {why}\n  stderr: {}", o.label, o.stderr.trim()));
        }
    }
    eprintln!(
        "{} hostile-argument cases over {} commands: {ok} succeeded (legal values), {refused} refused; {:.1} s",
        cases.len(),
        cmds.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
