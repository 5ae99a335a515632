"""``ladder`` and ``bench-env``: measure, show the tables, write the JSON and the figures.

Both check every size before the first is measured, show what they measured and write it
whole (a stop that comes while they write waits for the files), and on a stop keep what
finished in a ``_partial`` JSON beside, never over, a complete run's file. A stop is raised
to the caller as :class:`labkit.signals.Stop` with the line saying what was kept; the CLI
prints it and exits 128 + the signal. ``record``'s ladder parts write their figures with
:func:`write_figures` too.
"""
from __future__ import annotations

import signal
from pathlib import Path

import torch

from ..config import BenchConfig
from ..files import OutputError, check_output_dir, write_json
from ..signals import Stop, signals_deferred, stop_signals


def _free_file(path: Path) -> Path:
    if path.is_dir():
        raise OutputError(f"--out: {path} is a folder; it must be a file name free to write")
    return path


def write_figures(result: dict, out_dir: Path, stem: str, reraise: bool = True) -> list[Path]:
    """The ladder's figures, each written whole (a stop waits for them)."""
    from ..book.plots import save_figures

    with signals_deferred(reraise=reraise):  # a figure half written is worse than none
        return save_figures(result, out_dir, stem)


def _stopped_while_writing(late: list[int]) -> None:
    if late:
        raise Stop(late[0], said=f"interrupted by {signal.Signals(late[0]).name} while writing "
                                 "the results; they are all written")


def ladder(cfg: BenchConfig, device: torch.device, profile: str, out: str | Path, *,
           stages: list | None = None, scaling: bool = True, threads: int | None = None,
           progress: bool = True) -> int:
    """Run the ladder (and the scaling sweep) at ``cfg`` on ``device``, print its tables and
    write ``ladder_<device>_<profile>.json`` and its figures in ``out``: 0, or 1 if a stage
    failed (its row says why)."""
    from tqdm.auto import tqdm

    from ..book.plots import save_figures
    from ..measure.bench import (
        format_ladder,
        format_noise,
        format_phases,
        format_scaling,
        ladder_plan,
        run_ladder,
    )

    ladder_plan(cfg, device, stages, scaling)  # every size checked up front
    stem = f"ladder_{device.type}_{profile}"
    out_dir = check_output_dir(out)
    _free_file(out_dir / f"{stem}.json")
    bar = tqdm(total=1, desc="ladder", unit="run", disable=not progress)

    def step(i: int, total: int, what: str) -> None:
        bar.total, bar.n = total, i
        bar.set_postfix_str(what)
        bar.refresh()

    with stop_signals():
        result = run_ladder(cfg, device, stages=stages, scaling=scaling, profile=profile,
                            progress=step, threads=threads)
    with signals_deferred(reraise=False) as late:  # what was measured is shown and written
        bar.n = bar.total
        bar.close()
        print(format_ladder(result))
        if any(r.get("status") == "ok" for r in result["ladder"]):
            print("\nwhere an iteration goes:\n" + format_phases(result))
        if result["scaling"]:
            print("\nscaling sweep:\n" + format_scaling(result))
        if format_noise(result):
            print("\n" + format_noise(result))
        stopped = result.get("interrupted")
        path = write_json(out_dir / f"{stem}{'_partial' if stopped else ''}.json", result)
        figures = save_figures(result, out_dir, path.stem)
        print(f"wrote {path}, " + ", ".join(str(p) for p in figures))
    if stopped:
        raise Stop(signal.Signals[stopped], said=f"interrupted by {stopped}: {path} holds the "
                                                 "rows that finished")
    _stopped_while_writing(late)
    failed = [r for r in result["ladder"] + result["scaling"]
              if r["status"].startswith("error")]
    return 1 if failed else 0


def bench_env(device: torch.device, out: str | Path, *, repeats: int,
              n_envs: list[int] | None, compiled: bool, compile_loop: int) -> int:
    """Time every Forage implementation on ``device``, print the table and write
    ``bench_env_<device>.json`` in ``out``."""
    from ..measure.envbench import bench_envs, format_table

    path = _free_file(check_output_dir(out) / f"bench_env_{device.type}.json")
    result = bench_envs(device=device, repeats=repeats, n_envs=n_envs, compiled=compiled,
                        compile_loop=compile_loop)
    stopped = result.get("interrupted")
    if stopped:  # the rounds that finished, beside (never over) a complete run's file
        path = path.with_name(f"{path.stem}_partial.json")
    with signals_deferred(reraise=False) as late:  # what was measured is shown and written
        print(format_table(result))
        write_json(path, result)
        print(f"wrote {path}")
    if stopped:
        raise Stop(signal.Signals[stopped], said=f"interrupted by {stopped}: {path} holds the "
                                                 f"{result['repeats']} round(s) that finished")
    _stopped_while_writing(late)
    return 0
