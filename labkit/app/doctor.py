"""``python -m labkit doctor`` and ``rehearse``: diagnose a stage under the meters
(:func:`labkit.doctor.diagnose`: what regressed and the chapter with the fix), and rehearse its
CUDA graph captures on the CPU (:func:`labkit.doctor.rehearsal.rehearse_stage`); each exits 0
when it finds nothing, 1 when it does. ``--plant`` puts one of the doctor's planted
regressions into the stage first."""
from __future__ import annotations

import argparse

from .flags import choices, device_flag, int_at_least, stage_flags


def _planted(args: argparse.Namespace) -> tuple:
    """The doctor's and the rehearsal's stage (with --plant's regression) and run config."""
    from ..config import RunConfig
    from ..doctor.checkup import DOCTOR_COMPILE, DOCTOR_CONV_MATH
    from ..doctor.plants import plant

    chosen = plant(args.stage, args.plant) if args.plant else args.stage
    return chosen, RunConfig(n_envs=args.n_envs, n_steps=args.n_steps, compile=DOCTOR_COMPILE,
                             conv_math=DOCTOR_CONV_MATH)


def cmd_doctor(args: argparse.Namespace) -> int:
    """``diagnose`` a stage: 0 without findings, 1 with findings."""
    import json

    from ..doctor import diagnose

    chosen, cfg = _planted(args)
    report = diagnose(chosen, iterations=args.iterations, cfg=cfg, device=args.device)
    print(json.dumps(report.to_dict()) if args.json else report.format())
    return 1 if report.findings else 0


def cmd_rehearse(args: argparse.Namespace) -> int:
    from ..doctor.rehearsal import rehearse_stage

    if args.device != "cpu":
        raise ValueError(f"--device must be cpu, got {args.device!r}: a rehearsal stands in "
                         "for CUDA on the CPU; with a GPU, run the stage itself (python -m "
                         "labkit doctor --stage 8 --device cuda)")
    report = rehearse_stage(*_planted(args), iterations=args.iterations)
    print(report)
    return 0 if report.ok else 1


def _add_doctor(sub) -> None:
    from ..doctor import DOCTOR_RUN
    from ..stages import REFERENCE_STAGE

    p = sub.add_parser(
        "doctor", help="run a few iterations under the meters and report regressions",
        description="Run a stage for a few iterations under the sync meter, a function watch, a "
                    "memory tracker and dynamo's counters; print what regressed and the "
                    "chapter with the fix. Exit 0 without findings, 1 with, 2 on a usage error.")
    device_flag(p)
    stage_flags(p, REFERENCE_STAGE, choices(), **DOCTOR_RUN)
    p.add_argument("--iterations", type=int_at_least(2, 10_000), default=5,
                   help="timed iterations, 2 to 10,000 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], ...}')
    p.set_defaults(func=cmd_doctor)


def _add_rehearse(sub) -> None:
    from ..stages import STAGES

    p = sub.add_parser(
        "rehearse", help="rehearse a stage's CUDA graph captures on the CPU",
        description="Capture and replay a stage's CUDA graphs on the CPU "
                    "(labkit.doctor.rehearsal): report what a real capture would refuse "
                    "(host reads, data-dependent ops, unregistered generators, host tensors) "
                    "and whether the replays compute what the stage without graphs computes, "
                    "bit for bit. No speed is measured. Exit 0 when capturable and equal, 1 "
                    "otherwise, 2 on a usage error.")
    stage_flags(p, STAGES[-1].name, "a stage with CUDA graphs", n_envs=16, n_steps=16)
    p.add_argument("--device", default="cpu", help="cpu (the rehearsal's only device)")
    p.add_argument("--iterations", type=int_at_least(1, 10_000), default=2,
                   help="iterations rehearsed (default: %(default)s)")
    p.set_defaults(func=cmd_rehearse)


def add_parsers(sub) -> None:
    """``doctor`` and ``rehearse``, each with its flags."""
    _add_doctor(sub)
    _add_rehearse(sub)
