"""Re-run, my way, every case the fourth reliability pass found failing (issue 57;
``../shared/reviews/reliability.md``, "Every failing case"), and say which hold now.

Each case is tried as the pass tried it: a real process (``python -m labkit ...``), real files,
hard links, signals and environment variables; the Python-API and notebook-helper cases in a
fresh interpreter. A case holds when labkit refuses in one line naming what is wrong (exit 2),
or does what the case asks (a report, a stop), and leaves what it must not touch as it was.

    python scripts/reliability_cases.py            # every case, a table, the figure
    python scripts/reliability_cases.py K- W-      # the cases whose id starts so

Takes about three minutes on 2 cores. Exit 1 if a case fails."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TINY = ["--device", "cpu", "--stage", "async_logging", "--n-envs", "8", "--n-steps", "8",
        "--no-progress"]
DEEP = "[" * 200_000 + "]" * 200_000
CASES: list[tuple[str, str, Callable[[Path], str | None]]] = []  # (id, class, try it)


def case(name: str, what: str):
    def add(fn):
        CASES.append((name, what, fn))
        return fn
    return add


def labkit(*argv: str, cwd: Path, env: dict | None = None, timeout: float = 120
           ) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "labkit", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {}),
                                                "PYTHONPATH": str(ROOT)})


def one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> str | None:
    """None if ``r`` exited 2 with one ``error:`` line holding every needle; else why not."""
    said = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if r.returncode != 2 or len(said) != 1 or not said[0].startswith("error:"):
        return f"rc={r.returncode}, stderr: {r.stderr.strip()[-300:]!r}"
    missing = [n for n in needles if n not in said[0]]
    return f"the line lacks {missing}: {said[0][:300]!r}" if missing else None


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def raises(code: str, error: str, needle: str, cwd: Path) -> str | None:
    """None if ``code`` raises ``error`` with ``needle`` in its message."""
    r = python(f"import sys\ntry:\n{_indent(code)}\nexcept {error} as e:\n"
               f"    print('RAISED', e)\nelse:\n    print('ACCEPTED')", cwd)
    out = r.stdout.strip().splitlines()[-1:] or [r.stderr.strip()[-300:]]
    return None if out[0].startswith("RAISED") and needle in out[0] else out[0][:300]


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


# ------------------------------------------------------------------ runs to copy


def partial_run(tmp: Path, name: str) -> Path:
    """A run stopped after 1 of 2 iterations (what --resume continues)."""
    src = tmp / "_partial"
    if not src.exists():
        labkit("train", *TINY, "--total-steps", "128", "--stop-after", "1", "--out", str(src),
               cwd=tmp)
    shutil.copytree(src, tmp / name)
    return tmp / name


def complete_run(tmp: Path, name: str) -> Path:
    src = tmp / "_complete"
    if not src.exists():
        labkit("train", *TINY, "--total-steps", "128", "--out", str(src), cwd=tmp)
    shutil.copytree(src, tmp / name)
    return tmp / name


def edit_checkpoint(run: Path, edit: str) -> None:
    """Rewrite checkpoint.pt with ``edit`` (Python on ``p``, the payload), header valid."""
    code = ("from labkit.app import checkpoint\nimport torch\n"
            f"path = {str(run / 'checkpoint.pt')!r}\np = checkpoint.load(path)\n{edit}\n"
            "p.pop('format')\ncheckpoint.save(path, p)")
    r = python(code, run)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])


# ------------------------------------------------------------------ 1. security, links


@case("S-lock-hardlink-new-run", "security")
def _(tmp):
    victim = tmp / "victim.txt"
    victim.write_text("precious")
    (tmp / "R").mkdir()
    os.link(victim, tmp / "R" / ".lock")
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "R", cwd=tmp)
    return one_line_exit_2(r, ".lock") or (None if victim.read_text() == "precious"
                                           else "the linked file was written")


@case("H-foreign-dot-lock-new-run", "security")
def _(tmp):
    (tmp / "R").mkdir()
    (tmp / "R" / ".lock").write_text("another tool's lock\n")
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "R", cwd=tmp)
    kept = (tmp / "R" / ".lock").read_text() == "another tool's lock\n"
    return one_line_exit_2(r, ".lock") or (None if kept else "the foreign .lock was changed")


@case("S-stale-tmp-is-a-folder", "security")
def _(tmp):
    run = partial_run(tmp, "s6")
    (run / ".checkpoint.pt.zzzz.tmp" / "inner").mkdir(parents=True)
    return one_line_exit_2(labkit("train", "--resume", "s6", "--no-progress", cwd=tmp),
                           ".checkpoint.pt.zzzz.tmp")


@case("S-tensorboard-is-run-file", "security")
def _(tmp):
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "s10", "--tensorboard",
               "s10/metrics.jsonl", cwd=tmp)
    return one_line_exit_2(r, "--tensorboard") or (
        "a folder was left behind" if (tmp / "s10").exists() else None)


# ------------------------------------------------------------------ 3. history, saved state


def _running(tmp: Path, out: str, every: str) -> subprocess.Popen:
    """A long run in a real process, once it has logged three iterations."""
    proc = subprocess.Popen([PY, "-m", "labkit", "train", *TINY, "--total-steps", "640000",
                             "--checkpoint-every", every, "--out", out], cwd=tmp,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    path = tmp / out / "metrics.jsonl"
    deadline = time.time() + 120
    while (not path.exists() or len(path.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.1)
    return proc


@case("C-metrics-truncated-in-place-midrun", "history")
def _(tmp):
    proc = _running(tmp, "R", "2")
    os.truncate(tmp / "R" / "metrics.jsonl", 0)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "the run went on after its history was truncated"
    r = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
    return one_line_exit_2(r, "metrics.jsonl changed while the run was writing it")


def _edited_resume(tmp: Path, name: str, edit: str, *needles: str) -> str | None:
    """A partial run whose checkpoint ``edit`` changed (header valid), resumed."""
    edit_checkpoint(partial_run(tmp, name), edit)
    return one_line_exit_2(labkit("train", "--resume", name, "--no-progress", cwd=tmp),
                           *needles)


@case("K-metrics-return-impossible", "history")
def _(tmp):
    return _edited_resume(tmp, "k1", "p['state']['metrics'].update(returns=[1e9], lengths=[3])",
                          "checkpoint.pt", "returns")


@case("K-wall-s-negative", "history")
def _(tmp):
    return _edited_resume(tmp, "k2", "p['wall_s'] = -1e9", "wall_s")


@case("K-adam-exp-avg-sq-negative", "saved optimizer state")
def _(tmp):
    return _edited_resume(tmp, "k3", "for e in p['state']['optimizer']['state'].values():\n"
                                     "    e['exp_avg_sq'] = torch.full_like(e['exp_avg_sq'], "
                                     "-1.0)", "checkpoint.pt", "exp_avg_sq")


@case("K-threads-0", "JSON and fields")
def _(tmp):
    return _edited_resume(tmp, "k4", "p['threads'] = 0", "threads")


@case("K-threads-1e12", "JSON and fields")
def _(tmp):
    return _edited_resume(tmp, "k5", "p['threads'] = 10**12", "threads")


def _deep_resume(tmp: Path, name: str, file: str, complete: bool) -> str | None:
    run = (complete_run if complete else partial_run)(tmp, name)
    (run / file).write_text(DEEP)
    return one_line_exit_2(labkit("train", "--resume", name, "--no-progress", cwd=tmp), file)


@case("H-config-json-deeply-nested", "JSON and fields")
def _(tmp):
    return _deep_resume(tmp, "h1", "config.json", False)


@case("H-summary-deep-resume-complete", "JSON and fields")
def _(tmp):
    return _deep_resume(tmp, "h2", "summary.json", True)


@case("H-metrics-deeply-nested-last-line-resume", "JSON and fields")
def _(tmp):
    run = partial_run(tmp, "h3")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    return one_line_exit_2(labkit("train", "--resume", "h3", "--no-progress", cwd=tmp),
                           "metrics.jsonl")


@case("H-plot-runs-deeply-nested-first-line", "JSON and fields")
def _(tmp):
    run = complete_run(tmp, "h4")
    (run / "metrics.jsonl").write_text(DEEP + "\n" + (run / "metrics.jsonl").read_text())
    return one_line_exit_2(labkit("plot-runs", "h4", "--out", "p.png", cwd=tmp),
                           "metrics.jsonl")


@case("H-report-results-deep", "JSON and fields")
def _(tmp):
    (tmp / "res").mkdir()
    (tmp / "res" / "ladder_cpu_quick.json").write_text(DEEP)
    return one_line_exit_2(labkit("report", "--results", "res", cwd=tmp),
                           "ladder_cpu_quick.json")


def _summary_resume(tmp: Path, name: str, text: str) -> str | None:
    """A complete run whose summary.json holds ``text``, resumed."""
    (complete_run(tmp, name) / "summary.json").write_text(text)
    return one_line_exit_2(labkit("train", "--resume", name, "--no-progress", cwd=tmp),
                           "summary.json", "steps")


@case("H-summary-empty-object-resume-complete", "JSON and fields")
def _(tmp):
    return _summary_resume(tmp, "h5", "{}")


@case("H-summary-steps-null-resume-complete", "JSON and fields")
def _(tmp):
    return _summary_resume(tmp, "h6", '{"steps": null, "final_mean_return": null}')


@case("H-summary-huge-number-resume-complete", "JSON and fields")
def _(tmp):
    return _summary_resume(tmp, "h7", '{"steps": 1e400}')


@case("H-plot-runs-extreme-values", "JSON and fields")
def _(tmp):
    (tmp / "h8").mkdir()
    (tmp / "h8" / "metrics.jsonl").write_text(
        '{"step": 64, "wall_s": 1e308, "mean_return": 1e308}\n'
        '{"step": -64, "wall_s": -1.0, "mean_return": 0.5}\n')
    return one_line_exit_2(labkit("plot-runs", "h8", "--out", "h8.png", cwd=tmp),
                           "metrics.jsonl", "line 1")


@case("C-run-folder-deleted-midrun", "history")
def _(tmp):
    proc = _running(tmp, "k3", "1")
    shutil.rmtree(tmp / "k3")
    _, err = proc.communicate(timeout=60)
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]
    ok = proc.returncode == 1 and len(said) == 1 and "k3/metrics.jsonl was deleted" in said[0]
    return None if ok else f"rc={proc.returncode}: {err.strip()[-300:]!r}"


# ------------------------------------------------------------------ 2. torchrun


def _rank_env(**extra: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **extra}


@case("T-ws-2-master-addr-unresolvable", "torchrun")
def _(tmp):
    r = labkit("train", *TINY, "--total-steps", "256", "--out", "t1", cwd=tmp, timeout=60,
               env=_rank_env(MASTER_ADDR="no-such-host.invalid"))
    return one_line_exit_2(r, "MASTER_ADDR")


@case("T-ws-2-rank0-no-peer", "torchrun")
def _(tmp):
    failures = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([PY, "-m", "labkit", "train", *TINY, "--total-steps", "256",
                                 "--out", "t2"], cwd=tmp, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **_rank_env(), "PYTHONPATH": str(ROOT)})
        line = ""
        while "waiting up to" not in line and proc.poll() is None:
            line = proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append(f"{sig.name}: still waiting 10 s after it")
            continue
        if proc.returncode != -sig:
            failures.append(f"{sig.name}: rc={proc.returncode}")
    return "; ".join(failures) or None


@case("T-ws-huge", "torchrun")
def _(tmp):
    r = labkit("train", *TINY, "--total-steps", "128", "--out", "t3", cwd=tmp,
               env=_rank_env(WORLD_SIZE="999999999999999999999999999999"))
    return one_line_exit_2(r, "WORLD_SIZE")


@case("T-WORLD_SIZE-50k-digits", "torchrun")
def _(tmp):
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "t4", cwd=tmp,
               env=_rank_env(WORLD_SIZE="7" * 50_000))
    return one_line_exit_2(r, "WORLD_SIZE", "50,000 digits")


# ------------------------------------------------------------------ 6. watch on scripts

STEP = "import os, sys, torch\n\n\ndef step(x):\n    return x.sum().item()\n\n\n"


def _watch(tmp: Path, body: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp / "w.py").write_text(STEP + body)
    return labkit("watch", *flags, "w.py", cwd=tmp)


@case("W-missing-module", "watch")
def _(tmp):
    return one_line_exit_2(labkit("watch", "-m", "no_such_module_here", cwd=tmp),
                           "no_such_module_here")


@case("W-directory", "watch")
def _(tmp):
    (tmp / "w").mkdir()
    return one_line_exit_2(labkit("watch", "w", cwd=tmp), "is a folder")


@case("W-script-clears-setprofile", "watch")
def _(tmp):
    r = _watch(tmp, "for _ in range(3):\n    step(torch.ones(3))\n    sys.setprofile(None)\n",
               "--function", "step")
    return None if "replaced labkit's profile hook" in r.stdout else r.stdout[-300:]


@case("W-script-os-exit", "watch")
def _(tmp):
    r = _watch(tmp, "for _ in range(3):\n    step(torch.ones(3))\nos._exit(7)\n",
               "--function", "step")
    ok = r.returncode == 7 and "3 iteration(s)" in r.stdout and "os._exit(7)" in r.stdout
    return None if ok else f"rc={r.returncode}, stdout {r.stdout[-300:]!r}"


@case("W-script-forks", "watch")
def _(tmp):
    r = _watch(tmp, "step(torch.ones(3))\npid = os.fork()\nstep(torch.ones(3))\n"
                    "if pid:\n    os.waitpid(pid, 0)\n", "--function", "step")
    ok = r.stdout.count("labkit watch:") == 1 and "forked 1 process" in r.stdout
    return None if ok else r.stdout[-400:]


# ------------------------------------------------------------------ 7. the rest

_PIPE = ("import torch\nfrom labkit.stages import Pipeline\nfrom labkit.config import RunConfig\n"
         "p = Pipeline('async_logging', RunConfig(n_envs=4, n_steps=8), torch.device('cpu'))\n")


@case("A-pipeline-iteration-after-close", "Python API")
def _(tmp):
    return raises(_PIPE + "p.close()\np.iteration()", "ValueError", "is closed", tmp)


@case("A-pipeline-load-dict", "Python API")
def _(tmp):
    return raises(_PIPE + "p.load_state_dict({'agent': {}})", "TypeError", "PipelineState",
                  tmp)


@case("A-train-cfg-dict", "Python API")
def _(tmp):
    return raises("import labkit\nlabkit.train({'n_envs': 8}, 'a1')", "TypeError",
                  "cfg must be a TrainConfig", tmp)


@case("B-reads_table-list", "notebook helpers")
def _(tmp):
    return raises("from labkit.book import show\nshow.reads_table([1, 2])", "ValueError",
                  "reads_table", tmp)


@case("B-recorded_gpu-rows-ints", "notebook helpers")
def _(tmp):
    (tmp / "res").mkdir()
    (tmp / "res" / "ladder_cuda_full.json").write_text(json.dumps(
        {"meta": {"device": "cuda"}, "ladder": [1, 2]}))
    return raises("from labkit.book import show\nshow.recorded_gpu(['x'], results='res')",
                  "ValueError", "ladder_cuda_full.json", tmp)


@case("B-run_curve-inf-values", "notebook helpers")
def _(tmp):
    (tmp / "r").mkdir()
    (tmp / "r" / "metrics.jsonl").write_text('{"step": 64, "wall_s": 1.0, "mean_return": '
                                             'Infinity}\n')
    return raises("from labkit.book import plots\nplots.run_curve('r')", "ValueError",
                  "mean_return", tmp)


@case("E-numpy-pos-meta", "Python API")
def _(tmp):
    return raises("import torch\nfrom labkit.envs import ForageNumpy\ne = ForageNumpy(4)\n"
                  "s = e.state_dict()\ns['pos'] = torch.as_tensor(s['pos']).to('meta')\n"
                  "e.load_state_dict(s)", "ValueError", "meta device", tmp)


@case("E-torch-grid-meta", "Python API")
def _(tmp):
    return raises("from labkit.envs import ForageTorch\ne = ForageTorch(4)\n"
                  "s = e.state_dict()\ns['grid'] = s['grid'].to('meta')\n"
                  "e.load_state_dict(s)", "ValueError", "meta device", tmp)


@case("N-out-newline-rtl-control", "odd flag values")
def _(tmp):
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "f_ctl/a\x1b[31mred\x07",
               cwd=tmp)
    return one_line_exit_2(r, "control character") or (
        "a folder was made" if (tmp / "f_ctl").exists() else None)


@case("V-cwd-deleted", "odd environments")
def _(tmp):
    gone = tmp / "v_gone"
    gone.mkdir()
    r = subprocess.run(f"cd {gone} && rmdir {gone} && {PY} -m labkit train --device cpu "
                       "--total-steps 64", shell=True, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return one_line_exit_2(r, "folder")


def main(prefixes: list[str]) -> int:
    chosen = [c for c in CASES if not prefixes or c[0].startswith(tuple(prefixes))]
    held = 0
    with tempfile.TemporaryDirectory(prefix="labkit-cases-") as root:
        shared = Path(root) / "shared"
        shared.mkdir()
        for name, what, fn in chosen:
            tmp = shared / name
            tmp.mkdir()
            for src in ("_partial", "_complete"):  # the runs cases copy, made once
                if (shared / src).exists():
                    (tmp / src).symlink_to(shared / src)
            start = time.perf_counter()
            try:
                why = fn(tmp)
            except Exception as err:  # noqa: BLE001 - the case's own machinery broke
                why = f"the case raised {type(err).__name__}: {err}"
            for src in ("_partial", "_complete"):
                made = tmp / src
                if made.exists() and not made.is_symlink():
                    made.rename(shared / src)
            held += why is None
            print(f"{'holds' if why is None else 'FAILS':<6} {name:<44} {what:<22} "
                  f"{time.perf_counter() - start:5.1f} s" + (f"\n       {why}" if why else ""),
                  flush=True)
    print(f"\n{held} of {len(chosen)} cases hold")
    return 0 if held == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
