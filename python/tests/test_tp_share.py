"""Reads the ranks of a tensor-parallel group share (_tp_share): the
tensors a rank cannot read its part of alone (a part of a row under a
block) read once by the group, 1/W by each rank, into a buffer the ranks
map together, each rank's parts copied out of it. Two gloo ranks, each a
process of its own (tp_share_child.py): every part equal to the reference
reader's, each rank's storage reads about half the model, many batches
reusing the buffer's halves, a failed read and a rank failing before the
agreement raising on every rank (naming it), a buffer a rank cannot open
falling back to reads alone. The pure parts (the shares, the batches, the
box copies) in this process."""

import json
import os
import subprocess
import sys

import pytest
from conftest import o_direct_dir, require

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_share_child.py")
SHARED = sorted(p + n for p in ("a.", "b.") for n in ("f8", "narrow", "norm", "strided", "two"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Two files: row-parallel shapes whose half-rows are 1-2 KiB (narrow,
    strided, two, f8), a wide one whose half-rows are 64 KiB, rows, a norm."""
    torch = require("torch")
    from safetensors.torch import save_file

    d = o_direct_dir(tmp_path_factory, "tpshare")
    g = torch.Generator().manual_seed(47)
    # Two files of the same layout: their tensors tie on file offsets (the
    # ranks must still lay the buffer out alike).
    for f, prefix in (("model-00001-of-00002.safetensors", "a."), ("model-00002-of-00002.safetensors", "b.")):
        t = {
            "narrow": torch.randn((1024, 1024), generator=g).to(torch.bfloat16),
            "wide": torch.randn((16, 65536), generator=g).to(torch.bfloat16),
            "rows": torch.randn((512, 256), generator=g),
            "norm": torch.randn((4096,), generator=g),
            "strided": torch.randn((128, 512), generator=g),
            "two": torch.randn((300, 256), generator=g).to(torch.bfloat16),
            "f8": torch.randn((64, 2048), generator=g).to(torch.float8_e4m3fn),
        }
        save_file({prefix + k: v for k, v in t.items()}, os.path.join(d, f))
    return d


def run(model, mode, tmp_path, world=2):
    init = tmp_path / f"init-{mode}"
    procs, outs = [], []
    for r in range(world):
        out = tmp_path / f"out-{mode}-{r}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, CHILD, str(model), str(init), str(r), str(world), str(out), mode]))
    for p in procs:
        p.wait(timeout=300)
    return [json.loads(o.read_text()) if o.exists() else None for o in outs]


def test_each_rank_reads_half_of_what_it_cannot_read_alone_and_gets_its_exact_parts(model, tmp_path):
    res = run(model, "ok", tmp_path)
    size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model))
    shared_bytes = 0
    for r, res_r in enumerate(res):
        assert res_r is not None and "error" not in res_r, (r, res_r)
        assert res_r["got"] == res_r["want"], r
        assert res_r["done"] and res_r["shared"] == SHARED, res_r
        rep = res_r["report"]
        assert rep["why_not"] is None and rep["tensors"] == len(SHARED) and rep["ranks"] == 2, rep
        shared_bytes = rep["bytes"]
        # Its share of each shared tensor, cut at blocks: half, within a
        # block per tensor.
        assert abs(rep["read_bytes"] - shared_bytes / 2) <= 4096 * len(SHARED), rep
        # Alone it would have moved each of them nearly whole.
        assert rep["alone_bytes"] > 0.95 * shared_bytes, rep
        # From the drives (the engine's count): half the model and a few
        # blocks (the other tensors' halves are read alone: the wide one's
        # half-rows are long enough), where reading alone moves 0.75 of it.
        assert 0.45 * size < res_r["drive_bytes"] < 0.55 * size, (res_r["drive_bytes"], size)
    # Every byte of the shared tensors read by exactly one rank.
    assert sum(x["report"]["read_bytes"] for x in res) == shared_bytes


def test_batches_of_64_kib_cut_tensors_in_rows_and_reuse_the_buffers_halves(model, tmp_path):
    """BATCH_BYTES 64 KiB: the 2 MiB, 150 KiB and 128 KiB tensors are read
    in pieces of whole rows (their destinations are contiguous), many
    batches through halves of 64 KiB; the 256 KiB one whose destination
    is strided cannot be cut and is read alone, named in the report."""
    res = run(model, "batches", tmp_path)
    for r, res_r in enumerate(res):
        assert res_r is not None and "error" not in res_r, (r, res_r)
        assert res_r["got"] == res_r["want"], r
        rep = res_r["report"]
        assert res_r["shared"] == [n for n in SHARED if not n.endswith("strided")], res_r["shared"]
        assert sorted(rep["too_large"]) == ["a.strided", "b.strided"], rep
        assert rep["batch_bytes"] == 64 << 10 and rep["batches"] >= 2 * (2 << 20) // (64 << 10), rep
        assert rep["buffer_bytes"] <= 2 * ((64 << 10) + 4096), rep
        assert abs(rep["read_bytes"] - rep["bytes"] / 2) <= 4096 * rep["batches"], rep


def test_a_failed_read_raises_on_every_rank_naming_the_rank_and_the_file(model, tmp_path):
    res = run(model, "fail1", tmp_path)
    for r, res_r in enumerate(res):
        assert res_r is not None and "error" in res_r, (r, res_r)
        assert "GroupError" in res_r["error"] and "rank 1" in res_r["error"], res_r["error"]
        assert "model-00001-of-00002.safetensors" in res_r["error"] and "os error 5" in res_r["error"], res_r["error"]


def test_a_rank_failing_before_the_agreement_makes_the_others_raise_not_wait(model, tmp_path):
    res = run(model, "abandon1", tmp_path)
    assert "stand-in" in res[1]["error"], res[1]
    assert "GroupError" in res[0]["error"] and "rank 1" in res[0]["error"] and "stand-in" in res[0]["error"], res[0]


def test_a_buffer_a_rank_cannot_open_leaves_every_rank_reading_alone(model, tmp_path):
    res = run(model, "nobuffer", tmp_path)
    for r, res_r in enumerate(res):
        assert res_r is not None and "error" not in res_r, (r, res_r)
        assert res_r["done"] is False and res_r["got"] == res_r["want"], res_r
        why = res_r["report"]["why_not"]
        assert "rank 1" in why and "Permission denied" in why, why
        assert res_r["report"]["read_bytes"] == 0, res_r["report"]


def test_a_tensor_landing_on_a_device_is_read_alone_and_named(model, tmp_path):
    res = run(model, "ondevice", tmp_path)
    for r, res_r in enumerate(res):
        assert res_r is not None and "error" not in res_r, (r, res_r)
        assert res_r["got"] == res_r["want"], r
        assert res_r["report"]["on_device"] == ["a.narrow"], res_r["report"]
        assert res_r["shared"] == [n for n in SHARED if n != "a.narrow"], res_r["shared"]


def test_the_shares_cover_each_tensor_once_cut_at_blocks():
    from weightstream._tp_share import _parts

    for nbytes in (1, 100, 4095, 4096, 4097, 10000, 1 << 20, (1 << 20) + 13):
        for offset in (0, 8, 4000, 4096, 12345):
            for world in (1, 2, 3, 4, 8):
                parts = _parts(nbytes, offset, world, 4096)
                assert len(parts) == world and parts[0][0] == 0 and parts[-1][1] == nbytes
                for (a, z), (a2, _z2) in zip(parts, parts[1:]):
                    assert a <= z == a2
                    # A cut inside the tensor is a block boundary of the file.
                    assert z in (0, nbytes) or (offset + z) % 4096 == 0
                # Balanced within a block.
                if nbytes >= 4096 * world:
                    assert max(z - a for a, z in parts) - nbytes / world <= 4096


def test_batches_hold_whole_tensors_or_pieces_of_whole_rows_in_phase_within_the_budget():
    from weightstream._tp_share import _batches

    # (bytes, file offset, shape, cuttable in rows)
    specs = [(5000, 100, [5000], True), (4096, 8192, [4, 1024], True), (100000, 9, [100, 1000], True),
             (1, 4095, [1], True), (70000, 0, [7, 10000], False), (3 << 20, 12345, [3072, 1024], True)]
    regs = [(("m", f"t{i}"), f"t{i}", n, off, None, shape, cut) for i, (n, off, shape, cut) in enumerate(specs)]
    for budget in (16384, 65536, 1 << 20, 4 << 20):
        batches, largest = _batches(regs, 4096, budget)
        pieces = [p for b in batches for p in b]
        # The regions in order, each one's rows covered once, in order.
        order = []
        for r, *_ in pieces:
            if not order or order[-1] is not r:
                order.append(r)
        assert order == regs
        for reg in regs:
            mine = [(a, z) for r, a, z, _at in pieces if r is reg]
            rows = reg[5][0]
            assert mine[0][0] == 0 and mine[-1][1] == rows and all(z == a2 for (_a, z), (a2, _z) in zip(mine, mine[1:]))
            if reg[2] <= budget or not reg[6]:
                assert mine == [(0, rows)]
        for b in batches:
            end = 0
            for (_k, _n, n, off, _d, shape, cut), a, z, at in b:
                rb = n // shape[0]
                assert at % 4096 == 0 and at >= end
                end = at + -(-((off + a * rb) % 4096 + (z - a) * rb) // 4096) * 4096
                if cut and n > budget:
                    assert (z - a) * rb <= budget - 4096
            assert end <= largest and (end <= budget or len(b) == 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8", "float64"])
def test_a_box_copies_into_any_destination_view_as_indexing_gives_it(dtype):
    torch = require("torch")
    from weightstream._tp_share import _copy_box

    dt = getattr(torch, dtype)
    src = torch.randint(-100, 100, (6, 10, 8)).to(torch.float32).to(dt) if dt != torch.int8 else torch.randint(-100, 100, (6, 10, 8), dtype=dt)
    box = [(1, 5), (2, 3), (0, 8)]
    want = src[1:5, 2:3, 0:8]
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    for dest in (
        torch.empty((4, 1, 8), dtype=dt),
        torch.empty((4, 8), dtype=dt),
        torch.empty((8, 4), dtype=dt).t(),
        torch.empty((32,), dtype=dt),
    ):
        _copy_box(src, box, dest)
        assert torch.equal(dest.contiguous().reshape(-1).view(ints), want.contiguous().reshape(-1).view(ints))
