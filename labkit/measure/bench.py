"""The benchmark harness: every stage measured the same way.

Per stage: build the pipeline, run one warmup iteration off the clock (``warmup_s``: compile,
capture, autotune) and restore its state; a stage that compiles only where it pays then times
eager against compiled, also off the clock and undone (``choose_s``, ``executor_choices``).
Then the stages at one N are timed together, in rounds: each round runs one unmarked and one
phase-marked iteration of every stage in turn, so a machine that slows down half-way slows them
alike. The unmarked iterations give the headline
``sps`` (median) and its spread, the marked ones ``phase_ms`` (where the iteration went), and
the pair the marks' own overhead. On CUDA the host synchronizes only at iteration boundaries
(phases are CUDA events); on the CPU the clock is ``time.perf_counter``. One more iteration
runs under the sync meter to count host reads, device reads (a sync on a GPU) apart from
host-scalar reads (CPU tensors on every device). Last, the **compute ceiling**: the same stage's
model work alone (T policy forwards over N envs and the whole update, on tensors already in
place, no env, no logging) at its precision, timed in rounds too, so ``frac_of_ceiling`` says
how much of an iteration is still overhead. Every row gets a noise verdict
(:mod:`labkit.measure.noise`). Nothing is extrapolated: every figure comes from iterations
that ran.
"""
from __future__ import annotations

import gc
import resource
import signal
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..capture import counting_nodes, warmup
from ..config import BenchConfig, RunConfig, available_memory, memory_estimate
from ..device import run_metadata, synchronize
from ..executors import describe_model_math
from ..policy import flops_per_sample, sample_action
from ..ppo import Batch
from ..signals import raise_if_stopped, signum_of
from ..stages import STAGES, Pipeline, PipelineState, Stage, StageSkipped, get_stage
from ..timing import PHASES, lap_cost_s, timed
from . import noise, tables
from .noise import Wait
from .profiling import LaunchCount
from .syncmeter import SyncMeter

PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_peak_flops(device: torch.device, seconds: float = 1.0,
                      dtype: torch.dtype | None = None) -> dict:
    """Measured peak: a large square matmul in ``dtype`` (default: bf16 on CUDA, fp32 on the
    CPU), best of repeats."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    synchronize(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        seconds, _ = timed(lambda: [a @ b for _ in range(4)], device)
        best = max(best, 4 * 2 * n**3 / seconds)
    return {"peak_flops": best, "peak_dtype": str(dtype).removeprefix("torch."), "peak_n": n}


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, "process max RSS"


def timed_iteration(pipe: Pipeline, marked: bool) -> tuple[float, dict[str, float], dict]:
    """Seconds of one iteration (synchronized at both ends), its phases if ``marked``, and
    what the iteration returned."""
    def iteration() -> dict:
        if marked:
            pipe.clock.start()
        return pipe.iteration()

    elapsed, out = timed(iteration, pipe.device)  # its ends: the only syncs the harness adds
    return elapsed, (pipe.clock.stop() if marked else {}), out


def _policy(pipe: Pipeline) -> Callable:
    """The policy as the stage's rollout executor runs it: ``pipe.policy``; where the whole
    step is one region (``compile_unit="step"``, the policy eager inside it), the agent
    wrapped as the model unit wraps it, running what the step's choice kept."""
    region = getattr(pipe.collector, "region", None)
    if region is None:
        return pipe.policy
    policy = pipe.stage.rollout_executor.wrap_model(pipe.agent)
    if hasattr(region, "kept"):  # a Choice: the step's timed or forced choice
        policy.keep(region.kept)
    return policy


def model_work(pipe: Pipeline, batch) -> Callable[[], None]:
    """The stage's model work alone, what its compute ceiling times: T policy forwards over N
    envs on a fixed observation and the whole PPO update on ``batch``, through the stage's own
    executors and precision. It changes the pipeline's state (save and restore around it)."""
    obs, policy = pipe.collector.next_obs(), _policy(pipe)
    policy_step = pipe.stage.rollout_executor.wrap_step(
        lambda: sample_action(policy, obs, generator=pipe.generator), state=pipe,
        generator=pipe.generator)

    def work() -> None:
        with torch.no_grad():
            for _ in range(pipe.cfg.n_steps):
                policy_step()
        pipe.ppo_update(batch)

    return work


@dataclass
class _Timing:
    """One stage's timed iterations as they accumulate over the rounds of its group."""

    pipe: Pipeline
    row: dict
    plain: list[float] = field(default_factory=list)
    marked: list[float] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)
    curve: list[dict] = field(default_factory=list)
    wait_s: float = 0.0
    wall_s: float = 0.0
    source: str = "schedstat"
    ceiling: list[float] = field(default_factory=list)
    meters: tuple = ()
    work: Callable[[], None] | None = None  # the model work the ceiling times
    saved: PipelineState | None = None  # the state to restore after it

    def sample(self, start: float) -> None:
        """One plain and one phase-marked iteration, with the run-queue wait around each."""
        for is_marked in (False, True):
            with Wait() as w:
                seconds, ms, out = timed_iteration(self.pipe, is_marked)
            self.wait_s, self.wall_s, self.source = (self.wait_s + w.seconds,
                                                     self.wall_s + w.wall_s, w.source)
            (self.marked if is_marked else self.plain).append(seconds)
            if is_marked:
                self.phases.append(ms)
            self.curve.append({"steps": self.pipe.global_step,
                               "wall_s": time.perf_counter() - start,
                               "mean_return": out["mean_return"]})


def _steady_state(timings: list[_Timing], cfg: BenchConfig) -> None:
    """Timed iterations after the warmup, in rounds: each round times one plain and one
    phase-marked iteration of every stage in turn, so a machine that slows down during the run
    slows every stage alike instead of the later ones. A stage stops after ``cfg.iterations``
    rounds, or once ``cfg.stage_timeout_s`` of its own time was spent and it has 3 (a stage
    that raises is marked and leaves the rounds)."""
    start = time.perf_counter()
    least = min(3, cfg.iterations)
    for i in range(cfg.iterations):
        for t in timings:
            if t.row.get("status", "ok") != "ok":
                continue
            if i >= least and t.wall_s > cfg.stage_timeout_s:
                continue
            try:
                t.sample(start)
            except Exception as err:  # one broken stage must not lose the others' results
                t.row["status"] = _error_status(err)
        raise_if_stopped()  # a stop that something swallowed ends the rounds here


def _ceilings(timings: list[_Timing], cfg: BenchConfig) -> None:
    """Each stage's host reads (one metered iteration) and compute ceiling: its model work
    called once untimed (it compiles or captures), then timed once per round in turn with the
    other stages, like the iterations, and its state restored. The ceiling is the fastest call:
    it is a bound, and noise only adds time."""
    for t in timings:
        if t.row.get("status", "ok") != "ok":
            continue
        try:
            m_roll, m_upd, batch = _metered_iteration(t.pipe)
            t.meters, t.saved = (m_roll, m_upd), t.pipe.state_dict()
            t.work = model_work(t.pipe, batch)
            t.work()
        except Exception as err:  # one broken stage must not lose the others' results
            t.row["status"] = _error_status(err)
    for _ in range(cfg.iterations):
        for t in timings:
            if t.work is not None and t.row.get("status", "ok") == "ok":
                try:
                    t.ceiling.append(timed(t.work, t.pipe.device)[0])
                except Exception as err:
                    t.row["status"] = _error_status(err)
        raise_if_stopped()
    for t in timings:
        if t.saved is not None:
            t.pipe.load_state_dict(t.saved)


def _metered_iteration(pipe: Pipeline) -> tuple[SyncMeter, SyncMeter, Batch]:
    """One more iteration under the sync meter: the rollout's meter, the update's, and the
    batch (the compute ceiling's update reuses it). Each meter also holds the kernels its
    part would launch on a GPU (``launched``: :class:`labkit.measure.profiling.LaunchCount`,
    told each op by the meter's own data flow, compiled regions' kernels included)."""
    with SyncMeter(cuda_debug=True, device=pipe.device) as rollout, LaunchCount() as launched:
        batch = pipe.rollout()
    rollout.launched = launched
    with SyncMeter(cuda_debug=True, device=pipe.device) as update, LaunchCount() as launched:
        pipe.learn(batch)
    update.launched = launched
    synchronize(pipe.device)
    return rollout, update, batch


def _graph_nodes(meter: SyncMeter) -> int:
    """The kernels a meter's part replayed inside CUDA graphs (``graph:<op>``)."""
    return sum(n for op, n in meter.launched.counts.items() if op.startswith("graph:"))


def _update_flops(run: RunConfig) -> float:
    """Model FLOPs of one iteration's update: its epochs of training passes over N x T."""
    return (run.n_envs * run.n_steps * run.ppo.update_epochs
            * flops_per_sample(run.spec.view, run.model)["train"])


def _work_flops(run: RunConfig) -> float:
    """Model FLOPs of one iteration: T x N policy forwards, the update's epochs of training
    passes over them, and the bootstrap values."""
    flops = flops_per_sample(run.spec.view, run.model)
    samples = run.n_envs * run.n_steps
    return (samples * (flops["forward"] + run.ppo.update_epochs * flops["train"])
            + run.n_envs * flops["forward"])


def _build(stage: Stage, run: RunConfig, device: torch.device, row: dict) -> Pipeline | None:
    """The stage's pipeline, warmed up (``row["warmup_s"]``, its peak memory), or None with
    ``row["status"]`` saying why not."""
    gc.collect()  # a previous pipeline in a reference cycle must not hold its buffers
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    pipe = None
    try:
        pipe = Pipeline(stage, run, device)
        row["precision"] = pipe.precision.name
        if pipe.precision.why:  # a component chose it on this device: the reason, printed
            row["precision_why"] = pipe.precision.why
        start = time.perf_counter()
        with counting_nodes(LaunchCount):  # what each captured graph holds, counted
            row["warmup_s"] = warmup(pipe)
        row["model_math"] = pipe.math.kinds()
        if pipe.math.executor_choices:  # what a stage that compiles where it pays kept, and why
            row["executor_choices"] = pipe.math.executor_choices
            row["choose_s"] = time.perf_counter() - start - row["warmup_s"]
        if pipe.math.conv_choices:  # how each part runs its convolutions, and why
            row["conv_math"] = pipe.math.conv_choices
        mem, row["mem_kind"] = _peak_memory(device)
        row["peak_mem_mb"] = mem - base / 2**20
        return pipe
    except Exception as err:
        row["status"] = _error_status(err)
        if pipe is not None:
            pipe.close()
        return None


def shares(row: dict, peak: float) -> None:
    """``frac_of_peak`` (the iteration's model work) and ``update_frac_of_peak`` (the update's,
    over its phase) of a measured row, against ``peak``: one denominator for every row of a
    ladder, the device's matmul peak (bf16 on CUDA, fp32 on the CPU), whatever precision a
    stage runs in. The row keeps the peak it was divided by (``peak_flops``)."""
    row["peak_flops"] = peak
    row["frac_of_peak"] = row["flops_per_s"] / peak
    if row.get("update_flops_per_s") is not None:
        row["update_frac_of_peak"] = row["update_flops_per_s"] / peak


def one_denominator(result: dict) -> None:
    """Every row recorded before rows kept the one peak they were divided by (each stage by
    its own precision's peak, then) put on one (see :func:`shares`): its run's matmul peak
    where the file keeps its runs (``record``), else ``result["peak_flops"]``, and its update's
    FLOP/s from its update phase and the file's run config. Rows that keep theirs are left
    as they were measured."""
    try:
        run = RunConfig.from_dict(result["config"]["run"])
    except (KeyError, TypeError, ValueError):  # no config, or one an older labkit wrote
        run = None
    runs = result.get("runs") or {}
    for row in result.get("ladder", []) + result.get("scaling", []):
        if row.get("status") != "ok" or row.get("flops_per_s") is None or "peak_flops" in row:
            continue
        update_ms = row.get("phase_ms", {}).get("update", 0.0)
        if "update_flops_per_s" not in row and run is not None and update_ms > 0:
            at = run.replace(n_envs=row["n_envs"], n_steps=row["n_steps"])
            row["update_flops_per_s"] = _update_flops(at) / (update_ms / 1e3)
        shares(row, runs.get(row.get("run"), {}).get("peak_flops") or result["peak_flops"])


def _finish(t: _Timing, cfg: BenchConfig, lap_cost: float, peak: float | None) -> None:
    """Fill ``t.row`` from its timed iterations, its metered iteration (host reads) and its
    compute ceiling, and judge it."""
    pipe, row, run, plain = t.pipe, t.row, cfg.run, t.plain
    laps = pipe.clock.laps
    m_roll, m_upd = t.meters
    ceiling_s = min(t.ceiling)
    it_s = statistics.median(plain)
    samples = run.n_envs * run.n_steps
    row.update({
        "status": "ok", "iterations": len(plain), "iteration_s": it_s,
        "iteration_s_spread": [min(plain), it_s, max(plain)], "iteration_s_samples": plain,
        "sps": samples / it_s, "sps_spread": [samples / max(plain), samples / it_s,
                                              samples / min(plain)],
        "wait_share": t.wait_s / t.wall_s if t.wall_s else 0.0, "wait_source": t.source,
        "phase_ms": {k: statistics.median(p.get(k, 0.0) for p in t.phases)
                     for k in PHASES if any(k in p for p in t.phases)},
        "marked_iteration_s": statistics.median(t.marked),
        "marked_iteration_s_samples": t.marked, "phase_ms_samples": t.phases,
        "marks_per_iter": laps,
        "marks_overhead": laps * lap_cost / it_s,
        "marks_ab": statistics.median(t.marked) / it_s - 1,
        "ceiling_sps": samples / ceiling_s,
        "frac_of_ceiling": ceiling_s / it_s,
        "mean_return": t.curve[-1]["mean_return"], "curve": t.curve,
        "host_reads_per_iter": m_roll.host_reads + m_upd.host_reads,
        "host_reads_rollout_per_step": m_roll.host_reads / run.n_steps,
        "host_reads_update": m_upd.host_reads,
        "host_reads_by_kind": dict(m_roll.counts + m_upd.counts),
        "device_reads_per_iter": m_roll.device_reads + m_upd.device_reads,
        "kernels_per_step": m_roll.launched.total / run.n_steps,
        "kernels_per_minibatch": m_upd.launched.total / (run.ppo.update_epochs
                                                         * run.ppo.n_minibatches),
        "kernels_top": {part: dict(m.launched.counts.most_common(8))
                        for part, m in (("rollout", m_roll), ("update", m_upd))},
        "device_reads_rollout_per_step": m_roll.device_reads / run.n_steps,
        "device_reads_update": m_upd.device_reads,
        "host_scalar_reads_per_iter": m_roll.host_scalar_reads + m_upd.host_scalar_reads,
        "host_scalar_reads_update": m_upd.host_scalar_reads,
        "flops_per_s": _work_flops(run) / it_s,
    })
    if any("graph_replay" in m.launched.counts for m in t.meters):  # of which in CUDA graphs
        row["graph_kernels_per_step"] = _graph_nodes(m_roll) / run.n_steps
        row["graph_kernels_per_minibatch"] = _graph_nodes(m_upd) / (run.ppo.update_epochs
                                                                   * run.ppo.n_minibatches)
    row["update_ms"] = row["phase_ms"].get("update", 0.0)
    if pipe.device.type == "cuda":
        row["cuda_syncs_per_iter"] = m_roll.cuda_syncs + m_upd.cuda_syncs
        row["cuda_sync_sites"] = dict(m_roll.cuda_sync_sites + m_upd.cuda_sync_sites)
    if row["update_ms"] > 0:  # the update's model work over its phase (marked iterations)
        row["update_flops_per_s"] = _update_flops(run) / (row["update_ms"] / 1e3)
    if peak:
        shares(row, peak)
    noise.judge(row)


def measure_stages(stages: list, cfg: BenchConfig, device: torch.device,
                   peak: float | None = None, lap_cost: float | None = None
                   ) -> list[dict]:
    """Measure ``stages`` at ``cfg.run.n_envs`` x ``cfg.run.n_steps``, one row each: a dict of
    figures with its noise verdict, or a ``status`` saying why not (``skipped: ...`` or
    ``error: ...``). Each is built and warmed up in turn, then their timed iterations are
    interleaved in rounds (all pipelines alive at once, if their memory estimates fit
    together; else one stage at a time, ``interleaved`` says with how many). ``peak``
    (matmul FLOP/s measured on this device, one for every stage) gives ``frac_of_peak`` and
    ``update_frac_of_peak`` (:func:`shares`); ``lap_cost`` (seconds per phase mark, measured
    if not given) turns the marks per iteration into their overhead."""
    stages, run = [get_stage(s) for s in stages], cfg.run
    lap_cost = lap_cost if lap_cost is not None else lap_cost_s(device)
    free = available_memory(device)
    if len(stages) > 1 and free is not None and memory_estimate(run) * len(stages) > free / 2:
        return [row for s in stages for row in measure_stages([s], cfg, device, peak, lap_cost)]
    rows, timings = [], []
    for stage in stages:
        row = {"stage": stage.index, "name": stage.name, "lesson": stage.lesson,
               "n_envs": run.n_envs, "n_steps": run.n_steps}
        rows.append(row)
        try:
            stage.check(device)  # the size was checked by ladder_plan
        except StageSkipped as err:
            row["status"] = f"skipped: {err.reason}"
            continue
        pipe = _build(stage, run, device, row)
        if pipe is not None:
            timings.append(_Timing(pipe, row))
    try:
        _steady_state(timings, cfg)
        _ceilings(timings, cfg)
        for t in timings:
            t.row["interleaved"] = len(timings)
            if t.row.get("status", "ok") == "ok":
                try:
                    _finish(t, cfg, lap_cost, peak)
                except Exception as err:  # one broken stage must not lose the others' results
                    t.row["status"] = _error_status(err)
    finally:
        for t in timings:
            try:
                t.pipe.close()
            except Exception as err:
                t.row["status"] = _error_status(err)
    return rows


def measure_stage(stage: Stage, cfg: BenchConfig, device: torch.device,
                  peak: float | None = None, lap_cost: float | None = None) -> dict:
    """One stage's row (see :func:`measure_stages`)."""
    return measure_stages([stage], cfg, device, peak, lap_cost)[0]


def _error_status(err: Exception, limit: int = 300) -> str:
    """``error: <type>: <message>`` on one line (torch's messages run to pages)."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return "error: " + (text if len(text) <= limit else text[:limit - 3] + "...")


def add_ratios(rows: list[dict]) -> None:
    """``x_vs_stage0`` and ``x_vs_prev`` (over the row just before) of each measured ladder
    row, between rows of the same run only (a row's ``run``, where parts of a record merged
    rows of several runs): numbers from different runs are never divided."""
    first = STAGES[0].name
    base = next((r for r in rows if r.get("status") == "ok" and r["name"] == first), None)
    prev = None
    for r in rows:
        if r.get("status") == "ok":
            same = base is not None and base.get("run") == r.get("run")
            r["x_vs_stage0"] = r["sps"] / base["sps"] if same else None
            ok_prev = prev is not None and prev.get("status") == "ok" \
                and prev.get("run") == r.get("run")
            r["x_vs_prev"] = r["sps"] / prev["sps"] if ok_prev else None  # the row just before
        prev = r


def headline(result: dict) -> dict | None:
    """The final measured stage's best rate over every N, and the best row overall."""
    ok = [r for r in result["ladder"] + result["scaling"] if r.get("status") == "ok"]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["sps"])
    final = max(r["stage"] for r in ok)
    best_final = max((r for r in ok if r["stage"] == final), key=lambda r: r["sps"])
    return {"stage": final, "name": best_final["name"], "n_envs": best_final["n_envs"],
            "sps": best_final["sps"], "best_overall": {k: best[k] for k in ("name", "n_envs",
                                                                            "sps")}}


def bounded(stage: Stage, cfg: BenchConfig) -> BenchConfig:
    """``cfg`` for ``stage``'s ladder row: as it is, or for a stage that steps one env at a time
    (stages 0 and 2, whose iterations grow on the host with N x T, minutes on a GPU at its
    ladder's N) where N x T passes ``cfg.loop_steps_bound``, ``cfg`` at the same N with the
    largest T whose N x T keeps within the bound and fills the minibatches (at least 1).
    Its rate is still over whole iterations, rollout and update, of its own steps."""
    run = cfg.run
    if not stage.one_env_at_a_time or run.batch_size <= cfg.loop_steps_bound:
        return cfg
    fits = []
    for t in range(1, run.n_steps + 1):
        try:
            run.ppo.check_batch(run.n_envs, t)
        except ValueError:
            continue
        fits.append(t)
    within = [t for t in fits if run.n_envs * t <= cfg.loop_steps_bound]
    return cfg.replace(n_steps=max(within) if within else min(fits))


def ladder_plan(cfg: BenchConfig, device: torch.device, stages: list | None = None,
                scaling: bool = True, ladder: bool = True
                ) -> list[tuple[str, Stage, BenchConfig]]:
    """What ``run_ladder`` will measure, in order, as (section, stage, its config), every
    configuration checked (stage names, minibatch divisibility, memory) before anything runs:
    the ladder rows (unless ``ladder`` is False; a stage that steps one env at a time at
    most ``cfg.loop_steps_bound`` env steps an iteration, see :func:`bounded`, after the
    others), then the scaling rows (if ``scaling``)."""
    stages = [get_stage(s) for s in (stages if stages is not None else STAGES)]
    if not stages:
        raise ValueError("stages must name at least one stage")
    rows = [("ladder", s, bounded(s, cfg)) for s in stages] if ladder else []
    # the rows at the ladder's own T first: a stay cut short keeps those
    todo = sorted(rows, key=lambda row: row[2] is not cfg)
    if scaling:
        for n in cfg.scaling_n_envs:  # N by N: the stages at one N are measured together
            at_n = cfg.replace(n_envs=n)
            todo += [("scaling", s, at_n) for s in stages if s.scales]
    for _, s, c in todo:
        try:
            s.check(device, c.run)
        except StageSkipped as err:
            if err.cause == "memory":  # a size that cannot fit: the caller's error, before any row
                raise
    return todo


def calibrate(device: torch.device, stages: list) -> dict:
    """What every row of a run is measured against: a large matmul's FLOP/s (bf16 on CUDA,
    fp32 on the CPU; every row's share of peak divides by it), for reference the same in each
    precision that ``stages`` run in here (each dtype measured once: the peak's own is the
    peak), and the cost of one phase mark."""
    stages = [get_stage(s) for s in stages]
    precisions = {s.precision(device).name for s in stages if not s.skip_reason(device)}
    top = matmul_peak_flops(device)
    return {**top,
            "peaks": {p: top["peak_flops"] if PEAK_DTYPES[p] == getattr(torch, top["peak_dtype"])
                      else matmul_peak_flops(device, dtype=PEAK_DTYPES[p])["peak_flops"]
                      for p in sorted(precisions)},
            "lap_cost_s": lap_cost_s(device)}


def run_ladder(cfg: BenchConfig, device: torch.device, stages: list[Stage] | None = None,
               scaling: bool = True, profile: str | None = None,
               progress: Callable[[int, int, str], None] | None = None, ladder: bool = True,
               on_row: Callable[[str, dict, dict], None] | None = None,
               calibration: dict | None = None, threads: int | None = None) -> dict:
    """The ladder (every stage at one N, T) and the scaling sweep (the stages whose env is
    vectorized on the device, over ``cfg.scaling_n_envs``); ``ladder=False``: the sweep only.

    Every configuration is checked before the first is measured. ``on_row(section, row,
    result)`` is called as each row is added ("ladder" or "scaling"), so a caller can keep it
    at once. A KeyboardInterrupt (or a stop signal under :func:`labkit.signals.stop_signals`)
    ends the sweep early: the result keeps every measurement that finished and says
    ``"interrupted": "<signal name>"``. ``calibration`` (from :func:`calibrate`, for parts
    of one run measured by several calls) is measured here if not given.

    Noise: on the CPU, torch's intra-op threads are set for the run by
    :func:`labkit.measure.noise.choose_threads` (``threads`` overrides; restored afterwards);
    each row carries its spread, run-queue wait and noise verdict, and ``result["noise"]`` the
    run's (how many rows are noisy, the load before and after, one line to print)."""
    todo = ladder_plan(cfg, device, stages, scaling, ladder)
    load_before, saved_threads = noise.load(), torch.get_num_threads()
    threads_note = noise.choose_threads(device, threads)
    try:
        cal = calibration if calibration is not None else calibrate(device,
                                                                     [s for _, s, _ in todo])
        result = {"meta": run_metadata(device, profile), "config": cfg.to_dict(), **cal,
                  "threads": threads_note, "ladder": [], "scaling": []}
        _measure_plan(todo, cfg, device, cal, result, progress, on_row)
    finally:
        torch.set_num_threads(saved_threads)
    result["ladder"].sort(key=lambda r: r["stage"])  # bounded rows were measured last
    add_ratios(result["ladder"])
    result["noise"] = noise.summary(result["ladder"] + result["scaling"], load_before,
                                    noise.load(), threads_note["cores"], threads_note)
    top = headline(result)
    if top:
        result["headline"] = top
    return result


def _measure_plan(todo: list, cfg: BenchConfig, device: torch.device, cal: dict, result: dict,
                  progress: Callable | None, on_row: Callable | None) -> None:
    """Measure ``todo`` into ``result`` a group at a time (the ladder at its N, its stages
    bounded to fewer steps apart, then each N of the sweep), each group's stages interleaved;
    a stop keeps the groups that finished. A bounded row says its bound (``steps_bound``)."""
    groups: dict[tuple[str, int, int], tuple[BenchConfig, list]] = {}
    for section, stage, c in todo:  # the plan's order: the ladder, then the sweep N by N
        key = (section, c.run.n_envs, c.run.n_steps)
        groups.setdefault(key, (c, []))[1].append(stage)
    done = 0
    try:
        for (section, _, _), (c, stages) in groups.items():
            if progress:
                progress(done, len(todo), f"{len(stages)} stage(s) at N={c.run.n_envs}")
            # No pipeline is alive between groups: drop the compiled code of the groups before.
            # Dynamo keeps every compiled version of a function on its one code object, and a
            # sweep (each N, each stage's precision, stage 7's two ways to run convolutions)
            # passed its recompile limit (8), where a fullgraph compile fails.
            torch.compiler.reset()
            for row in measure_stages(stages, c, device, peak=cal["peak_flops"],
                                      lap_cost=cal["lap_cost_s"]):
                if c.run.n_steps != cfg.run.n_steps:
                    row["steps_bound"] = {"env_steps": cfg.loop_steps_bound,
                                          "n_steps_of": cfg.run.n_steps}
                result[section].append(row)
                if on_row:
                    on_row(section, row, result)
            done += len(stages)
    except KeyboardInterrupt as stop:
        result["interrupted"] = signal.Signals(signum_of(stop)).name


def format_ladder(result: dict) -> str:
    """The ladder table as text, with the device it was measured on."""
    return tables.LADDER.text(result["ladder"]) + "\n" + ladder_notes(result)


def ladder_notes(result: dict) -> str:
    """What is said under a ladder table: its device, each precision chosen and why, and
    whether the run was cut short."""
    m = result["meta"]
    threads = result.get("threads")
    lines = [f"device: {m['device_name']} ({m['device']}), torch {m['torch']}, "
             f"peak {result['peak_flops'] / 1e9:.1f} GFLOP/s ({result['peak_dtype']} matmul)"
             + (f", {threads['threads']} thread(s) ({threads['chosen_by']})" if threads else "")]
    chosen = {(r["precision"], r["precision_why"]) for r in result["ladder"]
              if r.get("precision_why")}
    lines += [f"precision {name}: {why}" for name, why in sorted(chosen)]
    if any(r.get("model_math") for r in result["ladder"]):
        lines.append("math: the model math of the rollout/update, e eager, c compiled, g "
                     "replayed in a CUDA graph; * kept by timing both at warmup; +mm the "
                     "convolutions as matmuls")
    lines += [f"model math, {r['stage']} {r['name']}: "
              + describe_model_math(r["executor_choices"], r.get("conv_math"))
              for r in result["ladder"] if r.get("executor_choices")]
    bound = [r for r in result["ladder"] if r.get("steps_bound") and r.get("status") == "ok"]
    if bound:
        lines.append(
            "bounded: " + ", ".join(f"{r['stage']} {r['name']} at T={r['n_steps']}" for r in bound)
            + f" of {bound[0]['steps_bound']['n_steps_of']}: a stage that steps one env at a "
            f"time is timed over whole iterations (rollout and update) of at most "
            f"{bound[0]['steps_bound']['env_steps']:,} env steps, at the ladder's N")
    if result.get("interrupted"):
        lines.append(f"PARTIAL: interrupted by {result['interrupted']}; what is not listed did "
                     "not run")
    return "\n".join(textwrap.fill(line, 96, subsequent_indent="  ", break_on_hyphens=False,
                                   break_long_words=False) for line in lines)


def format_noise(result: dict) -> str:
    """Why each noisy row is noisy, then the run's verdict line ("" for a result without)."""
    if "noise" not in result:
        return ""
    rows = [r for s in ("ladder", "scaling") for r in result.get(s, []) if r.get("noisy")]
    return "\n".join([f"noisy: {r['name']} N={r['n_envs']}: {'; '.join(r['noise'])}"
                      for r in rows] + [result["noise"]["line"]])


def phase_table(result: dict) -> tables.Table:
    """The phases table for the phases that some row of ``result`` measured."""
    rows = [r for r in result["ladder"] if r.get("status") == "ok"]
    return tables.phases([k for k in PHASES if any(k in r["phase_ms"] for r in rows)], PHASES)


def format_phases(result: dict) -> str:
    """Milliseconds per iteration in each phase, per stage, and the marks' own overhead."""
    rows = [r for r in result["ladder"] if r.get("status") == "ok"]
    return (phase_table(result).text(rows) + "\nms per iteration (median of the marked "
            "iterations). marks: phase marks per iteration x measured cost of one mark, over "
            "the iteration; A/B: marked vs unmarked iterations of the same run (noisy on a "
            "shared machine)")


def format_scaling(result: dict) -> str:
    """The scaling sweep as text."""
    return tables.SCALING.text(result["scaling"])

