"""NumPy or torch: the measurements of chapter 04's crossover (labkit.measure.envcrossover),
with the op census (labkit.measure.profiling) and the step timed by parts
(labkit.measure.envbench)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from labkit.envs import ForageNumpy, ForageSpec, ForageTorch
from labkit.measure.envbench import STEP_PARTS, _step_by_parts, step_parts
from labkit.measure.envcrossover import (
    CROSSOVER_CASES,
    calls_of,
    crossings,
    crossover,
    crossover_lines,
    numpy_calls,
    out_of_phase_steps,
    state_at,
    step_ops,
)
from labkit.measure.profiling import dispatch_ops, op_census


def test_numpy_calls_counts_functions_and_methods_once_and_not_operators():
    x = np.arange(6)

    def work():
        np.where(x > 2, x, 0)  # a call (its `>` is an operator: not counted)
        x.cumsum()
        x.sum()  # a C method that runs NumPy's Python _sum inside: one call
        np.take_along_axis(x[None], np.array([[0, 1]]), 1)  # dispatcher + impl: one call
        np.maximum(x, 1)  # a ufunc called by name: not a call the hook sees
        return x + 1

    counts = numpy_calls(work)
    assert counts == {"where": 1, "cumsum": 1, "sum": 1, "array": 1, "take_along_axis": 1}


def test_numpy_calls_restores_the_profile_hook():
    import sys

    def mine(frame, event, arg):
        return None

    sys.setprofile(mine)
    try:
        numpy_calls(lambda: np.zeros(3).sum())
        assert sys.getprofile() is mine
    finally:
        sys.setprofile(None)


def test_out_of_phase_steps_spread_the_envs_over_the_episode():
    assert out_of_phase_steps(4, 128).tolist() == [0, 32, 64, 96]
    assert len(set(out_of_phase_steps(32, 128))) == 32
    assert len(set(out_of_phase_steps(512, 128))) == 128  # min(N, L) steps end something


@pytest.mark.parametrize("cls", [ForageNumpy, ForageTorch])
def test_state_at_puts_the_envs_at_the_given_steps(cls):
    env = cls(4, ForageSpec(), seed=2)
    env.load_state_dict(state_at(env, [0, 5, 126, 127]))
    assert env.state_dict()["t"].tolist() == [0, 5, 126, 127]
    truncated = env.step(np.zeros(4, dtype=np.int64) if cls is ForageNumpy
                         else torch.zeros(4, dtype=torch.int64))[3]
    assert np.asarray(truncated).tolist() == [False, False, False, True]
    env.load_state_dict(state_at(env, 9))
    assert env.state_dict()["t"].tolist() == [9] * 4


def test_step_ops_torch_the_same_either_way_numpy_skips_its_reset():
    ops = step_ops(n_envs=8)
    t = ops["ForageTorch"]
    assert t["no end"] == t["one env ends"] == t["every env ends"]
    assert sum(t["no end"].values()) > 0
    n = {case: sum(c.values()) for case, c in ops["ForageNumpy"].items()}
    assert n["no end"] < n["one env ends"] == n["every env ends"]
    assert ops["numpy_resets"] == {"no end": 0, "one env ends": 1, "every env ends": 1}


def test_op_census_profiler_events_are_dispatched_plus_views_plus_inside():
    env = ForageTorch(8, seed=1)
    state = state_at(env, 10)
    a = torch.zeros(8, dtype=torch.int64)
    census = op_census(lambda: env.step(a), "cpu", setup=lambda: env.load_state_dict(state))
    totals = census["totals"]
    assert census["covered"]
    assert totals["profiler"] == totals["dispatched"] + totals["views"] + totals["inside"]
    assert totals["views"] > 0 and totals["inside"] > 0
    env.load_state_dict(state)
    assert census["dispatched"] == dispatch_ops(lambda: env.step(a))
    assert "aten::select" in census["views"] or "aten::as_strided" in census["views"]


def test_crossover_times_every_case_and_restores_the_threads():
    threads = torch.get_num_threads()
    spec = ForageSpec(episode_length=16)
    result = crossover((8, 16), spec=spec, steps=2, repeats=1, threads=1)
    assert torch.get_num_threads() == threads
    assert result["threads"] == 1
    rows = {(r["impl"], r["n_envs"]): r for r in result["rows"]}
    assert set(rows) == {(i, n) for i in ("ForageNumpy", "ForageTorch") for n in (8, 16)}
    for r in rows.values():
        assert all(r[case] > 0 and len(r["samples_s"][case]) == 1 for case in CROSSOVER_CASES)
        assert r["lockstep_s"] == pytest.approx((15 * r["no end"] + r["every env ends"]) / 16)
    # 8 envs at t = 0, 2, ..., 14: of the 2 steps from there, one ends env 7's episode; 16
    # envs take every t, so both steps end one.
    assert rows["ForageNumpy", 8]["end_share"] == 0.5
    assert rows["ForageTorch", 16]["end_share"] == 1.0


def test_crossover_refuses_more_steps_than_half_an_episode():
    with pytest.raises(ValueError, match="half an episode"):
        crossover((8,), spec=ForageSpec(episode_length=8), steps=8, repeats=1)


def _result(numpy_us: dict, torch_us: dict, end_share: float = 0.25) -> dict:
    """A crossover result with the same seconds in every case, per impl and N."""
    rows = []
    for impl, us in (("ForageNumpy", numpy_us), ("ForageTorch", torch_us)):
        for n, t in us.items():
            s = t * 1e-6
            rows.append({"impl": impl, "n_envs": n, "no end": s, "every env ends": 2 * s,
                         "out of phase": 3 * s, "lockstep_s": 1.5 * s,
                         "end_share": end_share if n < 128 else 1.0})
    return {"rows": rows, "episode_length": 128}


def test_crossings_and_sentences_follow_the_data_when_the_order_flips():
    numpy_small = _result({32: 100, 256: 300, 1024: 2000}, {32: 600, 256: 600, 1024: 1500})
    c = crossings(numpy_small)["lockstep"]
    assert (c["torch_from"], c["numpy_up_to"]) == (1024, 256)
    lines = crossover_lines(numpy_small, torch_ops=76)
    assert "ForageTorch is faster from N=1024 on, ForageNumpy at N=256 and below" in lines[0]
    assert "as long as 13 of them" in lines[3]  # 100 / 600 * 76

    flipped = _result({32: 600, 256: 600, 1024: 1500}, {32: 100, 256: 300, 1024: 2000})
    c = crossings(flipped)["lockstep"]
    assert (c["torch_from"], c["numpy_up_to"]) == (None, 1024)
    assert "ForageTorch is faster at N=32, 256 but not at the largest, 1024" in \
        crossover_lines(flipped)[0]

    torch_all = _result({32: 700, 256: 900}, {32: 100, 256: 300})
    assert "ForageTorch is faster at every N measured (32 to 256)" in \
        crossover_lines(torch_all)[0]
    numpy_all = _result({32: 100, 256: 300}, {32: 700, 256: 900})
    assert "ForageNumpy is faster at every N measured (32 to 256)" in \
        crossover_lines(numpy_all)[0]


def test_the_skip_sentence_flips_with_the_data():
    pays = _result({32: 100, 256: 300}, {32: 600, 256: 600})
    assert "its skipped reset pays here" in crossover_lines(pays)[-2]
    assert crossover_lines(pays)[-1].startswith("From N=256 on")
    doesnt = copy.deepcopy(pays)
    for r in doesnt["rows"]:
        r["lockstep_s"] = 4 * r["no end"]  # slower in lockstep than out of phase (3x)
    assert "its skipped reset does not pay here" in crossover_lines(doesnt)[-2]


def test_a_step_preempted_in_one_round_does_not_move_the_figure():
    from labkit.measure.envcrossover import _per_step

    # 3 rounds of 4 steps; the 4th step ends episodes (5 s); one round's 2nd step was preempted
    rounds = [[1.0, 9.0, 1.0, 5.0], [1.0, 1.0, 1.0, 5.0], [1.0, 1.0, 1.0, 5.0]]
    assert _per_step(rounds) == 2.0  # (1 + 1 + 1 + 5) / 4


def test_calls_of_counts_a_function_by_its_code_without_patching():
    env = ForageNumpy(4, ForageSpec(), seed=0)
    reset = ForageNumpy._new_episodes.__code__
    a = np.zeros(4, dtype=np.int64)
    env.load_state_dict(state_at(env, 127))
    assert calls_of(reset, lambda: env.step(a)) == 1
    assert calls_of(reset, lambda: env.step(a)) == 0  # mid-episode now: the reset is skipped
    assert "_new_episodes" not in vars(env)


@pytest.mark.parametrize("length", [128, 2])
def test_the_step_timed_by_parts_is_forage_torch_step(length):
    """step_parts times ForageTorch.step as written out in _step_by_parts: the same outputs and
    state, step for step, over episode ends (2-step episodes make several placement passes)."""
    spec = ForageSpec(episode_length=length)
    ref = ForageTorch(6, spec, seed=3, final_obs=True)
    timed_env = ForageTorch(6, spec, seed=3, final_obs=True)
    called = []

    def part(name, method, *args):
        called.append(name)
        return method(*args)

    actions = torch.randint(0, 5, (length + 3, 6), generator=torch.Generator().manual_seed(0))
    for a in actions:
        want, got = ref.step(a), _step_by_parts(timed_env, a, part)
        for w, g in zip(want[:4], got[:4], strict=True):
            assert torch.equal(w, g)
        assert want[4].keys() == got[4].keys()
        for key in want[4]:
            assert torch.equal(want[4][key], got[4][key]), key
    for key, value in ref.state_dict().items():
        assert torch.equal(value, timed_env.state_dict()[key]), key
    assert set(called) == set(STEP_PARTS)


def test_step_parts_times_every_part_and_patches_nothing():
    env = ForageTorch(8, seed=1)
    before = set(vars(env))
    out = step_parts(env, steps=4)
    assert set(vars(env)) == before
    assert list(out["parts_s"]) == [*STEP_PARTS, "other"]
    assert all(s > 0 for name, s in out["parts_s"].items() if name != "other")
    assert sum(out["parts_s"].values()) == pytest.approx(out["step_s"])

    class OwnStep(ForageTorch):
        def step(self, actions):
            return super().step(actions)

    with pytest.raises(TypeError, match="OwnStep has its own"):
        step_parts(OwnStep(8), steps=1)
