"""Judge every step of the case sets (registry.CASES and review_steps.CASES) with a real
``torch.cuda.graph`` capture on a GPU, to hold their expected verdicts, and so the rehearsal,
to what CUDA does:

    python -m tests.rehearsal_cases.real [--workers 8] [--out real.jsonl] [--only ID,...]

For each step, two builds from the same seeds: one is warmed up (``WARMUP`` eager calls on a
side stream, as torch's docs do), captured once and replayed ``REPLAYS`` times; the other is
called eagerly ``WARMUP + REPLAYS`` times. Before each replay, and each eager call it is compared
with, the floating-point inputs are scaled by a new factor (signs, positive definiteness and
probabilities' ratios kept), as a training loop feeds new data, so that a value frozen at
capture shows. ``refused``: the capture raised (``warmup_error``: an eager call raised first,
on this GPU, before any capture). ``replays_differ``:
a replay's outputs (tensors, and Python values) or the tensors the step holds (closure,
module, optimizer, arguments) are not bit-identical to the eager call's at the same count.
``capturable``: every replay is. ``max_diff`` gives the largest difference, to tell a frozen
value from a kernel chosen differently under capture. Each worker process runs its steps in
turn; a step that leaves CUDA unusable, or runs over ``STEP_S``, ends its worker, and the
next step starts in a new one."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import subprocess
import sys
import time
from typing import Any

WARMUP, REPLAYS, STEP_S = 3, 3, 90
_MARK = "@@real "


def _steps() -> dict[str, tuple[str, Any]]:
    """Every step by key ("cases:ID" or "review:NAME"): (expected verdict, factory)."""
    from . import CASES, review_steps
    found = {f"cases:{c.id}": (c.expect, c.build) for c in CASES}
    for name, expect, _, factory in review_steps.CASES:
        found[f"review:{name}"] = ("capturable" if expect == "ok" else expect, factory)
    return found


def _seed() -> None:
    import numpy as np
    import torch
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _walk(obj: Any, path: str, out: list, seen: set, depth: int, python: bool) -> None:
    """(path, value) of every tensor reachable from ``obj`` (and, where ``python``, every
    number, bool and None), in a fixed order."""
    import torch
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if isinstance(obj, (bool, int, float, complex, str, type(None))):
        if python:
            out.append((path, obj))
        return
    if depth > 6 or id(obj) in seen or callable(obj) and not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for k, v in obj.state_dict(keep_vars=True).items():
            _walk(v, f"{path}.{k}", out, seen, depth + 1, python)
    if isinstance(obj, torch.optim.Optimizer):
        for i, p in enumerate(obj.param_groups[0]["params"] if obj.param_groups else []):
            for k, v in sorted(obj.state.get(p, {}).items()):
                _walk(v, f"{path}.state[{i}].{k}", out, seen, depth + 1, python)
        for g, group in enumerate(obj.param_groups):
            for k, v in sorted(group.items()):
                if k != "params":
                    _walk(v, f"{path}.group{g}.{k}", out, seen, depth + 1, python)
        return
    if isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            _walk(obj[k], f"{path}[{k!r}]", out, seen, depth + 1, python)
    elif isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen, depth + 1, python)
    elif hasattr(obj, "__closure__") and hasattr(obj, "__code__"):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                _walk(cell.cell_contents, f"{path}<{name}>", out, seen, depth + 1, python)
            except ValueError:  # an empty cell
                pass
    elif hasattr(obj, "__self__"):
        _walk(obj.__self__, f"{path}.__self__", out, seen, depth + 1, python)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) \
            and type(obj).__module__.split(".")[0] not in ("torch", "numpy", "random"):
        for k, v in sorted(vars(obj).items()):
            _walk(v, f"{path}.{k}", out, seen, depth + 1, python)


def _snapshot(out: Any, fn: Any, args: tuple) -> list:
    """The output (tensors and Python values) and the state's tensors, copied to the host."""
    found: list = []
    _walk(out, "out", found, set(), 0, True)
    _walk((fn, args), "state", found, set(), 0, False)
    import torch
    copied = []
    for p, v in found:
        if isinstance(v, torch.Tensor):
            if v.is_meta:  # no data (vmap's stacked-parameter templates, say)
                continue
            v = v.detach()
            if v.is_nested:  # compared element by element
                v = torch.cat([t.reshape(-1) for t in v.unbind()])
            v = v.to("cpu", copy=True)
        copied.append((p, v))
    return copied


def _diff(a: list, b: list) -> tuple[bool, float, str]:
    """(bit-identical, largest absolute difference, the first path that differs)."""
    import torch
    if [p for p, _ in a] != [p for p, _ in b]:
        return False, math.inf, "the outputs' or state's structure"
    worst, first = 0.0, ""
    for (path, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False, math.inf, path
            if x.is_sparse or x.is_nested:
                x, y = x.to_dense(), y.to_dense()
            same = torch.equal(x, y) or (x.is_floating_point() and bool(
                ((x == y) | (x.isnan() & y.isnan())).all()))
            if not same:
                first = first or path
                d = (x.double() - y.double()).abs().nan_to_num(math.inf).max().item() \
                    if x.numel() else 0.0
                worst = max(worst, d)
        elif x != y and not (isinstance(x, float) and math.isnan(x) and math.isnan(y)):
            first = first or path
            worst = math.inf
    return not first, worst, first


def _feed(static: Any, base: Any, k: int) -> None:
    """The inputs of call ``k`` after the warm-up: ``base``'s floating-point tensors scaled by
    ``1 + (k + 1) / 4``, copied into ``static`` in place (the captured addresses)."""
    from labkit.capture import tree_tensors
    for dst, src in zip(tree_tensors(static), tree_tensors(base), strict=True):
        if dst.is_floating_point() and not dst.is_sparse and not dst.is_nested:
            dst.copy_(src * (1 + (k + 1) / 4))


def judge(factory: Any) -> dict:
    """The real-capture verdict of one step (see the module docstring)."""
    import torch
    from torch.distributions import Distribution

    from labkit.capture import clone_state
    Distribution.set_default_validate_args(True)  # as in a fresh process
    _seed()
    fn, args = factory()
    static, base = clone_state(args), clone_state(args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001
        return dict(real="warmup_error", detail=f"{type(err).__name__}: {err}"[:400])
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn(*static)
    except Exception as err:  # noqa: BLE001 - the capture refused the step
        return dict(real="refused", detail=f"{type(err).__name__}: {err}"[:400])
    replayed = []
    for k in range(REPLAYS):
        _feed(static, base, k)
        graph.replay()
        torch.cuda.synchronize()
        replayed.append(_snapshot(out, fn, static))
    del graph
    _seed()
    fn, args = factory()
    static, base = clone_state(args), clone_state(args)
    for _ in range(WARMUP):
        fn(*static)
    eager = []
    for k in range(REPLAYS):
        _feed(static, base, k)
        eager.append(_snapshot(fn(*static), fn, static))
    worst, where = 0.0, ""
    for i, (a, b) in enumerate(zip(replayed, eager)):
        same, d, path = _diff(a, b)
        if not same:
            worst, where = max(worst, d), where or f"replay {i + 1}: {path}"
    if where:
        return dict(real="replays_differ", max_diff=worst, detail=where)
    return dict(real="capturable", detail="")


def _worker(keys: list[str]) -> None:
    """Judge ``keys`` in turn, one JSON line each; exit 3 when CUDA, or its random number
    generator, is left unusable (a refused capture can leave the generator mid-capture)."""
    import warnings

    import torch
    warnings.simplefilter("ignore")
    steps = _steps()
    for key in keys:
        expect, factory = steps[key]
        start = time.perf_counter()
        try:
            got = judge(factory)
        except Exception as err:  # noqa: BLE001 - the step's own error
            got = dict(real="error", detail=f"{type(err).__name__}: {err}"[:400])
        got.update(key=key, expect=expect, seconds=round(time.perf_counter() - start, 2))
        sys.__stdout__.write(_MARK + json.dumps(got, default=str) + "\n")
        sys.__stdout__.flush()
        try:
            torch.cuda.synchronize()
            torch.ones(1, device="cuda").add_(torch.randn(1, device="cuda")).item()
        except Exception:  # noqa: BLE001
            sys.exit(3)


def _shard(keys: list[str], env: dict, results: list[dict]) -> None:
    """Run ``keys`` in worker processes, a new one after each that ends early; each verdict
    is appended to ``results`` as it comes (a run cut short keeps what it finished)."""
    left = list(keys)
    while left:
        proc = subprocess.Popen([sys.executable, "-m", "tests.rehearsal_cases.real",
                                 "--worker", ",".join(left)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], STEP_S)
            line = proc.stdout.readline() if ready else None
            if not line:
                if line is None:  # no answer in STEP_S: the step hangs
                    proc.kill()
                proc.wait()
                if left and proc.returncode != 3:  # 3: unusable after its last step
                    results.append(dict(key=left[0], expect=_steps()[left[0]][0],
                                        real="hang" if line is None else "crashed",
                                        detail=f"worker exit {proc.returncode}"))
                    left.pop(0)
                break
            if not line.startswith(_MARK):  # the step's own prints
                continue
            got = json.loads(line[len(_MARK):])
            results.append(got)
            left.remove(got["key"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rehearsal_cases.real")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", default="")
    parser.add_argument("--only", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker.split(","))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("skipped: needs CUDA (a real capture)")
        return 0
    keys = list(_steps())
    if args.only:
        keys = [k for k in keys if k.split(":", 1)[1] in args.only.split(",")]
    shards = [keys[i::args.workers] for i in range(args.workers)]
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ)
    results: list[dict] = []  # list.append is atomic: the shards' threads share it
    pool = ThreadPoolExecutor(args.workers)
    try:
        list(pool.map(lambda s: _shard(s, env, results), shards))
    except KeyboardInterrupt:  # timeout -s INT: write what was judged
        print(f"interrupted: {len(results)} of {len(keys)} steps judged")
    pool.shutdown(wait=False, cancel_futures=True)
    results = sorted(results, key=lambda r: list(_steps()).index(r["key"]))
    if args.out:
        with open(args.out, "w") as f:
            for r in results:
                f.write(json.dumps(r, default=str) + "\n")
    bad = [r for r in results if r["real"] != r["expect"]]
    for r in bad:
        print(f"{r['key']}: expected {r['expect']}, real {r['real']} "
              f"{r.get('max_diff', '')} {r['detail'][:200]}")
    print(f"{len(results) - len(bad)} of {len(results)} steps agree with a real capture "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
