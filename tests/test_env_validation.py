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
    env.load_state_dict(state)  # the refusals changed nothing
    assert all(torch.equal(v, state[k]) for k, v in env.state_dict().items())


def _hostile(state: dict) -> list[tuple[str, dict]]:
    """Well-formed states (right keys, shapes and dtypes) no run can reach, each with the key
    the refusal must name."""
    nan = torch.full_like(state["episode_return"], float("nan"))
    grid99 = torch.full_like(state["grid"], 99)
    under = state["grid"].clone()
    under.scatter_(1, state["pos"].long().unsqueeze(1), 2)  # food under the agent
    return [
        ("t", {"t": torch.full_like(state["t"], 128)}),
        ("t", {"t": state["t"] - 1}),
        ("pos", {"pos": torch.zeros_like(state["pos"])}),  # on the border wall
        ("pos", {"pos": torch.full_like(state["pos"], -3)}),
        ("pos", {"pos": torch.full_like(state["pos"], 10**6)}),
        ("episode", {"episode": torch.full_like(state["episode"], -1)}),
        ("episode_return", {"episode_return": nan}),
        ("episode_return", {"episode_return": torch.full_like(nan, float("inf"))}),
        ("episode_return", {"episode_return": state["episode_return"] + 5}),  # t is 0
        ("grid", {"grid": grid99}),
        ("grid", {"grid": under}),
        ("grid", {"grid": torch.zeros_like(state["grid"])}),  # no border, no items
    ]


@pytest.mark.parametrize("cls", [ForageTorch, ForageNumpy, ForageTorchLoop],
                         ids=lambda c: c.__name__)
def test_both_envs_refuse_the_same_unreachable_states(cls) -> None:
    """A hostile but well-formed state is refused at load, naming the key, by ForageTorch,
    ForageNumpy and ForageTorchLoop alike; a refusal changes nothing."""
    env = cls(4)
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in env.state_dict().items()}
    seeds = [("seed", {"seed": -1}), ("seed", {"seed": 2**70})] if cls is ForageNumpy else \
        [("seed", {"seed": torch.full_like(state["seed"], -1)})]
    for key, bad in _hostile(state) + seeds:
        with pytest.raises(ValueError, match=rf"state\[{key!r}\]|{key}"):
            env.load_state_dict({**state, **bad})
    env.load_state_dict(state)
    after = env.state_dict()
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(v))
               for k, v in state.items())


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


def test_forage_py_refuses_what_the_vectorized_envs_refuse() -> None:
    """The plain-Python env's state (lists and ints) goes through the same check."""
    env = ForagePy()
    env.reset()
    state = env.state_dict()
    agent_r, agent_c = state["pos"]
    food_under = [list(row) for row in state["grid"]]
    food_under[agent_r][agent_c] = 2
    for key, bad in (("t", {"t": 128}), ("t", {"t": -1}), ("episode", {"episode": -2}),
                     ("episode_return", {"episode_return": float("nan")}),
                     ("episode_return", {"episode_return": 3.0}),  # t is 0
                     ("pos", {"pos": (0, 0)}), ("pos", {"pos": (99, 1)}),
                     ("grid", {"grid": [[99] * len(row) for row in state["grid"]]}),
                     ("grid", {"grid": food_under}), ("grid", {"grid": [[0]]}),
                     ("seed", {"seed": -1})):
        with pytest.raises((ValueError, TypeError), match=rf"state\[{key!r}\]|{key}"):
            env.load_state_dict({**state, **bad})
    env.load_state_dict(state)
    assert env.state_dict() == state
