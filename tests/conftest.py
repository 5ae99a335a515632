"""What the tests share: the small run, the CPU and the short-episode world most of them use, and
the test tiers.

Tiers (markers registered in pyproject.toml):

- ``slow``: starts a Python process (``subprocess``, ``torchrun``, ``python -m labkit``), trains
  more than a few iterations, builds or diagnoses every stage, compiles, profiles or rehearses
  a whole iteration; by measurement, what takes more than :data:`FAST_TEST_S` (half a second)
  on a 2-core CPU: a run without the slow tier names its tests over that, so the split stays
  honest;
- ``notebook``: every cell that nbval collects from ``notebooks/*.ipynb`` (marked here);
- ``cuda``: needs a CUDA device (skipped without one);
- ``inductor``: its subject is what inductor generates (compiled-step parity, compiled kernel
  counts, the warm-up's real timing of compiled code): it compiles with inductor, as a user's
  ``torch.compile`` does. Every other test's ``torch.compile`` without a ``backend=`` compiles
  with ``aot_eager`` instead (the fixture below): dynamo still traces, with ``fullgraph=True``
  where labkit asks for it (a graph break or a recompile still fails), and autograd still runs
  through AOT's joint graph; only inductor's code generation and its C++ compile, most of a
  cold compile's time on a CPU, are skipped.

``make test`` runs everything (CI: ``.ci/run``); ``make test-fast`` runs
``-m "not slow and not notebook" tests``, under a minute on 2 quiet cores from a cold
compile cache. Both print their time by file at the end (:func:`pytest_terminal_summary`).
"""
import functools
import hashlib
import os
import shutil
import signal
import tempfile
from collections import defaultdict

import pytest
import torch

from labkit.config import RunConfig
from labkit.envs import ForageSpec


def pytest_collection_modifyitems(config, items):
    notebook = pytest.mark.notebook
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(notebook)


@pytest.fixture(scope="session")
def cpu() -> torch.device:
    """The CPU device (a ``torch.device``, not the string)."""
    return torch.device("cpu")


@pytest.fixture(scope="session")
def short_spec() -> ForageSpec:
    """Forage with 20-step episodes, so that a short rollout crosses resets (frozen: shared)."""
    return ForageSpec(episode_length=20)


@pytest.fixture
def tiny_run() -> RunConfig:
    """The tiny run: 8 envs x 16 steps, the default world (a fresh one per test: it is
    mutable)."""
    return RunConfig(n_envs=8, n_steps=16)


_real_compile = torch.compile


@functools.wraps(_real_compile)
def _aot_eager_compile(model=None, **kwargs):
    """``torch.compile`` with ``backend="aot_eager"`` where the caller named no backend;
    inductor's own ``mode`` and ``options`` are dropped with it (aot_eager takes neither)."""
    if "backend" not in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("mode", "options")}
        kwargs["backend"] = "aot_eager"
    if model is None:  # torch.compile(**kwargs) as a decorator
        return lambda fn: _real_compile(fn, **kwargs)
    return _real_compile(model, **kwargs)


_last_backend: list[str] = []
_SESSION_CACHE: list[str] = [tempfile.gettempdir()]


def pytest_configure(config):
    """aot_eager from the session's start: a module- or session-scoped fixture is set up
    before any test's own fixtures, so a pipeline it builds would otherwise compile with
    inductor (``tests/test_debug.py``'s stage 7 did: 25 s of a cold fast tier). Remembered
    warm-up choices (``labkit.app.remembered``) go to a folder of the session's own, never
    the user's cache, and each test gets its own below it."""
    torch.compile = _aot_eager_compile
    _SESSION_CACHE[:] = [tempfile.mkdtemp(prefix="labkit-test-cache-")]
    os.environ["LABKIT_CACHE_DIR"] = _SESSION_CACHE[0]
    _stops_at_their_defaults()


def _unheard(signum, frame) -> None:
    """SIGHUP under nohup: heard, and let pass (the suite goes on when its terminal closes)."""


#: The stop signals, and what the suite handles each with if it started ignoring it.
_STOP_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                  signal.SIGHUP: _unheard}


def _stops_at_their_defaults() -> None:
    """The tests stop runs with real signals, in this process and in the processes it starts
    (which inherit an ignored signal). A suite started under ``nohup`` has SIGHUP ignored, one
    started as a shell's background job SIGINT; labkit keeps a stop ignored at start ignored
    (``labkit.signals``), so those tests would pass or fail by how the suite was started. The
    suite handles each stop it started ignoring: the processes it starts begin with it at its
    default (exec resets a handler, not an ignored signal), and labkit takes it over in this
    process; a hangup still does not end a suite started under nohup."""
    for sig, handler in _STOP_DEFAULTS.items():
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _own_choice_cache(request, monkeypatch):
    """Each test remembers warm-up choices apart (a folder made only if it writes one), so no
    test keeps what another timed."""
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("LABKIT_CACHE_DIR", os.path.join(_SESSION_CACHE[0], digest))


def pytest_unconfigure(config):
    torch.compile = _real_compile
    if "labkit-test-cache-" in _SESSION_CACHE[0]:  # the session's own folder, made above
        shutil.rmtree(_SESSION_CACHE[0], ignore_errors=True)


@pytest.fixture(autouse=True)
def _compile_backend(request, monkeypatch):
    """Every test but an ``inductor`` one compiles with aot_eager (the tiers above; what a
    module-scoped fixture builds too, whoever uses it). Where the backend changes from one
    test to the next, dynamo's caches are reset first: compiled code is cached per code object
    (every compiled module shares one), an entry compiled for one backend never serves the
    other, and the two together would pass dynamo's recompile limit where either alone does
    not."""
    backend = "aot_eager" if request.node.get_closest_marker("inductor") is None else "inductor"
    if _last_backend and _last_backend[-1] != backend:
        torch._dynamo.reset()
    _last_backend[:] = [backend]
    if backend == "inductor":
        monkeypatch.setattr(torch, "compile", _real_compile)


_SECONDS_BY_FILE: dict[str, float] = defaultdict(float)
_SECONDS_BY_TEST: dict[str, float] = defaultdict(float)

#: The fast tier's bound for one test (setup, call and teardown): above it a test is ``slow``.
FAST_TEST_S = 0.5


def pytest_runtest_logreport(report):
    _SECONDS_BY_FILE[report.nodeid.split("::")[0]] += report.duration
    _SECONDS_BY_TEST[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    """The run's time by file (setup, call and teardown summed), the slowest first: the
    tiers' budgets stay visible in every run's log. A run without the slow tier also names
    its tests over :data:`FAST_TEST_S` (a module fixture's set-up counts for the first test
    that uses it): the drift is printed, not failed on, as timing on a shared machine would
    make such a failure flaky."""
    if not _SECONDS_BY_FILE:
        return
    rows = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: -kv[1])
    total = sum(_SECONDS_BY_FILE.values())
    terminalreporter.section(f"time by file: {total:.1f} s in tests, {len(rows)} files")
    for path, seconds in rows:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {path}")
    if "not slow" in (config.option.markexpr or ""):
        over = sorted(((s, t) for t, s in _SECONDS_BY_TEST.items() if s > FAST_TEST_S),
                      reverse=True)
        terminalreporter.write_line(f"fast-tier tests over {FAST_TEST_S} s: {len(over)}"
                                    + "".join(f"\n{s:8.2f} s  {t}" for s, t in over))


def pytest_runtest_setup(item):
    """A test marked ``cuda`` is skipped where there is no CUDA device."""
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
