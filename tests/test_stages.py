"""The ladder: every stage runs, computes the same thing, and syncs only where it should."""
import gc

import pytest
import torch

from labkit.bench import measure_stage, run_ladder
from labkit.compile import restore_, snapshot
from labkit.config import RunConfig
from labkit.envs import ForageSpec, ForageTorch
from labkit.graphs import GraphedCollector
from labkit.metrics import DeviceEpisodeStats
from labkit.ppo import PPOConfig
from labkit.rollout import DeviceCollector
from labkit.stages import STAGES, Pipeline, StageSkipped, get_stage
from labkit.syncmeter import SyncMeter

CPU = torch.device("cpu")
SPEC = ForageSpec(episode_length=16)
CFG = RunConfig(n_envs=8, n_steps=16, iterations=2, spec=SPEC)


@pytest.fixture(scope="module")
def pipelines():
    made = {}
    for stage in STAGES:
        try:
            made[stage.index] = Pipeline(stage, CFG, CPU)
        except StageSkipped as err:
            made[stage.index] = err
    yield made
    for p in made.values():
        if isinstance(p, Pipeline):
            p.close()


def test_each_stage_differs_from_the_previous_by_its_lesson():
    assert [s.index for s in STAGES] == list(range(9))
    assert len({s.name for s in STAGES}) == 9
    slots = ("collector", "env", "logger", "metrics", "compile", "fused_amp", "graphs")
    for prev, cur in zip(STAGES, STAGES[1:]):
        changed = [k for k in slots if getattr(prev, k) != getattr(cur, k)]
        assert 1 <= len(changed) <= 2, (cur.name, changed)


def test_every_stage_runs_an_iteration_on_cpu_and_graphs_say_why_not(pipelines):
    for index, p in pipelines.items():
        if index == 8:
            assert isinstance(p, StageSkipped) and "needs CUDA" in str(p)
            continue
        before = [t.clone() for t in p.agent.parameters()]
        out = p.iteration()
        assert out["episodes"] == CFG.n_envs  # one 16-step episode per env in 16 steps
        changed = any(not torch.equal(a, b) for a, b in zip(before, p.agent.parameters()))
        assert changed, STAGES[index].name


def test_skipped_stage_is_reported_not_replaced():
    row = measure_stage(get_stage("cuda_graphs"), CFG, CPU)
    assert row["status"] == "skipped: needs CUDA"
    assert "sps" not in row


def test_a_failing_stage_is_reported_as_an_error(monkeypatch):
    import labkit.bench

    def boom(pipeline):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(labkit.bench, "warmup", boom)
    row = measure_stage(get_stage("batched_ops"), CFG, CPU)
    assert row["status"] == "error: RuntimeError: capture failed"
    assert "sps" not in row


def test_get_stage_errors_name_the_allowed_values():
    assert get_stage(3).name == get_stage("batched_ops").name == "batched_ops"
    with pytest.raises(ValueError, match="stage must be one of"):
        get_stage("warp_speed")


def test_stages_collect_identical_rollouts():
    """Same seed -> same actions and env dynamics on every eager fp32 stage (bit-exact)."""
    rollouts = {}
    for index in (0, 1, 2, 3, 4, 6, 7):
        p = Pipeline(STAGES[index], CFG, CPU)
        rollouts[index] = {k: v.clone() for k, v in p.collector.collect().tensors().items()}
        p.close()
    ref = rollouts[3]
    for index, r in rollouts.items():
        for key in ("obs", "actions", "rewards", "dones"):
            assert torch.equal(r[key], ref[key]), (index, key)
        torch.testing.assert_close(r["values"], ref["values"], rtol=1e-5, atol=1e-6)
    assert ref["rewards"].abs().sum() > 0  # food and poison were eaten: respawns ran


def _update_result(index: int, batch, device: torch.device = CPU) -> list[torch.Tensor]:
    p = Pipeline(STAGES[index], CFG, device)
    p.generator.manual_seed(123)
    p.update(batch)
    params = [t.detach().clone() for t in p.agent.parameters()]
    p.close()
    return params


def test_update_of_every_fp32_stage_matches_stage_0():
    """Same batch, same initial parameters -> same parameters after the update.
    Eager stages agree to float32 rounding (rtol 1e-5); compiled ones reorder float ops."""
    p = Pipeline(STAGES[3], CFG, CPU)
    batch = p.rollout()
    p.close()
    ref = _update_result(0, batch)
    for index in (1, 2, 3, 4, 5, 6, 7):
        assert Pipeline(STAGES[index], CFG, CPU).precision == "fp32"  # AMP is off on the CPU
        for a, b in zip(_update_result(index, batch), ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _rollout_reads_per_step(p: Pipeline) -> float:
    with SyncMeter() as m:
        p.collector.collect()
    return m.host_reads / CFG.n_steps


def test_host_reads_in_the_rollout_step(pipelines):
    reads = {i: _rollout_reads_per_step(p) for i, p in pipelines.items()
             if isinstance(p, Pipeline)}
    assert reads[0] >= CFG.n_envs  # an .item() per env
    assert reads[2] > CFG.n_envs  # per-env conditionals on device tensors
    assert reads[3] >= 1  # .item() logging and eager metrics every step
    assert reads[4] >= 1  # logging is async now, metrics still eager
    assert reads[6] == 0 and reads[7] == 0


def test_graphed_rollout_body_matches_device_collector_and_reads_nothing():
    """Stage 8's capture-safe step, run eagerly on the CPU, is the stage-6 step."""
    def build(cls, **extra):
        gen = torch.Generator().manual_seed(5)
        torch.manual_seed(0)
        from labkit.logging import AsyncLogger
        from labkit.policy import Agent
        agent = Agent(SPEC.view)
        logger = AsyncLogger(open("/dev/null", "w"))
        col = cls(CFG.n_envs, CFG.n_steps, SPEC, 3, CPU, lambda o: agent.act(o, gen), logger,
                  DeviceEpisodeStats(CPU), env_cls=ForageTorch, **extra)
        return col, logger

    eager, l1 = build(DeviceCollector)
    graphed, l2 = build(GraphedCollector, capture=False)
    a = {k: v.clone() for k, v in eager.collect().tensors().items()}
    with SyncMeter() as m:
        b = graphed.collect().tensors()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert m.host_reads == 0
    assert eager.metrics.summary() == graphed.metrics.summary()
    l1.close()
    l2.close()


def test_warmup_restores_state_in_place():
    p = Pipeline(STAGES[7], CFG, CPU)
    p.iteration()  # optimizer state exists
    snap = snapshot(p.agent, p.optimizer)
    storage = [t.data_ptr() for t in p.agent.parameters()]
    p.iteration()
    restore_(p.agent, p.optimizer, snap)
    assert [t.data_ptr() for t in p.agent.parameters()] == storage
    for t, saved in zip(p.agent.parameters(), snap["module"]):
        assert torch.equal(t, saved)
    p.close()


def test_ppo_config_is_validated_by_the_pipeline():
    with pytest.raises(ValueError, match="n_minibatches"):
        Pipeline(STAGES[3], CFG, CPU, ppo=PPOConfig(n_minibatches=7))


@pytest.mark.slow
def test_ladder_twice_does_not_grow_memory():
    """RSS after a second ladder stays within 64 MiB of the first (allocator noise,
    compile caches); a leak per stage (loggers, threads, buffers) would show."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    stages = [STAGES[i] for i in (1, 3, 4, 6, 7)]
    cfg = CFG.replace(scaling_n_envs=(8, 16))
    run_ladder(cfg, CPU, stages=stages)
    gc.collect()
    first = proc.memory_info().rss
    result = run_ladder(cfg, CPU, stages=stages)
    gc.collect()
    second = proc.memory_info().rss
    assert second - first < 64 * 2**20, (first, second)
    assert all(r["status"] == "ok" for r in result["ladder"])
    assert [r["n_envs"] for r in result["scaling"]] == [8, 16] * 4


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_amp_and_graphed_updates_match_fp32_within_tolerance():
    """bf16 autocast changes the forward's rounding: after one update (16 Adam steps at
    lr 2.5e-4) parameters stay within 2e-3 absolute of the fp32 result; the graphed update
    replays the same bf16 math, so it matches stage 7 to float32 rounding."""
    cuda = torch.device("cuda")
    p = Pipeline(STAGES[3], CFG, cuda)
    batch = p.rollout()
    p.close()

    fp32, amp, graphed = (_update_result(i, batch, cuda) for i in (4, 7, 8))
    for a, b, c in zip(fp32, amp, graphed):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-3)
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_graphed_rollout_step_reads_nothing():
    p = Pipeline(STAGES[8], CFG, torch.device("cuda"))
    p.collector.collect()  # the first step captures the graph
    with SyncMeter(cuda_debug=True) as m:
        r = p.collector.collect()
    assert (m.host_reads, m.cuda_syncs) == (0, 0)
    assert r.actions.min() >= 0 and r.actions.max() < 5
    assert r.dones[0].eq(1).all()  # 16-step episodes, T=16: each rollout starts a new one
    p.close()
