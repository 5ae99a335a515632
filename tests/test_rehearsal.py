"""Stage 8 in CI without a GPU: labkit's graph code, unchanged, captured and replayed on the
CPU by ``labkit.doctor.rehearsal``, and checked against stage 7 run eagerly. Controls prove that
the graphs really replay (no Python after the capture, a float LR frozen in them), mutation
tests that the checks can fail, and ``rehearse`` / ``python -m labkit rehearse`` report what a
real capture would refuse."""
import dataclasses

import pytest
import torch

from labkit import rehearse
from labkit.app import cli
from labkit.capture import WARMUP_CALLS, CapturedStep, warmup
from labkit.config import BenchConfig, RunConfig
from labkit.doctor.plants import plant
from labkit.doctor.rehearsal import CaptureError, rehearsal, rehearse_stage
from labkit.envs import ForageSpec
from labkit.measure.bench import measure_stage
from labkit.measure.syncmeter import SyncMeter
from labkit.precision import agrees, update_agreement
from labkit.rollout import DeviceCollector
from labkit.stages import STAGES, Pipeline
from labkit.update import Adam, FusedAdam

RUN = RunConfig(n_envs=8, n_steps=16, spec=ForageSpec(episode_length=12))
EAGER, GRAPHED = STAGES[7], STAGES[8]


def _iterations(stage, n: int = 3, cfg: RunConfig = RUN) -> list:
    """(rollout, update statistics, parameters) after each of ``n`` iterations."""
    seen = []
    with Pipeline(stage, cfg, "cpu") as p:
        for _ in range(n):
            batch = p.rollout()
            rollout = {k: v.clone() for k, v in p.collector.storage.tensors().items()}
            stats = {k: float(v) for k, v in p.learn(batch).items()}
            seen.append((rollout, stats, [t.detach().clone() for t in p.agent.parameters()]))
    return seen


def _eager(stage, n: int = 3, cfg: RunConfig = RUN) -> list:
    with torch.compiler.set_stance("force_eager"):
        return _iterations(stage, n, cfg)


def _same(a: list, b: list) -> bool:
    return all(all(torch.equal(x[k], y[k]) for k in x) and sx == sy
               and all(torch.equal(p, q) for p, q in zip(px, py))
               for (x, sx, px), (y, sy, py) in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def stage_7():
    return _eager(EAGER)


@pytest.mark.slow
def test_stage_8_equals_stage_7_bit_for_bit(stage_7):
    """Three iterations; the captures happen inside the first rollout and the first update;
    every later step and minibatch is a replay."""
    with rehearsal() as r:
        graphed = _iterations(GRAPHED)
    assert r.problems == [] and len(r.graphs) == 2
    steps, minibatches = 3 * RUN.n_steps, 3 * RUN.ppo.update_epochs * RUN.ppo.n_minibatches
    assert sorted(g.replays for g in r.graphs) == sorted([steps, minibatches])
    assert _same(stage_7, graphed)
    assert stage_7[-1][0]["dones"].sum() > 0  # episodes ended inside: resets were replayed
    # and compiled stage 7 within the tolerance the suite states for compiled stages: rtol 1e-4
    # in fp32; in bf16 (a CPU with bf16 instructions) the bf16 criterion, as compiled code
    # rounds to bf16 at other places than eager code (labkit.precision.AGREEMENT)
    compiled = _iterations(EAGER, n=1)
    with Pipeline(EAGER, RUN, "cpu") as p:
        start, precision = [t.detach().clone() for t in p.agent.parameters()], p.precision.name
    if precision == "bf16":
        agreement = update_agreement(start, compiled[0][2], graphed[0][2])
        assert agrees(agreement), agreement
    else:
        for a, b in zip(compiled[0][2], graphed[0][2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_replayed_rollout_and_update_read_nothing():
    with rehearsal(), Pipeline(GRAPHED, RUN, "cpu") as p:
        batch = p.rollout()  # the rollout step is captured here
        p.ppo_update(batch)  # and the minibatch step here
        with SyncMeter() as rollout_meter:
            batch = p.rollout()
        with SyncMeter() as update_meter:
            p.ppo_update(batch)
    assert (rollout_meter.host_reads, update_meter.host_reads) == (0, 0)


@pytest.mark.slow
def test_warmup_restore_and_reset_with_graphs(stage_7):
    """warmup() captures both graphs inside its iteration and restores the state in place: the
    next iterations are stage 7's, the parameters keep their storage, and rewind() goes back."""
    with rehearsal(), Pipeline(GRAPHED, RUN, "cpu") as p:
        storage = [t.data_ptr() for t in p.agent.parameters()]
        assert warmup(p) > 0
        assert isinstance(p._step, CapturedStep) and p._step.graph is not None
        assert [t.data_ptr() for t in p.agent.parameters()] == storage
        first = {k: float(v) for k, v in p.iteration().items()}
        assert first == stage_7[0][1]
        assert all(torch.equal(a, b) for a, b in zip(p.agent.parameters(), stage_7[0][2]))
        p.rewind()
        assert p.global_step == 0 and {k: float(v) for k, v in p.iteration().items()} == first


class _Box:
    """A Stateful holding one tensor (what a captured step's warm-up calls change)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def state_dict(self) -> dict:
        return {"x": self.x.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.x.copy_(state["x"])


def test_a_replayed_graph_counts_the_kernels_it_holds_and_its_launch():
    """On a GPU a replay dispatches nothing: a launch count that saw only what runs outside the
    graph called stage 8's rollout step 4 kernels where the graph held ~100. A capture made
    under counting_nodes keeps the kernels its step launched (as LaunchCount counts an eager
    call), and each replay tells every launch count listening: the graph's launch and its
    nodes as graph:<op>; the rehearsal's stand-in replay, which dispatches the ops again, is
    not counted as launches of its own."""
    from labkit.capture import counting_nodes
    from labkit.measure.profiling import LaunchCount

    x, w = torch.zeros(4), torch.ones(4)

    def step():
        x.mul_(2).add_(w)
        return torch.where(x > 2, x, w).sum()

    with LaunchCount() as eager:
        step()
    assert eager.total == 5  # mul_, add_, gt, where, sum
    with rehearsal():
        plain, counted = CapturedStep(step, _Box(x)), CapturedStep(step, _Box(x))
        plain()
        with counting_nodes(LaunchCount):
            counted()
        with LaunchCount() as replays:
            counted()
            counted()
            plain()
    assert plain.nodes is None and counted.nodes == eager.counts
    graph = {f"graph:{op}": 2 * n for op, n in eager.counts.items()}
    assert replays.counts == {**graph, "graph_replay": 3, "clone": 3}  # clone: the outputs


@pytest.mark.slow
def test_measure_stage_8_is_ok_with_one_read_per_iteration(cpu):
    with rehearsal():
        row = measure_stage(GRAPHED, BenchConfig(run=RUN, iterations=2), cpu)
        eager = measure_stage(EAGER, BenchConfig(run=RUN, iterations=2), cpu)
    assert row["status"] == "ok", row["status"]
    assert row["host_reads_rollout_per_step"] == 0 and row["host_reads_per_iter"] == 1
    # kernels per step count what the graphs hold: the graphed rollout launches what stage 7's
    # eager one does (rehearsed, stage 7 runs eagerly), and one graph launch a step more
    top = row["kernels_top"]
    assert top["rollout"]["graph:where"] == eager["kernels_top"]["rollout"]["where"]
    assert row["kernels_per_step"] == eager["kernels_per_step"] + 1
    assert row["kernels_per_step"] > row["graph_kernels_per_step"] > 0.9 * eager["kernels_per_step"]
    assert row["kernels_per_minibatch"] > row["graph_kernels_per_minibatch"] > 50
    assert "graph_kernels_per_step" not in eager


@pytest.mark.slow
def test_train_stage_8_resumes_bit_exactly(tmp_path):
    from labkit.app import checkpoint
    from labkit.app.train import TrainConfig, train
    from labkit.capture import tree_tensors

    cfg = TrainConfig.flat(stage="cuda_graphs", device="cpu", n_envs=8, n_steps=16, seed=2,
                           total_steps=8 * 16 * 6, checkpoint_every=0)
    with rehearsal():
        train(cfg, tmp_path / "one_go", progress=False)
        train(cfg, tmp_path / "split", progress=False, stop_after=3)
        train(None, tmp_path / "split", resume=True, progress=False)
    a = checkpoint.load(tmp_path / "one_go" / "checkpoint.pt")["state"]
    b = checkpoint.load(tmp_path / "split" / "checkpoint.pt")["state"]
    assert a["iteration"] == b["iteration"] == 6
    for x, y in zip(tree_tensors(a), tree_tensors(b), strict=True):
        assert torch.equal(x, y)


@pytest.mark.slow
def test_two_graphed_updates_follow_stage_7_with_the_lr_annealed():
    with torch.compiler.set_stance("force_eager"), Pipeline(STAGES[3], RUN, "cpu") as p:
        batch = p.rollout()
    results = []
    for stage, context in ((EAGER, torch.compiler.set_stance("force_eager")),
                           (GRAPHED, rehearsal())):
        with context, Pipeline(stage, RUN, "cpu") as p:
            lrs = []
            for _ in range(2):
                p.learn(batch)
                lrs.append(float(p.optimizer.param_groups[0]["lr"]))
            results.append((lrs, [t.detach().clone() for t in p.agent.parameters()]))
    (lr7, params7), (lr8, params8) = results
    assert lr7 == lr8 and lr8[1] < lr8[0]  # annealed between the two updates' replays
    assert all(torch.equal(a, b) for a, b in zip(params7, params8))


@pytest.mark.slow
def test_a_planted_host_read_fails_the_capture():
    with rehearsal(), Pipeline(plant(GRAPHED, "unfused_adam"), RUN, "cpu") as p:
        batch = p.rollout()
        with pytest.raises(CaptureError) as caught:
            p.ppo_update(batch)
    problems = caught.value.problems
    # torch's capture health check refuses the non-capturable Adam at step(), before its
    # step counters (CPU tensors) would be read, and incremented once, at capture
    assert {x.kind for x in problems} == {"device_read", "host_op", "optimizer"}
    assert any("via torch/optim/" in x.where for x in problems if x.kind == "device_read")
    assert any("capturable=True" in x.summary for x in problems if x.kind == "optimizer")


# ---------------------------------------------------------------- the replays are real


class _CountingCollector(DeviceCollector):
    calls = 0

    def step(self) -> None:
        type(self).calls += 1
        super().step()


def test_python_runs_at_warmup_and_capture_only():
    stage = dataclasses.replace(GRAPHED, collector=_CountingCollector)
    _CountingCollector.calls = 0
    with rehearsal(), Pipeline(stage, RUN, "cpu") as p:
        p.collect()
        p.collect()
    assert _CountingCollector.calls == WARMUP_CALLS + 1  # then 2 x T replays, no Python


@dataclasses.dataclass(frozen=True, repr=False)
class _FloatLrAdam(FusedAdam):
    """Fused Adam with its LR a Python float: a graph bakes the value in at capture."""

    def __call__(self, params, cfg, device):
        return torch.optim.Adam(params, lr=cfg.lr, eps=cfg.adam_eps, fused=True,
                                capturable=True)

    set_lr = staticmethod(Adam.set_lr)  # the component owns its LR: here a float
    load_state_ = staticmethod(Adam.load_state_)


@pytest.mark.slow
def test_a_float_lr_is_frozen_in_the_graph():
    """A control that the updates are replays: annealing a float LR changes eager steps and not
    the captured ones, so the two runs part after the first iteration."""
    eager = _eager(dataclasses.replace(EAGER, optimizer=_FloatLrAdam()), n=2)
    with rehearsal():
        graphed = _iterations(dataclasses.replace(GRAPHED, optimizer=_FloatLrAdam()), n=2)
    assert _same(eager[:1], graphed[:1])
    assert not _same(eager, graphed)


@pytest.mark.slow
def test_without_the_restore_after_warmup_the_stages_part(monkeypatch, stage_7):
    """Mutation: CapturedStep's warm-up calls really run; without the restore that follows
    them, stage 8 starts from a state three steps ahead and no longer equals stage 7."""
    capture = CapturedStep._capture

    def capture_without_restore(self, args):
        state = self.state
        monkeypatch.setattr(state, "load_state_dict", lambda saved: None)
        try:
            capture(self, args)
        finally:
            monkeypatch.undo()

    monkeypatch.setattr(CapturedStep, "_capture", capture_without_restore)
    with rehearsal():
        graphed = _iterations(GRAPHED)
    assert not _same(stage_7, graphed)


@pytest.mark.slow
def test_without_the_generator_registration_replays_draw_the_same_numbers(monkeypatch,
                                                                         stage_7):
    """Mutation: a capture that does not register the sampling generator is a problem (a real
    capture raises), and in a lenient rehearsal every replay samples with the same noise."""
    init = CapturedStep.__init__

    def init_without_generator(self, step, state, generator=None, after_replay=None):
        init(self, step, state, None, after_replay)

    monkeypatch.setattr(CapturedStep, "__init__", init_without_generator)
    with rehearsal() as r, Pipeline(GRAPHED, RUN, "cpu") as p, pytest.raises(CaptureError):
        p.collect()
    assert [x.kind for x in r.problems] == ["unregistered_generator"]
    # the sampling noise is drawn by the collector's step, before the policy
    assert r.problems[0].where.startswith("labkit/rollout.py:") and "(step)" in \
        r.problems[0].where
    with rehearsal(strict=False):
        graphed = _iterations(GRAPHED, n=1)
    assert not _same(stage_7[:1], graphed)


# ---------------------------------------------------------------- the recipe


@pytest.mark.slow
def test_the_recipes_graph_step_equals_the_recipe_run_eagerly():
    from tests.test_recipe import _configs, recipe

    args, _ = _configs("cpu")

    def two_iterations(graphs: bool) -> tuple:
        r = recipe.make_runner(args)
        for group in r.optimizer.param_groups:  # as uses_graphs() builds it on a bf16 GPU
            group["capturable"] = graphs
        step, train_step, _ = recipe.make_steps(r)  # no graphs on a CPU: captured here
        if graphs:
            step, train_step = recipe.CudaGraphStep(step, r), recipe.CudaGraphStep(train_step, r)
        rollouts = []
        for i in range(2):
            rollouts.append({k: v.clone() for k, v in recipe.collect(r, step).items()})
            recipe.update(r, train_step, recipe.compute_batch(r), iteration=i)
        return rollouts, [p.detach().clone() for p in r.agent.parameters()], step

    with torch.compiler.set_stance("force_eager"):
        eager_rollouts, eager_params, _ = two_iterations(False)
    with rehearsal() as reh:
        rollouts, params, step = two_iterations(True)
    assert len(reh.graphs) == 2 and step.graph.replays == 2 * args.n_steps
    for a, b in zip(eager_rollouts, rollouts):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))


# ---------------------------------------------------------------- for readers


def _net_and_data():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01), fused=True, capturable=True)
    return net, opt, torch.randn(8, 4)


def test_rehearse_a_capturable_step_and_keep_its_results():
    net, opt, x = _net_and_data()

    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    report = rehearse(step, x, replays=2)
    assert report.ok and report.replays == 2 and "capturable" in str(report)
    net2, opt2, _ = _net_and_data()
    opt, net = opt2, net2
    losses = [step(x) for _ in range(5)]  # 3 warm-up calls and 2 replays, eagerly
    assert torch.equal(report.outputs, losses[-1])


@pytest.mark.parametrize("case, kind", [
    ("item", "device_read"), ("print", "device_read"), ("to_cpu", "device_read"),
    ("mask", "dynamic_shape"), ("nonzero", "dynamic_shape"), ("tensor", "host_tensor"),
    ("generator", "unregistered_generator"), ("shape", "shape"), ("number", "not_static"),
    ("arange", "host_mix"), ("host_through_ops", "host_mix")])
def test_rehearse_names_each_problem_at_its_line(case, kind, capsys):
    gen = torch.Generator().manual_seed(0)
    calls = []

    def step(x):
        calls.append(1)
        y = x * 2
        if case == "item":
            y = y + y.sum().item()
        elif case == "print":
            print(y)
        elif case == "to_cpu":
            y = y.to("cpu")
        elif case == "mask":
            y = y[y > 0]
        elif case == "nonzero":
            y = y.nonzero()
        elif case == "tensor":
            y = y + torch.tensor([1.0, 2.0, 3.0, 4.0])
        elif case == "generator":
            y = y + torch.rand(y.shape, generator=gen)
        elif case == "arange":
            y = y * torch.arange(4)  # a host tensor on a GPU
        elif case == "host_through_ops":
            idx = torch.ones(8)[::2] * 2  # still a host tensor after two ops
            y = y - idx
        elif case == "shape":
            y = y[: len(calls)]  # the capture's output is longer than the warm-up's
        elif case == "number":
            return y, float(len(calls))
        return y

    report = rehearse(step, torch.arange(4.0) - 1.5)
    assert not report.ok and report.replays == 0
    assert kind in {p.kind for p in report.problems}, report
    if kind not in ("shape", "not_static"):
        (where,) = {p.where for p in report.problems if p.kind == kind}
        assert where.startswith("tests/test_rehearsal.py:") and "(step)" in where
    assert f"[{kind}]" in str(report)
    if case == "item":  # one read is counted once
        assert str(report).count("[device_read]") == 1 and "(1x)" in str(report)


def test_a_tensor_made_with_a_device_or_a_host_scalar_is_no_problem():
    def step(x):
        here = torch.arange(4, device=x.device) + torch.zeros_like(x) + x.new_ones(4)
        return x * here + torch.zeros(()) + torch.full((), 2.0)  # 0-d host scalars: allowed

    report = rehearse(step, torch.arange(4.0))
    assert report.ok, report


@pytest.mark.slow  # about 3 s
def test_stage_8_capturing_its_whole_update_equals_stage_7_bit_for_bit(stage_7):
    """capture_unit="update": one graph for the whole update, the permutations drawn from the
    registered generator and every minibatch gathered and stepped inside it, replayed once an
    iteration (against epochs x minibatches replays of the minibatch graph): three iterations
    compute what eager stage 7 computes, bit for bit."""
    with rehearsal() as r:
        graphed = _iterations(GRAPHED, cfg=RUN.replace(capture_unit="update"))
    assert r.problems == [] and len(r.graphs) == 2
    assert sorted(g.replays for g in r.graphs) == sorted([3, 3 * RUN.n_steps])
    assert _same(stage_7, graphed)


@pytest.mark.slow
def test_stage_8_storing_observations_as_uint8_is_capturable():
    """obs_storage="uint8": the captured step casts each observation row as it stores it;
    rehearsed, stage 8 is capturable and bit-identical to the same stage without graphs."""
    report = rehearse_stage(GRAPHED, RUN.replace(obs_storage="uint8"), iterations=2)
    assert report.ok and report.equal and report.graphs == 2, report


@pytest.mark.slow
def test_stage_8_with_its_whole_rollout_step_fused_is_capturable():
    """compile_unit="step": the captured step holds the whole step past the noise as one
    region, episode statistics included; rehearsed, it is capturable and every rollout and
    update is bit-identical to the stage without graphs."""
    report = rehearse_stage(GRAPHED, RUN.replace(compile_unit="step"), iterations=2)
    assert report.ok and report.equal and report.graphs == 2, report


@pytest.mark.slow
def test_the_planted_host_tensor_in_stage_8_is_found():
    """The GRPO report's bug (``torch.zeros(n)`` without ``device=`` in the metrics, planted as
    ``cpu_tensor``) runs on a CPU and raises on a GPU; the rehearsal finds it at its line."""
    report = rehearse_stage(plant(GRAPHED, "cpu_tensor"), RUN, iterations=1)
    # sums[0] = done.sum() copies from the device into pageable memory, and sums.to(device)
    # copies pageable memory to the device: a capture records neither
    assert not report.ok
    assert {p.kind for p in report.problems} == {"host_copy"}
    whats = [p.summary for p in report.problems]
    assert sum("from the device into" in w for w in whats) == 4  # sums[0..3] = ...
    assert sum("copied to the device" in w for w in whats) == 1  # sums.to(self.device)
    assert all(p.where.startswith("labkit/doctor/plants.py:") for p in report.problems)


def test_rehearse_refuses_bad_input():
    with pytest.raises(ValueError, match="replays must be an int >= 0"):
        rehearse(lambda: None, replays=-1)
    with pytest.raises(TypeError, match="fn must be callable"):
        rehearse(3)


@pytest.mark.parametrize("argv, code, needle", [
    pytest.param([], 0, "capturable; 2 graphs replayed", marks=pytest.mark.slow),  # stage 8
    pytest.param(["--plant", "unfused_adam"], 1, "[device_read]", marks=pytest.mark.slow),
    pytest.param(["--plant", "cpu_tensor"], 1, "[host_copy]", marks=pytest.mark.slow),
    (["--stage", "7"], 2, "has no CUDA graphs to rehearse"),
    (["--device", "cuda"], 2, "--device"),
    (["--plant", "warp"], 2, "plant must be one of"),
    (["--iterations", "0"], 2, "--iterations: expected an integer in [1, 10,000]"),
])
def test_cli_rehearse(capsys, argv, code, needle):
    small = ["--n-envs", "8", "--n-steps", "8"]
    try:
        rc = cli.main(["rehearse", *small, *argv])
    except SystemExit as exit:
        rc = exit.code
    assert rc == code
    out = capsys.readouterr()
    assert needle in (out.out if code < 2 else out.err)
    if code == 2:
        assert out.err.startswith("error: ") and out.err.count("\n") == 1


def test_the_kernel_sync_table_was_read_from_the_installed_torch():
    """labkit/doctor/kernel_syncs.py was read from one torch's ATen sources: another torch
    may sync in other kernels, or no longer in these, so the table is read again (by the
    procedure in its docstring) and READ_FROM updated."""
    from labkit.doctor import kernel_syncs

    assert torch.__version__.split("+")[0] == kernel_syncs.READ_FROM, (
        f"torch {torch.__version__} is installed; labkit/doctor/kernel_syncs.py was read from "
        f"{kernel_syncs.READ_FROM}: read its ops again")


def test_a_default_device_takes_the_factories_that_name_none():
    """``torch.set_default_device(device)`` (torch's documented way to move factories that
    name no device; a portable script names "cuda" where there is one) makes ``torch.zeros(4)``
    a device tensor on a GPU: the rehearsal called it a host tensor mixed with device ones
    (host_mix) and a counter made that way a CPU counter frozen at capture (host_op). Without
    a default device both stay flagged, and a copy of NumPy data stays one either way."""
    import numpy as np

    from labkit import rehearse

    def make():
        counter = torch.zeros(())

        def step(x):
            counter.add_(1)
            bonus = torch.zeros(4)
            return x * counter + bonus

        return step

    def from_numpy(x):
        return x + torch.from_numpy(np.ones(4, dtype=np.float32))

    assert {p.kind for p in rehearse(make(), torch.ones(4)).problems} == {"host_mix", "host_op"}
    torch.set_default_device("cpu")  # the device, as `device` is on a machine without CUDA
    try:
        assert rehearse(make(), torch.ones(4)).ok
        assert [p.kind for p in rehearse(from_numpy, torch.ones(4)).problems] == ["host_tensor"]
    finally:
        torch.set_default_device(None)
