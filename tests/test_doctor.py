"""labkit doctor: every planted regression is found, with its evidence and chapter; the clean
final stage yields nothing; stage 0 yields its device reads, and a host-scalar read (a non-fused
Adam's CPU step counter) is never a sync finding; the unfused optimizer is found by its kernel
launches; a plant's times against the clean stage's get a noise verdict; a graphed stage is
diagnosed without its graphs; the CLI's exit codes and JSON."""
import copy
import dataclasses
import json

import pytest
import torch

import labkit
from labkit.app import cli
from labkit.config import RunConfig
from labkit.doctor import KINDS, Finding, diagnose, plants, without_graphs
from labkit.doctor.plants import PLANTS, plant
from labkit.doctor.report import WITHIN_NOISE, compare_times, symptoms
from labkit.envs import ForageTorch
from labkit.executors import Compiled, Eager, Graphed
from labkit.metrics import DeviceEpisodeStats
from labkit.policy import Agent, ValueHead
from labkit.stages import Pipeline, get_stage

CPU = torch.device("cpu")
RUN = RunConfig(n_envs=8, n_steps=8, compile="compiled")  # as the doctor runs its own

#: The chapter whose notebook teaches each plant's fix.
CHAPTERS = {
    "item_in_logging": "05_log_off_the_hot_path",
    "unfused_adam": "08_fused_optimizers_and_amp",
    "nan_checks": "10_the_regression_hunt",
    "per_item_loop": "07_metrics_on_the_device",
    "cpu_tensor": "03_tensors_on_the_device",
    "unbounded_buffer": "07_metrics_on_the_device",
    "clone_overuse": "04_batch_everything",
    "duplicate_forward": "00_measure_first",
    "branchy_value_head": "06_compile_and_warm_up",
    "amp_off": "08_fused_optimizers_and_amp",
}


#: Where each plant is diagnosed: amp_off on CUDA when there is one (on the CPU it is skipped).
DEVICES = {name: CPU for name in PLANTS} | {
    "amp_off": torch.device("cuda" if torch.cuda.is_available() else "cpu")}


@pytest.fixture(scope="module")
def reports():
    return {name: diagnose(plant("fused_amp", name), cfg=RUN, device=DEVICES[name])
            for name in PLANTS}


@pytest.fixture(scope="module")
def clean():
    return diagnose("fused_amp", cfg=RUN, device=CPU)


def _lines(name: str) -> set[str]:
    """``labkit/doctor/plants.py:N`` of the lines that carry a plant's bug."""
    return {site for site, _ in PLANTS[name].lines()}


def _where(site: str) -> str:
    return site.split(" ")[0]


def _findings(report, kind) -> list[Finding]:
    return [f for f in report.findings if f.kind == kind]


def test_the_plants_are_the_ten_regressions_of_the_reports():
    assert set(PLANTS) == set(CHAPTERS)
    for p in PLANTS.values():
        assert p.finds in KINDS
        assert p.report and "report" in p.story, p.name  # documented with the real-world bug
        assert p.slot in get_stage(7).components()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PLANTS if n != "amp_off"])
def test_each_plant_is_found_with_its_kind_and_chapter(reports, name):
    report = reports[name]
    assert report.status == "ok"
    found = _findings(report, PLANTS[name].finds)
    assert found, report.format()
    assert found[0].chapter.split(",")[0] == CHAPTERS[name]  # a section may follow
    part = PLANTS[name].part
    part_name = getattr(part, "__name__", None) or type(part).__name__
    # the doctor points at the planted component, and at nothing else
    for f in report.findings:
        assert part_name in f.where, (name, f.where)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["item_in_logging", "nan_checks", "per_item_loop"])
def test_host_reads_are_found_at_the_planted_line(reports, name):
    (f,) = _findings(reports[name], "device_read")
    sites = {_where(s["site"]) for s in f.evidence["sites"]}
    assert sites and sites <= _lines(name), (sites, _lines(name))


@pytest.mark.slow
def test_host_read_counts_match_the_plants(reports):
    logging = _findings(reports["item_in_logging"], "device_read")[0].evidence
    assert logging["per_step"] == 1  # the step's mean reward
    assert logging["per_update"] == 6  # the update's six statistics
    nan = _findings(reports["nan_checks"], "device_read")[0].evidence
    assert nan["per_step"] == 4  # observations, logprobs, values, rewards
    loop = _findings(reports["per_item_loop"], "device_read")[0].evidence
    assert loop["per_step"] >= RUN.n_envs  # one per env, more per finished episode


@pytest.mark.slow
def test_unfused_adam_is_found_by_its_launches_not_by_its_counter_reads(reports):
    """Per-parameter Adam reads a CPU step counter per parameter per step: host-scalar reads,
    no sync, so no device_read finding. Its GPU cost is kernel launches per optimizer step, one
    set per parameter against the clean stage's fused step; the finding claims no share of the
    iteration it did not measure."""
    report = reports["unfused_adam"]
    n_params = len(list(Agent().parameters()))
    minibatch_steps = RUN.ppo.update_epochs * RUN.ppo.n_minibatches
    assert report.kinds == ["excess_ops"]
    reads = report.host_reads
    assert reads["host_scalar"]["per_update"] == n_params * minibatch_steps
    assert reads["device"] == {"per_step": 0, "per_update": 1, "by_kind": {"tolist": 1}}
    assert reads["per_update"] == n_params * minibatch_steps + 1  # the total, as before
    (f,) = report.findings
    launched = f.evidence["ops"]["kernel launches per optimizer step"]
    mine, clean = launched["this stage"], launched["clean stage"]
    assert mine % n_params == 0 and mine >= 2 * n_params  # ops once per parameter
    assert clean < n_params  # fused: a few for all of them
    assert f.evidence["optimizer"] == "per-parameter Adam, foreach=False"
    assert f.evidence["steps_per_update"] == minibatch_steps
    assert f.summary.startswith(f"{mine:g} kernel launches per optimizer step vs {clean:g}")
    by_op = [part.rsplit(" ", 1) for part in f.evidence["launches_by_op"].split(", ")]
    assert sum(float(n) for _, n in by_op) == mine  # the ops named add up: none left out
    assert f.cost["share"] is None and f.cost["ms_per_iteration"] is None
    assert f.cost["extra_launches_per_update"] == (mine - clean) * minibatch_steps
    assert f.chapter == "08_fused_optimizers_and_amp"
    text = " ".join(report.format().split())
    assert "% of the iteration" not in text and "launch overhead on a GPU, not timed here" in text


@pytest.mark.slow
def test_host_scalar_reads_are_no_sync_finding():
    """Stage 6 at a small N reads Adam's 10 CPU step counters per minibatch step and the
    device metrics once per update: the counters are host-scalar reads (no finding), the one
    device read is the deliberate one (accepted); the report shows both apart."""
    report = diagnose("gpu_metrics", cfg=RUN, device=CPU, iterations=2)
    n_params = len(list(Agent().parameters()))
    minibatch_steps = RUN.ppo.update_epochs * RUN.ppo.n_minibatches
    assert "device_read" not in report.kinds and report.findings == [], report.format()
    assert report.host_reads["device"]["per_update"] == 1
    assert report.host_reads["host_scalar"] == {
        "per_step": 0, "per_update": n_params * minibatch_steps,
        "by_kind": {"item": n_params * minibatch_steps}}
    assert list(report.host_reads["accepted"].values()) == [1]
    text = " ".join(report.format().split())
    assert "device reads (a sync each on a GPU): 0 per rollout step, 1 per update" in text
    assert f"no GPU wait): 0 per rollout step, {n_params * minibatch_steps} per update" in text


def test_the_verdict_says_within_noise_only_when_the_samples_overlap():
    clean = [0.050, 0.052, 0.049, 0.061, 0.051]
    overlapping = [0.055, 0.058, 0.050, 0.070, 0.056]
    apart = [0.080, 0.082, 0.079, 0.085, 0.081]
    near = compare_times(overlapping, clean)
    assert near["verdict"] == WITHIN_NOISE and near["ratio"] > 1  # a higher median, still noise
    far = compare_times(apart, clean)
    assert far["verdict"] == "slower" and round(far["ratio"], 2) == 1.59
    assert (far["min"], far["median"], far["max"]) == (0.079, 0.081, 0.085)
    assert compare_times(clean, apart)["verdict"] == "faster"
    with pytest.raises(ValueError):
        compare_times([], clean)
    # the sentences come from the verdicts: flip the data, the sentence flips
    said = symptoms({"a": far, "b": near}, "this CPU")
    assert "1 of 2 plants ran slower" in said and "a 1.59x" in said and "within noise" in said
    said = symptoms({"a": near, "b": near}, "this CPU")
    assert "slower" not in said and "all 2 are within noise" in said


@pytest.mark.slow
def test_cpu_tensor_is_found_at_its_factory(reports):
    (f,) = _findings(reports["cpu_tensor"], "no_device")
    assert [_where(s["site"]) for s in f.evidence["sites"]] == sorted(_lines("cpu_tensor"))
    assert f.evidence["per_step"] == 1


@pytest.mark.slow
def test_unbounded_buffer_grows_by_one_tensor_per_step(reports):
    (f,) = _findings(reports["unbounded_buffer"], "memory_growth")
    assert f.evidence["attribute"] == "history"
    assert f.evidence["tensors_per_iteration"] == RUN.n_steps
    assert f.evidence["bytes_per_iteration"] == RUN.n_steps * 2 * RUN.n_envs * 4


@pytest.mark.slow
def test_excess_ops_against_the_clean_stage(reports):
    (clones,) = _findings(reports["clone_overuse"], "excess_ops")
    assert clones.evidence["ops"]["clone per step (rollout)"] == \
        {"this stage": 7, "clean stage": 0}
    assert {_where(s["site"]) for s in clones.evidence["sites"]} == _lines("clone_overuse")
    (twice,) = _findings(reports["duplicate_forward"], "excess_ops")
    conv = twice.evidence["ops"]["convolution per step (rollout)"]
    assert round(conv["this stage"] - conv["clean stage"], 2) == 2  # the body's convs again
    assert twice.where == "the model (TwiceAgent)"


def test_the_watch_counts_the_codes_own_clones_not_torchs():
    """Clones that torch makes inside its own functions (or, compiled, inside its graphs: their
    number changed between torch 2.11 and 2.13) are not the code's: only a clone called from
    labkit or user code counts."""
    x = torch.ones(3)
    with labkit.watch(CPU) as w:
        x.clone()
        copy.deepcopy(x)  # torch/_tensor.py clones inside
    (site,) = w.calls["clone"]
    assert site.startswith("tests/test_doctor.py:") and w.calls["clone"][site] == 1


@pytest.mark.slow
@pytest.mark.parametrize("name, kind", [("cpu_tensor", "no_device"),
                                        ("clone_overuse", "excess_ops")])
def test_the_doctor_counts_what_labkit_watch_counts_on_the_same_loop(reports, name, kind):
    """The doctor measures through ``labkit.watch``: a reader's watch around the same rollout
    (eager, as the doctor watches it) counts the same sites the same number of times."""
    with Pipeline(plant("fused_amp", name), RUN, CPU) as pipe:
        pipe.rollout()  # warm
        with torch.compiler.set_stance("force_eager"), labkit.watch(CPU) as w:
            pipe.rollout()
    counted = {"no_device": w.calls["no_device"], "excess_ops": w.calls["clone"]}[kind]
    (f,) = _findings(reports[name], kind)
    assert {s["site"]: s["per_step"] for s in f.evidence["sites"]} == \
        {site: round(n / RUN.n_steps, 3) for site, n in counted.items()}


@pytest.mark.slow
def test_branchy_value_head_breaks_the_compiled_loss(reports):
    report = reports["branchy_value_head"]
    (f,) = report.findings
    assert f.kind == "graph_break"
    assert _where(f.evidence["user_code"][-1]) in _lines("branchy_value_head")
    assert "branch" in f.evidence["message"].lower()


@pytest.mark.slow
def test_amp_off_needs_cuda(reports):
    report = reports["amp_off"]
    if torch.cuda.is_available():  # diagnosed on the GPU: fp32 where the clean stage is not
        assert report.status == "ok" and report.device.startswith("cuda")
        (f,) = _findings(report, "precision")
        assert f.where == "the precision (AmpOff)" and f.evidence["precision"] == "fp32"
        assert f.evidence["clean_stage_precision"] in ("bf16", "fp16")
    else:
        assert report.status == "skipped: needs CUDA" and report.findings == []


@pytest.mark.slow  # builds and compiles stage 7
def test_stage_7_runs_with_the_amp_off_precision_on_any_device():
    """The plant's precision is a Precision like every other (it was the string "fp32", which
    crashed the update on every GPU): stage 7 with it runs, here on the CPU."""
    part = dataclasses.replace(PLANTS["amp_off"].part, requires=())
    with Pipeline(dataclasses.replace(get_stage(7), precision=part), RUN, CPU) as p:
        stats = p.iteration()
        assert p.precision.name == "fp32" and torch.isfinite(stats["grad_norm"])


@pytest.mark.slow
def test_the_clean_final_stage_has_no_findings(clean):
    assert clean.status == "ok"
    assert clean.findings == [], clean.format()
    # its one read per update is the device metrics' documented .tolist()
    ((site, n),) = clean.host_reads["accepted"].items()
    assert site.startswith("labkit/metrics.py:") and "(summary)" in site and n == 1
    assert clean.host_reads["per_step"] == 0 and clean.host_reads["per_update"] == 1
    assert clean.host_reads["device"]["per_update"] == 1
    assert clean.host_reads["host_scalar"]["per_update"] == 0  # fused Adam: counters on device
    assert set(clean.phase_ms) >= {"policy", "env", "update"} and clean.iteration_s > 0
    # at least 5 timed iterations, kept, so a table can give min / median / max
    assert clean.iterations >= 5 and len(clean.iteration_s_samples) == clean.iterations
    assert min(clean.iteration_s_samples) <= clean.iteration_s <= max(clean.iteration_s_samples)


@pytest.mark.slow
@pytest.mark.parametrize("n_envs", [4, 16])
def test_the_clean_final_stage_has_no_findings_at_other_sizes(n_envs):
    report = diagnose("fused_amp", cfg=RunConfig(n_envs=n_envs, n_steps=8), device=CPU)
    assert report.findings == [], report.format()


@pytest.mark.slow
def test_stage_0_yields_its_device_reads_and_its_copies_of_python_data():
    n = 4
    report = diagnose("python_loop", cfg=RunConfig(n_envs=n, n_steps=8), device=CPU,
                      iterations=2)
    assert report.kinds == ["device_read", "from_data"]
    (made,) = _findings(report, "from_data")  # a host-to-device copy each on a GPU
    assert made.where == "the collector (PerEnvCollector)"
    per_env_obs = made.evidence["sites"][0]
    assert per_env_obs["site"].startswith("labkit/rollout.py:") and per_env_obs["per_step"] == n
    by_part = {f.where: f for f in _findings(report, "device_read")}
    per_env = by_part["the collector (PerEnvCollector)"]
    assert per_env.evidence["per_step"] == n  # one .item() per env per step
    assert per_env.evidence["sites"][0]["site"].startswith("labkit/rollout.py:")
    assert per_env.chapter == "02_vectorize_with_numpy"
    assert by_part["the logger (SyncLogger)"].chapter == "05_log_off_the_hot_path"
    assert by_part["the metrics (EagerEpisodeStats)"].chapter == "07_metrics_on_the_device"
    # Adam's step counters are CPU tensors on every device: counted apart, never a sync finding
    assert "the optimizer (Adam)" not in by_part
    assert report.host_reads["host_scalar"]["per_update"] == 160
    assert report.host_reads["per_update"] == report.host_reads["device"]["per_update"] + 160


@pytest.mark.slow
def test_a_diagnosed_pipeline_is_left_as_it_was():
    with Pipeline(plant("fused_amp", "item_in_logging"), RUN, CPU) as p:
        before = [t.clone() for t in p.agent.state_dict().values()]
        step = p.global_step
        report = diagnose(p)
        assert "device_read" in report.kinds
        assert p.global_step == step
        for a, b in zip(before, p.agent.state_dict().values()):
            assert torch.equal(a, b)


class _CountingHead(ValueHead):
    """A value head with a Python counter that the rollout's compiled policy branches on."""

    updates = 0

    def update_stats(self, returns):
        self.updates += 1


class _RecompilingAgent(Agent):
    def __init__(self, view=7, value_head="plain"):
        super().__init__(view, value_head)
        head = _CountingHead()
        head.linear.load_state_dict(self.value_head.linear.state_dict())
        self.value_head = head

    def forward(self, obs):
        logits, value = super().forward(obs)
        if not torch.is_grad_enabled() and self.value_head.updates > 1:  # the rollout only
            value = value + 0.0
        return logits, value


@pytest.mark.slow
def test_recompiles_after_warmup_are_found():
    # The update runs eagerly, so only this test's own policy code gathers compiled versions.
    stage = dataclasses.replace(get_stage("fused_amp"), name="recompiling",
                                model=_RecompilingAgent, update_executor=Eager())
    report = diagnose(stage, cfg=RUN, device=CPU, baseline=False)
    (f,) = _findings(report, "recompile")
    assert f.evidence["graphs_after_warmup"] >= 2
    assert any("updates" in r for r in f.evidence["reasons"])
    assert f.chapter == "06_compile_and_warm_up"


@pytest.mark.slow
def test_a_graphed_stage_is_diagnosed_without_its_graphs():
    graphed = get_stage("cuda_graphs")
    if not torch.cuda.is_available():
        assert diagnose(graphed, cfg=RUN, device=CPU).status == "skipped: needs CUDA"
    eager = without_graphs(graphed)
    assert (eager.rollout_executor, eager.update_executor) == \
        (graphed.rollout_executor.base, graphed.update_executor.base) \
        == (Compiled(), Compiled())
    assert dataclasses.replace(eager, rollout_executor=graphed.rollout_executor,
                               update_executor=graphed.update_executor) == graphed
    assert without_graphs(get_stage("fused_amp")) is get_stage("fused_amp")
    # The whole path on any device: graphs that need nothing, with a plant a replay would hide.
    anywhere = dataclasses.replace(graphed, rollout_executor=Graphed(Compiled(), requires=()),
                                   update_executor=Graphed(Compiled(), requires=()))
    report = diagnose(plant(anywhere, "clone_overuse"), cfg=RUN, device=CPU)
    assert report.graphs_off and "without its CUDA graphs" in report.format().splitlines()[0]
    (f,) = report.findings
    assert f.kind == "excess_ops" and f.where == "the env (CloningForage)"
    assert f.evidence["ops"]["clone per step (rollout)"]["clean stage"] == 0
    # A built graphed pipeline: diagnosed as an eager copy, itself untouched. A replay would
    # hide the unfused optimizer's launches; without graphs they are counted.
    with Pipeline(plant(anywhere, "unfused_adam"), RUN, CPU) as p:
        step = p.global_step
        report = diagnose(p, iterations=2)
        assert p.global_step == step and isinstance(p.stage.update_executor, Graphed)
    (f,) = report.findings
    assert report.graphs_off and f.kind == "excess_ops" and f.where == "the optimizer (UnfusedAdam)"
    assert report.host_reads["host_scalar"]["per_update"] == 160


class _FailingForage(ForageTorch):
    def step(self, actions):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")


@pytest.mark.slow
def test_an_error_in_the_stage_is_a_finding_not_a_traceback():
    stage = dataclasses.replace(get_stage("fused_amp"), name="failing", env=_FailingForage)
    report = diagnose(stage, cfg=RUN, device=CPU, baseline=False)
    (f,) = report.findings
    assert f.kind == "error" and f.where == "the env (_FailingForage)"
    assert f.summary == "the stage raised in the warmup: RuntimeError: CUDA error: operation " \
        "not permitted when stream is capturing"
    assert f.chapter == "09_cuda_graphs"
    assert f.evidence["user_code"][-1].startswith("tests/test_doctor.py:")
    assert report.notes == ["stopped in the warmup: the stage's code raised, so the rest could "
                            "not be measured"]


class _UnbuildableMetrics(DeviceEpisodeStats):
    def __init__(self, device="cpu"):
        raise AttributeError("'str' object has no attribute 'autocast'")


def test_a_component_that_cannot_be_built_is_a_finding_not_a_traceback():
    stage = dataclasses.replace(get_stage("fused_amp"), name="unbuildable",
                                metrics=_UnbuildableMetrics)
    report = diagnose(stage, cfg=RUN, device=CPU)
    (f,) = report.findings
    assert f.kind == "error" and f.where == "the metrics (_UnbuildableMetrics)"
    assert f.summary.startswith("the stage raised in building the pipeline: AttributeError")
    assert report.notes and report.notes[0].startswith("stopped while building the pipeline")


def test_plant_refuses_a_slot_it_is_not_a_variant_of():
    with pytest.raises(ValueError, match="plant must be one of"):
        plant("fused_amp", "warp_drive")
    with pytest.raises(ValueError, match="variant of DeviceEpisodeStats"):
        plant("batched_ops", "per_item_loop")
    planted = plant(7, "per_item_loop")
    assert planted.metrics is plants.ItemLoopEpisodeStats
    assert issubclass(planted.metrics, DeviceEpisodeStats)
    assert get_stage(7).metrics is DeviceEpisodeStats  # the clean stage is untouched


# ---------------------------------------------------------------- the CLI

SMALL = ["--device", "cpu", "--n-envs", "8", "--n-steps", "8"]


def main(argv: list[str]) -> int:
    """``python -m labkit doctor ARGV``: its exit code (argparse's usage errors exit too)."""
    try:
        return cli.main(["doctor", *argv])
    except SystemExit as exit:
        return exit.code


@pytest.mark.slow
def test_cli_json_and_exit_codes(capsys):
    assert main([*SMALL, "--stage", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["findings"] == [] and out["status"] == "ok" and out["stage"] == "fused_amp"

    assert main([*SMALL, "--plant", "item_in_logging", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    (finding,) = out["findings"]
    assert set(finding) == {"kind", "where", "summary", "evidence", "cost", "chapter", "fix"}
    assert finding["kind"] == "device_read"
    reads = out["host_reads"]  # the totals as before, and the split
    assert {"per_step", "per_update", "by_kind", "accepted", "device", "host_scalar"} <= set(reads)
    assert reads["per_step"] == reads["device"]["per_step"] == 1
    assert len(out["iteration_s_samples"]) == out["iterations"]
    assert finding["chapter"] == "05_log_off_the_hot_path"
    assert finding["cost"]["phases"] == ["io"]


@pytest.mark.slow
def test_cli_text_output(capsys):
    assert main([*SMALL, "--plant", "unbounded_buffer"]) == 1
    text = capsys.readouterr().out
    assert "[memory_growth] the metrics (HistoryEpisodeStats)" in text
    assert "notebooks/07_metrics_on_the_device.ipynb" in text


def test_cli_amp_off_is_skipped_on_the_cpu_and_found_on_cuda(capsys):
    assert main([*SMALL, "--plant", "amp_off"]) == 0  # SMALL says --device cpu
    assert "skipped: needs CUDA" in capsys.readouterr().out
    if torch.cuda.is_available():
        cuda = ["--device", "cuda", *SMALL[2:]]
        assert main([*cuda, "--plant", "amp_off"]) == 1
        assert "[precision] the precision (AmpOff)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--plant", "warp_drive"], "plant must be one of"),
    (["--stage", "99"], "stage must be one of"),
    (["--iterations", "1"], "--iterations: expected an integer in [2, 10,000]"),
    (["--n-envs", "many"], "--n-envs: expected an integer >= 1"),
    (["--device", "tpu"], "device must be one of"),
    (["--stage", "3", "--plant", "cpu_tensor"], "variant of DeviceEpisodeStats"),
    (["--bogus"], "unrecognized arguments"),
])
def test_cli_usage_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_the_chapter_of_each_fix_comes_from_the_ladder():
    """The chapter a finding points to is the chapter of the rung that replaces the component
    (or last changes the slot): moving a rung moves the advice with it."""
    from pathlib import Path

    from labkit.doctor.findings import _COMPONENT_FIX, _SLOT_FIX, MEASURE_FIRST
    from labkit.rollout import HostBatchedCollector, PerEnvCollector
    from labkit.stages import STAGES

    notebooks = {p.stem for p in (Path(__file__).parents[1] / "notebooks").glob("*.ipynb")}
    assert {*(s.chapter for s in STAGES), MEASURE_FIRST} <= notebooks
    for slot, stage in (("logger", "async_logging"), ("metrics", "gpu_metrics"),
                        ("optimizer", "fused_amp"), ("env", "batched_ops"),
                        ("rollout_executor", "compile_warmup")):
        assert _SLOT_FIX[slot][0] == get_stage(stage).chapter, slot
    assert _COMPONENT_FIX[PerEnvCollector][0] == get_stage("numpy_vec").chapter
    assert _COMPONENT_FIX[HostBatchedCollector][0] == get_stage("torch_state").chapter
