"""Warm-up choices remembered between runs. A stage that compiles only where it pays times
eager against compiled, and its convolutions' conv2d against matmul, at warm-up: most of its
set-up on a CPU. A new ``train`` run of the same stage, sizes, model, precision, device,
threads and torch keeps what the last such run timed instead, and says so ("remembered"); a
resumed run keeps its checkpoint's choices as before. ``--fresh-choices`` times them again
and replaces what was remembered.

The choices live in one JSON file, ``choices.json`` in ``$LABKIT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/labkit``, else ``~/.cache/labkit``), written atomically by rank 0. It is a
cache: a file that cannot be read, or an entry that is not a choice a checkpoint could hold, is
passed over (the choices are timed) and replaced; a file that cannot be written is left as it
is, and the run goes on (its checkpoint keeps its choices)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ..files import read_json_object, write_json
from ..policy import CONV_MATHS
from . import checkpoint

FILENAME = "choices.json"
#: The most entries the file keeps (the oldest go first).
MAX_ENTRIES = 256


def cache_dir() -> Path:
    """Where remembered choices live (see the module's docstring)."""
    for name, sub in (("LABKIT_CACHE_DIR", ""), ("XDG_CACHE_HOME", "labkit")):
        if os.environ.get(name, "").strip():
            return Path(os.environ[name]) / sub
    return Path.home() / ".cache" / "labkit"


def _processor() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def key(pipe: Any) -> str:
    """What the timed choices depend on: the stage, the run's sizes and the settings that change
    its model math, the precision, the device (the CPU's model and threads) and torch."""
    run, device = pipe.cfg, pipe.device
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{_processor()}, {torch.get_num_threads()} thread(s)")
    return json.dumps({
        "stage": pipe.stage.name, "device": f"{device.type}: {where}", "torch": torch.__version__,
        "precision": pipe.precision.name, "n_envs": run.n_envs, "n_steps": run.n_steps,
        "model": run.model, "view": run.spec.view, "value_head": run.value_head,
        "ppo": [run.ppo.update_epochs, run.ppo.n_minibatches],
        **{name: getattr(run, name) for name in ("compile", "conv_math", "compile_unit",
                                                  "capture_unit", "obs_storage")},
    }, sort_keys=True)


def _entries() -> dict:
    try:
        entries = read_json_object(cache_dir() / FILENAME, "remembered choices")
    except (OSError, ValueError, RuntimeError):  # RuntimeError: no home folder to be found
        return {}
    return entries.get("entries") if isinstance(entries.get("entries"), dict) else {}


def recall(pipe: Any) -> tuple[dict, dict] | None:
    """The executor and conv choices the last run like ``pipe``'s timed, each record marked
    ``"remembered"`` with the date it was timed; None where there are none (or not whole)."""
    entry = _entries().get(key(pipe))
    if not isinstance(entry, dict) or not isinstance(entry.get("date"), str):
        return None
    made, convs = entry.get("executor_choices"), entry.get("conv_choices")
    if not (isinstance(made, dict) and isinstance(convs, dict)
            and set(made) == set(pipe.math.choices)
            and all(checkpoint.choice_ok(m, part) for part, m in made.items())
            and (not convs or set(convs) == set(pipe.math.parts))
            and all(checkpoint.choice_ok(m, part, CONV_MATHS)
                    for part, m in convs.items())
            and bool(convs) == pipe.math.chooses_conv_math):
        return None
    date = entry["date"][:40]
    return ({p: {**m, "remembered": date} for p, m in made.items()},
            {p: {**m, "remembered": date} for p, m in convs.items()})


def remember(pipe: Any) -> None:
    """Keep what ``pipe`` timed at warm-up for the next run like it."""
    math, here = pipe.math, key(pipe)
    entries = _entries()
    entries.pop(here, None)  # re-added last: the newest entry is kept longest
    entries[here] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "executor_choices": math.executor_choices,
        "conv_choices": math.conv_choices if math.chooses_conv_math else {}}  # timed ones
    kept = dict(list(entries.items())[-MAX_ENTRIES:])
    with contextlib.suppress(OSError, RuntimeError):  # a cache: the run goes on without it
        write_json(cache_dir() / FILENAME, {"entries": kept})
