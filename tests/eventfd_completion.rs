//! Completion on an eventfd, for event loops in C and other languages: a
//! waker that writes an eventfd is all a caller needs (its own file: the
//! executor-time test beside it measures time and wants the CPUs alone).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use weightstream::{Engine, EngineConfig, Model, ModelConfig};
use weightstream_synth as synth;

/// Completion on an eventfd, as a C event loop wants it: the waker the
/// ticket is polled with writes to an eventfd, the loop sleeps in poll(2)
/// on it, and the next poll of the ticket has the payload. (A C ABI builds
/// exactly this waker; the library needs nothing more.)
#[test]
fn a_waker_that_writes_an_eventfd_wakes_an_event_loop() {
    use std::os::fd::{AsFd, OwnedFd};
    use std::task::{Wake, Waker};

    struct EventFdWaker(OwnedFd);
    impl Wake for EventFdWaker {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
        }
    }

    let tmp = common::tempdir();
    let dir = tmp.path().join("m");
    let s = common::small_synth_spec();
    common::synth_model(&dir, &s);
    let model = Model::open(ModelConfig::new(&dir)).unwrap();
    let engine = Engine::new(&model, EngineConfig::default()).unwrap();
    let arena = engine.packed_arena(64 << 20, false).unwrap();
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let waker = Arc::new(EventFdWaker(efd));
    let fd = waker.0.as_fd();
    let w = Waker::from(Arc::clone(&waker));
    let mut cx = Context::from_waker(&w);
    let mut pending: Vec<(String, weightstream::Ticket)> = model
        .catalog()
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), engine.read(t, arena.take_for(t).unwrap()).unwrap()))
        .collect();
    let (mut done, mut sleeps) = (0, 0);
    let t0 = Instant::now();
    while !pending.is_empty() {
        // Poll every ticket (registering the waker), keep the pending ones.
        let mut still = Vec::new();
        for (name, mut ticket) in pending {
            match Pin::new(&mut ticket).poll(&mut cx) {
                Poll::Ready(r) => {
                    assert!(synth::verify(s.seed, &name, &r.unwrap()), "{name}");
                    done += 1;
                }
                Poll::Pending => still.push((name, ticket)),
            }
        }
        pending = still;
        if !pending.is_empty() {
            // The event loop: sleep until a completion writes the eventfd.
            let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
            let timeout = rustix::event::Timespec { tv_sec: 30, tv_nsec: 0 };
            let n = rustix::event::poll(&mut fds, Some(&timeout)).unwrap();
            assert_eq!(n, 1, "no completion woke the event loop within 30 s");
            let mut buf = [0u8; 8];
            rustix::io::read(fd, &mut buf).unwrap();
            sleeps += 1;
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
    }
    assert_eq!(done, model.catalog().tensors().len());
    eprintln!("{done} reads, the event loop slept {sleeps} times on the eventfd");
}
