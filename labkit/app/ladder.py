"""``ladder`` and ``bench-env``: measure, show the tables, write the JSON and the figures.

Both check every size before the first is measured, show what they measured and write it
whole (a stop that comes while they write waits for the files), and on a stop keep what
finished in a ``_partial`` JSON beside, never over, a complete run's file. A stop is raised
to the caller as :class:`labkit.signals.Stop` with the line saying what was kept; the CLI
prints it and exits 128 + the signal. ``record``'s ladder parts write their figures with
:func:`write_figures` too.
"""
from __future__ import annotations

import argparse
import signal
from pathlib import Path

import torch

from ..config import BenchConfig
from ..files import OutputError, check_output_dir, output_dir, write_json
from ..signals import Stop, signals_deferred, stop_signals
from .flags import (
    device_and_profile,
    device_flag,
    field_flag,
    int_at_least,
    path,
    positive_int,
    stage,
    stage_list,
)


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
              n_envs: list[int] | None, compiled: bool, compile_loop: int,
              torch_only: bool = False) -> int:
    """Time every Forage implementation on ``device``, print the table and write
    ``bench_env_<device>.json`` in ``out``."""
    from ..measure.envbench import bench_envs, format_table

    name = f"bench_env_{device.type}" + ("_torch" if torch_only else "")
    with output_dir(out) as folder:  # a size refused for memory leaves no folder made
        path = _free_file(folder / f"{name}.json")
        result = bench_envs(device=device, repeats=repeats, n_envs=n_envs, compiled=compiled,
                            compile_loop=compile_loop, torch_only=torch_only)
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


def bench_update(device: torch.device, out: str | Path, *, sizes: list[tuple[int, int]],
                 rounds: int) -> int:
    """Time the PPO update's minibatch step eager and compiled, fp32 and bf16, print the
    table and write ``bench_update_<device>.json`` in ``out``."""
    from ..measure.updatebench import bench_update as measure
    from ..measure.updatebench import format_table

    with output_dir(out) as folder:
        path = _free_file(folder / f"bench_update_{device.type}.json")
        result = measure(device, sizes, rounds=rounds)
    _print_and_write(format_table(result), path, result)
    return 0


def bench_sb3(cfg, out: str | Path, *, stage: str | None, iterations: int, rounds: int,
              threads: int | None) -> int:
    """labkit's ``stage`` (default: the production stage, :data:`labkit.stages.REFERENCE_STAGE`)
    against SB3's PPO on the same work; print the table and write ``bench_sb3_cpu.json`` in
    ``out``."""
    from ..measure.sb3bench import bench_sb3 as measure
    from ..measure.sb3bench import format_table
    from ..stages import REFERENCE_STAGE

    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        raise ValueError("bench-sb3 needs Stable-Baselines3: pip install -e '.[sb3]'") from None
    with output_dir(out) as folder:
        path = _free_file(folder / "bench_sb3_cpu.json")
        result = measure(cfg, stage or REFERENCE_STAGE, iterations=iterations,
                         rounds=rounds, threads=threads)
    _print_and_write(format_table(result), path, result)
    return 0


def _print_and_write(text: str, path: Path, result: dict) -> None:
    """Show what was measured and write it; a stop signal waits until both are done."""
    with signals_deferred(reraise=False) as late:
        print(text)
        write_json(path, result)
        print(f"wrote {path}")
    _stopped_while_writing(late)


# ------------------------------------------------------------------ the commands


def cmd_bench_env(args: argparse.Namespace) -> int:
    from ..device import resolve_device

    return bench_env(resolve_device(args.device), args.out, repeats=args.repeats,
                     n_envs=args.n_envs, compiled=args.compiled, compile_loop=args.compile_loop,
                     torch_only=args.torch_only)


def cmd_bench_update(args: argparse.Namespace) -> int:
    from ..device import resolve_device

    return bench_update(resolve_device(args.device), args.out, sizes=args.sizes,
                        rounds=args.rounds)


def cmd_bench_sb3(args: argparse.Namespace) -> int:
    from ..config import RunConfig

    return bench_sb3(RunConfig(n_envs=args.n_envs, n_steps=args.n_steps), args.out,
                     stage=args.stage, iterations=args.iterations, rounds=args.rounds,
                     threads=args.threads)


def _size(text: str) -> tuple[int, int]:
    """``4096:2`` -> (minibatch 4096, 2 threads); ``4096`` -> (4096, 1)."""
    n, _, threads = text.partition(":")
    try:
        size = (int(n), int(threads) if threads else 1)
    except ValueError:
        size = (0, 0)
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"must be MINIBATCH or MINIBATCH:THREADS, positive "
                                         f"integers (e.g. 4096:2); got {text!r}")
    return size


def cmd_ladder(args: argparse.Namespace) -> int:
    from ..config import BenchConfig

    device, profile = device_and_profile(args)
    overrides = {k: v for k, v in (("n_envs", args.n_envs), ("n_steps", args.n_steps),
                                   ("iterations", args.iterations), ("compile", args.compile),
                                   ("conv_math", args.conv_math),
                                   ("compile_unit", args.compile_unit),
                                   ("capture_unit", args.capture_unit),
                                   ("obs_storage", args.obs_storage),
                                   ("loop_steps_bound", args.loop_steps_bound))
                 if v is not None}
    if args.scaling_n_envs:
        overrides["scaling_n_envs"] = tuple(args.scaling_n_envs)
    return ladder(BenchConfig.from_profile(profile, **overrides), device, profile, args.out,
                  stages=args.stages, scaling=not args.no_scaling, threads=args.threads,
                  progress=not args.no_progress)


def _add_bench_env(sub) -> None:
    p = sub.add_parser("bench-env", help="time each Forage implementation")
    device_flag(p)
    p.add_argument("--repeats", type=int_at_least(1, 1000), default=5,
                   help="rounds, each timing one episode of every implementation in turn "
                        "(default: %(default)s)")
    p.add_argument("--n-envs", type=positive_int, nargs="+", default=None,
                   help="N of the vectorized implementations, the same for each (default: "
                        "256 1024 4096 on the CPU, 4096 65536 on CUDA)")
    p.add_argument("--compiled", action="store_true",
                   help="also time torch.compile(ForageTorch.step), and a loop of "
                        "--compile-loop steps compiled as one graph (minutes on a CPU)")
    p.add_argument("--compile-loop", type=positive_int, default=4,
                   help="steps in the compiled loop; 1 leaves that row out; it must divide "
                        "the episode length and 16, the warmup steps (default: %(default)s)")
    p.add_argument("--torch-only", action="store_true",
                   help="time ForageTorch alone (and with --compiled its compiled rows): a "
                        "large-N GPU sweep without the NumPy and per-env loops at every size")
    p.add_argument("--out", type=path, default="results", help="folder for the JSON")
    p.set_defaults(func=cmd_bench_env)


def _add_ladder(sub) -> None:
    p = sub.add_parser("ladder", help="run every stage, print the table, write JSON + PNG")
    device_flag(p)
    p.add_argument("--profile", choices=("quick", "full"), default=None,
                   help="default: full on CUDA, quick otherwise")
    p.add_argument("--stages", type=stage_list, default=None,
                   help="comma-separated stage indices or names (default: all)")
    from ..config import (
        CAPTURE_UNITS,
        COMPILE_CHOICES,
        COMPILE_UNITS,
        CONV_MATH_CHOICES,
        OBS_STORAGES,
        BenchConfig,
        RunConfig,
    )

    profile = "default: the profile's"
    field_flag(p, RunConfig, "n_envs", positive_int, default_note=profile)
    field_flag(p, RunConfig, "n_steps", positive_int, default_note=profile)
    field_flag(p, BenchConfig, "iterations", int_at_least(2), default_note=profile)
    field_flag(p, BenchConfig, "scaling_n_envs", positive_int, nargs="+", default_note=profile)
    field_flag(p, BenchConfig, "loop_steps_bound", positive_int)
    field_flag(p, RunConfig, "compile", str, choices=COMPILE_CHOICES)
    field_flag(p, RunConfig, "compile_unit", str, choices=COMPILE_UNITS)
    field_flag(p, RunConfig, "capture_unit", str, choices=CAPTURE_UNITS)
    field_flag(p, RunConfig, "obs_storage", str, choices=OBS_STORAGES)
    field_flag(p, RunConfig, "conv_math", str, choices=CONV_MATH_CHOICES)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads on the CPU (default: the cores no other "
                        "process is running on; see labkit.measure.noise)")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", type=path, default="results", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_ladder)




def _add_bench_update(sub) -> None:
    p = sub.add_parser("bench-update", help="time the PPO update eager and compiled, in fp32 "
                                            "and bf16")
    device_flag(p)
    p.add_argument("--sizes", type=_size, nargs="+", default=[(4096, 2), (1024, 1)],
                   metavar="MINIBATCH[:THREADS]",
                   help="minibatch sizes, each with its CPU threads (default: 4096:2 1024:1, "
                        "the N=256 ladder's minibatch on 2 threads and a smaller one on 1)")
    p.add_argument("--rounds", type=int_at_least(1, 1000), default=5,
                   help="interleaved rounds, each timing every variant once (default: "
                        "%(default)s)")
    p.add_argument("--out", type=path, default="results", help="folder for the JSON")
    p.set_defaults(func=cmd_bench_update)


def _add_bench_sb3(sub) -> None:
    from ..stages import REFERENCE_STAGE

    p = sub.add_parser("bench-sb3", help="labkit's stage against Stable-Baselines3's PPO on "
                                         "the same envs, network and hyperparameters (CPU)")
    p.add_argument("--stage", type=stage, default=None,
                   help=f"the labkit stage (default: {REFERENCE_STAGE}, the production stage "
                        "and the fastest of the recorded CPU ladders at N=256)")
    p.add_argument("--n-envs", type=positive_int, default=256, help="N (default: %(default)s)")
    p.add_argument("--n-steps", type=positive_int, default=64, help="T (default: %(default)s)")
    p.add_argument("--iterations", type=positive_int, default=3,
                   help="PPO iterations timed per round and side (default: %(default)s)")
    p.add_argument("--rounds", type=int_at_least(1, 1000), default=5,
                   help="interleaved rounds (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads for both (default: torch's)")
    p.add_argument("--out", type=path, default="results", help="folder for the JSON")
    p.set_defaults(func=cmd_bench_sb3)


def add_parsers(sub) -> None:
    """``bench-env``, ``bench-update``, ``bench-sb3`` and ``ladder``, each with its flags."""
    _add_bench_env(sub)
    _add_bench_update(sub)
    _add_bench_sb3(sub)
    _add_ladder(sub)
