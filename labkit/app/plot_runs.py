"""``python -m labkit plot-runs``: the learning curves of train runs (return against steps and
against wall time) in one figure (:func:`labkit.book.plots.plot_runs`)."""
from __future__ import annotations

import argparse

from .flags import finite_float, path


def cmd_plot_runs(args: argparse.Namespace) -> int:
    from ..book.plots import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out, oracle=args.oracle)}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plot-runs", help="learning curves of train runs (steps and wall time)")
    p.add_argument("runs", type=path, nargs="+", help="train --out folders")
    p.add_argument("--oracle", type=finite_float, default=None,
                   help="draw the oracle's return")
    p.add_argument("--out", type=path, default="results/learning.png", help="PNG to write")
    p.set_defaults(func=cmd_plot_runs)
