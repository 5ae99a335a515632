"""``python -m labkit {ladder,train,bench-env}``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .files import write_json


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_bench_env(args: argparse.Namespace) -> int:
    from .device import resolve_device
    from .envs.bench import bench_envs, format_table

    device = resolve_device(args.device)
    result = bench_envs(device=device, repeats=args.repeats)
    print(format_table(result))
    out = write_json(Path(args.out) / f"bench_env_{device.type}.json", result)
    print(f"wrote {out}")
    return 0


def _stage_list(text: str) -> list:
    from .stages import STAGE_NAMES, get_stage
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated stages (0-{len(STAGE_NAMES) - 1} or names), got {text!r}")
    try:
        return [get_stage(part) for part in parts if part]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _stage(text: str) -> str:
    from .stages import get_stage
    try:
        return get_stage(text).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cmd_ladder(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .bench import format_ladder, format_phases, format_scaling, run_ladder
    from .config import BenchConfig
    from .device import resolve_device
    from .plots import save_figures

    device = resolve_device(args.device)
    profile = args.profile or ("full" if device.type == "cuda" else "quick")
    overrides = {k: v for k, v in (("n_envs", args.n_envs), ("n_steps", args.n_steps),
                                   ("iterations", args.iterations)) if v is not None}
    if args.scaling_n_envs:
        overrides["scaling_n_envs"] = tuple(args.scaling_n_envs)
    cfg = BenchConfig.from_profile(profile, **overrides)
    bar = tqdm(total=1, desc="ladder", unit="run", disable=args.no_progress)

    def progress(i: int, total: int, what: str) -> None:
        bar.total = total
        bar.n = i
        bar.set_postfix_str(what)
        bar.refresh()

    result = run_ladder(cfg, device, stages=args.stages, scaling=not args.no_scaling,
                        profile=profile, progress=progress)
    bar.n = bar.total
    bar.close()
    print(format_ladder(result))
    print("\nwhere an iteration goes:\n" + format_phases(result))
    if result["scaling"]:
        print("\nscaling sweep:\n" + format_scaling(result))
    stem = f"ladder_{device.type}_{profile}"
    out = write_json(Path(args.out) / f"{stem}.json", result)
    figures = save_figures(result, args.out, stem)
    print(f"wrote {out}, " + ", ".join(str(p) for p in figures))
    failed = [r for r in result["ladder"] + result["scaling"]
              if r["status"].startswith("error")]
    return 1 if failed else 0


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


TRAIN_OPTIONS = ("stage", "device", "n_envs", "n_steps", "total_steps", "seed", "value_head",
                 "checkpoint_every")


def cmd_train(args: argparse.Namespace) -> int:
    import time

    from .train import TrainConfig, TrainingInterrupted, train

    given = {k: getattr(args, k) for k in TRAIN_OPTIONS if getattr(args, k) is not None}
    if args.resume:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"--resume continues the run with its saved config; drop {flags}")
        if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ValueError("--resume continues the run in its own folder; drop --out or "
                             "give the same folder")
        cfg, out = None, Path(args.resume)
    else:
        cfg = TrainConfig.flat(**given)
        out = Path(args.out or time.strftime("runs/train-%Y%m%d-%H%M%S"))
    try:
        s = train(cfg, out, resume=bool(args.resume), progress=not args.no_progress)
    except TrainingInterrupted as err:
        print(f"\n{err}\ncontinue with: python -m labkit train --resume {out}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted before training started; nothing saved", file=sys.stderr)
        return 130
    print(f"trained {s['steps']:,} steps ({s['stage']} on {s['device']}) in {s['wall_s']:.0f} s: "
          f"final mean return {s['final_mean_return']:.2f}, {s['steps_per_s']:,.0f} steps/s "
          f"({s['steady_steps_per_s']:,.0f} after the first iteration); wrote {out}")
    return 0


def cmd_plot_runs(args: argparse.Namespace) -> int:
    import matplotlib.pyplot as plt

    from .plots import learning_curves, run_curve

    curves = {Path(d).name: run_curve(d) for d in args.runs}
    axes = learning_curves(curves, oracle=args.oracle)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    axes[0].figure.savefig(args.out, dpi=120)
    plt.close(axes[0].figure)
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bench-env", help="time each Forage implementation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--repeats", type=_positive_int, default=5)
    p.add_argument("--out", default="results", help="folder for the JSON")
    p.set_defaults(func=cmd_bench_env)

    p = sub.add_parser("ladder", help="run every stage, print the table, write JSON + PNG")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--profile", choices=("quick", "full"), default=None,
                   help="default: full on CUDA, quick otherwise")
    p.add_argument("--stages", type=_stage_list, default=None,
                   help="comma-separated stage indices or names (default: all)")
    p.add_argument("--n-envs", type=_positive_int, default=None, help="N of the ladder sweep")
    p.add_argument("--n-steps", type=_positive_int, default=None, help="rollout length T")
    p.add_argument("--iterations", type=_positive_int, default=None,
                   help="steady-state iterations per stage (>= 2)")
    p.add_argument("--scaling-n-envs", type=_positive_int, nargs="+", default=None,
                   help="N values of the scaling sweep")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling sweep")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="results", help="folder for JSON and PNG")
    p.set_defaults(func=cmd_ladder)

    p = sub.add_parser("train", help="train PPO on Forage with one stage's pipeline")
    p.add_argument("--stage", type=_stage, default=None,
                   help="stage whose pipeline trains, 0-8 or a name (default: fused_amp)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--n-envs", type=_positive_int, default=None, help="N (default: 64)")
    p.add_argument("--n-steps", type=_positive_int, default=None,
                   help="rollout length T (default: 32)")
    p.add_argument("--total-steps", type=_positive_int, default=None,
                   help="env steps of the run (default: 500000)")
    p.add_argument("--seed", type=_non_negative_int, default=None, help="default: 1")
    p.add_argument("--value-head", choices=("plain", "popart"), default=None,
                   help="default: plain")
    p.add_argument("--checkpoint-every", type=_non_negative_int, default=None,
                   help="iterations between checkpoints, 0 = only at the end (default: 25)")
    p.add_argument("--out", default=None,
                   help="run folder (default: runs/train-<date>-<time>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR/checkpoint.pt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot-runs", help="learning curves of train runs (steps and wall time)")
    p.add_argument("runs", nargs="+", help="train --out folders")
    p.add_argument("--oracle", type=float, default=None, help="draw the oracle's return")
    p.add_argument("--out", default="results/learning.png", help="PNG to write")
    p.set_defaults(func=cmd_plot_runs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
