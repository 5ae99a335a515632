"""The benchmark harness: every stage measured the same way.

Per stage: build the pipeline, run one warmup iteration off the clock (``warmup_s``: compile,
capture, autotune) and restore its state, then time steady-state iterations, alternately
without and with the phase clock: the unmarked ones give the headline ``sps``, the marked ones
``phase_ms`` (where the iteration went), and the pair the marks' own overhead. On CUDA the host
synchronizes only at iteration boundaries (phases are CUDA events); on the CPU the clock is
``time.perf_counter``. One more iteration runs under the sync meter to count host reads.
Last, the **compute ceiling**: the same stage's model work alone (T policy forwards over N
envs and the whole update, on tensors already in place, no env, no logging) at its precision,
so ``frac_of_ceiling`` says how much of an iteration is still overhead.
Nothing is extrapolated: every figure comes from iterations that ran.
"""
from __future__ import annotations

import gc
import resource
import signal
import statistics
import time
from collections.abc import Callable

import torch

from ..capture import warmup
from ..config import BenchConfig, RunConfig
from ..device import run_metadata, synchronize
from ..policy import flops_per_sample
from ..ppo import Batch
from ..signals import signum_of
from ..stages import STAGES, Pipeline, Stage, StageSkipped, get_stage
from ..timing import PHASES, lap_cost_s, time_calls, timed
from . import tables
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


def compute_ceiling(pipe: Pipeline, batch, repeats: int) -> float:
    """Median seconds of the stage's model work alone: T policy forwards over N envs on a fixed
    observation and the whole PPO update on ``batch``, through the stage's own executors and
    precision. The pipeline's state is restored afterwards."""
    saved = pipe.state_dict()
    obs = pipe.collector.next_obs()
    policy_step = pipe.stage.rollout_executor.wrap_step(lambda: pipe.collector.act(obs), state=pipe,
                                               generator=pipe.generator)

    def model_work() -> None:
        with torch.no_grad():
            for _ in range(pipe.cfg.n_steps):
                policy_step()
        pipe.ppo_update(batch)

    timings = time_calls(model_work, pipe.device, repeats)  # the first call captures/compiles
    pipe.load_state_dict(saved)
    return timings.median


def _steady_state(pipe: Pipeline, cfg: BenchConfig) -> tuple[list, list, list, list]:
    """Timed iterations after the warmup, plain and phase-marked in turn, until
    ``cfg.iterations`` of each (at least 2 whatever the time budget): their seconds, the
    marked ones' phases, and the learning curve along the way."""
    plain: list[float] = []
    marked: list[float] = []
    phases: list[dict] = []
    curve: list[dict] = []
    budget_end = time.perf_counter() + cfg.stage_timeout_s
    start = time.perf_counter()
    while len(plain) < cfg.iterations and (len(plain) < 2 or time.perf_counter() < budget_end):
        for is_marked in (False, True):
            seconds, ms, out = timed_iteration(pipe, is_marked)
            (marked if is_marked else plain).append(seconds)
            if is_marked:
                phases.append(ms)
            curve.append({"steps": pipe.global_step, "wall_s": time.perf_counter() - start,
                          "mean_return": out["mean_return"]})
    return plain, marked, phases, curve


def _metered_iteration(pipe: Pipeline) -> tuple[SyncMeter, SyncMeter, Batch]:
    """One more iteration under the sync meter: the rollout's meter, the update's, and the
    batch (the compute ceiling's update reuses it)."""
    with SyncMeter(cuda_debug=True) as rollout:
        batch = pipe.rollout()
    with SyncMeter(cuda_debug=True) as update:
        pipe.learn(batch)
    synchronize(pipe.device)
    return rollout, update, batch


def _work_flops(run: RunConfig) -> float:
    """Model FLOPs of one iteration: T x N policy forwards, the update's epochs of training
    passes over them, and the bootstrap values."""
    flops = flops_per_sample(run.spec.view)
    samples = run.n_envs * run.n_steps
    return (samples * (flops["forward"] + run.ppo.update_epochs * flops["train"])
            + run.n_envs * flops["forward"])


def _measure_pipe(pipe: Pipeline, cfg: BenchConfig, row: dict, lap_cost: float,
                  peaks: dict[str, float] | None) -> None:
    """Fill ``row`` with what :func:`measure_stage` measures of ``pipe``, as it goes (a stage
    that fails half-way keeps the figures it got)."""
    run, device = cfg.run, pipe.device
    row["precision"] = pipe.precision.name
    row["warmup_s"] = warmup(pipe)
    plain, marked, phases, curve = _steady_state(pipe, cfg)
    laps = pipe.clock.laps
    m_roll, m_upd, batch = _metered_iteration(pipe)
    ceiling_s = compute_ceiling(pipe, batch, cfg.iterations)
    it_s = statistics.median(plain)
    samples = run.n_envs * run.n_steps
    mem, mem_kind = _peak_memory(device)
    row.update({
        "status": "ok", "iterations": len(plain), "iteration_s": it_s,
        "iteration_s_spread": [min(plain), it_s, max(plain)],
        "sps": samples / it_s,
        "phase_ms": {k: statistics.median(p.get(k, 0.0) for p in phases)
                     for k in PHASES if any(k in p for p in phases)},
        "marked_iteration_s": statistics.median(marked),
        "marks_per_iter": laps,
        "marks_overhead": laps * lap_cost / it_s,
        "marks_ab": statistics.median(marked) / it_s - 1,
        "ceiling_sps": samples / ceiling_s,
        "frac_of_ceiling": ceiling_s / it_s,
        "peak_mem_mb": mem, "mem_kind": mem_kind,
        "mean_return": curve[-1]["mean_return"], "curve": curve,
        "host_reads_per_iter": m_roll.host_reads + m_upd.host_reads,
        "host_reads_rollout_per_step": m_roll.host_reads / run.n_steps,
        "host_reads_update": m_upd.host_reads,
        "host_reads_by_kind": dict(m_roll.counts + m_upd.counts),
        "flops_per_s": _work_flops(run) / it_s,
    })
    row["update_ms"] = row["phase_ms"].get("update", 0.0)
    if device.type == "cuda":
        row["cuda_syncs_per_iter"] = m_roll.cuda_syncs + m_upd.cuda_syncs
    if peaks and pipe.precision.name in peaks:
        row["frac_of_peak"] = row["flops_per_s"] / peaks[pipe.precision.name]


def measure_stage(stage: Stage, cfg: BenchConfig, device: torch.device,
                  peaks: dict[str, float] | None = None, lap_cost: float | None = None) -> dict:
    """Measure one stage at ``cfg.run.n_envs`` x ``cfg.run.n_steps``; a dict of figures or a
    ``status`` saying why not (``skipped: ...`` or ``error: ...``). ``peaks`` (matmul FLOP/s
    per precision name, measured on this device) gives ``frac_of_peak`` at the stage's own
    precision; ``lap_cost`` (seconds per phase mark, measured if not given) turns the marks per
    iteration into their overhead."""
    stage = get_stage(stage)
    run = cfg.run
    row: dict = {"stage": stage.index, "name": stage.name, "lesson": stage.lesson,
                 "n_envs": run.n_envs, "n_steps": run.n_steps}
    try:
        stage.check(device)  # the size was checked by ladder_plan
    except StageSkipped as err:
        return {**row, "status": f"skipped: {err.reason}"}
    # The previous stage's pipeline may still sit in a reference cycle; its buffers must not
    # count against this one's memory.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    pipe = None
    try:
        pipe = Pipeline(stage, run, device)
        _measure_pipe(pipe, cfg, row, lap_cost if lap_cost is not None else lap_cost_s(device),
                      peaks)
    except Exception as err:  # one broken stage must not lose the others' results
        row = {**row, "status": _error_status(err)}
    finally:
        if pipe is not None:
            try:
                pipe.close()
            except Exception as err:
                row = {**row, "status": _error_status(err)}
    return row


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


def ladder_plan(cfg: BenchConfig, device: torch.device, stages: list | None = None,
                scaling: bool = True, ladder: bool = True) -> list[tuple[Stage, BenchConfig]]:
    """What ``run_ladder`` will measure, in order, every configuration checked (stage names,
    minibatch divisibility, memory) before anything runs: the ladder rows (unless ``ladder``
    is False), then the scaling rows (if ``scaling``)."""
    stages = [get_stage(s) for s in (stages if stages is not None else STAGES)]
    if not stages:
        raise ValueError("stages must name at least one stage")
    todo = [(s, cfg) for s in stages] if ladder else []
    if scaling:
        todo += [(s, cfg.replace(n_envs=n)) for s in stages if s.scales
                 for n in cfg.scaling_n_envs]
    for s, c in todo:
        try:
            s.check(device, c.run)
        except StageSkipped as err:
            if err.cause == "memory":  # a size that cannot fit: the caller's error, before any row
                raise
    return todo


def calibrate(device: torch.device, stages: list) -> dict:
    """What every row of a run is measured against: a large matmul's FLOP/s (bf16 on CUDA,
    fp32 on the CPU), the same per precision that ``stages`` run in here, and the cost of one
    phase mark."""
    stages = [get_stage(s) for s in stages]
    precisions = {s.precision(device).name for s in stages if not s.skip_reason(device)}
    return {**matmul_peak_flops(device),
            "peaks": {p: matmul_peak_flops(device, dtype=PEAK_DTYPES[p])["peak_flops"]
                      for p in sorted(precisions)},
            "lap_cost_s": lap_cost_s(device)}


def run_ladder(cfg: BenchConfig, device: torch.device, stages: list[Stage] | None = None,
               scaling: bool = True, profile: str | None = None,
               progress: Callable[[int, int, str], None] | None = None, ladder: bool = True,
               on_row: Callable[[str, dict, dict], None] | None = None,
               calibration: dict | None = None) -> dict:
    """The ladder (every stage at one N, T) and the scaling sweep (the stages whose env is
    vectorized on the device, over ``cfg.scaling_n_envs``); ``ladder=False``: the sweep only.

    Every configuration is checked before the first is measured. ``on_row(section, row,
    result)`` is called as each row is added ("ladder" or "scaling"), so a caller can keep it
    at once. A KeyboardInterrupt (or a stop signal under :func:`labkit.signals.stop_signals`)
    ends the sweep early: the result keeps every measurement that finished and says
    ``"interrupted": "<signal name>"``. ``calibration`` (from :func:`calibrate`, for parts
    of one run measured by several calls) is measured here if not given."""
    todo = ladder_plan(cfg, device, stages, scaling, ladder)
    stages = [s for s, c in todo if c is cfg and ladder]
    cal = calibration if calibration is not None else calibrate(device, [s for s, _ in todo])
    peaks, lap_cost = cal["peaks"], cal["lap_cost_s"]
    result = {"meta": run_metadata(device, profile), "config": cfg.to_dict(), **cal,
              "ladder": [], "scaling": []}
    try:
        for i, (stage, c) in enumerate(todo):
            if progress:
                progress(i, len(todo), f"{stage.name} N={c.run.n_envs}")
            row = measure_stage(stage, c, device, peaks=peaks, lap_cost=lap_cost)
            section = "ladder" if i < len(stages) else "scaling"
            result[section].append(row)
            if on_row:
                on_row(section, row, result)
    except KeyboardInterrupt as stop:
        result["interrupted"] = signal.Signals(signum_of(stop)).name
    add_ratios(result["ladder"])
    top = headline(result)
    if top:
        result["headline"] = top
    return result


def format_ladder(result: dict) -> str:
    """The ladder table as text, with the device it was measured on."""
    m = result["meta"]
    lines = [tables.LADDER.text(result["ladder"]),
             f"device: {m['device_name']} ({m['device']}), torch {m['torch']}, "
             f"peak {result['peak_flops'] / 1e9:.1f} GFLOP/s ({result['peak_dtype']} matmul)"]
    if result.get("interrupted"):
        lines.append(f"PARTIAL: interrupted by {result['interrupted']}; what is not listed did "
                     "not run")
    return "\n".join(lines)


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

