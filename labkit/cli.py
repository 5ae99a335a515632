"""``python -m labkit {ladder,train,bench-env}``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def cmd_bench_env(args: argparse.Namespace) -> int:
    from .device import resolve_device
    from .envs.bench import bench_envs, format_table

    device = resolve_device(args.device)
    result = bench_envs(device=device, repeats=args.repeats)
    print(format_table(result))
    out = write_json(Path(args.out) / f"bench_env_{device.type}.json", result)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bench-env", help="time each Forage implementation")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--repeats", type=_positive_int, default=5)
    p.add_argument("--out", default="results", help="folder for the JSON")
    p.set_defaults(func=cmd_bench_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
