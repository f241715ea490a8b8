//! An async engine on an executor thread: `read` never blocks and a
//! `Ticket` is a future, so the executor thread never waits inside a
//! weightstream call. Checked here as a fact that does not depend on the
//! machine's load: the executor thread makes no voluntary context switch
//! (`getrusage(RUSAGE_THREAD)`'s `ru_nvcsw`) inside any `read` call or any
//! poll of a ticket, on a current-thread tokio runtime at default settings,
//! on each backend. A call that waited on an I/O thread, a condition
//! variable or a lock held across I/O would sleep and count one. The time
//! inside the calls is printed, not asserted (timing belongs in the
//! benchmarks).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

/// What the executor thread did inside weightstream calls: voluntary
/// context switches, calls, and (for the record) time.
#[derive(Default)]
struct Inside {
    switches: AtomicU64,
    calls: AtomicU64,
    time: Mutex<Duration>,
}

impl Inside {
    fn measure<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let (out, switches) = common::voluntary_switches_in(f);
        *self.time.lock().unwrap() += t0.elapsed();
        self.switches.fetch_add(switches, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        out
    }
}

/// A future whose polls are measured into `inside`.
struct Measured<F> {
    inner: F,
    inside: Arc<Inside>,
}

impl<F: Future + Unpin> Future for Measured<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let inside = Arc::clone(&self.inside);
        inside.measure(|| Pin::new(&mut self.inner).poll(cx))
    }
}

/// The probe sees a wait: a 1 ms sleep is one voluntary context switch at
/// least (so a `read` or a poll that blocked could not pass unseen).
#[test]
fn the_probe_counts_a_call_that_waits() {
    let inside = Inside::default();
    inside.measure(|| std::thread::sleep(Duration::from_millis(1)));
    assert!(inside.switches.load(Ordering::Relaxed) >= 1);
}

#[test]
fn an_executor_thread_never_waits_inside_weightstream() {
    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = SynthSpec {
        layers: 4,
        experts: 4,
        expert_bytes: 2 << 20,
        shards: 2,
        seed: 0xa51c,
        ..SynthSpec::default()
    };
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let experts: Vec<_> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .cloned()
        .collect();
    for backend in common::engine_backend_choices() {
        let engine = Arc::new(Engine::new(&model, EngineConfig::default().backend(backend)).unwrap());
        let arena = engine
            .packed_arena(8 * (experts[0].len as usize + 8192), false)
            .unwrap();
        let inside = Arc::new(Inside::default());
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (t0, run_switches0) = (Instant::now(), common::thread_voluntary_switches());
        let verified = rt.block_on(async {
            // Eight reads in flight, each awaited; every expert twice.
            let mut next = 0;
            let mut ok = 0;
            let order: Vec<_> = experts.iter().chain(experts.iter()).collect();
            let mut inflight = std::collections::VecDeque::new();
            while next < order.len() || !inflight.is_empty() {
                while inflight.len() < 8 && next < order.len() {
                    let t = order[next];
                    let Ok(slot) = arena.take_for(t) else { break };
                    next += 1;
                    let ticket = inside.measure(|| engine.read(t, slot).unwrap());
                    inflight.push_back((
                        t,
                        tokio::spawn(Measured {
                            inner: ticket,
                            inside: Arc::clone(&inside),
                        }),
                    ));
                }
                let (t, h) = inflight.pop_front().unwrap();
                let l = h.await.unwrap().unwrap();
                ok += usize::from(synth::verify(s.seed, &t.name, &l));
            }
            ok
        });
        let (total, run_switches) = (t0.elapsed(), common::thread_voluntary_switches() - run_switches0);
        assert_eq!(verified, 2 * experts.len(), "{backend:?}");
        let (calls, switches) = (
            inside.calls.load(Ordering::Relaxed),
            inside.switches.load(Ordering::Relaxed),
        );
        let time = *inside.time.lock().unwrap();
        eprintln!(
            "{backend:?}: {calls} calls (reads and polls), {switches} voluntary context switches inside them \
             ({run_switches} on the executor thread in the whole run, where it may park); \
             inside weightstream {time:?} of {total:?} ({:.3}%)",
            time.as_secs_f64() / total.as_secs_f64() * 100.0
        );
        // Every read and at least one poll per read.
        assert!(calls >= 2 * 2 * experts.len() as u64, "{backend:?}: {calls} calls");
        // A call that waits for a read (or for an I/O thread to answer)
        // switches on every read: at least `2 * experts` times. A lone
        // switch can be a lock an I/O thread held when it was preempted on
        // a busy machine (the queue, a request): allowed, one per 50 calls.
        assert!(
            switches <= calls / 50,
            "{backend:?}: the executor thread waited {switches} time(s) inside {calls} calls of read or a ticket's poll"
        );
    }
}
