"""What the tests share: the small run, the CPU and the short-episode world most of them use, and
the test tiers.

Tiers (markers registered in pyproject.toml):

- ``slow``: starts a Python process (``subprocess``, ``torchrun``, ``python -m labkit``), trains
  more than a few iterations, builds or diagnoses every stage, or compiles; by measurement, what
  takes more than about 2 s on a 2-core CPU (``make test`` prints the 25 slowest, so the split
  stays honest);
- ``notebook``: every cell that nbval collects from ``notebooks/*.ipynb`` (marked here);
- ``cuda``: needs a CUDA device (skipped without one).

``make test`` runs everything (CI: ``.ci/run``); ``make test-fast`` runs
``-m "not slow and not notebook" tests``, about a minute on 2 cores.
"""
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


def pytest_runtest_setup(item):
    """A test marked ``cuda`` is skipped where there is no CUDA device."""
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
