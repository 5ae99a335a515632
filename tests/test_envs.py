"""Forage: the four implementations agree bit for bit; the torch one never syncs."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from labkit.envs import (
    ForageNumpy,
    ForagePy,
    ForageSpec,
    ForageTorch,
    ForageTorchLoop,
    kth_free,
    mean_return,
    oracle_actions,
    random_actions,
)
from labkit.measure.envbench import bench_envs, format_table
from labkit.measure.syncmeter import SyncMeter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FIELDS = ("obs", "reward", "terminated", "truncated", "episode_return", "episode_length",
          "final_observation")
DTYPES = (np.float32, np.float32, np.bool_, np.bool_, np.float32, np.int64, np.float32)


class PyEnvs:
    """A list of ForagePy, env ``i`` with ``env_index=i``, with the vectorized API."""

    def __init__(self, n_envs: int, spec: ForageSpec, seed: int) -> None:
        self.envs = [ForagePy(spec, seed=seed, env_index=i, final_obs=True)
                     for i in range(n_envs)]

    def reset(self, seed: int | None = None) -> np.ndarray:
        return np.array([env.reset(seed)[0] for env in self.envs], dtype=np.float32)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        out = [env.step(int(a)) for env, a in zip(self.envs, actions, strict=True)]
        obs = np.array([o[0] for o in out], dtype=np.float32)
        return (obs, np.array([o[1] for o in out], dtype=np.float32),
                np.array([o[2] for o in out]), np.array([o[3] for o in out]),
                np.array([o[4].get("episode_return", 0.0) for o in out], dtype=np.float32),
                np.array([o[4].get("episode_length", 0) for o in out], dtype=np.int64),
                np.array([o[4].get("final_observation", o[0]) for o in out], dtype=np.float32))


class VecEnv:
    """ForageNumpy / ForageTorch / ForageTorchLoop with outputs as NumPy tuples."""

    def __init__(self, env) -> None:
        self.env = env
        self.torch = isinstance(env, (ForageTorch, ForageTorchLoop))

    def reset(self, seed: int | None = None) -> np.ndarray:
        return self._np(self.env.reset(seed)[0])

    def _np(self, x) -> np.ndarray:
        return x.cpu().numpy() if self.torch else x

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.torch:
            actions = torch.as_tensor(actions, device=self.env.device)
        obs, reward, term, trunc, info = self.env.step(actions)
        return tuple(self._np(x) for x in (obs, reward, term, trunc, info["episode_return"],
                                            info["episode_length"], info["final_observation"]))


def make_envs(spec: ForageSpec, n_envs: int, seed: int, loop: bool = True,
              device: str = "cpu") -> dict:
    envs = {"py": PyEnvs(n_envs, spec, seed),
            "numpy": VecEnv(ForageNumpy(n_envs, spec, seed, final_obs=True)),
            "torch": VecEnv(ForageTorch(n_envs, spec, seed, device=device, final_obs=True))}
    if loop:
        envs["loop"] = VecEnv(ForageTorchLoop(n_envs, spec, seed, device=device,
                                              final_obs=True))
    return envs


def run_parity(envs: dict, n_envs: int, steps: int, action_seed: int = 0) -> dict:
    """Step all envs with the same random actions, asserting equal outputs at every step."""
    rng = np.random.default_rng(action_seed)
    first = {name: env.reset() for name, env in envs.items()}
    for name, obs in first.items():
        np.testing.assert_array_equal(obs, first["py"], err_msg=f"{name} reset")
    rewards, truncations = [], 0
    for t in range(steps):
        actions = rng.integers(0, 5, n_envs)
        ref = envs["py"].step(actions)
        for name, env in envs.items():
            if name == "py":
                continue
            out = env.step(actions)
            for field, dtype, got, want in zip(FIELDS, DTYPES, out, ref, strict=True):
                assert got.dtype == dtype, (name, field, got.dtype)
                assert np.array_equal(got, want), f"{name} {field} differs at step {t}"
        rewards.append(ref[1])
        truncations += int(ref[3].sum())
    return {"rewards": np.array(rewards), "truncations": truncations}


@pytest.mark.slow
def test_parity_16_envs_1000_steps() -> None:
    spec, n_envs, steps = ForageSpec(), 16, 1000
    stats = run_parity(make_envs(spec, n_envs, seed=0), n_envs, steps)
    assert stats["truncations"] == n_envs * (steps // spec.episode_length)  # 7 resets per env
    # The respawn path runs: both food and poison get eaten, many times.
    assert (stats["rewards"] == 1).sum() > 100 and (stats["rewards"] == -1).sum() > 100


def test_parity_with_the_python_reference_across_resets() -> None:
    """The fast tier's check of all four against the pure-Python reference: a few episodes of
    8 envs (the longer and odder specs below are slow)."""
    spec = ForageSpec(height=6, width=7, view=5, n_food=4, n_poison=3, episode_length=6)
    stats = run_parity(make_envs(spec, 8, seed=11), 8, 20, action_seed=11)
    assert stats["truncations"] == 8 * (20 // spec.episode_length)
    assert (stats["rewards"] != 0).any()


@pytest.mark.slow  # 1-4 s each
@pytest.mark.parametrize("spec, seed", [
    (ForageSpec(height=7, width=9, view=5, episode_length=40), 1),
    (ForageSpec(height=15, width=13, view=9, n_walls=10, n_food=8), 2),
    (ForageSpec(episode_length=3), 3),
    (ForageSpec(height=5, width=5, view=11, n_walls=2, n_food=3, n_poison=3,
                episode_length=20), 4),  # a full grid: one free cell to respawn on
    (ForageSpec(height=3, width=4, view=1, n_walls=0, n_food=1, n_poison=0,
                episode_length=7), 5),
    (ForageSpec(episode_length=1), 6),  # every step ends an episode: 12 layout draws per step
])
def test_parity_other_specs(spec: ForageSpec, seed: int) -> None:
    run_parity(make_envs(spec, 16, seed), 16, 100, action_seed=seed)  # ForageTorchLoop is slow
    stats = run_parity(make_envs(spec, 16, seed + 100, loop=False), 16, 400)
    assert stats["truncations"] == 16 * (400 // spec.episode_length)
    assert (stats["rewards"] != 0).any()


@needs_cuda
def test_parity_cuda() -> None:
    spec = ForageSpec()
    run_parity(make_envs(spec, 16, seed=7, device="cuda"), 16, 300)
    run_parity(make_envs(spec, 64, seed=8, loop=False, device="cuda"), 64, 1000)


@pytest.mark.parametrize("cls", [ForageNumpy, ForageTorch, ForageTorchLoop])
def test_reset_with_seed_reproduces(cls) -> None:
    spec, n_envs = ForageSpec(episode_length=16), 8
    env = VecEnv(cls(n_envs, spec, seed=1, final_obs=True))
    fresh = VecEnv(cls(n_envs, spec, seed=5, final_obs=True))
    actions = np.random.default_rng(0).integers(0, 5, (40, n_envs))
    for a in actions[:25]:
        env.step(a)
    np.testing.assert_array_equal(env.reset(seed=5), fresh.reset())
    for a in actions:
        for got, want in zip(env.step(a), fresh.step(a), strict=True):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(env.reset(seed=5), PyEnvs(n_envs, spec, seed=5).reset())


def test_seeds_differ() -> None:
    a, b = ForageTorch(8, seed=0), ForageTorch(8, seed=1)
    assert not torch.equal(a.observation(), b.observation())
    assert not torch.equal(a.observation()[0], a.observation()[1])  # env index matters


def test_state_dict_resumes_exactly() -> None:
    spec, n_envs = ForageSpec(episode_length=20), 8
    env, other = ForageTorch(n_envs, spec, seed=3), ForageTorch(n_envs, spec, seed=9)
    gen = torch.Generator().manual_seed(0)
    actions = torch.randint(0, 5, (60, n_envs), generator=gen)
    for a in actions[:30]:
        env.step(a)
    other.load_state_dict(env.state_dict())
    torch.testing.assert_close(other.observation(), env.observation(), rtol=0, atol=0)
    for a in actions[30:]:
        for got, want in zip(other.step(a)[:4], env.step(a)[:4], strict=True):
            assert torch.equal(got, want)
    assert set(env.state_dict()) == {"seed", "episode", "t", "grid", "pos", "episode_return"}


def staggered(spec: ForageSpec, n_envs: int, seed: int) -> dict:
    """A state where env i is at step (7 * i) % episode_length of its episode, each env's
    episode count different too: envs out of lock-step, as ForageTorch must handle."""
    env = ForageNumpy(n_envs, spec, seed)
    rng = np.random.default_rng(seed)
    for _ in range(spec.episode_length + 5):
        env.step(rng.integers(0, 5, n_envs))
    state = env.state_dict()
    state["seed"] = torch.tensor(seed)
    state["t"] = torch.tensor([(7 * i) % spec.episode_length for i in range(n_envs)])
    state["episode"] = state["episode"] + torch.arange(n_envs) % 3
    t = state["t"].to(state["episode_return"].dtype)  # a return a step counter can reach
    state["episode_return"] = torch.minimum(torch.maximum(state["episode_return"], -t), t)
    return state


def from_state(cls, spec: ForageSpec, state: dict, **kwargs):
    env = cls(len(state["t"]), spec, **kwargs)
    if cls is ForageNumpy:
        state = {**state, "seed": int(state["seed"])}
    env.load_state_dict(state)
    return env


@pytest.mark.parametrize("spec", [
    pytest.param(ForageSpec(), id="default", marks=pytest.mark.slow),
    pytest.param(ForageSpec(episode_length=5), id="short"),
    pytest.param(ForageSpec(height=5, width=5, view=3, n_walls=2, n_food=3, n_poison=3,
                            episode_length=11), id="crowded")])
def test_parity_envs_at_different_steps(spec: ForageSpec) -> None:
    """ForageTorch builds each env's next layout during its episode: envs at different steps
    (loaded through load_state_dict) end their episodes at different steps, bit-exact with
    ForageNumpy and ForageTorchLoop, which build the layout when the episode ends."""
    n_envs = 24
    state = staggered(spec, n_envs, seed=4)
    envs = {cls.__name__: VecEnv(from_state(cls, spec, state, final_obs=True))
            for cls in (ForageNumpy, ForageTorch, ForageTorchLoop)}
    rng, ends = np.random.default_rng(1), []
    for t in range(2 * spec.episode_length + 3):
        actions = rng.integers(0, 5, n_envs)
        ref = envs["ForageNumpy"].step(actions)
        for name in ("ForageTorch", "ForageTorchLoop"):
            for field, got, want in zip(FIELDS, envs[name].step(actions), ref, strict=True):
                assert np.array_equal(got, want), f"{name} {field} differs at step {t}"
        ends.append(int(ref[3].sum()))
    assert sum(ends) >= 2 * n_envs and max(ends) < n_envs  # every env ended, never all at once


def test_checkpoints_cross_implementations() -> None:
    """ForageTorch's state_dict is ForageNumpy's layout, the one ForageTorch wrote before it
    built layouts ahead (ForageTorchLoop still keeps it): mid-episode states move between
    them and continue bit-exactly."""
    spec, n_envs = ForageSpec(episode_length=20), 8
    actions = torch.randint(0, 5, (70, n_envs), generator=torch.Generator().manual_seed(2))
    loop, fast = ForageTorchLoop(n_envs, spec, seed=5), ForageTorch(n_envs, spec, seed=5)
    for a in actions[:27]:  # 7 steps into the second episode: 7 of 12 draws built ahead
        loop.step(a)
    fast.load_state_dict(loop.state_dict())
    for key, value in fast.state_dict().items():
        assert torch.equal(value, loop.state_dict()[key]), key
    for a in actions[27:50]:
        for got, want in zip(fast.step(a)[:4], loop.step(a)[:4], strict=True):
            assert torch.equal(got, want)
    back = ForageTorchLoop(n_envs, spec, seed=0)
    back.load_state_dict(fast.state_dict())
    for a in actions[50:]:
        for got, want in zip(back.step(a)[:4], fast.step(a)[:4], strict=True):
            assert torch.equal(got, want)


def test_step_ops() -> None:
    """At most 50 non-view aten ops per step (counted below any wrapper: the dispatches a GPU
    pays kernel launches for), the number the module's docstring says, the same ops whether no
    episode or every episode ends."""
    import labkit.envs.torch as module
    from labkit.measure.profiling import dispatch_ops

    env = ForageTorch(64, ForageSpec(), seed=0)
    a = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(0))
    mid = dispatch_ops(lambda: env.step(a))
    state = env.state_dict()
    env.load_state_dict({**state, "t": torch.full_like(state["t"], 127)})
    end = dispatch_ops(lambda: env.step(a))
    assert env.t.eq(0).all() and mid == end
    assert sum(mid.values()) <= 50, mid
    assert f"A step is {sum(mid.values())} non-view ops" in module.__doc__


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("device, options", [
    ("cpu", None), ("cpu", {"cpp.simdlen": 0}),  # bench-env's "+compile scalar" on the CPU
    pytest.param("cuda", None, marks=needs_cuda)], ids=["cpu", "cpu-scalar", "cuda"])
@pytest.mark.parametrize("spec", [ForageSpec(episode_length=6), ForageSpec(episode_length=20)],
                         ids=["two-draws-a-step", "one-draw-a-step"])
def test_compiled_step_parity(spec: ForageSpec, device: str, options: dict | None) -> None:
    """torch.compile(ForageTorch.step): one graph, no recompiles across steps and episode
    ends (envs at different steps), outputs bit-exact with the eager step."""
    n_envs = 16
    state = staggered(spec, n_envs, seed=2)
    eager = from_state(ForageTorch, spec, state, final_obs=True, device=device)
    compiled_env = from_state(ForageTorch, spec, state, final_obs=True, device=device)
    torch._dynamo.reset()
    step = torch.compile(compiled_env.step, fullgraph=True, options=options)
    gen = torch.Generator(device).manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(2 * spec.episode_length + 1):
            a = torch.randint(0, 5, (n_envs,), generator=gen, device=device)
            got, want = step(a), eager.step(a)
            for x, y in zip(got[:4], want[:4], strict=True):
                assert torch.equal(x, y), t
            for key in want[4]:
                assert torch.equal(got[4][key], want[4][key]), (t, key)


def test_kth_free() -> None:
    free = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert kth_free(free, torch.tensor([0, 0])).tolist() == [1, 0]
    assert kth_free(free, torch.tensor([2, 4])).tolist() == [4, 4]


@pytest.mark.parametrize("final_obs", [False, True])
def test_torch_step_has_no_host_reads(final_obs: bool) -> None:
    env = ForageTorch(64, ForageSpec(episode_length=50), seed=0, final_obs=final_obs)
    actions = random_actions(64 * 120, generator=0).view(120, 64)
    with SyncMeter() as meter:
        truncated = torch.zeros((), dtype=torch.int64)
        for a in actions:  # 120 steps: two episode resets included
            truncated += env.step(a)[3].sum()
    assert meter.host_reads == 0, meter.counts
    assert truncated.item() == 2 * 64


def test_torch_loop_step_syncs() -> None:
    env = ForageTorchLoop(16, seed=0)
    with SyncMeter() as meter:
        env.step(torch.zeros(16, dtype=torch.int64))
    assert meter.host_reads >= 16  # at least one `if` on a tensor per env: the stage-2 lesson


def test_actions_of_any_integer_dtype() -> None:
    env, ref = ForageTorch(4, seed=0), ForageTorch(4, seed=0)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):
        a = torch.tensor([1, 2, 3, 4], dtype=dtype)
        assert torch.equal(env.step(a)[0], ref.step(a.long())[0])


def one_hot_obs(view: int = 7, **cells: list[tuple[int, int]]) -> torch.Tensor:
    """An observation (1, 3, view, view) with walls/food/poison at (row, col) offsets."""
    obs, r = torch.zeros(1, 3, view, view), view // 2
    for channel, name in enumerate(("wall", "food", "poison")):
        for dr, dc in cells.get(name, []):
            obs[0, channel, r + dr, r + dc] = 1.0
    return obs


def test_oracle_moves_to_food_around_poison_and_walls() -> None:
    assert oracle_actions(one_hot_obs(food=[(0, 2)])).tolist() == [4]  # right
    assert oracle_actions(one_hot_obs(food=[(-3, 0)])).tolist() == [1]  # up
    # Food straight left behind poison: go round (up and down tie; up comes first).
    assert oracle_actions(one_hot_obs(food=[(0, -2)], poison=[(0, -1)])).tolist() == [1]
    # The nearest food is walled off: head for the farther one that can be reached.
    walled = one_hot_obs(food=[(2, 0), (0, 3)], wall=[(1, 0), (2, -1), (2, 1), (3, 0)])
    assert oracle_actions(walled).tolist() == [4]


def test_oracle_explores_without_food_and_avoids_walls() -> None:
    obs = one_hot_obs(wall=[(-1, 0), (1, 0), (0, -1)], poison=[(0, 1)])
    assert oracle_actions(obs, 0).tolist() == [0]  # boxed in: stay
    obs = one_hot_obs(wall=[(-1, 0), (1, 0), (0, -1)])
    headings = {oracle_actions(obs, t).item() for t in range(64)}
    assert headings == {4}  # the only open side
    free = {oracle_actions(one_hot_obs(), t).item() for t in range(64)}
    assert free == {1, 2, 3, 4}  # the heading changes over time


def test_oracle_has_no_host_reads() -> None:
    obs = ForageTorch(32, seed=0).observation()
    with SyncMeter() as meter:
        oracle_actions(obs, torch.tensor(5))
    assert meter.host_reads == 0


@pytest.mark.slow
def test_oracle_beats_random() -> None:
    # Measured (default spec, 256 envs x 4 episodes, seeds 0 and 1): oracle 25.9, random 0.5.
    # Here 64 envs x 1 episode; the margin of 15 leaves room for that smaller sample.
    oracle = mean_return("oracle", n_envs=64, episodes=1, seed=0)
    random = mean_return("random", n_envs=64, episodes=1, seed=0)
    assert oracle > random + 15, (oracle, random)
    assert -3 < random < 4


def test_bench_envs_small() -> None:
    """Every implementation timed over whole episodes in interleaved rounds; the vectorized
    ones at each N given; torch rows count their non-view aten ops per step."""
    spec = ForageSpec(episode_length=8)
    result = bench_envs("cpu", repeats=3, n_envs=(8, 16), spec=spec, loop_envs=2, warmup=1)
    assert [(r["impl"], r["n_envs"]) for r in result["rows"]] == [
        ("ForagePy", 2), ("ForageTorchLoop", 2), ("ForageNumpy", 8), ("ForageTorch", 8),
        ("ForageNumpy", 16), ("ForageTorch", 16)]
    assert result["steps_per_sample"] == 8
    for row in result["rows"]:
        lo, mid, hi = row["steps_per_s_spread"]
        assert len(row["samples_s"]) == 3 and 0 < lo <= mid <= hi and mid == row["steps_per_s"]
        assert (row["ops_per_step"] is None) == (row["impl"] in ("ForagePy", "ForageNumpy"))
    torch_row = result["rows"][3]
    assert 50 < torch_row["ops_per_step"] < 1000
    assert result["rows"][0]["ratio_vs_py"] == 1.0
    assert set(result["fastest"]) == {8, 16}
    assert result["fastest"][16]["impl"] in ("ForageNumpy", "ForageTorch")
    text = format_table(result)
    assert "ForageTorchLoop" in text and "N=16: fastest" in text and result["meta"]["torch"]


def test_bench_env_torch_only_times_forage_torch_alone(tmp_path, capsys) -> None:
    """``--torch-only``: ForageTorch's rows alone at every N (no NumPy or per-env loop to
    time at a GPU's large Ns), no ratio to a ForagePy that did not run, and its own file
    beside (never over) a whole sweep's."""
    from labkit.app.cli import main

    spec = ForageSpec(episode_length=8)
    result = bench_envs("cpu", repeats=2, n_envs=(8, 16), spec=spec, warmup=1, torch_only=True)
    assert [(r["impl"], r["n_envs"]) for r in result["rows"]] == [("ForageTorch", 8),
                                                                  ("ForageTorch", 16)]
    assert all(r["ratio_vs_py"] is None and r["steps_per_s"] > 0 for r in result["rows"])
    assert result["torch_only"] and result["fastest"][16]["next"] is None
    assert "ForageNumpy" not in format_table(result)
    assert main(["bench-env", "--device", "cpu", "--repeats", "1", "--n-envs", "8",
                 "--torch-only", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "bench_env_cpu_torch.json").read_text())
    assert {r["impl"] for r in written["rows"]} == {"ForageTorch"}
    assert not (tmp_path / "bench_env_cpu.json").exists()


@pytest.mark.slow
def test_bench_envs_compiled_rows_on_the_cpu() -> None:
    """``compiled``: the step compiled (and a loop of K steps as one graph), and on the CPU
    the step compiled to scalar C++ too, each with its first call's seconds."""
    spec = ForageSpec(episode_length=8)
    torch._dynamo.reset()
    result = bench_envs("cpu", repeats=1, n_envs=(8, 16), spec=spec, loop_envs=2, warmup=4,
                        compiled=True, compile_loop=4)
    compiled = [r for r in result["rows"] if "+compile" in r["impl"]]
    # two Ns in one process: the second compiles its own static graph (it once recompiled
    # with symbolic sizes, which the step's gather(out=) refuses)
    assert [(r["impl"], r["n_envs"]) for r in compiled] == [
        (impl, n) for n in (8, 16) for impl in ("ForageTorch+compile", "ForageTorch+compile x4")
    ] + [("ForageTorch+compile scalar", n) for n in (8, 16)]
    assert all(r["compile_s"] > 0 and r["steps_per_s"] > 0 for r in compiled)


def test_dispatch_ops_counts_non_view_ops_below_wrappers() -> None:
    from labkit.measure.profiling import dispatch_ops

    x = torch.ones(4)
    counts = dispatch_ops(lambda: (x.view(2, 2) + 1).t().sum())
    assert counts == {"add": 1, "sum": 1}  # view and t launch nothing


def test_observation_channels() -> None:
    # A 3x3 grid: the agent on the one interior cell sees the 8 border walls and nothing else.
    env = ForageTorch(1, ForageSpec(height=3, width=3, view=3, n_walls=0, n_food=0,
                                    n_poison=0))
    obs = env.observation()[0]
    assert obs[0].sum() == 8 and obs[0, 1, 1] == 0 and obs[1:].sum() == 0


def test_reset_and_load_write_in_place() -> None:
    """Compiled code and CUDA graphs hold the env's buffers: reset and load_state_dict keep
    every one's storage."""
    env = ForageTorch(8, ForageSpec(episode_length=10), seed=1)
    pointers = {k: v.data_ptr() for k, v in env.buffers().items()}
    saved = env.state_dict()
    for _ in range(13):
        env.step(torch.zeros(8, dtype=torch.int64))
    env.load_state_dict(saved)
    env.reset(seed=4)
    assert {k: v.data_ptr() for k, v in env.buffers().items()} == pointers


def test_a_state_of_another_spec_is_refused() -> None:
    """The step relies on the spec's counts of walls and items (the respawn's modulus is a
    constant of the spec): a state that does not hold them is refused, naming the grid."""
    state = ForageTorch(4, ForageSpec(), seed=1).state_dict()
    other = ForageTorch(4, ForageSpec(n_walls=0, n_food=1, n_poison=0), seed=1)
    with pytest.raises(ValueError, match=r"state\['grid'\] must hold this spec's 0 walls"):
        other.load_state_dict(state)
    bad_pos = {**state, "pos": torch.full_like(state["pos"], -3)}
    with pytest.raises(ValueError, match=r"state\['pos'\] must be interior cells"):
        ForageTorch(4, ForageSpec(), seed=1).load_state_dict(bad_pos)


def test_observation_is_float32_whatever_the_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        env = ForageTorch(2, seed=0)
        assert env.observation().dtype == torch.float32
        assert env.step(torch.zeros(2, dtype=torch.int64))[0].dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.slow
def test_parity_on_a_grid_too_big_for_the_window_table() -> None:
    """Beyond 4M window-table entries the observation maps offsets on each call."""
    spec = ForageSpec(height=130, width=130, view=17, n_walls=400, episode_length=9)
    envs = {"numpy": VecEnv(ForageNumpy(2, spec, 3, final_obs=True)),
            "torch": VecEnv(ForageTorch(2, spec, 3, final_obs=True))}
    assert envs["torch"].env._window is None
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(envs["numpy"].reset(), envs["torch"].reset())
    for _ in range(20):
        a = rng.integers(0, 5, 2)
        for got, want in zip(envs["torch"].step(a), envs["numpy"].step(a), strict=True):
            assert np.array_equal(got, want)
