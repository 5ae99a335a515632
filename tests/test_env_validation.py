"""Bad arguments to the Forage envs raise ValueError/TypeError naming the field."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit.envs import (
    ForageNumpy,
    ForagePy,
    ForageSpec,
    ForageTorch,
    ForageTorchLoop,
    mean_return,
)
from labkit.measure.envbench import bench_envs

VECTOR = [ForageNumpy, ForageTorch, ForageTorchLoop]
TORCH = [ForageTorch, ForageTorchLoop]


@pytest.mark.parametrize("cls", VECTOR)
@pytest.mark.parametrize("n_envs, error", [(0, ValueError), (-3, ValueError),
                                           (2.0, TypeError), (True, TypeError)])
def test_n_envs(cls, n_envs, error) -> None:
    with pytest.raises(error, match="n_envs"):
        cls(n_envs)


@pytest.mark.parametrize("cls", VECTOR)
def test_seed_and_spec(cls) -> None:
    with pytest.raises(ValueError, match="seed"):
        cls(2, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        cls(2, seed=2**32)
    with pytest.raises(TypeError, match="spec"):
        cls(2, spec={"height": 5})
    with pytest.raises(ValueError, match="seed"):
        cls(2).reset(seed=-5)


@pytest.mark.parametrize("kwargs, field", [
    ({"height": 2}, "height"), ({"width": 1}, "width"), ({"height": 1000}, "height"),
    ({"width": 257}, "width"), ({"view": 4}, "view"), ({"view": 0}, "view"),
    ({"view": 25}, "view"),  # larger than 2 * max(11, 11) + 1
    ({"episode_length": 0}, "episode_length"), ({"n_food": -1}, "n_food"),
    # 81 interior cells: 40 + 30 + 20 + the agent do not fit
    ({"n_walls": 40, "n_food": 30, "n_poison": 20}, "n_food"),
    ({"height": 4, "width": 4, "n_walls": 1, "n_food": 2, "n_poison": 1}, "n_poison"),
])
def test_spec(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        ForageSpec(**kwargs)


def test_spec_fields_must_be_ints() -> None:
    with pytest.raises(TypeError, match="view"):
        ForageSpec(view=7.0)


def test_py_action() -> None:
    env = ForagePy()
    with pytest.raises(TypeError, match="action"):
        env.step(1.0)
    with pytest.raises(TypeError, match="action"):
        env.step(np.array([1]))
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=r"action must be in \[0, 5\)"):
            env.step(bad)


def test_numpy_actions() -> None:
    env = ForageNumpy(4)
    with pytest.raises(TypeError, match="actions"):
        env.step([0, 1, 2, 3])
    with pytest.raises(TypeError, match="actions"):
        env.step(np.zeros(4, dtype=np.float32))
    with pytest.raises(TypeError, match="actions"):
        env.step(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="actions must have shape"):
        env.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="actions must have shape"):
        env.step(np.zeros((4, 1), dtype=np.int64))
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=r"actions must be integers in \[0, 5\)"):
            env.step(np.array([0, 1, bad, 2]))


@pytest.mark.parametrize("cls", TORCH)
def test_torch_actions(cls) -> None:
    env = cls(4)
    before = env.state_dict()
    with pytest.raises(TypeError, match="actions"):
        env.step(np.zeros(4, dtype=np.int64))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match="actions"):
            env.step(torch.zeros(4, dtype=dtype))
    with pytest.raises(ValueError, match="actions must have shape"):
        env.step(torch.zeros(5, dtype=torch.int64))
    for bad in (-1, 5, 100):
        with pytest.raises(ValueError, match=r"actions must be integers in \[0, 5\)"):
            env.step(torch.tensor([0, 1, bad, 2]))
    for key, value in env.state_dict().items():  # a rejected step changes nothing
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("cls", TORCH)
@pytest.mark.parametrize("device", ["tpu", "banana", "mps", 3])
def test_unknown_device(cls, device) -> None:
    error = TypeError if isinstance(device, int) else ValueError
    with pytest.raises(error, match="device"):
        cls(2, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
@pytest.mark.parametrize("cls", TORCH)
def test_cuda_without_cuda(cls) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        cls(2, device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        cls(2, device="cuda:1")


def test_load_state_dict() -> None:
    env = ForageTorch(4)
    state = env.state_dict()
    with pytest.raises(ValueError, match="state must have keys"):
        env.load_state_dict({k: v for k, v in state.items() if k != "seed"})
    with pytest.raises(ValueError, match=r"state\['grid'\]"):
        env.load_state_dict({**state, "grid": state["grid"][:2]})
    with pytest.raises(ValueError, match=r"state\['pos'\]"):
        env.load_state_dict({**state, "pos": state["pos"].float()})
    # Values the rebuilt state could not come from: a step past the episode, the agent on a wall.
    for bad in ({"t": torch.full_like(state["t"], 128)}, {"t": state["t"] - 1},
                {"pos": torch.zeros_like(state["pos"])}):
        with pytest.raises(ValueError, match=r"state\['pos'\] must be interior cells and "
                                             r"state\['t'\] steps in \[0, 128\)"):
            env.load_state_dict({**state, **bad})
    env.load_state_dict(state)  # the refusals changed nothing
    assert all(torch.equal(v, state[k]) for k, v in env.state_dict().items())


def test_mean_return_and_bench_arguments() -> None:
    with pytest.raises(ValueError, match="policy_name"):
        mean_return("greedy")
    with pytest.raises(ValueError, match="repeats"):
        bench_envs("cpu", repeats=0)
    with pytest.raises(ValueError, match="device"):
        bench_envs("tpu")
    with pytest.raises(ValueError, match="n_envs"):
        bench_envs("cpu", n_envs=(0,))
    with pytest.raises(ValueError, match="n_envs must name"):
        bench_envs("cpu", n_envs=())
