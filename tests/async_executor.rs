//! An async engine on an executor thread: `read` never blocks and a
//! `Ticket` is a future, so an executor thread spends almost none of a run
//! inside weightstream calls (the bound: 1%). Measured here: the
//! time inside every `read` call and every poll of a ticket, against the
//! whole run, on a current-thread tokio runtime at default settings.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth::{self as synth, SynthSpec};

/// A future whose polls are timed into `spent`.
struct Timed<F> {
    inner: F,
    spent: Arc<std::sync::Mutex<Duration>>,
}

impl<F: Future + Unpin> Future for Timed<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let t0 = Instant::now();
        let r = Pin::new(&mut self.inner).poll(cx);
        *self.spent.lock().unwrap() += t0.elapsed();
        r
    }
}

#[test]
fn an_executor_thread_is_almost_never_blocked_in_weightstream() {
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
    let engine = Arc::new(Engine::new(&model, EngineConfig::default()).unwrap());
    let experts: Vec<_> = model
        .catalog()
        .tensors()
        .iter()
        .filter(|t| t.name.contains(".experts."))
        .cloned()
        .collect();
    let arena = engine
        .packed_arena(8 * (experts[0].len as usize + 8192), false)
        .unwrap();
    let spent = Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let t0 = Instant::now();
    let verified = rt.block_on(async {
        // Eight reads in flight, each awaited; every expert twice.
        let mut next = 0;
        let mut ok = 0;
        let order: Vec<_> = experts.iter().chain(experts.iter()).collect();
        let mut inflight = std::collections::VecDeque::new();
        while next < order.len() || !inflight.is_empty() {
            while inflight.len() < 8 && next < order.len() {
                let t = order[next];
                let Some(slot) = arena.take_for(t) else { break };
                next += 1;
                let c0 = Instant::now();
                let ticket = engine.read(t, slot).unwrap();
                *spent.lock().unwrap() += c0.elapsed();
                inflight.push_back((
                    t,
                    tokio::spawn(Timed {
                        inner: ticket,
                        spent: Arc::clone(&spent),
                    }),
                ));
            }
            let (t, h) = inflight.pop_front().unwrap();
            let l = h.await.unwrap().unwrap();
            ok += usize::from(synth::verify(s.seed, &t.name, &l));
        }
        ok
    });
    let total = t0.elapsed();
    assert_eq!(verified, 2 * experts.len());
    let inside = *spent.lock().unwrap();
    let share = inside.as_secs_f64() / total.as_secs_f64();
    eprintln!("inside weightstream: {inside:?} of {total:?} ({:.3}%)", share * 100.0);
    assert!(
        share <= 0.01,
        "the executor thread spent {:.2}% of the run inside weightstream calls",
        share * 100.0
    );
}
