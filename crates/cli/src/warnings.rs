//! The library's warnings (`Engine::warnings`, `Model::warnings`: every
//! fallback that costs speed, with its fix), said once at the end of a run
//! on stderr, each line starting `warning: `, worst first. They are said
//! whatever the log level (`-v`, `WEIGHTSTREAM_LOG`): the log says each
//! fallback once as it happens, this says what the run ended with.
//!
//! Each model and engine a command makes is watched ([`Watch`]): its
//! warnings are collected when the watch drops (the end of the command, or
//! an error on the way out), and the same warning from several engines
//! (bench arms) is said once, with the largest count.

use std::sync::Mutex;

use weightstream::Warning;

static SEEN: Mutex<Vec<Warning>> = Mutex::new(Vec::new());

fn seen() -> std::sync::MutexGuard<'static, Vec<Warning>> {
    SEEN.lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds `warnings` to those said at the end: one per kind and place, the
/// largest count (a later snapshot of the same engine counts more).
pub(crate) fn note(warnings: Vec<Warning>) {
    let mut all = seen();
    for w in warnings {
        match all.iter_mut().find(|s| s.kind == w.kind && s.location == w.location) {
            Some(s) if s.count >= w.count => {}
            Some(s) => *s = w,
            None => all.push(w),
        }
    }
}

/// Notes the warnings `f` returns when dropped: `let _w = Watch(|| engine.warnings());`
/// right after the engine (or model) is made, so they are collected however
/// the command ends.
pub(crate) struct Watch<F: FnMut() -> Vec<Warning>>(pub(crate) F);

impl<F: FnMut() -> Vec<Warning>> Drop for Watch<F> {
    fn drop(&mut self) {
        note((self.0)());
    }
}

/// The lines to say: `warning: <where>: <message> (<count>; costs: ...)`,
/// worst first; empties the collection (said once).
pub(crate) fn take_lines() -> Vec<String> {
    let mut all = std::mem::take(&mut *seen());
    all.sort_by(|a, b| {
        (a.kind, std::cmp::Reverse(a.count), &a.location).cmp(&(b.kind, std::cmp::Reverse(b.count), &b.location))
    });
    all.iter().map(|w| format!("warning: {w}")).collect()
}

/// Says the collected warnings on stderr, once.
pub(crate) fn print() {
    for line in take_lines() {
        eprintln!("{line}");
    }
}
