//! The `weightstream` command: inspect a model, digest its tensors through
//! any read path, verify its files, place it across drives, measure the
//! device ceiling, bench the engine against it, write synthetic models, and
//! a demo that shows the point in one command.
//!
//! `cli` defines the command line, `config` builds the library's
//! configurations from it, `commands` runs each command; `ceiling`,
//! `bench`, `plot` and `progress` are the tools they use.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Cmd};

mod args;
mod bench;
mod ceiling;
mod cli;
mod commands;
mod config;
mod error;
mod load_ceiling;
mod plot;
mod progress;
mod suggest;
mod warnings;

fn main() -> ExitCode {
    // A command-line tool dies quietly when its reader goes away
    // (`weightstream digest ... | head`), instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE at the start of
    // main, before any thread exists, races with nothing.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    init_logging(cli.verbose);
    run(cli.cmd)
}

/// Says the run's warnings (every fallback that cost speed, with its fix:
/// `warning: ...` lines, see `warnings`), then the error, if any.
fn finish(error: Option<String>) {
    warnings::print();
    if let Some(e) = error {
        eprintln!("{e}");
    }
}

/// Logs to stderr: warnings by default, `-v` info, `-vv` debug, or
/// `WEIGHTSTREAM_LOG` (an env-filter directive).
fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env(weightstream::env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
}

/// Runs one command: exit 0 on success, 1 on an error (said on stderr);
/// `verify` has its own statuses.
fn run(cmd: Cmd) -> ExitCode {
    let r = match cmd {
        // Its own exit status: 0 nothing changed, 1 changed, 2 could not check.
        Cmd::Verify {
            model_dir,
            digest,
            against,
            layout,
            json,
        } => {
            let r = commands::verify::verify(&model_dir, digest, against.as_deref(), &layout, json);
            return match r {
                Ok(same) => {
                    finish(None);
                    ExitCode::from(if same { 0 } else { 1 })
                }
                Err(e) => {
                    finish(Some(error_text(&*e)));
                    ExitCode::from(2)
                }
            };
        }
        Cmd::Inspect {
            model_dir,
            layout,
            numa: _,
            tensors: true,
            json,
        } => commands::inspect::tensors(model_dir, &layout, json),
        Cmd::Inspect {
            model_dir,
            layout,
            numa,
            tensors: false,
            json,
        } => commands::inspect::inspect(model_dir, &layout, numa, json),
        Cmd::Load {
            model_dir,
            method,
            names,
            align,
            order,
            populate,
            register,
            fault_ahead,
            fault_ahead_threads,
            memory,
            digest,
            engine,
            layout,
            json,
        } => commands::load::load(
            &model_dir,
            &commands::load::LoadArgs {
                method,
                names,
                align,
                order: order.into(),
                populate,
                register,
                fault_ahead: fault_ahead.chosen(),
                fault_ahead_threads: fault_ahead_threads.map(usize::from),
                memory,
                digest,
                json,
            },
            &engine,
            &layout,
        ),
        Cmd::Digest {
            model_dir,
            tensors,
            direct,
            engine,
            layout,
            json,
        } => commands::digest::digest(model_dir, tensors, direct, &engine, &layout, json),
        Cmd::Place {
            src_dir,
            to,
            layout,
            digest,
            allow_source_volume,
            json,
        } => commands::place::place(src_dir, to.0, layout.into(), digest, allow_source_volume, json),
        Cmd::Ceiling {
            paths,
            quick,
            bs,
            qd,
            readers,
            submit,
            buffers,
            bytes,
            seconds,
            small_pages,
            json,
        } => config::sweep_config(quick, &bs, &qd, &readers, &submit, &buffers, bytes, seconds).and_then(|mut cfg| {
            cfg.huge_pages = !small_pages;
            commands::ceiling::ceiling_cmd(paths, &cfg, json)
        }),
        Cmd::Gen {
            model_dir,
            size,
            layers,
            experts,
            expert_bytes,
            shards,
            seed,
        } => commands::gen::gen(model_dir, size, layers, experts, expert_bytes, shards, seed),
        Cmd::Bench {
            model_dir,
            arms,
            sweep,
            small_pages,
            sweep_figure,
            runs,
            concurrency,
            seed,
            filter,
            engine,
            layout,
            passes,
            timeline_ms,
            plot,
            json,
        } => commands::bench::bench_cmd(
            model_dir,
            arms,
            (sweep, small_pages, sweep_figure),
            (runs, concurrency, seed, passes, timeline_ms),
            filter,
            &engine,
            &layout,
            plot,
            json,
        ),
        Cmd::LoadCeiling {
            model_dir,
            sweep,
            fault_rounds,
            fio_config,
            layout,
            json,
        } => commands::load_ceiling::load_ceiling_cmd(model_dir, (sweep, fio_config), fault_rounds, &layout, json),
        Cmd::Plot { spec, out } => commands::plot::plot(spec, out),
        Cmd::CliTree => commands::tree::tree(),
        Cmd::Demo { dir, size, keep } => commands::demo::demo(dir, size, keep),
    };
    match r {
        Ok(()) => {
            finish(None);
            ExitCode::SUCCESS
        }
        Err(e) => {
            finish(Some(error_text(&*e)));
            ExitCode::FAILURE
        }
    }
}

/// `weightstream: error: ...` with the chain of causes.
fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = format!("weightstream: error: {e}");
    let mut src = e.source();
    while let Some(s) = src {
        // Messages that already state their cause are not repeated.
        let cause = s.to_string();
        if !msg.contains(&cause) {
            msg.push_str(&format!(": {cause}"));
        }
        src = s.source();
    }
    msg
}
