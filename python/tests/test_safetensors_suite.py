"""safetensors' own published read tests, run against the drop-in.

The installed safetensors' source distribution is fetched from the package
index (cached beside the peer venv; never copied into this repository),
and four of its test files are run twice: as published, and with only the
reading imports swapped for weightstream's (`safe_open`, `SafetensorError`
and `load_file` from `safetensors`, `safetensors.torch` and
`safetensors.numpy`; the writers stay safetensors'). Every test that passes
as published must pass swapped."""

import ast
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest
from conftest import require

FILES = ["test_simple.py", "test_pt_comparison.py", "test_multithreaded.py", "test_pread_backend.py"]

# What the drop-in replaces: (module, name) -> weightstream's module.
SWAPS = {
    ("safetensors", "safe_open"): "weightstream",
    ("safetensors", "SafetensorError"): "weightstream",
    ("safetensors.torch", "load_file"): "weightstream.torch",
    ("safetensors.numpy", "load_file"): "weightstream.numpy",
}

CACHE = os.environ.get("WS_SAFETENSORS_SDIST_CACHE", "/var/cache/weightstream/safetensors-sdist")


def swap_imports(source):
    """`source` with each `from safetensors[.torch|.numpy] import ...` of a
    swapped name split: the swapped names from weightstream's module, the
    rest as they were. Returns (new source, how many names were swapped)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    swapped = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.module not in ("safetensors", "safetensors.torch", "safetensors.numpy"):
            continue
        keep, moved = [], {}
        for a in node.names:
            target = SWAPS.get((node.module, a.name))
            if target:
                moved.setdefault(target, []).append(a)
            else:
                keep.append(a)
        if not moved:
            continue
        swapped += sum(len(v) for v in moved.values())
        indent = lines[node.lineno - 1][: node.col_offset]

        def names(alias_list):
            return ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in alias_list)

        new = [f"from {node.module} import {names(keep)}"] if keep else []
        new += [f"from {m} import {names(v)}" for m, v in moved.items()]
        edits.append((node.lineno, node.end_lineno, indent + f"\n{indent}".join(new) + "\n"))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1 : end] = [text]
    return "".join(lines), swapped


def sdist(version):
    """safetensors `version`'s source distribution (downloaded once into
    the cache), or a skip / failure when the index cannot be reached."""
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"safetensors-{version}.tar.gz")
    if not os.path.exists(path):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", CACHE, f"safetensors=={version}"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0 or not os.path.exists(path):
            msg = f"could not fetch safetensors {version}'s source distribution: {out.stderr[-2000:]}"
            if os.environ.get("WEIGHTSTREAM_REQUIRE_TORCH") == "1":
                pytest.fail(msg)
            pytest.skip(msg)
    return path


def newer_releases(installed):
    """Final safetensors releases on the package index newer than the one
    installed (a release is a test: its read tests run too); empty when
    the index cannot be asked."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "safetensors"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Available versions:")), "")
    found = [v.strip() for v in line.split(":", 1)[-1].split(",") if v.strip()]

    def key(v):
        return tuple(int(x) for x in v.split("."))

    final = [v for v in found if all(x.isdigit() for x in v.split("."))]
    return sorted((v for v in final if key(v) > key(installed)), key=key)


def run_suite(root, files, pythonpath=None):
    """pytest on `files` (relative to `root`, which holds tests/data): the
    outcome of each test id ("passed", "failed", "skipped")."""
    xml = os.path.join(root, "report.xml")
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath] + [p for p in [env.get("PYTHONPATH")] if p])
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def check_release(version, tmp_path, pythonpath=None):
    """Runs `version`'s published read tests as published and swapped;
    returns (passing as published, lost on the drop-in, names swapped)."""
    with tarfile.open(sdist(version)) as tar:
        prefix = f"safetensors-{version}/bindings/python/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "tests/") and m.isfile()]
        tar.extractall(tmp_path, members=members, filter="data")
    published = tmp_path / prefix
    swapped_root = tmp_path / f"swapped-{version}"
    (swapped_root / "tests" / "data").mkdir(parents=True)
    (swapped_root / "tests" / "data" / "__init__.py").write_text("")
    files, total = [], 0
    for f in FILES:
        src_path = published / "tests" / f
        if not src_path.exists():
            continue  # a later release may have renamed or dropped it
        new, n = swap_imports(src_path.read_text())
        assert n > 0, f"{version} {f}: no reading import was swapped"
        total += n
        (swapped_root / "tests" / f).write_text(new)
        files.append(f"tests/{f}")
    assert files, f"safetensors {version} has none of {FILES}"
    theirs = run_suite(str(published), files, pythonpath)
    ours = run_suite(str(swapped_root), files, pythonpath)
    passed = sorted(t for t, r in theirs.items() if r == "passed")
    lost = [t for t in passed if ours.get(t) != "passed"]
    print(f"safetensors {version}: {len(passed)} tests pass as published; {len(passed) - len(lost)} of them with {total} reading imports swapped")
    return passed, lost


def test_safetensors_own_read_tests_pass_on_the_drop_in(tmp_path):
    require("torch")
    st = require("safetensors")
    passed, lost = check_release(st.__version__, tmp_path)
    assert len(passed) >= 40, f"only {len(passed)} tests pass as published"
    assert not lost, f"{len(lost)} of {len(passed)} tests that pass on safetensors {st.__version__} fail on the drop-in: {lost}"


def test_a_newer_safetensors_release_is_tested_when_it_is_out(tmp_path):
    """A final release newer than the pinned one (0.9.0 when it is out):
    installed into a folder of its own, its published read tests run the
    same way. Until one is out, there is nothing to run."""
    require("torch")
    st = require("safetensors")
    newer = newer_releases(st.__version__)
    if not newer:
        pytest.skip(f"no final safetensors release after {st.__version__} on the package index (or it cannot be asked)")
    version = newer[-1]
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), f"safetensors=={version}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    passed, lost = check_release(version, tmp_path, pythonpath=str(site))
    assert not lost, f"safetensors {version} is out: {len(lost)} of its {len(passed)} passing read tests fail on the drop-in (follow its reader API): {lost}"


def test_the_import_swap_moves_only_the_readers():
    src = (
        "from safetensors import SafetensorError, TensorSpec, safe_open, serialize\n"
        "from safetensors.torch import load_file as load_file_pt, save_file\n"
        "def f():\n"
        "    from safetensors.numpy import load_file, save_file as s\n"
    )
    new, n = swap_imports(src)
    assert n == 4
    assert new == (
        "from safetensors import TensorSpec, serialize\n"
        "from weightstream import SafetensorError, safe_open\n"
        "from safetensors.torch import save_file\n"
        "from weightstream.torch import load_file as load_file_pt\n"
        "def f():\n"
        "    from safetensors.numpy import save_file as s\n"
        "    from weightstream.numpy import load_file\n"
    ), new
