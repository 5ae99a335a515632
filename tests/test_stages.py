"""The ladder: every stage runs, computes the same thing, and syncs only where it should."""
import ast
import dataclasses
import gc
from pathlib import Path

import pytest
import torch

import labkit
from labkit.capture import tree_tensors, warmup
from labkit.config import BenchConfig, RunConfig
from labkit.device import has_bf16
from labkit.envs import ForageSpec
from labkit.executors import Compiled, CompiledIfFaster
from labkit.measure.bench import measure_stage, run_ladder
from labkit.measure.syncmeter import SyncMeter
from labkit.ppo import PPOConfig
from labkit.precision import Bf16, Fp32, ScaledPrecision, agrees, update_agreement
from labkit.stages import (
    DEFAULT_STAGE,
    REFERENCE_STAGE,
    STAGE_NAMES,
    STAGES,
    Pipeline,
    PipelineState,
    Stage,
    StageSkipped,
    default_stage,
    describe_choices,
    get_stage,
)
from labkit.timing import PHASES

CPU = torch.device("cpu")
SPEC = ForageSpec(episode_length=16)
RUN = RunConfig(n_envs=8, n_steps=16, spec=SPEC)
BENCH = BenchConfig(run=RUN, iterations=2, scaling_n_envs=(8, 16))


@pytest.fixture(scope="module")
def pipelines():
    made = {}
    for stage in STAGES:
        try:
            made[stage.index] = Pipeline(stage, RUN, CPU)
        except StageSkipped as err:
            made[stage.index] = err
    yield made
    for p in made.values():
        if isinstance(p, Pipeline):
            p.close()


# ---------------------------------------------------------------- the ladder's shape


def test_each_stage_differs_from_the_previous_by_its_lesson():
    assert [s.index for s in STAGES] == list(range(9))
    assert len({s.name for s in STAGES}) == 9
    for prev, cur in zip(STAGES, STAGES[1:]):
        changed = {k for k, v in cur.components().items() if prev.components()[k] != v}
        # stage 8 captures both steps, and a captured optimizer step must be capturable;
        # stage 7, the production stage, also keeps compile only where it pays (stage 5
        # always compiles: it teaches compile)
        assert 1 <= len(changed) <= 2 or (cur.name, changed) in (
            ("cuda_graphs", {"optimizer", "rollout_executor", "update_executor"}),
            ("fused_amp", {"optimizer", "precision", "rollout_executor", "update_executor"})), \
            (cur.name, changed)
    assert isinstance(get_stage("fused_amp").update_executor, CompiledIfFaster)
    assert type(get_stage("compile_warmup").update_executor) is Compiled


def test_a_stage_holds_components_only():
    for f in dataclasses.fields(Stage):
        assert f.type not in (bool, "bool"), f.name
    for s in STAGES:
        for slot, part in s.components().items():
            assert not isinstance(part, bool), (s.name, slot)


def test_each_stage_names_the_chapter_that_teaches_it():
    """Stage i is taught in chapter i + 1, a notebook that exists; the chapter is no slot."""
    notebooks = Path(__file__).parents[1] / "notebooks"
    for s in STAGES:
        assert s.chapter.startswith(f"{s.index + 1:02d}_"), (s.name, s.chapter)
        assert (notebooks / f"{s.chapter}.ipynb").is_file(), s.chapter
        assert "chapter" not in s.components()


def test_slots_hold_what_their_protocols_ask_for():
    """Each optimizer, precision and executor in the ladder offers its slot's Protocol; a
    value that does not is told apart (the runtime check can fail)."""
    from labkit.executors import Executor
    from labkit.stages import OptimizerComponent, PrecisionComponent

    protocols = {"optimizer": OptimizerComponent, "precision": PrecisionComponent,
                 "rollout_executor": Executor, "update_executor": Executor}
    for s in STAGES:
        for slot, protocol in protocols.items():
            assert isinstance(getattr(s, slot), protocol), (s.name, slot)
    assert not isinstance(STAGES[7].precision, Executor)
    assert not isinstance(STAGES[5].rollout_executor, OptimizerComponent)


def _recorded_ladders(device_type: str) -> list[Path]:
    return sorted((Path(__file__).parents[1] / "results").glob(f"ladder_{device_type}_*.json"))


def _fastest_recorded(path: Path) -> str:
    import json

    rows = [r for r in json.loads(path.read_text())["ladder"] if r["status"] == "ok"]
    return max(rows, key=lambda r: r["sps"])["name"]


def _compiles(row: dict) -> bool:
    """Whether a ladder row's stage compiles before or in its first iteration (a choosing
    stage compiles to time its choices, whatever it keeps)."""
    return bool(row.get("executor_choices")) or any(
        kind != "eager" for kind in (row.get("model_math") or {}).values())


def test_the_cpu_default_stage_trains_the_default_run_soonest_by_the_recorded_cpu_ladder():
    """``train`` with no stage runs ``DEFAULT_STAGE['cpu']`` at RunConfig's N and T for
    TrainConfig's total steps, so the ladder that decides it is recorded there
    (``results/ladder_cpu_train.json``), and what decides is the whole run: the seconds before
    the first iteration (the row's warmup and the timing of its choices) plus the steps over the
    rate. No stage may train that run measurably sooner, its slowest whole run shorter than the
    default's fastest (stages whose ranges overlap are tied: a re-record may order them either
    way); of the tied, the default is one that starts without compiling where one does, and no
    such stage runs measurably more steps a second. The ladder's set-up is measured in a process
    that has compiled before, so it understates a fresh process's: the whole-process timings
    (test below) are the sharper test."""
    import json

    from labkit.app.run import TrainConfig

    path = Path(__file__).parents[1] / "results" / "ladder_cpu_train.json"
    result = json.loads(path.read_text())
    run = result["config"]["run"]
    assert (run["n_envs"], run["n_steps"]) == (RunConfig().n_envs, RunConfig().n_steps), (
        f"{path.name} was recorded at N={run['n_envs']}, T={run['n_steps']}, not at train's "
        "defaults: re-record it (the README says how)")
    cfg = TrainConfig()
    steps = cfg.n_iterations * cfg.run.batch_size

    def whole_run_s(row: dict) -> tuple[float, float]:
        start = row["warmup_s"] + (row.get("choose_s") or 0.0)
        return start + steps / max(row["sps_spread"]), start + steps / min(row["sps_spread"])

    rows = {r["name"]: r for r in result["ladder"] if r["status"] == "ok"}
    spans = {name: whole_run_s(r) for name, r in rows.items()}
    mine = DEFAULT_STAGE["cpu"]
    soonest, slowest = spans[mine]
    sooner = [name for name, (_, other_slowest) in spans.items() if other_slowest < soonest]
    assert not sooner, (
        f"{path.name} records {sooner} as training train's default run sooner than "
        f"labkit.stages.DEFAULT_STAGE['cpu'] ({mine!r}) beyond both ranges: a re-record changed "
        "the order, so update the constant (and the README, which names the default)")
    tied = [name for name, (fastest, _) in spans.items() if fastest <= slowest]
    plain = [name for name in tied if not _compiles(rows[name])]
    if plain:
        assert mine in plain, f"{mine!r} compiles, but {plain} tie with it and do not"
        faster = [name for name in plain
                  if min(rows[name]["sps_spread"]) > max(rows[mine]["sps_spread"])]
        assert not faster, f"{faster} start without compiling and run faster than {mine!r}"
    assert default_stage(CPU) == DEFAULT_STAGE["cpu"]


@pytest.mark.parametrize("name", ["train_default_cpu.json", "train_default_cpu_fresh.json"])
def test_the_cpu_default_stage_finishes_the_default_run_first_as_a_whole_process(name):
    """``scripts/train_default_ab.py`` times ``train``'s default run as whole processes, stage
    by stage in turn (with inductor's cache as a user's second run finds it, and empty): the
    default's median is the shortest, and no stage's slowest run beat the default's fastest."""
    import json

    path = Path(__file__).parents[1] / "results" / name
    stages = json.loads(path.read_text())["stages"]
    mine = stages[DEFAULT_STAGE["cpu"]]
    for stage, found in stages.items():
        assert found["process_s_median"] >= mine["process_s_median"], (stage, found, mine)
        assert max(found["process_s_spread"]) >= min(mine["process_s_spread"]), (stage, found)


@pytest.mark.parametrize("path", _recorded_ladders("cuda") or [None],
                         ids=lambda p: p.name if p else "none recorded")
def test_the_cuda_default_stage_is_the_fastest_of_a_recorded_cuda_ladder(path):
    # where the fastest cannot run (a GPU without bf16), the default is a stage that can
    reference = get_stage(REFERENCE_STAGE)
    assert reference.skip_reason(CPU) is None and "bf16" not in {
        need for part in reference.components().values() for need in getattr(part, "requires", ())}
    if path is None:
        pytest.skip("no CUDA ladder recorded in results/ (ladder_cuda_*.json)")
    fastest = _fastest_recorded(path)
    assert DEFAULT_STAGE["cuda"] == fastest, (
        f"{path.name} records {fastest} as the fastest stage on CUDA, but "
        f"labkit.stages.DEFAULT_STAGE['cuda'] is {DEFAULT_STAGE['cuda']!r}: update the constant")


def test_defaults_and_choices_are_named_once():
    from labkit.config import PROFILES, default_profile

    assert set(DEFAULT_STAGE) == {"cpu", "cuda"}  # the device types resolve_device allows
    assert default_stage(CPU) == DEFAULT_STAGE["cpu"]
    if torch.cuda.is_available():  # on a GPU without bf16, the stage that runs on every GPU
        cuda = torch.device("cuda")
        expected = REFERENCE_STAGE if get_stage(DEFAULT_STAGE["cuda"]).skip_reason(cuda) \
            else DEFAULT_STAGE["cuda"]
        assert default_stage(cuda) == expected
    assert (default_profile(CPU), default_profile(torch.device("cuda"))) == ("quick", "full")
    assert {"quick", "full"} <= set(PROFILES)
    choices = describe_choices()
    assert choices.startswith(f"0-{len(STAGES) - 1} or a name (")
    assert all(name in choices for name in STAGE_NAMES)


def _branches_on_a_stage(tree: ast.AST) -> list[int]:
    """Lines outside stages.py that read stage.index / stage.<flag> in a condition."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Compare, ast.BoolOp)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and sub.attr in (
                        "index", "compile", "fused_amp", "graphs") \
                        and "stage" in ast.unparse(sub.value).lower():
                    lines.append(sub.lineno)
    return sorted(set(lines))


def test_nothing_outside_stages_py_branches_on_the_stage():
    root = Path(labkit.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        if path.name != "stages.py":
            lines = _branches_on_a_stage(ast.parse(path.read_text()))
            if lines:
                found[str(path.relative_to(root))] = lines
    assert found == {}
    planted = ast.parse("if stage.index >= 3:\n    pass\nx = 1 if cfg.stage.compile else 2\n")
    assert _branches_on_a_stage(planted) == [1, 3]  # the check itself can fail


def test_skip_reasons_come_from_the_components():
    assert STAGES[8].skip_reason(CPU) == "needs CUDA"
    assert all(s.skip_reason(CPU) is None for s in STAGES[:8])
    custom = dataclasses.replace(STAGES[3], rollout_executor=STAGES[8].rollout_executor)
    assert custom.skip_reason(CPU) == "needs CUDA"
    assert [s.name for s in STAGES if s.scales] == [s.name for s in STAGES[3:]]


def test_one_refusal_path_for_device_and_memory():
    """``Stage.check`` is the one refusal: a device the stage cannot use and a run that cannot
    fit both raise StageSkipped (a ValueError, so the CLI prints one line), with its cause; it
    pickles (torchrun and record pass errors between processes)."""
    import pickle

    with pytest.raises(StageSkipped) as err:
        STAGES[8].check(CPU, RUN)
    assert (err.value.cause, err.value.reason) == ("device", "needs CUDA")
    assert isinstance(err.value, ValueError) and "'cuda_graphs' cannot run on cpu" in str(err.value)
    huge = RunConfig(n_envs=2**24, n_steps=32)
    with pytest.raises(StageSkipped, match="needs about .* GiB on cpu") as err:
        STAGES[3].check(CPU, huge)
    assert err.value.cause == "memory"
    copy = pickle.loads(pickle.dumps(err.value))
    assert (str(copy), copy.cause, copy.reason) == (str(err.value), "memory", err.value.reason)
    assert STAGES[3].check(CPU, RUN) is None


def test_get_stage_errors_name_the_allowed_values():
    assert get_stage(3).name == get_stage("batched_ops").name == get_stage("3").name
    assert get_stage(STAGES[4]) is STAGES[4]
    for bad in ("warp_speed", True, 9, -1, 3.0, ""):
        with pytest.raises(ValueError, match="stage must be one of"):
            get_stage(bad)


# ---------------------------------------------------------------- every stage runs


@pytest.mark.slow
def test_every_stage_runs_an_iteration_on_cpu_and_graphs_say_why_not(pipelines):
    for index, p in pipelines.items():
        if index == 8:
            assert isinstance(p, StageSkipped) and "needs CUDA" in str(p)
            continue
        before = [t.clone() for t in p.agent.parameters()]
        out = p.iteration()
        assert out["episodes"] == RUN.n_envs  # one 16-step episode per env in 16 steps
        changed = any(not torch.equal(a, b) for a, b in zip(before, p.agent.parameters()))
        assert changed, STAGES[index].name


@pytest.mark.slow
def test_no_component_is_patched_on_its_instance(pipelines):
    """The pipeline wraps functions where it calls them: no env or collector has an instance
    attribute standing in for one of its class's methods (``env.step = torch.compile(...)``)."""
    for index, p in pipelines.items():
        if isinstance(p, Pipeline):
            for obj in (p.collector.env, p.collector):
                shadowed = [k for k in vars(obj) if callable(getattr(type(obj), k, None))]
                assert shadowed == [], (STAGES[index].name, type(obj).__name__, shadowed)


def test_pipeline_accepts_names_and_device_strings():
    with Pipeline("3", RUN, "cpu") as p:
        assert p.stage is STAGES[3] and p.device == CPU
    with pytest.raises(TypeError, match="cfg must be a RunConfig"):
        Pipeline(3, BENCH, CPU)
    with pytest.raises(ValueError, match="device must be one of"):
        Pipeline(3, RUN, "tpu")


def test_skipped_stage_is_reported_not_replaced():
    row = measure_stage(get_stage("cuda_graphs"), BENCH, CPU)
    assert row["status"] == "skipped: needs CUDA"
    assert "sps" not in row


def test_a_failing_stage_is_reported_as_an_error(monkeypatch):
    import labkit.measure.bench

    def boom(pipeline):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(labkit.measure.bench, "warmup", boom)
    row = measure_stage(get_stage("batched_ops"), BENCH, CPU)
    assert row["status"] == "error: RuntimeError: capture failed"
    assert "sps" not in row


# ---------------------------------------------------------------- parity


@pytest.mark.inductor
@pytest.mark.slow
def test_stages_collect_identical_rollouts():
    """Same seed -> same actions and env dynamics on every fp32 stage (bit-exact), compiled
    policy included; values agree to float32 rounding."""
    rollouts = {}
    fused = RUN.replace(compile_unit="step")  # stages 5-7's whole step compiled: one region
    for index, cfg in [*((i, RUN) for i in range(8)), *((i, fused) for i in (5, 6, 7))]:
        with Pipeline(STAGES[index], cfg, CPU) as p:
            rollouts[index, cfg.compile_unit] = {k: v.clone()
                                                 for k, v in p.collect().tensors().items()}
    ref = rollouts[3, "model"]
    for index, r in rollouts.items():
        for key in ("obs", "actions", "rewards", "dones"):
            assert torch.equal(r[key], ref[key]), (index, key)
        torch.testing.assert_close(r["values"], ref["values"], rtol=1e-5, atol=1e-6)
    assert ref["rewards"].abs().sum() > 0  # food and poison were eaten: respawns ran


@pytest.mark.parametrize("index", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 3,
                                   pytest.param(7, marks=pytest.mark.slow)])
def test_observations_stored_as_uint8_change_nothing_a_stage_computes(index):
    """``obs_storage="uint8"``: the rollout keeps its observations in a quarter of the bytes,
    and, observations being 0 or 1, every stored value, statistic and parameter after two
    iterations is what float32 storage gives, bit for bit (stage 7: compiled, and bf16 where
    the CPU has it)."""
    seen = {}
    for storage in ("float32", "uint8"):
        with Pipeline(STAGES[index], RUN.replace(obs_storage=storage), CPU) as p:
            runs = []
            for _ in range(2):
                stats = p.learn(p.rollout())
                obs = p.collector.storage.obs
                runs.append((obs.float().clone(), {k: float(v) for k, v in stats.items()},
                             [t.detach().clone() for t in p.agent.parameters()]))
            assert obs.dtype == getattr(torch, storage)
        seen[storage] = runs
    for (obs_a, stats_a, params_a), (obs_b, stats_b, params_b) in zip(*seen.values()):
        assert torch.equal(obs_a, obs_b) and stats_a == stats_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    with pytest.raises(ValueError, match="obs_storage must be one of float32, uint8; got 'int8'"):
        RUN.replace(obs_storage="int8")


@pytest.mark.parametrize("index, marks", [
    (4, {"policy", "env", "metrics"}),  # eager: compile_unit says nothing
    # (slow: each compiles the step, about 3 s)
    pytest.param(5, {"step", "metrics"}, marks=pytest.mark.slow),  # host-reading statistics:
    pytest.param(6, {"step"}, marks=pytest.mark.slow)])  # outside; device statistics: inside
def test_a_fused_rollout_step_runs_as_one_region(index, marks):
    """compile_unit="step": the step past the sampling noise is one compiled region
    (fullgraph: a graph break would raise), marked as one ``step`` phase; stage 6's episode
    statistics are updated inside it, stage 5's eager ones after it; an eager stage is as
    it was. The rollout is the model unit's, bit for bit, and the warm-up's choice is timed
    in the ``step`` phase."""
    fused = RUN.replace(compile_unit="step")
    with Pipeline(STAGES[index], RUN, CPU) as ref, Pipeline(STAGES[index], fused, CPU) as p:
        assert (p.collector.region is not None) == (index >= 5)
        assert p.math.phases["rollout"] == ("step" if index >= 5 else "policy")
        p.clock.start()
        a = p.collect()
        assert set(p.clock.stop()) == marks | {"io"}
        b = ref.collect()
        for key in ("obs", "actions", "rewards", "dones"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
        assert p.metrics.summary() == ref.metrics.summary()
    with pytest.raises(ValueError, match="compile_unit must be one of model, step"):
        RUN.replace(compile_unit="region")


@pytest.mark.inductor
@pytest.mark.slow
def test_a_fused_rollout_step_launches_fewer_kernels():
    """What compile_unit="step" exists for: on a GPU the eager ops around the compiled policy
    (sampling, storage writes, the env step, the statistics) are one launch each. Counted as
    a GPU would launch them (labkit.measure.profiling.LaunchCount: inductor's generated
    kernels, and the aten ops outside them), stages 5 and 6 launch fewer kernels a step with
    the whole step compiled, and stage 6's device statistics then launch nothing of their own
    (its step launches no more than stage 5's, where they had added launches)."""
    from labkit.measure.profiling import LaunchCount

    per_step = {}
    for unit in ("model", "step"):
        for index in (5, 6):
            with Pipeline(STAGES[index], RUN.replace(compile_unit=unit), CPU) as p:
                warmup(p)
                with LaunchCount() as launched:
                    p.collect()
            per_step[index, unit] = launched.total / RUN.n_steps
    assert per_step[5, "step"] < per_step[5, "model"], per_step
    assert per_step[6, "step"] < per_step[6, "model"], per_step
    assert per_step[6, "model"] > per_step[5, "model"], per_step  # the statistics' own ops
    assert per_step[6, "step"] <= per_step[5, "step"], per_step


def _update_result(index: int, batch, device: torch.device = CPU) -> list[torch.Tensor]:
    with Pipeline(STAGES[index], RUN, device) as p:
        p.generator.manual_seed(123)
        p.ppo_update(batch)
        return [t.detach().clone() for t in p.agent.parameters()]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("cpu_bf16", ["AMX", None], ids=["bf16-cpu", "no-bf16-cpu"])
def test_update_of_every_stage_matches_stage_0(monkeypatch, cpu_bf16):
    """Same batch, same initial parameters -> same parameters after the update.
    Eager fp32 stages agree to float32 rounding; compiled ones reorder float ops (rtol 1e-4);
    stage 7 runs bf16 on a CPU with bf16 instructions (labkit.device.cpu_bf16, forced both
    ways here), and then meets the bf16 criterion (the update's direction and size:
    labkit.precision.AGREEMENT)."""
    monkeypatch.setattr(labkit.device, "cpu_bf16", lambda: cpu_bf16)
    monkeypatch.setattr(labkit.precision, "cpu_bf16", lambda: cpu_bf16)
    with Pipeline(STAGES[3], RUN, CPU) as p:
        batch = p.rollout()
        start = [t.detach().clone() for t in p.agent.parameters()]
    ref = _update_result(0, batch)
    for index in range(1, 8):
        with Pipeline(STAGES[index], RUN, CPU) as p:
            precision = p.precision.name
        assert precision == ("bf16" if index == 7 and has_bf16(CPU) else "fp32"), index
        after = _update_result(index, batch)
        if precision == "bf16":
            agreement = update_agreement(start, ref, after)
            assert agrees(agreement) and agreement["relative_l2"] > 0, agreement
            continue
        for a, b in zip(after, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.inductor
@pytest.mark.parametrize("index, device", [
    pytest.param(0, "cpu", marks=pytest.mark.slow),  # stage 0's per-env loop: ~1 s
    (1, "cpu"), (3, "cpu"),
    pytest.param(5, "cpu", marks=pytest.mark.slow),  # inductor compiles
    pytest.param(7, "cpu", marks=pytest.mark.slow),  # inductor, and its warmup times choices
    pytest.param(8, "cuda", marks=[needs_cuda, pytest.mark.cuda])])
def test_warmup_then_restore_computes_what_a_fresh_pipeline_computes(index, device):
    """warmup() runs an iteration and restores the state in place (the same restore a graph
    capture does after its warmup calls): the next iteration is bit-identical to a fresh
    pipeline's, and the parameters keep their storage. Stage 8 captures its graphs inside the
    warmup, so its replays must restore and compute the same."""
    if STAGES[index].skip_reason(torch.device(device)):
        pytest.skip(STAGES[index].skip_reason(torch.device(device)))
    with Pipeline(STAGES[index], RUN, device) as fresh, \
            Pipeline(STAGES[index], RUN, device) as p:
        storage = [t.data_ptr() for t in p.agent.parameters()]
        assert warmup(p) > 0
        assert [t.data_ptr() for t in p.agent.parameters()] == storage
        fresh.math.keep_choices(p.math.executor_choices)  # what stage 7's warmup chose, untimed
        if p.math.conv_choices:
            fresh.math.keep_conv_math(p.math.conv_choices)
        a, b = fresh.iteration(), p.iteration()
        assert {k: float(v) for k, v in a.items()} == {k: float(v) for k, v in b.items()}
        for x, y in zip(tree_tensors(fresh.state_dict()), tree_tensors(p.state_dict())):
            assert torch.equal(x, y)
        p.rewind()
        assert p.global_step == 0 and p.iteration_index == 0
        assert {k: float(v) for k, v in p.iteration().items()} == \
            {k: float(v) for k, v in a.items()}


@dataclasses.dataclass(frozen=True, repr=False)
class _Fp16Overflowing(Fp32):
    """fp16 with a GradScaler whose first scale overflows fp16's gradients: each step it
    skips halves the scale, so an iteration changes the scaler's state."""

    def __call__(self, device: torch.device) -> ScaledPrecision:
        return ScaledPrecision("fp16", device.type, init_scale=2.0**40)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda,
                                                                        pytest.mark.cuda])])
def test_warmup_and_checkpoints_keep_an_fp16_scalers_state(device):
    """The precision's own state is in the pipeline's snapshot: an iteration that warmup undoes
    leaves a GradScaler's scale as it was (a GPU without bf16 runs stage 7 in fp16 with one),
    and a saved state carries it; a state saved before it was kept still loads."""
    from labkit.device import deterministic

    stage = dataclasses.replace(STAGES[4], precision=_Fp16Overflowing())
    with deterministic(), Pipeline(stage, RUN, device) as fresh, \
            Pipeline(stage, RUN, device) as p:
        def scaler_state():
            return {k: v.item() for k, v in p.precision.state_dict().items()}

        before = scaler_state()
        assert before == {"scale": 2.0**40, "growth_tracker": 0}
        with SyncMeter() as meter:
            p.state_dict()
        assert meter.host_reads == 0, meter.counts  # the snapshot reads nothing on the host
        warmup(p)
        assert scaler_state() == before
        a, b = fresh.iteration(), p.iteration()
        for key in a:  # a skipped step's grad norm is NaN in both
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True)
        after = scaler_state()
        assert after["scale"] < before["scale"]  # the iteration skipped overflowing steps
        saved = PipelineState.from_dict(p.state_dict().to_dict())
        assert {k: v.item() for k, v in saved.precision.items()} == after
        p.rewind()
        assert scaler_state() == before
        p.load_state_dict(saved)
        assert scaler_state() == after
        old = {k: v for k, v in saved.to_dict().items() if k != "precision"}
        p.load_state_dict(PipelineState.from_dict(old))  # no precision state: left as it is
        assert scaler_state() == after


def test_a_checkpoint_with_a_bad_precision_state_is_refused_naming_the_field(tmp_path):
    from labkit.app import checkpoint
    from labkit.app.train import TrainConfig, train

    cfg = TrainConfig.flat(stage="async_logging", device="cpu", n_envs=8, n_steps=16,
                           total_steps=2 * 128, seed=3, spec=SPEC)
    train(cfg, tmp_path / "run", progress=False)
    path = tmp_path / "run" / checkpoint.FILENAME
    payload = checkpoint.load(path)
    assert payload["state"]["precision"] == {}  # fp32: nothing to keep
    payload.pop("format")
    scale, tracker = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    for bad in ({"scale": torch.tensor(float("nan")), "growth_tracker": tracker},
                {"scale": torch.tensor(-1.0), "growth_tracker": tracker},
                {"scale": scale, "growth_tracker": torch.tensor(-1, dtype=torch.int32)},
                {"scale": torch.tensor(1.0, dtype=torch.float64), "growth_tracker": tracker},
                {"scale": 1.0, "growth_tracker": 0}, {"scale": scale}, [1.0]):
        checkpoint.save(path, {**payload, "state": {**payload["state"], "precision": bad}})
        with pytest.raises(checkpoint.CheckpointError, match="field 'state.precision' must"):
            checkpoint.check(checkpoint.load(path), path)
    good = {"scale": scale, "growth_tracker": tracker}
    checkpoint.save(path, {**payload, "state": {**payload["state"], "precision": good}})
    checkpoint.check(checkpoint.load(path), path)
    state = {k: v for k, v in payload["state"].items() if k != "precision"}  # an older run's
    checkpoint.save(path, {**payload, "state": state})
    checkpoint.check(checkpoint.load(path), path)


def test_config_errors_surface_before_a_pipeline_is_built():
    with pytest.raises(ValueError, match="n_minibatches"):
        RunConfig(n_envs=8, n_steps=16, ppo=PPOConfig(n_minibatches=7))
    with pytest.raises(ValueError, match="n_minibatches"):  # 1 env x 2 steps: no 4 minibatches
        BenchConfig(run=RunConfig(n_envs=8, n_steps=2), scaling_n_envs=(1,))


# ---------------------------------------------------------------- host reads


def _rollout_reads_per_step(p: Pipeline) -> float:
    with SyncMeter() as m:
        p.collect()
    return m.host_reads / RUN.n_steps


@pytest.mark.slow
def test_host_reads_in_the_rollout_step(pipelines):
    reads = {i: _rollout_reads_per_step(p) for i, p in pipelines.items()
             if isinstance(p, Pipeline)}
    assert reads[0] >= RUN.n_envs  # an .item() per env
    assert reads[2] > RUN.n_envs  # per-env conditionals on device tensors
    assert reads[3] >= 1  # .item() logging and eager metrics every step
    assert reads[4] >= 1  # logging is async now, metrics still eager
    assert reads[6] == 0 and reads[7] == 0


# ---------------------------------------------------------------- the harness


@pytest.mark.slow  # compiles stage 6's policy (and, for "step", the whole step)
@pytest.mark.parametrize("unit, rollout", [("model", {"policy", "env"}), ("step", {"step"})])
def test_phases_and_ceiling_are_measured(unit, rollout):
    """The phases of a row and its compute ceiling (the model work alone: with the whole step
    compiled, the policy as the model unit runs it)."""
    bench = dataclasses.replace(BENCH, run=RUN.replace(compile_unit=unit))
    row = measure_stage(get_stage("gpu_metrics"), bench, CPU)
    assert row["status"] == "ok"
    assert set(row["phase_ms"]) >= {*rollout, "io", "metrics", "gae", "update"}
    assert set(row["phase_ms"]) <= set(PHASES)
    total_s = sum(row["phase_ms"].values()) / 1e3
    assert abs(total_s - row["marked_iteration_s"]) <= 0.1 * row["marked_iteration_s"]
    assert row["ceiling_sps"] > 0 and 0 < row["frac_of_ceiling"]
    assert row["marks_per_iter"] >= (len(rollout) + 1) * RUN.n_steps  # and io, a mark each step
    assert 0 <= row["marks_overhead"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("cpu_bf16", ["AVX-512 BF16", None])
def test_a_row_and_the_ladder_say_why_a_precision_was_chosen(monkeypatch, cpu_bf16):
    """Stage 7's precision component chooses on the device and says why, in its ladder row;
    the fp32 stages choose nothing. ``format_ladder`` prints each reason once, under the
    table."""
    from labkit.measure.bench import _build, format_ladder

    # stage 7 with and without bf16 adds compiled variants of the agent's call: the tests
    # before it in this process (every stage, both conv maths, both precisions) already hold
    # up to dynamo's recompile limit of them (stage 7 then ran eagerly and warmup failed)
    torch._dynamo.reset()
    monkeypatch.setattr(labkit.device, "cpu_bf16", lambda: cpu_bf16)
    monkeypatch.setattr(labkit.precision, "cpu_bf16", lambda: cpu_bf16)
    rows = []
    for index in (4, 7):
        row = {"stage": index, "name": STAGES[index].name, "status": "ok", "n_envs": 8,
               "sps": 1.0, "ceiling_sps": 2.0}
        with _build(STAGES[index], RUN, CPU, row):
            rows.append(row)
    assert "precision_why" not in rows[0] and rows[0]["precision"] == "fp32"
    assert rows[1]["precision"] == ("bf16" if cpu_bf16 else "fp32")
    assert rows[1]["precision_why"].startswith(
        f"this CPU has {cpu_bf16}" if cpu_bf16 else "this CPU has no bf16 instructions")
    meta = {"device_name": "a CPU", "device": "cpu", "torch": torch.__version__}
    text = format_ladder({"meta": meta, "peak_flops": 1e9, "peak_dtype": "fp32",
                          "ladder": rows + [{**rows[1], "stage": 8}]})
    said = [line for line in text.splitlines() if line.startswith("precision ")]
    assert said == [f"precision {rows[1]['precision']}: {rows[1]['precision_why']}"]


@pytest.mark.slow
def test_building_a_pipeline_leaves_the_readers_compiled_functions_alone():
    """No global dynamo reset: a function the reader compiled before stays compiled."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
    fn(torch.ones(3))
    with Pipeline("compile_warmup", RUN, CPU) as p:
        p.iteration()
    fn(torch.ones(3))
    assert len(compiles) == 1


def test_each_group_of_a_sweep_starts_from_empty_compile_caches(monkeypatch):
    """Between groups (the ladder at its N, then each N of the sweep) no pipeline is alive, and
    the compiled code of the groups before is dropped: one code object holds every compiled
    version of a function, and a whole sweep passed dynamo's recompile limit."""
    from labkit.measure import bench

    events = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(bench, "measure_stages",
                        lambda stages, c, *a, **k: events.append(c.run.n_envs) or [])
    todo = bench.ladder_plan(BENCH, CPU, [STAGES[3], STAGES[7]])
    bench._measure_plan(todo, BENCH, CPU, {"peak_flops": 1e9, "lap_cost_s": 0.0},
                        {"ladder": [], "scaling": []}, None, None)
    assert events == ["reset", 8, "reset", 8, "reset", 16]


@pytest.mark.inductor
@pytest.mark.slow
def test_ladder_twice_does_not_grow_memory():
    """RSS after a second ladder stays within 64 MiB of the first (allocator noise,
    compile caches); a leak per stage (loggers, threads, buffers) would show."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    stages = [STAGES[i] for i in (1, 3, 4, 6, 7)]
    run_ladder(BENCH, CPU, stages=stages)
    gc.collect()
    first = proc.memory_info().rss
    result = run_ladder(BENCH, CPU, stages=stages)
    gc.collect()
    second = proc.memory_info().rss
    assert second - first < 64 * 2**20, (first, second)
    assert all(r["status"] == "ok" for r in result["ladder"])
    # the kernels a GPU would launch per minibatch step, compiled regions' own included: the
    # compiled loss (stage 6 against 4) and the fused Adam (7 against 6) each remove some
    per_mb = {r["stage"]: r["kernels_per_minibatch"] for r in result["ladder"]}
    assert per_mb[4] > per_mb[6] > per_mb[7] > 0, per_mb
    assert any(k.startswith("inductor::") for k in result["ladder"][-1]["kernels_top"]["update"])
    assert all(r["kernels_per_step"] > 0 for r in result["ladder"])
    assert [r["n_envs"] for r in result["scaling"]] == [8] * 4 + [16] * 4  # N by N


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["compile_warmup", "fused_amp"])
def test_rebuilding_compiled_pipelines_does_not_grow_memory(stage, tiny_run):
    """Building a pipeline used to reset dynamo and compile afresh each time (memory grew with
    every rebuild); compiled code is now shared by every pipeline of the same shapes."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    rss = []
    for _ in range(10):
        with Pipeline(stage, tiny_run, "cpu") as p:
            p.iteration()
        del p
        gc.collect()
        rss.append(proc.memory_info().rss)
    assert (rss[-1] - rss[3]) / 6 < 0.5 * 2**20, [r / 2**20 for r in rss]


# ---------------------------------------------------------------- CUDA only


def _update_from(stage, batch, device):
    """(start, after) parameters of one update of ``stage`` on ``batch``."""
    with Pipeline(stage, RUN, device) as p:
        start = [t.detach().clone() for t in p.agent.parameters()]
        p.generator.manual_seed(123)
        p.ppo_update(batch)
        return start, [t.detach().clone() for t in p.agent.parameters()]


def test_a_bf16_update_goes_where_the_fp32_one_goes():
    """bf16 changes single parameters by as much as Adam's step, so the criterion is the
    update's direction and size (labkit.precision.AGREEMENT); here bf16 autocast on the CPU,
    eagerly: the same criterion stage 7 meets against stage 4 on a bf16 GPU."""
    with Pipeline(STAGES[3], RUN, CPU) as p:
        batch = p.rollout()
    start, fp32 = _update_from(STAGES[4], batch, CPU)
    start2, bf16 = _update_from(dataclasses.replace(STAGES[4], precision=Bf16()), batch, CPU)
    assert all(torch.equal(a, b) for a, b in zip(start, start2))
    agreement = update_agreement(start, fp32, bf16)
    assert agrees(agreement), agreement
    assert agreement["relative_l2"] > 0  # bf16 really ran: not the fp32 update again
    assert not agrees(update_agreement(start, fp32, [2 * b - a for a, b in zip(start, bf16)]))


@needs_cuda
@pytest.mark.cuda
def test_cuda_amp_and_graphed_updates_match_fp32_within_tolerance():
    """Stage 7's bf16 update goes where stage 4's fp32 one goes (direction and size:
    labkit.precision.AGREEMENT); the graphed update replays the same bf16 math, so it matches
    stage 7 to float32 rounding."""
    cuda = torch.device("cuda")
    if STAGES[8].skip_reason(cuda):
        pytest.skip(STAGES[8].skip_reason(cuda))
    with Pipeline(STAGES[3], RUN, cuda) as p:
        batch = p.rollout()
    (start, fp32), (_, amp), (_, graphed) = (_update_from(STAGES[i], batch, cuda)
                                             for i in (4, 7, 8))
    agreement = update_agreement(start, fp32, amp)
    assert agrees(agreement), agreement
    for b, c in zip(amp, graphed):
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.cuda
def test_cuda_graphed_rollout_and_update_match_eager_and_read_nothing():
    """Stage 8 captures a graph for its rollout step and for its minibatch step: two rollouts
    in a row are bit-exact with stage 7's, and a replayed rollout and a replayed update make
    no host read and no CUDA sync."""
    from labkit.capture import CapturedStep

    cuda = torch.device("cuda")
    if STAGES[8].skip_reason(cuda):
        pytest.skip(STAGES[8].skip_reason(cuda))
    with Pipeline(STAGES[7], RUN, cuda) as eager, Pipeline(STAGES[8], RUN, cuda) as graphed:
        for _ in range(2):  # the first captures; the second replays from where it left off
            a = {k: v.clone() for k, v in eager.collect().tensors().items()}
            b = {k: v.clone() for k, v in graphed.collect().tensors().items()}
            for key in ("obs", "actions", "rewards", "dones"):
                assert torch.equal(a[key], b[key]), key
        rollout_step, update_step = graphed._step, graphed.ppo_update.keywords["step"]
        assert isinstance(rollout_step, CapturedStep) and rollout_step.graph is not None
        with SyncMeter(cuda_debug=True) as m:
            r = graphed.collect()
        assert (m.host_reads, m.cuda_syncs) == (0, 0), m.cuda_sync_sites
        assert r.actions.min() >= 0 and r.actions.max() < 5
        assert r.dones[0].eq(1).all()  # 16-step episodes, T=16: each rollout starts a new one
        batch = graphed.rollout()
        graphed.ppo_update(batch)  # captures the minibatch step
        assert isinstance(update_step, CapturedStep) and update_step.graph is not None
        with SyncMeter(cuda_debug=True) as m:
            graphed.ppo_update(batch)
        assert (m.host_reads, m.cuda_syncs) == (0, 0), m.cuda_sync_sites


@needs_cuda
@pytest.mark.cuda
def test_cuda_two_graphed_updates_follow_stage_7_with_the_lr_annealed():
    """Two learn() calls in a row on the same batch: the LR, a device tensor the captured
    optimizer step reads, is annealed between the replays, and the parameters follow stage 7's
    to float32 rounding."""
    cuda = torch.device("cuda")
    if STAGES[8].skip_reason(cuda):
        pytest.skip(STAGES[8].skip_reason(cuda))
    with Pipeline(STAGES[3], RUN, cuda) as p:
        batch = p.rollout()
    params, lrs = [], []
    for stage in (STAGES[7], STAGES[8]):
        with Pipeline(stage, RUN, cuda) as p:
            p.generator.manual_seed(123)
            seen = []
            for _ in range(2):
                p.learn(batch)
                seen.append(p.optimizer.param_groups[0]["lr"].clone())
            params.append([t.detach().clone() for t in p.agent.parameters()])
            lrs.append(torch.stack(seen).cpu())
    horizon, lr = RUN.lr_horizon, RUN.ppo.lr
    expected = torch.tensor([lr * (1 - i / horizon) for i in (0, 1)])
    for seen in lrs:
        torch.testing.assert_close(seen, expected)
    for a, b in zip(*params):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.cuda
def test_cuda_measure_stage_8():
    """The harness on stage 8 at a tiny size: three captures (rollout, update, the ceiling's
    policy step), one host read per iteration (the metrics' summary) and one CUDA sync."""
    cuda = torch.device("cuda")
    if STAGES[8].skip_reason(cuda):
        pytest.skip(STAGES[8].skip_reason(cuda))
    row = measure_stage(STAGES[8], BENCH, cuda)
    assert row["status"] == "ok", row["status"]
    assert row["host_reads_rollout_per_step"] == 0 and row["host_reads_per_iter"] == 1
    assert row["cuda_syncs_per_iter"] == 1, row["cuda_sync_sites"]
    assert row["sps"] > 0 and row["ceiling_sps"] > 0


@pytest.mark.parametrize("stage, env", [(3, "ForageNumpy"), (1, "ForageTorch"),
                                        (0, "ForageNumpy")])
def test_a_collector_refuses_an_env_it_cannot_step(stage, env, cpu):
    """The env-collector pairing is declared (``Collector.accepts``) and a wrong one is refused
    the way a missing device is: a skip reason, and StageSkipped from the Pipeline."""
    import labkit.envs

    wrong = dataclasses.replace(STAGES[stage], env=getattr(labkit.envs, env))
    reason = wrong.skip_reason(cpu)
    assert reason and f"cannot step {env}" in reason
    with pytest.raises(StageSkipped, match=f"cannot step {env}"):
        Pipeline(wrong, RunConfig(n_envs=2, n_steps=4), "cpu")


@pytest.mark.slow  # compiles (mode="reduce-overhead")
def test_the_reduce_overhead_variant_runs_a_stage_and_collects_what_stage_5_does():
    """Chapter 09's variant of a stage with ``Compiled(mode="reduce-overhead")`` executors: its
    compiled policy keeps the module's attributes (the rollout reads ``value_head``), and its
    rollout is stage 5's, bit for bit (on the CPU torch compiles it without CUDA graphs)."""
    import dataclasses

    from labkit.executors import Compiled

    ro = Compiled(mode="reduce-overhead")
    variant = dataclasses.replace(STAGES[5], name="reduce_overhead", rollout_executor=ro,
                                  update_executor=ro)
    with Pipeline(STAGES[5], RUN, CPU) as a, Pipeline(variant, RUN, CPU) as b:
        ra, rb = a.collect().tensors(), b.collect().tensors()
        for key in ("obs", "actions", "rewards", "dones"):
            assert torch.equal(ra[key], rb[key]), key
        assert b.policy.value_head is b.agent.value_head
