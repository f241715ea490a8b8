"""One reader used by many threads at once, closed while they read, and
tensors read by forked children (multiprocessing, DataLoader workers,
pre-fork servers). Each scenario that could hang runs in a child process
with a watchdog (a timeout on the process, and faulthandler's stack dump),
never a wall-clock assertion."""

import textwrap

import numpy as np
import pytest
from conftest import run_python, torch_or_skip, write_layered_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Three shards and their index, written by safetensors.numpy."""
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("threads")
    rng = np.random.default_rng(34)
    return d, write_layered_model(d, lambda _p, shape: rng.standard_normal(shape).astype(np.float32), save_file)


def child(code, model, head="", timeout=300):
    """Runs `head` then `code` (dedented) in a fresh interpreter with
    `MODEL` set, a stack dump after `timeout - 30` s, and fails with its
    output unless it printed "ok" last."""
    prelude = textwrap.dedent(
        f"""
        import faulthandler, sys
        faulthandler.dump_traceback_later({timeout - 30}, exit=True)
        MODEL = {str(model)!r}
        """
    )
    out = run_python(prelude + head + textwrap.dedent(code), timeout=timeout)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines and lines[-1] == "ok", (out.returncode, out.stdout[-3000:], out.stderr[-6000:])
    return lines


def test_eight_threads_on_one_fresh_safe_open_never_deadlock(sharded):
    """8 threads x 100 mixed get_tensor / get_slice on a fresh safe_open,
    10 times, every result checked. Before: the first two get_tensor calls
    deadlocked (one held the shared arena's lock across a GIL release, the
    other waited for that lock holding the GIL)."""
    d, _ = sharded
    child(
        """
        import threading
        import numpy as np
        from safetensors.numpy import load_file
        import weightstream
        want = {}
        for i in range(3):
            want.update(load_file(f"{MODEL}/model-0000{i + 1}-of-00003.safetensors"))
        names = sorted(want)
        bad = []
        for rnd in range(10):
            f = weightstream.safe_open(MODEL, framework="np")
            start = threading.Barrier(8)

            def work(k):
                start.wait()
                for i in range(100):
                    n = names[(k * 7 + i) % len(names)]
                    w = want[n]
                    if i % 3 == 0 and w.ndim == 2:
                        got, exp = f.get_slice(n)[1:5, 2:40], w[1:5, 2:40]
                    elif i % 3 == 1:
                        got, exp = f.get_slice(n)[:], w
                    else:
                        got, exp = f.get_tensor(n), w
                    if not np.array_equal(got, exp):
                        bad.append((rnd, k, i, n))

            th = [threading.Thread(target=work, args=(k,)) for k in range(8)]
            for t in th:
                t.start()
            for t in th:
                t.join()
            f.close()
        assert not bad, bad[:5]
        print("ok")
        """,
        d,
    )


def test_close_while_other_threads_read_waits_for_them_or_refuses_them_cleanly(sharded):
    """Leaving the with block (close) while 4 threads read: close does not
    raise; each read either completes with the right bytes or raises
    SafetensorError naming the file and saying it is closed, and every
    thread, reading until it is refused, is refused. Before: a bare
    "RuntimeError: Already borrowed", and the reader stayed open."""
    d, _ = sharded
    lines = child(
        """
        import threading
        import numpy as np
        from safetensors.numpy import load_file
        import weightstream
        want = {}
        for i in range(3):
            want.update(load_file(f"{MODEL}/model-0000{i + 1}-of-00003.safetensors"))
        names = sorted(want)
        bad, done, refused = [], [0], [0]
        for rnd in range(20):
            f = weightstream.safe_open(MODEL, framework="np")
            started = [threading.Event() for _ in range(4)]

            def work(k):
                i = 0
                while True:
                    n = names[(k + i) % len(names)]
                    try:
                        got = f.get_tensor(n) if i % 2 else f.get_slice(n)[0:1]
                    except weightstream.SafetensorError as e:
                        if "closed" not in str(e) or MODEL not in str(e):
                            bad.append(repr(e))
                        refused[0] += 1
                        return
                    except BaseException as e:
                        bad.append(repr(e))
                        return
                    finally:
                        started[k].set()
                    exp = want[n] if i % 2 else want[n][0:1]
                    if not np.array_equal(got, exp):
                        bad.append(n)
                    done[0] += 1
                    i += 1

            th = [threading.Thread(target=work, args=(k,)) for k in range(4)]
            with f:
                for t in th:
                    t.start()
                for e in started:
                    e.wait()
                f.get_tensor(names[0])
            # The with block ended: every call from now on is refused, and
            # the threads, reading until refused, all end.
            for t in th:
                t.join()
            try:
                f.keys()
                bad.append("keys() after close")
            except weightstream.SafetensorError:
                pass
            assert f.close() is True  # a second close does nothing
        assert not bad, bad[:5]
        print(done[0], refused[0])
        print("ok")
        """,
        d,
    )
    done, refused = map(int, lines[-2].split())
    assert refused == 20 * 4 and done > 0, (done, refused)


FORK_CHILD = """
import hashlib, os, sys, json
import numpy as np
import weightstream


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def in_child(check):
    # The child reads what its parent holds; exit 0 only if every byte is
    # what the parent saw. A SIGSEGV shows as a signal, not as 0.
    pid = os.fork()
    if pid == 0:
        try:
            ok = check()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return status
"""


def test_a_forked_child_reads_every_kind_of_tensor_its_parent_holds(sharded):
    """load, get_tensor, get_slice (rows and columns), stream, and a
    sliced load: a forked child reads each byte for byte. Before: the
    child died of SIGSEGV at its first touch (arena pages MADV_DONTFORK)."""
    d, _ = sharded
    child(
        """
        import signal
        held = {}
        held.update({f"load/{k}": v for k, v in weightstream.load(MODEL, framework="np").items()})
        with weightstream.safe_open(MODEL, framework="np") as f:
            for k in f.keys()[:6]:
                held[f"get_tensor/{k}"] = f.get_tensor(k)
            held["rows"] = f.get_slice("model.layers.0.q.weight")[10:20]
            held["cols"] = f.get_slice("model.layers.0.q.weight")[:, 3:50]
        for n, a in weightstream.stream(MODEL, framework="np", names="layers.1."):
            held[f"stream/{n}"] = a
        sl = weightstream.load(MODEL, framework="np", shard={"*.q.weight": (1, 0, 2)})
        held.update({f"sliced/{k}": v for k, v in sl.items()})
        sums = {k: digest(v) for k, v in held.items()}
        status = in_child(lambda: all(digest(v) == sums[k] for k, v in held.items()))
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"child status {status}" + (f" (signal {signal.Signals(os.WTERMSIG(status)).name})" if os.WIFSIGNALED(status) else "")
        )
        print("ok")
        """,
        d,
        head=FORK_CHILD,
    )


def test_a_reader_used_in_a_forked_child_refuses_before_any_lock(sharded):
    """A safe_open inherited by a forked child: its calls raise
    SafetensorError naming both processes (its engine's threads and locks
    are the parent's), and leaving its with block there does not raise;
    the tensors it returned before the fork read right. The parent's
    reader goes on."""
    d, _ = sharded
    child(
        """
        f = weightstream.safe_open(MODEL, framework="np")
        a = f.get_tensor("model.layers.0.q.weight")
        sums = digest(a)

        def check():
            try:
                f.get_tensor("model.layers.1.q.weight")
                return False
            except weightstream.SafetensorError as e:
                if "forked child" not in str(e):
                    return False
            f.__exit__(None, None, None)
            return digest(a) == sums

        status = in_child(check)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert f.get_tensor("model.layers.1.q.weight").shape == (256, 96)
        f.close()
        print("ok")
        """,
        d,
        head=FORK_CHILD,
    )


def test_a_multiprocessing_fork_pool_maps_over_loaded_tensors(sharded):
    """The reported hang: a fork Pool whose workers read tensors the
    parent loaded. Before, a worker died and map never returned."""
    d, _ = sharded
    child(
        """
        import multiprocessing as mp
        import numpy as np
        import weightstream
        sd = weightstream.load(MODEL, framework="np")
        names = sorted(sd)

        def total(n):
            return float(np.asarray(sd[n], dtype=np.float64).sum())

        ctx = mp.get_context("fork")
        with ctx.Pool(2) as pool:
            got = pool.map_async(total, names).get(timeout=120)
        assert got == [total(n) for n in names]
        print("ok")
        """,
        d,
    )


def test_torch_tensors_survive_fork(sharded):
    """The same for torch tensors (the DataLoader worker case)."""
    torch_or_skip()
    d, _ = sharded
    child(
        """
        import torch
        sd = weightstream.load(MODEL)
        with weightstream.safe_open(MODEL, framework="pt") as f:
            one = f.get_tensor("model.layers.3.k.weight")
        want = {k: v.clone() for k, v in sd.items()}
        status = in_child(lambda: all(torch.equal(sd[k], want[k]) for k in sd) and torch.equal(one, want["model.layers.3.k.weight"]))
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        print("ok")
        """,
        d,
        head=FORK_CHILD,
    )


def test_stress_one_safe_open_threads_slices_close_and_a_fork(sharded):
    """The done-means stress test: 6 threads of get_tensor / get_slice on
    one safe_open, a forked child reading tensors the threads already got
    while they go on, then close with the threads still reading; repeated.
    Every result right, every refusal a SafetensorError, the child's bytes
    right, nothing hangs (the watchdog is the process timeout)."""
    d, _ = sharded
    child(
        """
        import threading
        from safetensors.numpy import load_file
        want = {}
        for i in range(3):
            want.update(load_file(f"{MODEL}/model-0000{i + 1}-of-00003.safetensors"))
        names = sorted(want)
        bad = []
        for rnd in range(5):
            f = weightstream.safe_open(MODEL, framework="np")
            got = {}
            lock = threading.Lock()
            enough = threading.Event()

            def work(k):
                for i in range(400):
                    n = names[(3 * k + i) % len(names)]
                    try:
                        a = f.get_slice(n)[:, 1:7] if (i % 4 == 1 and want[n].ndim == 2) else f.get_tensor(n)
                        e = want[n][:, 1:7] if (i % 4 == 1 and want[n].ndim == 2) else want[n]
                    except weightstream.SafetensorError as err:
                        if "closed" not in str(err):
                            bad.append(repr(err))
                        return
                    if not np.array_equal(a, e):
                        bad.append(n)
                    with lock:
                        got[(k, i)] = (a, digest(a))
                        if len(got) >= 40:
                            enough.set()

            th = [threading.Thread(target=work, args=(k,)) for k in range(6)]
            for t in th:
                t.start()
            enough.wait()
            with lock:
                snap = dict(got)
            status = in_child(lambda: all(digest(a) == s for a, s in snap.values()))
            if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                bad.append(f"round {rnd}: fork child status {status}")
            f.close()
            for t in th:
                t.join()
        assert not bad, bad[:5]
        print("ok")
        """,
        d,
        head=FORK_CHILD,
    )


def test_a_forked_child_reads_column_and_row_slices_that_share_no_whole_page(tmp_path):
    """weightstream.load(shard=...) with column slices of odd sizes beside
    row slices: no slice is a whole number of pages, so packed together
    they would share pages. A forked child reads every one byte for byte.
    Before: slices were packed 64 bytes apart, the hand-over to children
    was refused for any slice sharing a page (and the refusal ignored), and
    the child died of SIGSEGV."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(46)
    t = {
        "a.weight": rng.standard_normal((37, 50)).astype(np.float32),
        "b.weight": rng.standard_normal((41, 30)).astype(np.float32),
        "c.weight": rng.standard_normal((13, 100)).astype(np.float32),
        "d.weight": rng.standard_normal((29, 7)).astype(np.float16),
    }
    save_file(t, str(tmp_path / "model.safetensors"))
    child(
        """
        import signal
        shard = {"a.weight": (1, 0, 2), "b.weight": (0, 1, 2), "c.weight": (1, 1, 3), "d.weight": (1, 1, 2)}
        sl = weightstream.load(MODEL, framework="np", shard=shard)
        from safetensors.numpy import load_file
        ref = load_file(MODEL + "/model.safetensors")
        want = {}
        for k, spec in shard.items():
            b = weightstream.shard_bounds(k, ref[k].shape, spec)
            want[k] = ref[k][tuple(slice(x, y) for x, y in b)]
            assert want[k].nbytes % 4096, k  # never a whole number of pages
        for k, v in want.items():
            assert sl[k].shape == v.shape and np.array_equal(sl[k], v), k
        sums = {k: digest(v) for k, v in sl.items()}
        status = in_child(lambda: all(digest(v) == sums[k] for k, v in sl.items()))
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"child status {status}" + (f" (signal {signal.Signals(os.WTERMSIG(status)).name})" if os.WIFSIGNALED(status) else "")
        )
        print("ok")
        """,
        tmp_path,
        head=FORK_CHILD,
    )
