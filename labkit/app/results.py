"""The results files a record writes into: ``results/ladder_D_P.json`` as its parts fill it
(:class:`LadderFile`, rows merged by (stage, N), each naming its run), run ids, and the record
log's place (``results/record_log_D_P.json``: how long each part took)."""
from __future__ import annotations

import datetime as _dt
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .. import files
from ..files import write_json

ROOT = Path(__file__).resolve().parents[2]
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: What must be equal for parts recorded by several commands to count as one run.
_SAME_RUN = ("device_name", "torch", "git_commit", "profile")


class RecordError(ValueError):
    """A record that must not start (modified code, a bad part name, another run's id)."""


def read_json(path: Path) -> dict | None:
    """A results file as a dict, or None where there is none or it is not one."""
    try:
        data = files.read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_log_path(out: Path, device: torch.device, profile: str) -> Path:
    """Where the record log of ``device``'s kind and ``profile`` lives in ``out``."""
    return out / f"record_log_{device.type}_{profile}.json"


def new_run_id() -> str:
    """A fresh run id: the UTC time and the process."""
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}"


def check_run_id(run: str) -> str:
    if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
        raise RecordError(f"--run must be 1-64 letters, digits, '.', '_' or '-'; got {run!r}")
    return run


class LadderFile:
    """``results/ladder_D_P.json`` as parts fill it: rows merged by (stage, N), each naming
    its run; ratios and the headline recomputed and the file rewritten at every row.

    An existing file measured at another configuration (N, T, iterations, PPO) is started
    afresh; a run id already in the file must come from the same kind of machine and commit
    (:data:`_SAME_RUN`)."""

    def __init__(self, path: Path, cfg, meta: dict, run: str, say: Callable[[str], None]
                 ) -> None:
        self.path, self.run, self.meta = path, run, meta
        old = read_json(path)
        fresh = {"meta": meta, "config": cfg.to_dict(), "runs": {}, "ladder": [],
                 "scaling": []}
        if old is not None and not self._compatible(old, cfg):
            say(f"{path.name}: recorded at another configuration or by an older labkit; "
                "its rows are replaced")
            old = None
        self.data = old if old is not None else fresh
        known = self.data["runs"].get(run)
        if known is not None:
            theirs = {k: known["meta"].get(k) for k in _SAME_RUN}
            mine = {k: meta.get(k) for k in _SAME_RUN}
            if theirs != mine:
                raise RecordError(f"--run {run} was recorded with {theirs}; this is {mine}: "
                                  "give this record a new --run")

    @staticmethod
    def _compatible(old: dict, cfg) -> bool:
        have = old.get("config")
        return isinstance(old.get("runs"), dict) and isinstance(have, dict) \
            and have.get("run") == cfg.run.to_dict() \
            and have.get("iterations") == cfg.iterations \
            and isinstance(old.get("ladder"), list) and isinstance(old.get("scaling"), list)

    def begin(self, part: str) -> None:
        """Note that ``part`` of this run started (the run's entry made if new)."""
        entry = self.data["runs"].setdefault(self.run, {"meta": self.meta, "parts": []})
        entry["meta"] = self.meta
        if part not in entry["parts"]:
            entry["parts"].append(part)

    def add(self, section: str, row: dict, result: dict) -> None:
        """Merge ``row`` (from ``run_ladder``, whose in-progress ``result`` gives the peaks)
        into ``section`` and write the file."""
        entry = self.data["runs"][self.run]
        for key in ("peak_flops", "peak_dtype", "peak_n", "peaks", "lap_cost_s"):
            entry[key] = self.data[key] = result[key]
        row = {**row, "run": self.run}
        rows = [r for r in self.data[section]
                if (r["stage"], r["n_envs"]) != (row["stage"], row["n_envs"])]
        rows.append(row)
        rows.sort(key=lambda r: (r["stage"], r["n_envs"]))
        self.data[section] = rows
        # a run whose every row was measured again is no longer where any row comes from
        used = {r.get("run") for s in ("ladder", "scaling") for r in self.data[s]} | {self.run}
        self.data["runs"] = {k: v for k, v in self.data["runs"].items() if k in used}
        self.write()

    @property
    def rows(self) -> int:
        return len(self.data["ladder"]) + len(self.data["scaling"])

    def interrupted(self, signal_name: str, part: str) -> None:
        """Note where this run was stopped (in a file that holds rows: an empty one is not
        written at all)."""
        self.data["runs"][self.run]["interrupted"] = {"signal": signal_name, "part": part}
        if self.rows:
            self.write()

    def write(self) -> Path:
        from ..measure.bench import add_ratios, headline, one_denominator

        self.data["meta"] = self.meta
        add_ratios(self.data["ladder"])
        one_denominator(self.data)
        top = headline(self.data)
        self.data.pop("headline", None)
        if top:
            self.data["headline"] = top
        return write_json(self.path, self.data)
