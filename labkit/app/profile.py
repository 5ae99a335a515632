"""``python -m labkit profile``: a torch.profiler trace of a stage's steady-state iterations
(:func:`labkit.measure.profiling.profile_stage`), its top-ops table printed."""
from __future__ import annotations

import argparse

from .flags import choices, default_stage_note, device_flag, int_at_least, path, positive_int, stage


def cmd_profile(args: argparse.Namespace) -> int:
    from ..config import RunConfig
    from ..device import resolve_device
    from ..measure.profiling import profile_stage
    from ..stages import default_stage

    device = resolve_device(args.device)
    print(profile_stage(args.stage or default_stage(device),
                        RunConfig(n_envs=args.n_envs, n_steps=args.n_steps), device, args.out,
                        iterations=args.iterations, top=args.top))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="a torch.profiler trace of steady-state iterations")
    device_flag(p)
    p.add_argument("--stage", type=stage, default=None,
                   help=f"{choices()} ({default_stage_note()})")
    p.add_argument("--n-envs", type=positive_int, default=64, help="N (default: %(default)s)")
    p.add_argument("--n-steps", type=positive_int, default=32, help="T (default: %(default)s)")
    p.add_argument("--iterations", type=int_at_least(1, 100), default=1,
                   help="iterations traced, after one warmup; the trace keeps every event, "
                        "so at most 100 (default: %(default)s)")
    p.add_argument("--top", type=positive_int, default=15, help="rows of the top-ops table")
    p.add_argument("--out", type=path, default="runs/profile", help="folder for the trace")
    p.set_defaults(func=cmd_profile)
