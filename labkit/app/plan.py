"""The plan of a record (:mod:`labkit.app.record`): its parts, which of them a ``--part``
selects, how long each takes (the record log's measured minutes, or an estimate) and the
commands that keep each under a GPU machine's 10-minute limit, as ``record --plan`` prints
them."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .results import ROOT, RecordError, read_json, record_log_path

#: Groups of parts, in the order a record runs them; ``all`` names every part.
GROUPS = ("ladder", "scaling", "bench_env", "learning", "notebooks", "report")
#: Learning runs per profile: env steps per stage, N, T.
LEARNING = {"tiny": dict(total_steps=4096, n_envs=16, n_steps=32),
            "quick": dict(total_steps=262_144, n_envs=64, n_steps=32),
            "full": dict(total_steps=2_097_152, n_envs=1024, n_steps=32)}
LEARNING_STAGES = ("numpy_vec", "async_logging", "fused_amp", "cuda_graphs")
#: The longest a part may be planned to take: a GPU machine runs no command over 10 minutes.
PART_BUDGET_MIN = 9.0
#: Minutes per part of ``record --device cuda --profile full`` before any was measured:
#: estimates from op counts and launch costs (reviews/gpu-first-run.md, "Time estimates"),
#: not measurements. The record log replaces each one once its part has run. Stages 0 and 2
#: run at most ``BenchConfig.loop_steps_bound`` env steps an iteration (1/16 of N x T here):
#: a minute each, where unbounded they ran past 4 and 5 minutes on an H100 without finishing.
CUDA_FULL_ESTIMATES = {"ladder-0": 1.0, "ladder-2": 1.0, "ladder": 0.5,
                       "scaling-256": 1.0, "scaling-1024": 1.5, "scaling-4096": 2.0,
                       "scaling-16384": 2.5, "scaling-65536": 3.5, "bench_env": 0.5,
                       "learning": 2.5, "notebook-11": 3.0, "notebook": 2.0, "report": 0.1}




@dataclass(frozen=True)
class Part:
    """One part of a record: ``kind`` is its group (the record's runner of that name records
    it), ``item`` the stage index (ladder), N (scaling), stage names (learning) or notebook
    path it is about; ``together``: consecutive parts of the kind are recorded as one batch."""

    name: str
    kind: str
    item: Any = None
    what: str = ""
    together: bool = False


def notebook_paths(pattern: str) -> list[Path]:
    """The notebooks matching ``pattern`` (a glob in notebooks/; "none" for none)."""
    if pattern == "none":
        return []
    if not pattern.strip():
        raise RecordError("notebooks (--notebooks) must be a glob in notebooks/ or none; got ''")
    found = sorted((ROOT / "notebooks").glob(pattern))
    if not found:
        raise RecordError(f"notebooks (--notebooks) {pattern!r} matches no notebook in notebooks/ "
                          "(give a glob such as '0[0-3]*.ipynb', or none)")
    return found


def plan(profile: str, notebooks: str = "[0-9]*.ipynb", stages: list | None = None
         ) -> list[Part]:
    """Every part of a record at ``profile``, in the order it runs (``stages`` limits the
    ladder, the sweep and the learning runs)."""
    from ..config import BenchConfig
    from ..stages import STAGES, get_stage

    cfg = BenchConfig.from_profile(profile)
    chosen = [get_stage(s) for s in stages] if stages else list(STAGES)
    run = f"N={cfg.run.n_envs}, T={cfg.run.n_steps}"
    parts = [Part(f"ladder-{s.index}", "ladder", s.index,
                  f"stage {s.index} {s.name} at {run}", together=True) for s in chosen]
    scaling = [s.index for s in chosen if s.scales]
    if scaling:
        parts += [Part(f"scaling-{n}", "scaling", n,
                       f"stages {','.join(map(str, scaling))} at N={n}, T={cfg.run.n_steps}")
                  for n in cfg.scaling_n_envs]
    learning = [s for s in LEARNING_STAGES if not stages or s in {c.name for c in chosen}]
    budget = LEARNING[profile]
    parts += [Part("bench_env", "bench_env", None,
                   "env steps/s of each Forage implementation"),
              Part("learning", "learning", tuple(learning),
                   f"{budget['total_steps']:,} env steps of {', '.join(learning)}")]
    parts += [Part(f"notebook-{p.name[:2]}", "notebooks", p,
                   f"notebooks/{p.name}") for p in notebook_paths(notebooks)]
    parts.append(Part("report", "report", None,
                      "RESULTS.md and the README's results"))
    return parts




def select(parts: list[Part], names: str | Iterable[str]) -> list[Part]:
    """The parts ``names`` asks for (part names, groups or ``all``; a string is split at
    commas), in plan order; a name that is neither is a :class:`RecordError`."""
    if isinstance(names, str):
        names = names.split(",")
    names = [n.strip() for n in names if n.strip()]
    known = {p.name for p in parts}
    if not names:
        raise RecordError("parts (--parts) must name at least one part or group: "
                          f"{', '.join(GROUPS)}, all, or a part of --plan")
    for name in names:
        if name not in known and name not in GROUPS and name != "all":
            raise RecordError(f"parts (--parts) must be among {', '.join(GROUPS)}, all, or a "
                              f"part of the plan (python -m labkit record --plan); got {name!r}")
    chosen = [p for p in parts if "all" in names or p.name in names or p.kind in names]
    if not chosen:
        raise RecordError(f"parts (--parts) {','.join(names)} select nothing in this plan "
                          "(python -m labkit record --plan lists it)")
    return chosen


def _prior_minutes(part: Part, device: torch.device, profile: str) -> float | None:
    if (device.type, profile) != ("cuda", "full"):
        return None
    generic = part.name.split("-")[0] if part.kind != "notebooks" else "notebook"
    return CUDA_FULL_ESTIMATES.get(part.name, CUDA_FULL_ESTIMATES.get(generic))


def estimates(parts: list[Part], device: torch.device, profile: str, out: str | Path
              ) -> list[tuple[Part, float | None, str]]:
    """(part, minutes, where the minutes come from) for each part: the record log's measured
    time of its last full run on this kind of device, else the estimate, else None."""
    log = (read_json(record_log_path(Path(out), device, profile)) or {}).get("parts", {})
    rows = []
    for part in parts:
        done = log.get(part.name)
        took = done.get("seconds") if isinstance(done, dict) else None
        when = (f"{str(done.get('date', ''))[:10]} on {done.get('device_name', '?')}"
                if isinstance(done, dict) else "")
        if isinstance(took, (int, float)) and done.get("status") == "done":
            rows.append((part, took / 60, f"measured {when}"))
            continue
        prior = _prior_minutes(part, device, profile)
        if isinstance(took, (int, float)) and done.get("status") == "interrupted":
            rows.append((part, max(took / 60, PART_BUDGET_MIN), f"cut short after "
                         f"{took / 60:.1f} min {when}: at least that, planned alone"))
            continue
        rows.append((part, prior, "estimate, not measured" if prior is not None
                     else "no estimate: never recorded on this kind of device"))
    return rows


def commands(rows: list[tuple[Part, float | None, str]], budget: float = PART_BUDGET_MIN
             ) -> list[tuple[list[str], float | None]]:
    """The parts grouped, in order, into commands of at most ``budget`` estimated minutes
    (a part without an estimate goes alone)."""
    groups: list[tuple[list[str], float | None]] = []
    names: list[str] = []
    total = 0.0
    for part, minutes, _ in rows:
        if minutes is None or (names and total + minutes > budget):
            if names:
                groups.append((names, total))
            names, total = [], 0.0
        if minutes is None:
            groups.append(([part.name], None))
            continue
        names.append(part.name)
        total += minutes
    if names:
        groups.append((names, total))
    return groups


def format_plan(parts: list[Part], device: torch.device, profile: str,
                out: str | Path = "results") -> str:
    """The plan as ``record --plan`` prints it: each part, its minutes and their source, then
    the commands that keep each under the budget."""
    rows = estimates(parts, device, profile, out)
    known = [m for _, m, _ in rows if m is not None]
    head = (f"record plan: {device.type}, profile {profile}; {len(parts)} parts"
            + (f", about {sum(known):.0f} min in all" if known else "")
            + (f" ({len(rows) - len(known)} without an estimate)"
               if len(known) < len(rows) else ""))
    width = max(len(p.name) for p in parts) + 2
    lines = [head, f"{'part':<{width}}{'minutes':>8}  what  [minutes from]"]
    for part, minutes, source in rows:
        shown = f"{minutes:>8.1f}" if minutes is not None else f"{'?':>8}"
        lines.append(f"{part.name:<{width}}{shown}  {part.what}  [{source}]")
    lines.append(f"\nCommands of at most {PART_BUDGET_MIN:g} estimated minutes each; one --run "
                 "ID for all of them keeps their ratios comparable (same machine and commit):")
    for names, minutes in commands(rows):
        when = f"~{minutes:.1f} min" if minutes is not None else "? min"
        lines.append(f"  python -m labkit record --device {device.type} --profile {profile} "
                     f"--run RUN --part {','.join(names)}   # {when}")
    return "\n".join(lines)
