"""Compile only where it pays: ``CompiledIfFaster`` (stage 7's executors) times eager against
compiled at warmup and keeps the faster; a run's ``compile`` forces either; a resumed run keeps
what its checkpoint says.

The rule is tested on a stand-in pipeline whose phase times are scripted; the plumbing on real
pipelines whose "compiled" twin is the eager function itself (a CPU compile takes a minute and
is not what these tests are about; ``tests/test_stages.py`` runs the real stage)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from labkit.app import checkpoint
from labkit.app import train as train_module
from labkit.app.train import TrainConfig, start_line, train
from labkit.capture import warmup
from labkit.config import RunConfig
from labkit.envs import ForageSpec
from labkit.executors import (
    CHOICE_ROUNDS,
    Choice,
    CompiledIfFaster,
    choose,
    choose_conv_math,
    describe_choice,
    describe_conv_math,
)
from labkit.stages import Pipeline, get_stage

SPEC = ForageSpec(episode_length=20)


# ---------------------------------------------------------------- the rule


class _Clock:
    def __init__(self, owner: _Scripted) -> None:
        self.owner = owner

    def start(self) -> None:
        pass

    def stop(self) -> dict[str, float]:
        return self.owner.last


class _Scripted:
    """A pipeline whose iteration reports scripted phase times for the kind its choices keep,
    and counts how its state is saved and restored."""

    device = torch.device("cpu")

    def __init__(self, ms: dict[str, dict[str, list[float]]]) -> None:
        self.choices = {part: Choice(lambda: "eager", lambda: "compiled") for part in ms}
        self.ms = {part: {k: itertools.cycle(v) for k, v in kinds.items()}
                   for part, kinds in ms.items()}
        self.clock = _Clock(self)
        self.kinds: list[str] = []
        self.state, self.restored = 0, []
        self.last: dict[str, float] = {}

    def iteration(self) -> None:
        kinds = {c.kept for c in self.choices.values()}
        assert len(kinds) == 1  # every part eager, or every part compiled
        kind = kinds.pop()
        self.kinds.append(kind)
        phase = {"rollout": "policy", "update": "update"}
        self.last = {phase[p]: next(self.ms[p][kind]) for p in self.choices}
        self.state += 1

    def state_dict(self) -> int:
        return self.state

    def load_state_dict(self, state: int) -> None:
        self.restored.append(state)
        self.state = state


@pytest.mark.parametrize("eager, compiled, kept", [
    ([10, 11, 12], [20, 21, 22], "eager"),          # faster by more than the spread
    ([10, 25, 12], [20, 21, 22], "compiled"),       # the spreads overlap: compiled stays
    ([30, 31, 32], [20, 21, 22], "compiled"),       # compiled faster
    ([20, 20, 20], [20, 20, 20], "compiled"),       # a tie
])
def test_compiled_is_kept_unless_eager_is_faster_by_more_than_the_spread(eager, compiled, kept):
    pipe = _Scripted({"update": {"eager": eager, "compiled": compiled}})
    made = choose(pipe, pipe.choices)
    assert made["update"]["kept"] == kept == pipe.choices["update"].kept
    assert len(made["update"]["eager_ms"]) == len(made["update"]["compiled_ms"]) == CHOICE_ROUNDS
    # one untimed eager iteration, then rounds of both kinds, the order alternating
    assert pipe.kinds[0] == "eager"
    rounds = [pipe.kinds[1 + 2 * r: 3 + 2 * r] for r in range(CHOICE_ROUNDS)]
    assert all(sorted(r) == ["compiled", "eager"] for r in rounds)
    assert rounds[0] != rounds[1]
    # every iteration undone: the state is the one before
    assert pipe.state == 0 and pipe.restored == [0] * (1 + 2 * CHOICE_ROUNDS)


def test_each_part_is_decided_by_its_own_phase():
    pipe = _Scripted({"rollout": {"eager": [5, 6], "compiled": [9, 8]},
                      "update": {"eager": [50, 52], "compiled": [40, 41]}})
    made = choose(pipe, pipe.choices)
    assert (made["rollout"]["kept"], made["update"]["kept"]) == ("eager", "compiled")
    assert made["rollout"]["phase"] == "policy"
    text = describe_choice("rollout", made["rollout"])
    assert text.startswith("rollout eager (policy ") and "compiled; medians of 5" in text


def test_a_choice_runs_what_it_keeps_and_shares_the_eager_function_s_attributes():
    agent = torch.nn.Linear(2, 1)
    choice = Choice(agent, lambda x: "compiled")
    assert choice(torch.zeros(1, 2)) == "compiled"  # compiled until told
    choice.keep("eager")
    assert isinstance(choice(torch.zeros(1, 2)), torch.Tensor)
    assert choice.weight is agent.weight
    with pytest.raises(ValueError, match="kind must be one of compiled, eager; got 'fast'"):
        choice.keep("fast")


# ---------------------------------------------------------------- real pipelines


@dataclasses.dataclass(frozen=True)
class _Uncompiled(CompiledIfFaster):
    """Chooses like stage 7's executor, between two eager copies of the function."""

    def wrap_model(self, fn):
        return Choice(fn, fn)


def _stage():
    return dataclasses.replace(get_stage("fused_amp"), rollout_executor=_Uncompiled(),
                               update_executor=_Uncompiled())


def test_stage_7_compiles_where_it_pays_and_stage_5_always_compiles():
    assert type(get_stage("fused_amp").rollout_executor) is CompiledIfFaster
    assert type(get_stage("compile_warmup").rollout_executor).__name__ == "Compiled"
    # stage 8 replays compiled code: nothing is chosen inside a graph
    assert type(get_stage("cuda_graphs").update_executor.base).__name__ == "Compiled"


@pytest.mark.inductor
@pytest.mark.slow
def test_the_warmup_decides_and_undoes_what_it_ran():
    cfg = RunConfig(n_envs=8, n_steps=8, spec=SPEC, conv_math="conv2d")  # fresh's convolutions
    with Pipeline(_stage(), cfg, "cpu") as pipe, Pipeline(_stage(), cfg, "cpu") as fresh:
        assert set(pipe.math.choices) == {"rollout", "update"} and not pipe.math.executor_choices
        warmup(pipe)
        made = pipe.math.executor_choices
        assert set(made) == {"rollout", "update"}
        assert all(m["why"] == "timed" and len(m["eager_ms"]) == CHOICE_ROUNDS
                   for m in made.values())
        assert pipe.math.kinds() == {p: made[p]["kept"] for p in ("rollout", "update")}
        # the timing iterations were undone: the next iteration is a fresh pipeline's first
        a, b = pipe.iteration(), fresh.iteration()
        assert torch.equal(a["pg_loss"], b["pg_loss"])
        assert torch.equal(pipe.agent.body[0].weight, fresh.agent.body[0].weight)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_forced_choice_is_kept_without_timing(kind, monkeypatch):
    monkeypatch.setattr("labkit.executors.choose", lambda *a, **k: pytest.fail("timed"))
    cfg = RunConfig(n_envs=8, n_steps=8, spec=SPEC, compile=kind)
    with Pipeline(_stage(), cfg, "cpu") as pipe:
        warmup(pipe)
        assert pipe.math.kinds() == {"rollout": kind, "update": kind}
        assert pipe.math.executor_choices["update"] == {"kept": kind, "why": f"compile={kind}"}
        assert describe_choice("update", pipe.math.executor_choices["update"]) == \
            f"update {kind} (compile={kind})"


def test_stages_that_do_not_choose_say_what_runs_their_model_math():
    cfg = RunConfig(n_envs=8, n_steps=8, spec=SPEC)
    with Pipeline("async_logging", cfg, "cpu") as pipe:
        assert pipe.math.choices == {}
        assert pipe.math.kinds() == {"rollout": "eager", "update": "eager"}
    with pytest.raises(ValueError, match="compile must be one of auto, compiled, eager"):
        RunConfig(compile="yes")


@pytest.mark.slow
def test_a_resumed_run_keeps_the_choice_its_checkpoint_holds(tmp_path, monkeypatch):
    made = {"rollout": {"kept": "eager", "why": "timed", "phase": "policy",
                        "eager_ms": [1.0] * 5, "compiled_ms": [2.0] * 5},
            "update": {"kept": "compiled", "why": "timed", "phase": "update",
                       "eager_ms": [3.0] * 5, "compiled_ms": [2.0] * 5}}

    def scripted(pipe, choices, rounds=CHOICE_ROUNDS, phases=None):
        for part, choice in choices.items():
            choice.keep(made[part]["kept"])
        return {part: made[part] for part in choices}

    built = []

    def build(cfg, device, group):
        built.append(Pipeline(_stage(), cfg.run, device, group=group))
        return built[-1]

    monkeypatch.setattr(train_module, "build_pipeline", build)
    monkeypatch.setattr("labkit.executors.choose", scripted)
    cfg = TrainConfig.flat(stage="fused_amp", device="cpu", n_envs=8, n_steps=16,
                           total_steps=4 * 128, seed=3, checkpoint_every=2, spec=SPEC)
    summary = train(cfg, tmp_path / "run", progress=False, stop_after=2)
    assert summary["executor_choices"] == made
    assert summary["model_math"] == {"rollout": "eager", "update": "compiled"}
    saved = checkpoint.load(tmp_path / "run" / checkpoint.FILENAME)
    assert saved["executor_choices"] == made
    assert "rollout eager (policy 1.0 ms per iteration eager, 2.0 compiled" in \
        start_line(cfg, built[-1])
    # a resume keeps the saved choice: nothing is timed again
    monkeypatch.setattr("labkit.executors.choose", lambda *a, **k: pytest.fail("timed again"))
    summary = train(None, tmp_path / "run", resume=True, progress=False)
    assert summary["complete"] and summary["executor_choices"] == made
    assert built[-1].math.kinds() == {"rollout": "eager", "update": "compiled"}
    # a checkpoint written before runs chose (no executor_choices) resumes compiled, as it ran
    payload = checkpoint.load(tmp_path / "run" / checkpoint.FILENAME)
    payload.pop("format")
    payload.pop("executor_choices")
    checkpoint.save(tmp_path / "run" / checkpoint.FILENAME, payload)
    (tmp_path / "run" / "summary.json").unlink()
    train(None, tmp_path / "run", resume=True, progress=False)
    assert built[-1].math.kinds() == {"rollout": "compiled", "update": "compiled"}


@pytest.mark.slow
def test_a_new_run_keeps_what_the_last_run_like_it_timed(tmp_path, monkeypatch):
    """labkit.app.remembered: a second new run of the same stage and sizes keeps the first's
    timed choices without timing and says so; remember_choices=False (--fresh-choices) times
    again, another N is timed apart, and a cache file that is not JSON is passed over and
    replaced."""
    from labkit.app import remembered
    from labkit.app.cli import build_parser

    made = {"rollout": {"kept": "eager", "why": "timed", "phase": "policy",
                        "eager_ms": [1.0] * 5, "compiled_ms": [2.0] * 5},
            "update": {"kept": "compiled", "why": "timed", "phase": "update",
                       "eager_ms": [3.0] * 5, "compiled_ms": [2.0] * 5}}
    timed = []

    def scripted(pipe, choices, rounds=CHOICE_ROUNDS, phases=None):
        timed.append(pipe.cfg.n_envs)
        for part, choice in choices.items():
            choice.keep(made[part]["kept"])
        return {part: made[part] for part in choices}

    monkeypatch.setattr("labkit.executors.choose", scripted)
    flat = dict(stage="fused_amp", device="cpu", n_envs=8, n_steps=16, total_steps=128, seed=3,
                conv_math="conv2d", spec=SPEC)
    cfg = TrainConfig.flat(**flat)
    assert train(cfg, tmp_path / "a", progress=False)["executor_choices"] == made
    second = train(cfg, tmp_path / "b", progress=False)["executor_choices"]
    assert timed == [8]  # kept, not timed
    assert {p: {k: v for k, v in m.items() if k != "remembered"}
            for p, m in second.items()} == made
    assert "compiled; medians of 5, remembered: timed 20" in describe_choice("update",
                                                                              second["update"])
    assert checkpoint.load(tmp_path / "b" / checkpoint.FILENAME)["executor_choices"] == second
    fresh = train(cfg, tmp_path / "c", progress=False, remember_choices=False)
    assert timed == [8, 8] and fresh["executor_choices"] == made
    train(TrainConfig.flat(**{**flat, "n_envs": 4}), tmp_path / "d", progress=False)
    assert timed == [8, 8, 4]
    (remembered.cache_dir() / remembered.FILENAME).write_text("not JSON")
    train(cfg, tmp_path / "e", progress=False)
    assert timed == [8, 8, 4, 8]
    assert train(cfg, tmp_path / "f", progress=False)["executor_choices"]["update"][
        "remembered"] and timed == [8, 8, 4, 8]
    assert build_parser().parse_args(["train", "--fresh-choices"]).fresh_choices
    with pytest.raises(TypeError, match="remember_choices must be True or False, got str"):
        train(cfg, tmp_path / "g", remember_choices="no")


def test_a_checkpoint_with_a_bad_choice_is_refused_naming_the_field(tmp_path):
    cfg = TrainConfig.flat(stage="async_logging", device="cpu", n_envs=8, n_steps=16,
                           total_steps=2 * 128, seed=3, spec=SPEC)
    train(cfg, tmp_path / "run", progress=False)
    path = tmp_path / "run" / checkpoint.FILENAME
    payload = checkpoint.load(path)
    payload.pop("format")
    checkpoint.save(path, {**payload, "executor_choices": {"update": {"kept": "fast"}}})
    with pytest.raises(checkpoint.CheckpointError, match="field 'executor_choices' must map"):
        checkpoint.check(checkpoint.load(path), path)


@pytest.mark.slow
def test_the_cli_says_what_the_model_math_kept(tmp_path, capsys):
    """--compile forces the choice (nothing compiles: the compiled twin is never called), and
    the run's last line says what each part ran."""
    from labkit.app.cli import main

    code = main(["train", "--stage", "fused_amp", "--device", "cpu", "--n-envs", "8",
                 "--n-steps", "16", "--total-steps", "256", "--compile", "eager",
                 "--out", str(tmp_path / "run"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "rollout eager, update eager, " in out, out
    saved = checkpoint.load(tmp_path / "run" / checkpoint.FILENAME)
    assert saved["executor_choices"]["update"] == {"kept": "eager", "why": "compile=eager"}


@pytest.mark.slow
def test_a_checkpoint_whose_choices_do_not_fit_the_stage_is_refused(tmp_path, monkeypatch):
    """Saved choices must name exactly the parts the stage chooses for; a timed one needs its
    timings (else the resume would time again, or fail in the middle)."""
    built = []

    def build(cfg, device, group):
        built.append(Pipeline(_stage(), cfg.run, device, group=group))
        return built[-1]

    monkeypatch.setattr(train_module, "build_pipeline", build)
    cfg = TrainConfig.flat(stage="fused_amp", device="cpu", n_envs=8, n_steps=16,
                           total_steps=4 * 128, seed=3, spec=SPEC, compile="eager")
    train(cfg, tmp_path / "run", progress=False, stop_after=2)
    path = tmp_path / "run" / checkpoint.FILENAME
    payload = checkpoint.load(path)
    payload.pop("format")
    for bad in ({"update": {"kept": "eager", "why": "compile=eager"}}, {}):
        checkpoint.save(path, {**payload, "executor_choices": bad})
        with pytest.raises(checkpoint.CheckpointError, match="chooses for"):
            train(None, tmp_path / "run", resume=True, progress=False)
    timed_without_timings = {part: {"kept": "eager", "why": "timed", "phase": "policy",
                                    "eager_ms": [], "compiled_ms": [1.0]}
                             for part in ("rollout", "update")}
    checkpoint.save(path, {**payload, "executor_choices": timed_without_timings})
    with pytest.raises(checkpoint.CheckpointError, match="field 'executor_choices' must map"):
        checkpoint.check(checkpoint.load(path), path)


def test_a_graph_cannot_replay_a_choice():
    from labkit.executors import Graphed

    with pytest.raises(TypeError, match="a captured graph replays what it captured"):
        Graphed(CompiledIfFaster())


def test_choosing_needs_the_phase_it_times():
    pipe = _Scripted({"update": {"eager": [1.0], "compiled": [2.0]}})
    pipe.iteration = lambda: None  # marks no phase
    pipe.last = {"env": 1.0}
    with pytest.raises(RuntimeError, match="marked no 'update' phase"):
        choose(pipe, pipe.choices)


# ---------------------------------------------------------------- the convolutions' math


class _ScriptedConvs(_Scripted):
    """A pipeline whose iteration reports scripted phase times for the way its conv body
    (any object with ``conv_math``) runs its convolutions."""

    def __init__(self, ms: dict[str, dict[str, list[float]]]) -> None:
        super().__init__({})
        self.body = type("Body", (), {"conv_math": "conv2d"})()
        self.ms = {part: {k: itertools.cycle(v) for k, v in kinds.items()}
                   for part, kinds in ms.items()}

    def iteration(self) -> None:
        math = self.body.conv_math
        self.kinds.append(math)
        phase = {"rollout": "policy", "update": "update"}
        self.last = {phase[p]: next(self.ms[p][math]) for p in self.ms}
        self.state += 1


@pytest.mark.parametrize("conv2d, matmul, kept", [
    ([20, 21, 22], [10, 11, 12], "matmul"),         # faster by more than the spread
    ([20, 21, 22], [10, 25, 12], "conv2d"),         # the spreads overlap: conv2d stays
    ([10, 11, 12], [20, 21, 22], "conv2d"),         # conv2d faster
    ([20, 20, 20], [20, 20, 20], "conv2d"),         # a tie
])
def test_conv2d_is_kept_unless_matmul_is_faster_by_more_than_the_spread(conv2d, matmul, kept):
    pipe = _ScriptedConvs({"rollout": {"conv2d": [5, 5], "matmul": [9, 9]},
                           "update": {"conv2d": conv2d, "matmul": matmul}})
    made = choose_conv_math(pipe, pipe.body, ("rollout", "update"))
    # each part by its own phase: the rollout's matmul is slower whatever the update does
    assert made["rollout"]["kept"] == "conv2d" and made["update"]["kept"] == kept
    assert made["update"]["phase"] == "update" and made["rollout"]["phase"] == "policy"
    assert len(made["update"]["conv2d_ms"]) == len(made["update"]["matmul_ms"]) == CHOICE_ROUNDS
    # one untimed matmul iteration (its bases, its compile), then rounds of both, alternating
    assert pipe.kinds[0] == "matmul"
    rounds = [pipe.kinds[1 + 2 * r: 3 + 2 * r] for r in range(CHOICE_ROUNDS)]
    assert all(sorted(r) == ["conv2d", "matmul"] for r in rounds) and rounds[0] != rounds[1]
    assert pipe.state == 0 and pipe.restored == [0] * (1 + 2 * CHOICE_ROUNDS)
    text = describe_conv_math(made)
    assert text.startswith("convolutions: rollout conv2d (policy 5.0 ms per iteration conv2d, "
                           "9.0 matmul; medians of 5), update ")


@pytest.mark.slow
def test_stage_7_times_its_convolutions_and_each_part_runs_what_it_kept(monkeypatch):
    cfg = RunConfig(n_envs=8, n_steps=8, spec=SPEC, compile="eager")
    kept = {"rollout": "conv2d", "update": "matmul"}
    timed = []

    def scripted(pipe, body, parts, rounds=CHOICE_ROUNDS, phases=None):
        timed.append(body)
        return {part: {"kept": kept[part], "why": "timed", "phase": part,
                       "conv2d_ms": [1.0], "matmul_ms": [1.0]} for part in parts}

    monkeypatch.setattr("labkit.executors.choose_conv_math", scripted)
    with Pipeline(_stage(), cfg, "cpu") as pipe:
        assert pipe.math.chooses_conv_math and not pipe.math.conv_choices
        warmup(pipe)  # the executors are forced: the warmup times the convolutions alone
        assert timed == [pipe.agent.body]
        assert {p: m["kept"] for p, m in pipe.math.conv_choices.items()} == kept
        seen = []
        real_step, real_update = pipe._step, pipe.ppo_update
        pipe._step = lambda: (seen.append(("rollout", pipe.agent.body.conv_math)), real_step())
        pipe.ppo_update = lambda b: (seen.append(("update", pipe.agent.body.conv_math)),
                                     real_update(b))[1]
        pipe.iteration()
        assert set(seen) == {("rollout", "conv2d"), ("update", "matmul")}
    # the real timing, on a real pipeline: both parts decided, timed, five rounds each
    monkeypatch.undo()
    with Pipeline(_stage(), cfg, "cpu") as pipe:
        warmup(pipe)
        assert set(pipe.math.conv_choices) == {"rollout", "update"}
        assert all(m["why"] == "timed" and len(m["matmul_ms"]) == CHOICE_ROUNDS
                   and m["kept"] in ("conv2d", "matmul") for m in pipe.math.conv_choices.values())


@pytest.mark.parametrize("math", ["conv2d", "matmul"])
def test_forced_convolutions_are_kept_without_timing_in_any_stage(math, monkeypatch):
    monkeypatch.setattr("labkit.executors.choose_conv_math",
                        lambda *a, **k: pytest.fail("timed"))
    for stage in (_stage(), "async_logging"):
        cfg = RunConfig(n_envs=8, n_steps=8, spec=SPEC, compile="eager", conv_math=math)
        with Pipeline(stage, cfg, "cpu") as pipe:
            warmup(pipe)
            assert pipe.agent.body.conv_math == math
            assert pipe.math.conv_choices == {p: {"kept": math, "why": f"conv_math={math}"}
                                         for p in ("rollout", "update")}
            assert describe_conv_math(pipe.math.conv_choices) == (
                f"convolutions: rollout {math} (conv_math={math}), update {math} "
                f"(conv_math={math})")


def test_stages_that_do_not_choose_run_conv2d_and_bad_conv_math_is_refused():
    with Pipeline("async_logging", RunConfig(n_envs=8, n_steps=8, spec=SPEC), "cpu") as pipe:
        assert not pipe.math.chooses_conv_math and pipe.math.conv_choices == {}
        assert pipe.agent.body.conv_math == "conv2d"
    with pytest.raises(ValueError, match="conv_math must be one of auto, conv2d, matmul"):
        RunConfig(conv_math="fft")
    with pytest.raises(ValueError, match="conv_math=matmul needs the conv body"):
        RunConfig(model="attention", conv_math="matmul")
    with Pipeline(_stage(), RunConfig(n_envs=8, n_steps=8, spec=SPEC, model="attention"),
                  "cpu") as pipe:  # no conv body: nothing to time
        assert pipe.math.conv_body is None and not pipe.math.chooses_conv_math
    big = dataclasses.replace(SPEC, view=11)
    with Pipeline(_stage(), RunConfig(n_envs=8, n_steps=8, spec=big), "cpu") as pipe:
        assert not pipe.math.chooses_conv_math  # its dense matrices would not fit


@pytest.mark.slow
def test_a_resumed_run_keeps_its_convolutions_and_a_bad_record_is_refused(tmp_path,
                                                                           monkeypatch):
    made = {"rollout": {"kept": "conv2d", "why": "timed", "phase": "policy",
                        "conv2d_ms": [1.0] * 5, "matmul_ms": [2.0] * 5},
            "update": {"kept": "matmul", "why": "timed", "phase": "update",
                       "conv2d_ms": [3.0] * 5, "matmul_ms": [2.0] * 5}}
    built = []

    def build(cfg, device, group):
        built.append(Pipeline(_stage(), cfg.run, device, group=group))
        return built[-1]

    monkeypatch.setattr(train_module, "build_pipeline", build)
    monkeypatch.setattr("labkit.executors.choose_conv_math", lambda *a, **k: made)
    cfg = TrainConfig.flat(stage="fused_amp", device="cpu", n_envs=8, n_steps=16,
                           total_steps=4 * 128, seed=3, checkpoint_every=2, spec=SPEC,
                           compile="eager")
    summary = train(cfg, tmp_path / "run", progress=False, stop_after=2)
    assert summary["conv_choices"] == made
    assert "convolutions: rollout conv2d (policy 1.0 ms per iteration conv2d, 2.0 matmul" in \
        start_line(cfg, built[-1])
    path = tmp_path / "run" / checkpoint.FILENAME
    assert checkpoint.load(path)["conv_choices"] == made
    monkeypatch.setattr("labkit.executors.choose_conv_math",
                        lambda *a, **k: pytest.fail("timed again"))
    summary = train(None, tmp_path / "run", resume=True, progress=False)
    assert summary["complete"] and summary["conv_choices"] == made
    assert built[-1].math.conv_choices == made
    # a checkpoint written before the choice existed resumes conv2d, as it ran
    payload = checkpoint.load(path)
    payload.pop("format")
    payload.pop("conv_choices")
    checkpoint.save(path, payload)
    (tmp_path / "run" / "summary.json").unlink()
    train(None, tmp_path / "run", resume=True, progress=False)
    assert {p: m["kept"] for p, m in built[-1].math.conv_choices.items()} == \
        {"rollout": "conv2d", "update": "conv2d"}
    for bad in ({"update": made["update"]}, {**made, "update": {"kept": "fft", "why": "x"}},
                {**made, "update": {**made["update"], "matmul_ms": []}}, ["matmul"],
                {**made, "rollout": {**made["rollout"], "phase": "update"}}):
        checkpoint.save(path, {**payload, "conv_choices": bad})
        with pytest.raises(checkpoint.CheckpointError, match="field 'conv_choices' must be"):
            checkpoint.check(checkpoint.load(path), path)
