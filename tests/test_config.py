"""The memory a run may use (``labkit/config.py``): the cgroup's limit and the address-space
limit are read, and a run or benchmark that cannot fit under them is refused up front."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.runs import ROOT


def test_the_memory_cgroup_limit_is_read_v2_with_its_parents_and_v1(tmp_path):
    """A cgroup folder given by parameter (CI cannot set cgroup limits): v2 takes the smallest
    room over the cgroup and its parents, "max" is no limit, v1's huge number is no limit."""
    from labkit.config import cgroup_headroom
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    (root / "a" / "b" / "memory.max").write_text("1000000\n")
    (root / "a" / "b" / "memory.current").write_text("400000\n")
    assert cgroup_headroom(root, proc) == 600_000
    (root / "a" / "memory.max").write_text("700000\n")
    (root / "a" / "memory.current").write_text("650000\n")
    assert cgroup_headroom(root, proc) == 50_000  # the parent's limit binds
    for f in ("a/b/memory.max", "a/memory.max"):
        (root / f).write_text("max\n")
    assert cgroup_headroom(root, proc) is None
    proc.write_text("4:memory:/x\n0::/\n")
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (root / "memory" / "x" / "memory.usage_in_bytes").write_text("400000000")
    assert cgroup_headroom(root, proc) is None
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("1000000000")
    assert cgroup_headroom(root, proc) == 600_000_000
    assert cgroup_headroom(root, tmp_path / "missing") is None


_RLIMIT_SCRIPT = """
import resource, sys
from labkit.app.cli import main
from labkit.config import address_space_headroom
import labkit.app.train, labkit.stages  # what train imports, mapped before the limit
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2**28, resource.RLIM_INFINITY))
assert address_space_headroom() <= 2**28
sys.exit(main(sys.argv[2:]))
"""
_TRAIN_BIG = ["train", "--stage", "async_logging", "--device", "cpu", "--n-envs", "4096",
              "--n-steps", "128", "--total-steps", "524288", "--out"]


@pytest.mark.slow
def test_a_run_larger_than_the_address_space_limit_is_refused_up_front(tmp_path):
    """A real RLIMIT_AS (ulimit -v) 256 MiB above what the process maps: a run estimated at
    gigabytes is refused in one line naming the limit, exit 2, before anything is allocated."""
    done = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, "-", *_TRAIN_BIG,
                           str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "left under the address-space limit (RLIMIT_AS" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-2000:]


@pytest.mark.slow
def test_a_bench_env_size_past_the_address_space_limit_is_refused_up_front(tmp_path):
    argv = ["bench-env", "--device", "cpu", "--n-envs", "1048576", "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, "-", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "benchmark's runners need about" in done.stderr, done.stderr[-2000:]
    assert "left under the address-space limit (RLIMIT_AS" in done.stderr, done.stderr[-2000:]
    assert not list((tmp_path / "out").glob("*.json"))
