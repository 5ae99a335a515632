"""The benchmark harness: every stage measured the same way.

Per stage: build the pipeline, run one warmup iteration off the clock (``warmup_s``; it
compiles, captures, autotunes) and restore its state, then time steady-state iterations
(median of >= 2, more while the stage's time budget lasts). On CUDA, events mark rollout and
update inside an iteration and the host synchronizes only at iteration boundaries; on the CPU,
``time.perf_counter``. One more iteration runs under the sync meter to count host reads.
Nothing is extrapolated: every figure comes from iterations that ran.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import statistics
import subprocess
import time
from dataclasses import replace

import torch

from . import __version__
from .compile import warmup
from .config import RunConfig
from .device import device_name, synchronize
from .policy import flops_per_sample
from .ppo import PPOConfig
from .stages import STAGES, Pipeline, Stage, StageSkipped
from .syncmeter import SyncMeter


def metadata(device: torch.device, profile: str | None = None) -> dict:
    """Where and when a result was measured."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"device": device.type, "device_name": device_name(device),
            "torch": torch.__version__, "labkit": __version__, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "git_commit": commit or "unknown", "profile": profile,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def matmul_peak_flops(device: torch.device, seconds: float = 1.0) -> dict:
    """Measured peak: a large square matmul (bf16 on CUDA, fp32 on the CPU), best of repeats."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    synchronize(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    return {"peak_flops": best, "peak_dtype": str(dtype).removeprefix("torch."), "peak_n": n}


class _Clock:
    """Marks inside an iteration without syncing: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (call after synchronizing)."""
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, "process max RSS"


def measure_stage(stage: Stage, cfg: RunConfig, device: torch.device,
                  ppo: PPOConfig | None = None, peak_flops: float | None = None) -> dict:
    """Measure one stage at ``cfg.n_envs`` x ``cfg.n_steps``; a dict of figures (or status)."""
    ppo = ppo or PPOConfig()
    row: dict = {"stage": stage.index, "name": stage.name, "lesson": stage.lesson,
                 "n_envs": cfg.n_envs, "n_steps": cfg.n_steps}
    try:
        pipe = Pipeline(stage, cfg, device, ppo, n_iterations=cfg.iterations + 1)
    except StageSkipped as err:
        return {**row, "status": f"skipped: {str(err).split(': ', 1)[1]}"}
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row["precision"] = pipe.precision
        row["warmup_s"] = warmup(pipe)
        times, rollouts, updates, curve = [], [], [], []
        budget_end = time.perf_counter() + cfg.stage_timeout_s
        start = time.perf_counter()
        while len(times) < cfg.iterations and (len(times) < 2 or time.perf_counter() < budget_end):
            clock = _Clock(device)
            synchronize(device)
            t0 = time.perf_counter()
            clock.mark()
            batch = pipe.rollout()
            clock.mark()
            out = pipe.learn(batch)
            clock.mark()
            synchronize(device)  # iteration boundary: the only sync the harness adds
            times.append(time.perf_counter() - t0)
            rollout_s, update_s = clock.intervals()
            rollouts.append(rollout_s)
            updates.append(update_s)
            curve.append({"steps": pipe.collector.global_step,
                          "wall_s": time.perf_counter() - start,
                          "mean_return": out["mean_return"]})
        with SyncMeter(cuda_debug=True) as m_roll:
            batch = pipe.rollout()
        with SyncMeter(cuda_debug=True) as m_upd:
            pipe.learn(batch)
        synchronize(device)
        it_s = statistics.median(times)
        samples = cfg.n_envs * cfg.n_steps
        flops = flops_per_sample(cfg.spec.view)
        work = samples * (flops["forward"] + ppo.update_epochs * flops["train"]) \
            + cfg.n_envs * flops["forward"]
        mem, mem_kind = _peak_memory(device)
        row.update({
            "status": "ok", "iterations": len(times), "iteration_s": it_s,
            "sps": samples / it_s,
            "rollout_sps": samples / statistics.median(rollouts),
            "update_ms": 1e3 * statistics.median(updates),
            "peak_mem_mb": mem, "mem_kind": mem_kind,
            "mean_return": curve[-1]["mean_return"], "curve": curve,
            "host_reads_per_iter": m_roll.host_reads + m_upd.host_reads,
            "host_reads_rollout_per_step": m_roll.host_reads / cfg.n_steps,
            "host_reads_update": m_upd.host_reads,
            "host_reads_by_kind": dict(m_roll.counts + m_upd.counts),
            "flops_per_s": work / it_s,
        })
        if device.type == "cuda":
            row["cuda_syncs_per_iter"] = m_roll.cuda_syncs + m_upd.cuda_syncs
        if peak_flops:
            row["frac_of_peak"] = row["flops_per_s"] / peak_flops
    except Exception as err:  # one broken stage must not lose the others' results
        row = {**row, "status": f"error: {type(err).__name__}: {err}"}
        for key in ("warmup_s", "precision"):
            row.pop(key, None)
    finally:
        pipe.close()
    return row


def _add_ratios(rows: list[dict]) -> None:
    base = next((r for r in rows if r.get("status") == "ok" and r["stage"] == 0), None)
    prev = None
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["x_vs_stage0"] = r["sps"] / base["sps"] if base else None
        r["x_vs_prev"] = r["sps"] / prev["sps"] if prev else None
        prev = r


def run_ladder(cfg: RunConfig, device: torch.device, stages: list[Stage] | None = None,
               scaling: bool = True, profile: str | None = None, progress=None) -> dict:
    """The ladder (every stage at one N, T) and the scaling sweep (stages >= 3 over N)."""
    stages = list(stages or STAGES)
    peak = matmul_peak_flops(device)
    result = {"meta": metadata(device, profile), "config": cfg.to_dict(), **peak,
              "ladder": [], "scaling": []}
    todo = [(s, cfg) for s in stages]
    if scaling:
        todo += [(s, replace(cfg, n_envs=n)) for s in stages if s.index >= 3
                 for n in cfg.scaling_n_envs]
    for i, (stage, c) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{stage.name} N={c.n_envs}")
        row = measure_stage(stage, c, device, peak_flops=peak["peak_flops"])
        (result["ladder"] if i < len(stages) else result["scaling"]).append(row)
    _add_ratios(result["ladder"])
    ok = [r for r in result["ladder"] + result["scaling"] if r.get("status") == "ok"]
    if ok:
        best = max(ok, key=lambda r: r["sps"])
        final = max(r["stage"] for r in ok)
        best_final = max((r for r in ok if r["stage"] == final), key=lambda r: r["sps"])
        result["headline"] = {"stage": final, "name": best_final["name"],
                              "n_envs": best_final["n_envs"], "sps": best_final["sps"],
                              "best_overall": {k: best[k] for k in ("name", "n_envs", "sps")}}
    return result


def format_ladder(result: dict) -> str:
    """The ladder table as text."""
    head = (f"{'#':>2} {'stage':<15} {'N':>6} {'sps':>11} {'x st0':>7} {'x prev':>7} "
            f"{'reads/it':>9} {'warmup s':>9} {'% peak':>7}  precision")
    lines = [head, "-" * len(head)]
    for r in result["ladder"]:
        if r.get("status") != "ok":
            lines.append(f"{r['stage']:>2} {r['name']:<15} {r['n_envs']:>6} {r['status']}")
            continue
        x0 = f"{r['x_vs_stage0']:.1f}" if r.get("x_vs_stage0") else "-"
        xp = f"{r['x_vs_prev']:.2f}" if r.get("x_vs_prev") else "-"
        pk = f"{100 * r['frac_of_peak']:.2f}" if r.get("frac_of_peak") else "-"
        lines.append(f"{r['stage']:>2} {r['name']:<15} {r['n_envs']:>6} {r['sps']:>11,.0f} "
                     f"{x0:>7} {xp:>7} {r['host_reads_per_iter']:>9} {r['warmup_s']:>9.2f} "
                     f"{pk:>7}  {r['precision']}")
    m = result["meta"]
    lines.append(f"device: {m['device_name']} ({m['device']}), torch {m['torch']}, "
                 f"peak {result['peak_flops'] / 1e9:.1f} GFLOP/s ({result['peak_dtype']} matmul)")
    return "\n".join(lines)


def format_scaling(result: dict) -> str:
    lines = [f"{'#':>2} {'stage':<15} {'N':>7} {'sps':>12}"]
    for r in result["scaling"]:
        value = f"{r['sps']:>12,.0f}" if r.get("status") == "ok" else r["status"]
        lines.append(f"{r['stage']:>2} {r['name']:<15} {r['n_envs']:>7} {value}")
    return "\n".join(lines)
