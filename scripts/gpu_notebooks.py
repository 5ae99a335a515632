"""Execute chapters on a GPU machine, each in its own process, and keep what each showed.

    python3 scripts/gpu_notebooks.py OUT_DIR notebooks/00_measure_first.ipynb ...

Each notebook is executed in place (``labkit.app.notebooks.execute_notebook``: the device and the
commit stamped in its metadata) and copied into OUT_DIR, also when a cell raised (then the
error is printed and the exit status is 1). For a first look at what CUDA cells do there;
``record --part notebook-NN`` is what records a chapter."""
from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _one(path: str, out: str) -> tuple[str, float, str]:
    import torch

    from labkit.app.notebooks import execute_notebook
    start = time.perf_counter()
    error = ""
    try:
        execute_notebook(Path(path), torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                         os.environ.get("LABKIT_GIT_COMMIT", "unknown"), timeout=240)
    except Exception:  # noqa: BLE001 - reported, the other notebooks go on
        error = traceback.format_exc()[-3000:]
    shutil.copy(path, Path(out) / Path(path).name)
    return path, time.perf_counter() - start, error


def main(argv: list[str]) -> int:
    out, paths = argv[0], argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    failed = 0
    workers = min(len(paths), int(os.environ.get("LABKIT_NB_WORKERS", "6")))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for path, seconds, error in pool.map(_one, paths, [out] * len(paths)):
            print(f"{path}: {seconds:.0f} s {'FAILED' if error else 'ok'}", flush=True)
            if error:
                failed += 1
                print(error, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
