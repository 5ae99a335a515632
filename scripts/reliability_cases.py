"""Re-run, my way, every case of the fourth reliability pass (issue 57;
``../shared/reviews/reliability.md``): the 39 it found failing ("Every failing case") and the 171
it found holding ("Holding cases (briefly)"), and say which hold now, with the figure for each
list and for the whole set of 210.

Each case is tried as the pass tried it: a real process (``python -m labkit ...``), real files,
hard and symbolic links, signals, environment variables, resource limits (``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``) and, as root, a small tmpfs that fills up or is remounted
read-only. The failing list's Python-API and notebook-helper cases run in a fresh interpreter
each; the holding list's share one (torch imported once), each in a fresh namespace and folder.
A case holds when labkit refuses in one line naming what is wrong (exit 2; a machine fault exit
1, the old file kept; a signal 128 + n with a folder that resumes), raises the documented
exception naming the argument, or does what the case asks (a report, a stop, a run), and leaves
what it must not touch as it was. A case that cannot be set up here (no tmpfs mount) is
"skipped" and counted apart.

    python scripts/reliability_cases.py            # every case, a table, the figures
    python scripts/reliability_cases.py K- W-      # the cases whose id starts so

Takes 15 to 18 minutes on 2 cores (17.6 measured at a load average of 3.5 from other work; the
failing list alone 3 to 7), 16 CPU-minutes in all. Exit 1 if a case fails (a skipped one does
not count)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TINY = ["--device", "cpu", "--stage", "async_logging", "--n-envs", "8", "--n-steps", "8",
        "--no-progress"]
DEEP = "[" * 200_000 + "]" * 200_000
#: (id, class or family, which list of the review, try it): a case returns None where it
#: holds, "skipped: why" where it cannot be set up here, and otherwise what went wrong.
CASES: list[tuple[str, str, str, Callable[[Path], str | None]]] = []
LISTS = {"failing": 39, "holding": 171}  # the review's counts


def case(name: str, what: str, listed: str = "failing"):
    def add(fn):
        CASES.append((name, what, listed, fn))
        return fn
    return add


def holding(name: str, family: str):
    """A case of the review's "Holding cases (briefly)", in ``family``."""
    return case(name, family, "holding")


def _environ(env: dict | None) -> dict:
    """This process's environment with ``env`` over it (a None value: the variable unset)."""
    merged = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return {k: v for k, v in merged.items() if v is not None}


def _limited(limits: dict[int, int] | None, close: tuple[int, ...]) -> Callable | None:
    """A preexec_fn setting resource ``limits`` (soft and hard) and closing the fds ``close``."""
    if not limits and not close:
        return None

    def setup() -> None:
        for what, value in (limits or {}).items():
            resource.setrlimit(what, (value, value))
        for fd in close:
            os.close(fd)
    return setup


def labkit(*argv: str, cwd: Path, env: dict | None = None, timeout: float = 120,
           limits: dict[int, int] | None = None, close: tuple[int, ...] = ()
           ) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "labkit", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_environ(env), preexec_fn=_limited(limits, close))


def one_line_exit(r: subprocess.CompletedProcess, code: int, *needles: str) -> str | None:
    """None if ``r`` exited ``code`` with one ``error:`` line holding every needle; else why
    not."""
    said = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if r.returncode != code or len(said) != 1 or not said[0].startswith("error:"):
        return f"rc={r.returncode}, stderr: {r.stderr.strip()[-300:]!r}"
    missing = [n for n in needles if n not in said[0]]
    return f"the line lacks {missing}: {said[0][:300]!r}" if missing else None


def one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> str | None:
    """None if ``r`` exited 2 with one ``error:`` line holding every needle; else why not."""
    return one_line_exit(r, 2, *needles)


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


# ------------------------------------------------------------------ what a case may not change


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) with a digest of what it holds; each
    ``.lock`` left out: a run writes its pid there before it judges the saved state."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            p = Path(folder) / name
            if name == ".lock":
                continue
            seen[str(p.relative_to(root))] = (
                "-> " + os.readlink(p) if p.is_symlink() else
                hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "folder")
    return seen


def _changed(root: Path, before: dict[str, str]) -> str | None:
    """What is made, changed or gone under ``root`` since ``before`` (None: nothing)."""
    after = _tree(root)
    diff = [f"made {p}" for p in after.keys() - before.keys()] + \
        [f"removed {p}" for p in before.keys() - after.keys()] + \
        [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return "; ".join(sorted(diff)[:4]) or None


def refused(tmp: Path, argv: tuple[str, ...] | list[str], *needles: str, code: int = 2,
            **kw) -> str | None:
    """None if ``python -m labkit argv`` (run in ``tmp``; ``kw``: :func:`labkit`'s) refuses in
    one line holding ``needles``, exit ``code``, and nothing under ``tmp`` changed."""
    before = _tree(tmp)
    return one_line_exit(labkit(*argv, cwd=tmp, **kw), code, *needles) or _changed(tmp, before)


def no_traceback(r: subprocess.CompletedProcess, *codes: int) -> str | None:
    """None if ``r`` exited with one of ``codes`` and wrote no traceback."""
    if r.returncode not in codes or "Traceback" in r.stderr:
        return f"rc={r.returncode}, stderr: {r.stderr.strip()[-300:]!r}"
    return None


def trained(r: subprocess.CompletedProcess, run: Path) -> str | None:
    """None if ``r`` ended a run in ``run`` (exit 0, no traceback, its summary written)."""
    return no_traceback(r, 0) or (None if (run / "summary.json").is_file()
                                  else f"no summary.json in {run.name}")


# ------------------------------------------------------------------ one interpreter for the API

_WORKER = r"""
import json, os, sys
reply = os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
os.dup2(quiet, 2)
import torch, labkit  # noqa: E401 - imported once for every case
for line in sys.stdin:
    ask = json.loads(line)
    os.chdir(ask["cwd"])
    try:
        exec(compile(ask["code"], "<case>", "exec"),
             {"__name__": "__case__", "labkit": labkit, "torch": torch})
        said = ["ACCEPTED", ""]
    except BaseException as err:  # noqa: BLE001 - what the case raised is its answer
        said = [type(err).__name__, str(err)[:600]]
    reply.write(json.dumps(said) + "\n")
    reply.flush()
"""


class Worker:
    """A Python process that runs the holding list's API snippets, each in a fresh namespace
    (``labkit`` and ``torch`` imported) with its case's folder as cwd; restarted after a snippet
    that hangs or kills it."""

    proc: subprocess.Popen | None = None

    @classmethod
    def run(cls, code: str, cwd: Path, timeout: float = 120) -> tuple[str, str]:
        """(the exception's type name, its message), or ("ACCEPTED", "")."""
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([PY, "-c", _WORKER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env=_environ({"MPLBACKEND": "Agg"}))
        cls.proc.stdin.write(json.dumps({"code": code, "cwd": str(cwd)}) + "\n")
        cls.proc.stdin.flush()
        ready, _, _ = select.select([cls.proc.stdout], [], [], timeout)
        line = cls.proc.stdout.readline() if ready else ""
        if not line:
            cls.stop()
            return ("HANG" if not ready else "DIED"), f"no answer within {timeout:.0f} s"
        return tuple(json.loads(line))

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None:
            cls.proc.kill()
            cls.proc.wait()
            cls.proc = None


def api_refuses(tmp: Path, code: str, errors: str, *needles: str) -> str | None:
    """None if ``code`` raises one of ``errors`` (names, space-separated) with every needle
    in its message, and nothing under ``tmp`` changed."""
    before = _tree(tmp)
    kind, said = Worker.run(code, tmp)
    if kind not in errors.split():
        return f"{kind}: {said[:300]}"
    missing = [n for n in needles if n not in said]
    return (f"{kind} lacks {missing}: {said[:300]}" if missing else None) or \
        _changed(tmp, before)


def api_works(tmp: Path, code: str) -> str | None:
    """None if ``code`` (which asserts what it needs) runs without raising."""
    kind, said = Worker.run(code, tmp)
    return None if kind == "ACCEPTED" else f"{kind}: {said[:300]}"


# ------------------------------------------------------------------ runs to copy

SHARED_RUNS = ("_partial", "_complete", "_np_partial")  # made once, by the first case asking


def _copy_of(tmp: Path, src: str, name: str, *argv: str) -> Path:
    """A copy named ``name`` of the run ``train argv`` made (once) in ``tmp/src``."""
    if not (tmp / src).exists():
        labkit("train", *argv, "--out", str(tmp / src), cwd=tmp)
    shutil.copytree(tmp / src, tmp / name, symlinks=True)
    return tmp / name


def partial_run(tmp: Path, name: str) -> Path:
    """A run stopped after 1 of 2 iterations (what --resume continues)."""
    return _copy_of(tmp, "_partial", name, *TINY, "--total-steps", "128", "--stop-after", "1")


def np_partial_run(tmp: Path, name: str) -> Path:
    """The same, with numpy_vec's envs (their state is NumPy's, the seed a plain int)."""
    return _copy_of(tmp, "_np_partial", name, *TINY, "--stage", "numpy_vec", "--total-steps",
                    "128", "--stop-after", "1")


def complete_run(tmp: Path, name: str) -> Path:
    return _copy_of(tmp, "_complete", name, *TINY, "--total-steps", "128")


def _edit_code(run: Path, edit: str) -> str:
    return ("from labkit.app import checkpoint\nimport torch\n"
            f"path = {str(run / 'checkpoint.pt')!r}\np = checkpoint.load(path)\n{edit}\n"
            "p.pop('format')\ncheckpoint.save(path, p)")


def edit_checkpoint(run: Path, edit: str) -> None:
    """Rewrite checkpoint.pt with ``edit`` (Python on ``p``, the payload), header valid."""
    r = python(_edit_code(run, edit), run)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])


def edit_in_worker(run: Path, edit: str) -> None:
    """:func:`edit_checkpoint` in the shared interpreter."""
    kind, said = Worker.run(_edit_code(run, edit), run)
    if kind != "ACCEPTED":
        raise RuntimeError(f"the edit raised {kind}: {said}")
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


def _start(tmp: Path, *argv: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m labkit argv`` started in ``tmp``, its stderr piped, its stdout dropped, the
    stop signals at their defaults (this script may run under nohup, whose ignored SIGHUP a
    run keeps ignoring)."""
    return subprocess.Popen([PY, "-m", "labkit", *argv], cwd=tmp, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=_environ(env),
                            preexec_fn=_default_signals)


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _wait_for(ready: Callable[[], bool], timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while not ready() and time.time() < deadline:
        time.sleep(0.05)
    return ready()


def _records(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _running(tmp: Path, out: str, every: str, lines: int = 3) -> subprocess.Popen:
    """A long run in a real process, once it has logged ``lines`` iterations."""
    proc = _start(tmp, "train", *TINY, "--total-steps", "640000", "--checkpoint-every", every,
                  "--out", out)
    _wait_for(lambda: _records(tmp / out / "metrics.jsonl") >= lines)
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
    while (tmp / "k3").exists():  # the run may write a file while the folder goes: again
        shutil.rmtree(tmp / "k3", ignore_errors=True)
    _, err = proc.communicate(timeout=60)
    said = [ln for ln in err.splitlines() if ln.startswith("error:")]
    # whichever the run notices first: its log file gone, or the folder its lock was in
    ok = proc.returncode == 1 and len(said) == 1 and (
        "k3/metrics.jsonl was deleted" in said[0] or "run folder" in said[0] and "k3" in said[0])
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


# ================================================================== the holding list (171)
# Each id of the review's "Holding cases (briefly)", in its family; where the review names only
# the class, the case is the closest input its id names (said in a comment).

SEC, KST, TRN, CON = "security", "hostile checkpoint state", "torchrun environment", \
    "concurrency and signals"
WAT, API, FLG, ENV = "watch on scripts", "Python API and Gymnasium", "odd flag values", \
    "odd environments"
HOS, BOK = "hostile files", "notebook helpers"


def _resume(run: Path, **kw) -> subprocess.CompletedProcess:
    return labkit("train", "--resume", run.name, "--no-progress", cwd=run.parent, **kw)


def _victim(tmp: Path) -> Path:
    """A file outside every run folder that no case may write."""
    victim = tmp / "victim.txt"
    victim.write_text("precious")
    return victim


def _kept(victim: Path) -> str | None:
    return None if victim.read_text() == "precious" else f"{victim.name} was written"


# ------------------------------------------------------------------ security (7)


def _linked_resume(tmp: Path, name: str, target: Callable[[Path], Path], *needles: str,
                   no_checkpoint: bool = False) -> str | None:
    """A partial run whose file ``name`` is a symbolic link to ``target(tmp)``, resumed:
    refused in one line naming the link, nothing written where it points."""
    run = partial_run(tmp, "R")
    if no_checkpoint:  # died before its first checkpoint: config.json alone
        for gone in ("checkpoint.pt", "metrics.jsonl", "summary.json"):
            (run / gone).unlink()
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target(tmp))
    return refused(tmp, ("train", "--resume", "R", "--no-progress"), name, *needles)


def _folder(tmp: Path) -> Path:
    (tmp / "elsewhere").mkdir()
    return tmp / "elsewhere"


for _name, _file, _target, _bare in (
        ("S-lock-symlink-resume", ".lock", _victim, False),
        ("S-dangling-metrics-symlink-resume-no-ckpt", "metrics.jsonl",
         lambda tmp: tmp / "nowhere.txt", True),
        ("S-summary-symlink-resume", "summary.json", _victim, False),
        ("S-metrics-symlink-to-dir-resume", "metrics.jsonl", _folder, False)):
    holding(_name, SEC)(lambda tmp, f=_file, t=_target, b=_bare:
                        _linked_resume(tmp, f, t, "symbolic link", no_checkpoint=b))


@holding("S-stale-tmp-symlink-metrics", SEC)
def _(tmp):
    victim, run = _victim(tmp), partial_run(tmp, "R")
    stale = run / ".metrics.jsonl.zzzz.tmp"
    stale.symlink_to(victim)
    return trained(_resume(run), run) or _kept(victim) or (
        "the stale link was left" if stale.is_symlink() else None)


@holding("S-out-through-symlinked-parent", SEC)
def _(tmp):
    (tmp / "real").mkdir()
    (tmp / "L").symlink_to(tmp / "real")  # the user's own link above the run folder: taken
    return trained(labkit("train", *TINY, "--total-steps", "64", "--out", "L/run", cwd=tmp),
                   tmp / "real" / "run")


@holding("S-plot-runs-out-symlink", SEC)
def _(tmp):
    victim, out = _victim(tmp), tmp / "p.png"
    complete_run(tmp, "R")
    out.symlink_to(victim)
    r = labkit("plot-runs", "R", "--out", "p.png", cwd=tmp)
    replaced = not out.is_symlink() and out.read_bytes().startswith(b"\x89PNG")
    return no_traceback(r, 0) or _kept(victim) or (None if replaced else "the link was kept")


# ------------------------------------------------------------------ hostile checkpoint state (28)

_ENV = "e = p['state']['collector']['env']\n"
_METRICS = "p['state']['metrics'].update(returns={}, lengths={})"


def _hostile(tmp: Path, base: Callable[[Path, str], Path], edit: str, *needles: str
             ) -> str | None:
    """A partial run (``base``) whose checkpoint ``edit`` rewrote (header valid), resumed:
    refused in one line naming checkpoint.pt and the field, the run folder as it was."""
    edit_in_worker(base(tmp, "R"), edit)
    return refused(tmp, ("train", "--resume", "R", "--no-progress"), "checkpoint.pt", *needles)


for _name, _base, _edit, _needles in (
        ("K-np-pos-negative", np_partial_run, _ENV + "e['pos'][0] = -1", ("pos",)),
        ("K-np-pos-wall", np_partial_run, _ENV + "e['pos'][0] = 0", ("pos",)),  # the corner
        ("K-np-t-past-episode", np_partial_run, _ENV + "e['t'][0] = 500", ("state['t']",)),
        ("K-np-return-inf", np_partial_run, _ENV + "e['episode_return'][0] = float('inf')",
         ("episode_return",)),
        ("K-np-grid-77", np_partial_run, _ENV + "e['grid'].fill_(77)", ("grid",)),
        ("K-np-episode-negative", np_partial_run, _ENV + "e['episode'][0] = -1",
         ("episode",)),
        ("K-np-seed-2**40", np_partial_run, _ENV + "e['seed'] = 2**40", ("seed",)),
        ("K-np-seed-str", np_partial_run, _ENV + "e['seed'] = 'x'", ("seed",)),
        ("K-torch-seed-negative", partial_run, _ENV + "e['seed'].fill_(-5)", ("seed",)),
        ("K-torch-return-neg-inf", partial_run,
         _ENV + "e['episode_return'][0] = float('-inf')", ("episode_return",)),
        ("K-collector-t-negative", partial_run, "p['state']['collector']['t'].fill_(-3)",
         ("collector state['t']",)),
        ("K-collector-t-huge", partial_run, "p['state']['collector']['t'].fill_(10**12)",
         ("collector state['t']",)),
        ("K-collector-done-2.5", partial_run, "p['state']['collector']['done'][0] = 2.5",
         ("done",)),
        ("K-agent-weight-wrong-shape", partial_run,
         "p['state']['agent']['body.0.weight'] = torch.zeros(16, 3, 5, 5)", ("body.0.weight",)),
        ("K-generator-short", partial_run,
         "p['state']['generator'] = p['state']['generator'][:100]", ("RNG state",)),
        # the lists apart (lengths missing) and matched, each bad in one way
        ("K-metrics-returns-nan", partial_run, _METRICS.format("[float('nan')]", "[]"),
         ("returns",)),
        ("K-metrics-returns-dict", partial_run, _METRICS.format("{'a': 1.0}", "[3]"),
         ("returns",)),
        ("K-metrics-lengths-negative", partial_run, _METRICS.format("[]", "[-3]"),
         ("lengths",)),
        ("K-metrics-returns-nan-matched", partial_run,
         _METRICS.format("[float('nan')]", "[3]"), ("returns",)),
        ("K-metrics-lengths-negative-matched", partial_run, _METRICS.format("[1.0]", "[-3]"),
         ("lengths",)),
        ("K-metrics-returns-str-matched", partial_run, _METRICS.format("['x']", "[3]"),
         ("returns",)),
        ("K-config-n-envs-bool", partial_run, "p['config']['run']['n_envs'] = True",
         ("n_envs",)),
        ("K-state-iteration-huge", partial_run, "p['state']['iteration'] = 10**12",
         ("state.iteration",)),
        ("K-executor-choices-foreign", partial_run,
         "p['executor_choices'] = {'bogus': {'kept': 'eager', 'why': 'forced'}}",
         ("executor_choices",)),
        ("K-device-meta", partial_run, "p['device'] = 'meta'", ("meta",))):
    holding(_name, KST)(lambda tmp, b=_base, e=_edit, n=_needles: _hostile(tmp, b, e, *n))


def _taken_or_refused(tmp: Path, edit: str) -> str | None:
    """A partial run whose checkpoint ``edit`` rewrote with a value a run may ignore, resumed:
    refused as :func:`_hostile`, or trained bit-exactly as the run never stopped (the value
    changed nothing)."""
    reference, run = complete_run(tmp, "ref"), partial_run(tmp, "R")
    edit_in_worker(run, edit)
    r = _resume(run)
    if r.returncode:
        return one_line_exit_2(r, "checkpoint.pt")
    return trained(r, run) or (None if _curve(run) == _curve(reference) else
                               "the resumed run differs from the run that never stopped")


for _name, _edit in (
        # the saved Adam lr: a run sets its lr from its config's schedule at every iteration
        ("K-adam-lr-1e30", "p['state']['optimizer']['param_groups'][0]['lr'] = 1e30"),
        # a GradScaler's state (fp16 only) in a run that trains in fp32
        ("K-precision-scaler-on-fp32", "p['state']['precision'] = {'scale': torch.tensor("
         "[65536.0]), 'growth_tracker': torch.tensor([0], dtype=torch.int32)}"),
        # an extra key (no field of the format) holding a 200,000-element list
        ("K-format-extra-key-huge-list", "p['extra'] = list(range(200_000))")):
    holding(_name, KST)(lambda tmp, e=_edit: _taken_or_refused(tmp, e))


# ------------------------------------------------------------------ torchrun environment (10)


def _ranked(tmp: Path, env: dict, argv: tuple[str, ...], *needles: str) -> str | None:
    """``train argv`` with torchrun's variables ``env`` (over a sound two-rank set; None
    unsets): refused in one line naming the variable, before any folder is made."""
    return refused(tmp, ("train", *TINY, "--total-steps", "256", *argv), *needles,
                   env=_rank_env(**env), timeout=60)


_OUT = ("--out", "t")

for _name, _env, _argv, _needles in (
        ("T-ws-space-rank-missing", {"WORLD_SIZE": " 2", "RANK": None}, _OUT, ("RANK",)),
        ("T-ws-2-rank-float", {"RANK": "1.0"}, _OUT, ("RANK",)),
        ("T-ws-2-rank-2", {"RANK": "2"}, _OUT, ("RANK=2",)),
        ("T-ws-2-local-world-0", {"LOCAL_WORLD_SIZE": "0"}, _OUT, ("LOCAL_WORLD_SIZE",)),
        ("T-ws-2-local-rank-3", {"LOCAL_RANK": "3"}, _OUT, ("LOCAL_RANK",)),
        ("T-ws-2-port-99999", {"MASTER_PORT": "99999"}, _OUT, ("MASTER_PORT",)),
        # fullwidth '２' is read as 2 (Python's int): the missing RANK is then named
        ("T-ws-unicode-digits", {"WORLD_SIZE": "\uff12", "RANK": None}, _OUT, ("RANK",)),
        ("T-ws-2-no-master-addr", {"MASTER_ADDR": None}, _OUT, ("MASTER_ADDR",)),
        ("T-ws-2-popart", {}, ("--value-head", "popart", *_OUT), ("value_head",)),
        ("T-ws-2-no-out", {}, (), ("--out",))):
    holding(_name, TRN)(lambda tmp, e=_env, a=_argv, n=_needles: _ranked(tmp, e, a, *n))


# ------------------------------------------------------------------ concurrency and signals (6)

_LOSSES = ("pg_loss", "v_loss", "entropy", "approx_kl", "grad_norm")


def _curve(run: Path) -> list[tuple]:
    """The losses of each iteration in ``run``'s metrics.jsonl (what bit-exact runs share)."""
    return [tuple(json.loads(line)[k] for k in _LOSSES)
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _consecutive(run: Path) -> str | None:
    """None if ``run``'s metrics.jsonl holds iterations 1, 2, ... in order, each once."""
    its = [json.loads(line)["iteration"]
           for line in (run / "metrics.jsonl").read_text().splitlines()]
    return None if its == list(range(1, len(its) + 1)) else f"iterations {its[:12]}"


def _ended(proc: subprocess.Popen, timeout: float = 90) -> subprocess.CompletedProcess:
    """``proc``'s exit (killed after ``timeout``: its code is then that of SIGKILL)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err or "")


@holding("C-two-new-trains-same-folder", CON)
def _(tmp):
    reference = complete_run(tmp, "ref")  # the same config, trained alone
    procs = [_start(tmp, "train", *TINY, "--total-steps", "128", "--out", "R") for _ in "ab"]
    ends = sorted((_ended(p) for p in procs), key=lambda r: r.returncode)
    if [r.returncode for r in ends] != [0, 2]:
        return f"exit codes {[r.returncode for r in ends]}: {ends[-1].stderr[-300:]!r}"
    return one_line_exit_2(ends[1], "R") or _consecutive(tmp / "R") or (
        None if _curve(tmp / "R") == _curve(reference) else "not bit-exact with a run alone")


@holding("C-resume-while-running", CON)
def _(tmp):
    proc = _running(tmp, "R", "1")
    try:
        return one_line_exit_2(labkit("train", "--resume", "R", "--no-progress", cwd=tmp),
                               "in use")
    finally:
        proc.send_signal(signal.SIGINT)
        _ended(proc)


@holding("C-lock-replaced-midrun", CON)
def _(tmp):
    proc = _running(tmp, "R", "1")
    (tmp / "R" / ".lock.new").write_text("0")
    os.replace(tmp / "R" / ".lock.new", tmp / "R" / ".lock")
    r = _ended(proc)
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    if r.returncode not in (1, 2) or len(said) != 1 or ".lock" not in said[0] \
            or "replaced" not in said[0]:
        return f"rc={r.returncode}: {r.stderr.strip()[-300:]!r}"
    return _consecutive(tmp / "R")


@holding("G-sigint-storm-during-checkpoints", CON)
def _(tmp):
    proc = _running(tmp, "R", "1", lines=5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.03)
    proc.send_signal(signal.SIGINT)
    r = _ended(proc)
    kept = re.search(r"checkpoint\.pt holds the state after iteration (\d+)", r.stderr)
    if r.returncode not in (130, -signal.SIGINT) or not kept or "Traceback" in r.stderr:
        return f"rc={r.returncode}: {r.stderr.strip()[-300:]!r}"
    if list((tmp / "R").glob(".*.tmp")):
        return "a temporary file was left"
    k = int(kept.group(1))
    again = labkit("train", "--resume", "R", "--no-progress", "--stop-after", str(k + 1),
                   cwd=tmp)
    return no_traceback(again, 0) or _consecutive(tmp / "R") or (
        None if _records(tmp / "R" / "metrics.jsonl") == k + 1 else "the resume did not go on")


@holding("G-sigterm-during-warmup", CON)
def _(tmp):
    proc = _start(tmp, "train", *TINY, "--stage", "fused_amp", "--total-steps", "640",
                  "--out", "R")
    _wait_for(lambda: (tmp / "R" / "config.json").exists())
    time.sleep(1.0)  # in the compile warmup: fused_amp times compiled against eager
    proc.send_signal(signal.SIGTERM)
    r = _ended(proc, 60)
    left = sorted(p.name for p in (tmp / "R").iterdir())
    if r.returncode not in (143, -signal.SIGTERM) or "nothing trained yet" not in r.stderr:
        return f"rc={r.returncode}: {r.stderr.strip()[-300:]!r}"
    return None if left == [".lock", "config.json"] else f"the folder holds {left}"


@holding("G-sighup-at-import", CON)
def _(tmp):
    proc = _start(tmp, "train", *TINY, "--total-steps", "64", "--out", "R")
    time.sleep(0.3)  # still importing torch
    proc.send_signal(signal.SIGHUP)
    r = _ended(proc, 60)
    if r.returncode not in (129, -signal.SIGHUP) or "Traceback" in r.stderr:
        return f"rc={r.returncode}: {r.stderr.strip()[-300:]!r}"
    return "R was made" if (tmp / "R").exists() else None


# ------------------------------------------------------------------ labkit watch on scripts (10)


def _watched(r: subprocess.CompletedProcess, code: int, stderr: str = "", stdout: str = ""
             ) -> str | None:
    """None if ``watch`` exited ``code`` and printed its report (holding ``stdout``), its
    stderr ending in ``stderr`` (the script's own error, as Python prints it, runner frames
    and all, as ``python -m cProfile`` does) or empty."""
    said = r.stderr.strip().splitlines()
    ok = r.returncode == code and "labkit watch:" in r.stdout and stdout in r.stdout \
        and (stderr in said[-1] if stderr and said else not said)
    return None if ok else f"rc={r.returncode}, stdout {r.stdout[-200:]!r}, " \
                           f"stderr {r.stderr[-200:]!r}"


for _name, _body, _flags, _code, _err, _out in (
        ("W-script-raises", "step(torch.ones(3))\nraise ValueError('boom')\n",
         ("--function", "step"), 1, "ValueError: boom", "1 iteration(s)"),
        ("W-function-never-called", "step(torch.ones(3))\n", ("--function", "nothere"), 0, "",
         "never called a function of that name"),
        ("W-sysexit-string", "step(torch.ones(3))\nsys.exit('bye')\n", ("--function", "step"),
         1, "bye", "1 iteration(s)"),
        ("W-thread-raises", "import threading\nt = threading.Thread(target=lambda: 1 / 0)\n"
         "t.start()\nt.join()\nstep(torch.ones(3))\n", ("--function", "step"), 0,
         "ZeroDivisionError", "1 iteration(s)"),
        # each call of a generator function: its frames resume and return at every yield
        ("W-generator-function", "def gen():\n    yield step(torch.ones(3))\n\n\n"
         "for _ in range(3):\n    list(gen())\n", ("--function", "gen"), 0, "", "iteration(s)"),
        ("W-syntax-error", "def (:\n", (), 1, "SyntaxError", "0 iteration(s)")):
    holding(_name, WAT)(lambda tmp, b=_body, f=_flags, c=_code, e=_err, o=_out:
                        _watched(_watch(tmp, b, *f), c, e, o))


@holding("W-binary-file", WAT)
def _(tmp):
    (tmp / "w.bin").write_bytes(bytes(range(256)) * 4)
    r = labkit("watch", "w.bin", cwd=tmp)  # Python's own refusal of the file, then the report
    return _watched(r, 1, "SyntaxError")


@holding("W-function-dotted-bad", WAT)
def _(tmp):
    (tmp / "w.py").write_text(STEP)
    return refused(tmp, ("watch", "--function", "a..b", "w.py"), "--function")


@holding("W-no-target", WAT)
def _(tmp):
    return refused(tmp, ("watch",), "TARGET")


@holding("W-watch-labkit-itself", WAT)
def _(tmp):  # labkit's own train run as the watched module
    r = labkit("watch", "-m", "labkit", "train", *TINY, "--total-steps", "64", "--out", "R",
               cwd=tmp)
    return _watched(r, 0, stdout="trained 64 steps") or trained(r, tmp / "R")


# ------------------------------------------------------------------ Python API and Gymnasium (39)

_CFG = ("from labkit.app.train import TrainConfig\n"
        "cfg = TrainConfig.flat(device='cpu', stage='async_logging', n_envs=8, n_steps=8, "
        "total_steps=64)\n")
_RC = "from labkit.config import RunConfig\n"
_P = _RC + "from labkit.stages import Pipeline\ncfg = RunConfig(n_envs=4, n_steps=4)\n"
_GYM = "import gymnasium as gym, numpy as np, labkit.envs.gym\n"
_ONE = _GYM + "e = gym.make('labkit/Forage-v0')\ne.reset(seed=1)\n"
_REH = _RC + "from labkit.doctor.rehearsal import rehearse_stage\n"
_ENVS = "import torch\nfrom labkit.envs import ForageNumpy, ForageTorch\n"

for _name, _code, _errors, _needles in (
        ("A-train-out-int", _CFG + "labkit.train(cfg, 5)", "TypeError", ("out",)),
        ("A-train-stop-after-float", _CFG + "labkit.train(cfg, 'a', stop_after=1.5)",
         "TypeError ValueError", ("stop_after",)),
        ("A-train-resume-cfg-none-newrun", "labkit.train(None, 'a')", "ValueError", ("cfg",)),
        ("A-runconfig-n-envs-nan", _RC + "RunConfig(n_envs=float('nan'))",
         "TypeError ValueError", ("n_envs",)),
        ("A-runconfig-n-envs-np-int", _RC + "import numpy as np\nRunConfig(n_envs=np.int64(8))",
         "TypeError", ("n_envs",)),
        ("A-runconfig-seed-2**70", _RC + "RunConfig(seed=2**70)", "ValueError", ("seed",)),
        ("A-runconfig-unknown-kw", _RC + "RunConfig(bogus=1)", "TypeError", ("bogus",)),
        ("A-pipeline-stage-list", _P + "Pipeline([4], cfg, 'cpu')", "ValueError", ("stage",)),
        ("A-pipeline-stage-99", _P + "Pipeline(99, cfg, 'cpu')", "ValueError", ("stage",)),
        ("A-pipeline-cfg-dict", _P + "Pipeline('async_logging', {'n_envs': 4}, 'cpu')",
         "TypeError", ("cfg",)),
        ("A-pipeline-device-obj", _P + "Pipeline('async_logging', cfg, object())", "TypeError",
         ("device",)),
        ("A-pipeline-device-cuda", _P + "Pipeline('async_logging', cfg, 'cuda')", "ValueError",
         ("cuda",)),
        ("A-get-stage-none-str", "labkit.get_stage('None')", "ValueError", ("stage",)),
        ("A-get-stage-bool", "labkit.get_stage(True)", "ValueError", ("stage",)),
        ("A-rehearse-stage-str-99", _REH + "rehearse_stage('99')", "ValueError", ("stage",)),
        ("A-rehearse-n-envs-neg", _REH + "rehearse_stage('cuda_graphs', RunConfig(n_envs=-4))",
         "ValueError", ("n_envs",)),
        ("A-rehearse-plant-bogus", "from labkit.doctor.plants import plant\n"
         "plant('cuda_graphs', 'bogus')", "ValueError", ("plant",)),
        # the rehearsal's command as a function (rehearse_stage itself takes no device)
        ("A-rehearse-device-cuda", "import argparse\nfrom labkit.app.doctor import "
         "cmd_rehearse\ncmd_rehearse(argparse.Namespace(device='cuda', stage='cuda_graphs', "
         "plant=None, n_envs=4, n_steps=4, iterations=1))", "ValueError", ("--device",)),
        ("A-watch-nested", "with labkit.watch():\n    with labkit.watch():\n        pass",
         "RuntimeError", ("nest",)),  # the documented refusal
        ("A-watch-kwarg-bogus", "labkit.watch(bogus=1)", "TypeError", ("bogus",)),
        ("A-gym-make-n-envs-kw", _GYM + "gym.make('labkit/Forage-v0', n_envs=4)", "TypeError",
         ("n_envs",)),
        ("A-gym-make-spec-dict", _GYM + "gym.make('labkit/Forage-v0', forage={'height': 9})",
         "TypeError", ("forage",)),
        ("A-gym-make-seed-kw", _GYM + "gym.make('labkit/Forage-v0', seed=3)", "TypeError",
         ("seed",)),
        ("A-gym-make-vec-backend-bogus", _GYM + "gym.make_vec('labkit/Forage-v0', num_envs=4, "
         "backend='jax')", "ValueError", ("backend",)),
        ("A-gym-make-vec-device-bogus", _GYM + "gym.make_vec('labkit/Forage-v0', num_envs=4, "
         "backend='torch', device='tpu')", "ValueError", ("device",)),
        ("A-gym-make-vec-num-envs-float", _GYM + "gym.make_vec('labkit/Forage-v0', "
         "num_envs=2.5)", "TypeError ValueError", ("num_envs",)),
        ("A-gym-make-max-episode-steps-0", _GYM + "gym.make('labkit/Forage-v0', "
         "max_episode_steps=0)", "ValueError", ("max_episode_steps",)),
        ("A-gym-step-before-reset", _GYM + "gym.make('labkit/Forage-v0').step(0)",
         "ResetNeeded", ("reset",)),  # Gymnasium's documented exception
        ("A-gym-vec-torch-numpy-actions", _GYM + "e = gym.make_vec('labkit/Forage-v0', "
         "num_envs=4, backend='torch')\ne.reset(seed=1)\ne.step(np.zeros(4, dtype=np.int64))",
         "TypeError", ("actions",)),
        ("E-numpy-pos-float", _ENVS + "e = ForageNumpy(4)\ns = e.state_dict()\n"
         "s['pos'] = s['pos'].double()\ne.load_state_dict(s)", "ValueError", ("pos",)),
        # half a reward at step 0 (rewards are whole: -1, 0 or +1 a step)
        ("E-torch-return-half-step", _ENVS + "e = ForageTorch(4)\ns = e.state_dict()\n"
         "s['episode_return'] += 0.5\ne.load_state_dict(s)", "ValueError", ("episode_return",)),
        ("G-step-np-bool", _ONE + "e.step(np.bool_(True))", "ValueError", ("action",))):
    holding(_name, API)(lambda tmp, c=_code, e=_errors, n=_needles: api_refuses(tmp, c, e, *n))

for _name, _code in (
        # a string for progress: a TypeError naming it, or taken as true and the run trained
        ("A-train-progress-str", _CFG + "try:\n    labkit.train(cfg, 'a', progress='no')\n"
         "except (TypeError, ValueError) as err:\n    assert 'progress' in str(err), err\n"
         "else:\n    import os\n    assert os.path.isfile('a/summary.json')"),
        ("A-watch-step-outside", "w = labkit.watch()\nw.step()\n"
         "assert w.report().iterations == 1"),  # the documented count, outside a block too
        ("A-watch-reenter", "w = labkit.watch()\nfor _ in range(2):\n    with w:\n"
         "        torch.ones(3).sum().item()\nassert w.report().device_reads == 2"),
        ("A-watch-report-inside", "w = labkit.watch()\nwith w:\n    r = w.report()\n"
         "assert r.iterations == 0 and not type(w)._active"),
        # options is Gymnasium's free-form dict: its 'seed' is not the reset's seed keyword
        ("A-gym-reset-options-seed", _GYM + "e = gym.make('labkit/Forage-v0')\n"
         "obs, info = e.reset(options={'seed': 3})\nassert e.observation_space.contains(obs)"),
        ("G-step-np-uint8-4", _ONE + "r = e.step(np.uint8(4))\nassert isinstance(r[1], float)"),
        ("G-step-after-timelimit-no-reset", _GYM + "e = gym.make('labkit/Forage-v0', "
         "max_episode_steps=2)\ne.reset(seed=1)\nends = [e.step(0)[3] for _ in range(3)]\n"
         "assert ends == [False, True, True], ends")):
    holding(_name, API)(lambda tmp, c=_code: api_works(tmp, c))


# ------------------------------------------------------------------ odd flag values (28)

_RUN = ("train", *TINY, "--total-steps", "64", "--out", "R")
_50K = "z" * 50_000


def _flag(tmp: Path, argv: tuple[str, ...], *needles: str) -> str | None:
    """``argv`` refused in one line naming the flag, nothing made (plot-runs: of a real run)."""
    if argv[0] == "plot-runs":
        partial_run(tmp, "R")
    return refused(tmp, argv, *needles)


for _name, _argv, _needles in (
        # digits Python's int() reads (Arabic-Indic, with an underscore): read as the number
        # they spell, said by the batch-size check (--total-steps 8 is under one batch)
        ("N-n-envs-arabic-digits", ("train", *TINY, "--n-envs", "\u0668", "--total-steps", "8",
                                    "--out", "R"), ("n_envs * n_steps * world_size = 64",)),
        ("N-n-envs-underscore", ("train", *TINY, "--n-envs", "1_6", "--total-steps", "8",
                                 "--out", "R"), ("n_envs * n_steps * world_size = 128",)),
        ("N-total-steps-1e30", ("train", *TINY, "--total-steps", "1e30", "--out", "R"),
         ("--total-steps",)),
        ("N-checkpoint-every-1e30", (*_RUN, "--checkpoint-every", "1e30"),
         ("--checkpoint-every",)),
        ("N-stage-fullwidth", (*_RUN, "--stage", "\uff4e\uff55\uff4d\uff50\uff59_vec"),
         ("--stage",)),
        ("N-stage-mixed-case", (*_RUN, "--stage", "Async_Logging"), ("--stage",)),
        ("N-device-cuda-minus1", (*_RUN, "--device", "cuda:-1"), ("device", "cuda:-1")),
        ("N-device-CPU-upper", (*_RUN, "--device", "CPU"), ("device", "CPU")),
        ("N-out-empty", ("train", *TINY, "--out", ""), ("--out",)),
        ("N-resume-empty", ("train", "--resume", ""), ("--resume",)),
        ("N-out-is-dev-null", ("train", *TINY, "--out", "/dev/null"), ("--out", "/dev/null")),
        ("N-out-name-too-long", ("train", *TINY, "--out", "x" * 300 + "/R"),
         ("--out", "File name too long")),
        # TensorBoard is installed here: its folder a path that cannot be one
        ("N-tensorboard-not-installed-or-bad", (*_RUN, "--tensorboard", "/dev/null/tb"),
         ("--tensorboard",)),
        ("N-plot-runs-out-no-suffix", ("plot-runs", "R", "--out", "fig"), ("--out",)),
        ("N-plot-runs-out-pdf-suffix-bogus", ("plot-runs", "R", "--out", "fig.pdfx"),
         ("--out", "fig.pdfx")),
        ("N-bench-env-n-envs-list-dup-zero", ("bench-env", "--n-envs", "8", "8", "0",
                                              "--out", "B"), ("--n-envs",)),
        ("N-ladder-stages-dup-and-range", ("ladder", "--stages", "4,4,99", "--out", "L"),
         ("--stages", "99")),
        ("N-ladder-stages-empty", ("ladder", "--stages", ",", "--out", "L"), ("--stages",)),
        ("N-rehearse-device-cuda", ("rehearse", "--device", "cuda"), ("--device",)),
        ("N-record-parts-comma", ("record", "--part", ",", "--plan", "--out", "res"), ("--parts",)),
        ("N-stage-50k", (*_RUN, "--stage", _50K), ("--stage", "characters)")),
        ("N-device-50k", (*_RUN, "--device", _50K), ("device", "characters)")),
        ("N-oracle-50k", ("plot-runs", "R", "--oracle", _50K, "--out", "f.png"),
         ("--oracle", "characters)"))):
    holding(_name, FLG)(lambda tmp, a=_argv, n=_needles: _flag(tmp, a, *n))


def _figure(tmp: Path, *argv: str) -> str | None:
    r = labkit("plot-runs", *argv, cwd=tmp)
    return no_traceback(r, 0) or (None if (tmp / argv[-1]).is_file() else "no figure")


@holding("N-plot-runs-same-folder-twice", FLG)
def _(tmp):  # drawn twice, as asked
    partial_run(tmp, "R")
    return _figure(tmp, "R", "R", "--out", "f.png")


@holding("N-plot-runs-out-is-folder", FLG)
def _(tmp):
    (tmp / "fig.png").mkdir()
    return _flag(tmp, ("plot-runs", "R", "--out", "fig.png"), "--out", "folder")


# '' is no plant (the flag's default): the doctor then runs the stage as it is
@holding("N-doctor-json-plant-empty", FLG)
def _(tmp):
    r = labkit("doctor", "--json", "--plant", "", "--device", "cpu", "--stage",
               "async_logging", "--n-envs", "4", "--n-steps", "4", "--iterations", "2", cwd=tmp)
    try:
        json.loads(r.stdout)
    except ValueError:
        return f"stdout is not JSON: {r.stdout[:200]!r}; {r.stderr[-200:]!r}"
    return no_traceback(r, 0, 1)


@holding("N-profile-top-huge", FLG)
def _(tmp):  # every op of the trace, however many rows were asked for
    r = labkit("profile", "--device", "cpu", "--stage", "async_logging", "--n-envs", "4",
               "--n-steps", "4", "--top", "9" * 30, "--out", "prof", cwd=tmp)
    return no_traceback(r, 0) or (None if any((tmp / "prof").iterdir()) else "no trace")


@holding("N-watch-json-function-unicode", FLG)
def _(tmp):
    (tmp / "w.py").write_text(STEP.replace("step", "schritt_\u00fc") +
                              "for _ in range(3):\n    schritt_\u00fc(torch.ones(3))\n")
    r = labkit("watch", "--json", "--function", "schritt_\u00fc", "w.py", cwd=tmp)
    try:
        iterations = json.loads(r.stdout)["iterations"]
    except (ValueError, KeyError, TypeError):
        return f"rc={r.returncode}, stdout {r.stdout[:200]!r}"
    return no_traceback(r, 0) or (None if iterations == 3 else f"{iterations} iterations")


# ------------------------------------------------------------------ odd environments (28)

_AS = {resource.RLIMIT_AS: 3_500_000_000}


def _trains(tmp: Path, out: str = "R", **kw) -> str | None:
    """A tiny run trains under ``kw`` (:func:`labkit`'s: an environment, limits, closed fds)."""
    return trained(labkit("train", *TINY, "--total-steps", "64", "--out", out, cwd=tmp, **kw),
                   tmp / out)


def _trains_or_fault(tmp: Path, **kw) -> str | None:
    """A tiny run trains, or stops on the machine's fault in one line (exit 1)."""
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "R", cwd=tmp, **kw)
    return one_line_exit(r, 1) if r.returncode == 1 else trained(r, tmp / "R")


_ASCII = {"PYTHONIOENCODING": "ascii"}
_SMALL = ("--n-envs", "4", "--n-steps", "4")

for _name, _out, _env in (
        ("V-ioencoding-ascii-train", "r\u00fcn", _ASCII),
        ("V-LC_ALL-C-unicode-out", "run\U0001F600", {"LC_ALL": "C", "LANG": "C"}),
        ("V-no-HOME", "R", {"HOME": None}),
        ("V-TMPDIR-missing", "R", {"TMPDIR": "/nonexistent/tmp"})):
    holding(_name, ENV)(lambda tmp, o=_out, e=_env: _trains(tmp, o, env=e))

for _name, _argv in (
        ("V-ioencoding-ascii-doctor", ("doctor", "--device", "cpu", "--stage", "async_logging",
                                       *_SMALL, "--iterations", "2")),
        ("V-ioencoding-ascii-rehearse", ("rehearse", *_SMALL, "--iterations", "1"))):
    holding(_name, ENV)(lambda tmp, a=_argv: no_traceback(
        labkit(*a, cwd=tmp, env=_ASCII), 0, 1))

for _name, _limit in (("V-nofile-16", 16), ("V-nofile-40", 40)):
    holding(_name, ENV)(lambda tmp, n=_limit: _trains_or_fault(
        tmp, limits={resource.RLIMIT_NOFILE: n}))


@holding("V-HOME-readonly-proc", ENV)
def _(tmp):  # matplotlib's own warning about its config folder, at most; the figure written
    complete_run(tmp, "R")
    r = labkit("plot-runs", "R", "--out", "f.png", cwd=tmp,
               env={"HOME": "/proc", "MPLCONFIGDIR": None, "XDG_CONFIG_HOME": None,
                    "XDG_CACHE_HOME": None})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return no_traceback(r, 0) or (f"{len(lines)} stderr lines" if len(lines) > 2 else None) \
        or (None if (tmp / "f.png").is_file() else "no figure")


@holding("V-broken-pipe-doctor", ENV)
def _(tmp):  # the reader gone before the report: quiet, 128 + SIGPIPE
    proc = subprocess.Popen([PY, "-m", "labkit", "doctor", "--device", "cpu", "--stage",
                             "async_logging", *_SMALL, "--iterations", "2"], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_environ(None))
    proc.stdout.close()
    r = _ended(proc, 120)
    quiet = not r.stderr.strip()
    return None if r.returncode == 128 + signal.SIGPIPE and quiet else \
        f"rc={r.returncode}, stderr {r.stderr.strip()[-300:]!r}"


@holding("V-stdout-closed-train", ENV)
def _(tmp):
    return _trains(tmp, close=(1,))


@holding("V-stderr-closed-usererror", ENV)
def _(tmp):  # nothing to say it on: the exit code says it, and nothing is made
    before = _tree(tmp)
    r = labkit("train", *TINY, "--n-envs", "0", "--out", "R", cwd=tmp, close=(2,))
    return (None if r.returncode == 2 else f"rc={r.returncode}") or _changed(tmp, before)


# the run's memory judged against the address-space limit, not the RAM (21+ GiB here)
for _name, _argv in (
        ("M-as-3g-train-fits-ram-not-limit", ("train", *TINY, "--n-envs", "20000",
                                              "--n-steps", "64", "--total-steps", "1280000",
                                              "--out", "R")),
        ("M-as-3g-bench-env-4M", ("bench-env", "--device", "cpu", "--n-envs", "4000000",
                                  "--repeats", "1", "--out", "B")),
        ("M-as-3g-rehearse", ("rehearse", "--n-envs", "60000", "--n-steps", "16"))):
    holding(_name, ENV)(lambda tmp, a=_argv: refused(tmp, a, "RLIMIT_AS", limits=_AS))


@holding("M-as-1g-import", ENV)
def _(tmp):  # 1 GB of address space: torch imports; the run fits, or is refused in one line
    r = labkit("train", *TINY, "--total-steps", "64", "--out", "R", cwd=tmp,
               limits={resource.RLIMIT_AS: 1_000_000_000})
    return trained(r, tmp / "R") if r.returncode == 0 else one_line_exit(r, r.returncode)


for _name, _var in (("E-LABKIT_DEBUG-50k", {"LABKIT_DEBUG": "y" * 50_000}),
                    ("E-LABKIT_GIT_COMMIT-backtick-newline",
                     {"LABKIT_GIT_COMMIT": "abc1234`id`\nx"})):
    holding(_name, ENV)(lambda tmp, v=_var: refused(tmp, _RUN, *v, env=v))


# ---- disk: RLIMIT_FSIZE, a tmpfs that fills, a read-only mount

_OLD = b"an old figure, kept"


def _kept_on_fault(tmp: Path, argv: tuple[str, ...], limit: int, files: list[Path],
                   *needles: str) -> str | None:
    """``argv`` under ``RLIMIT_FSIZE`` = ``limit``: one line, exit 1, naming ``needles`` and
    saying the file is kept; ``files`` byte for byte as they were, no temporary left."""
    old = {f: f.read_bytes() for f in files}
    r = labkit(*argv, cwd=tmp, limits={resource.RLIMIT_FSIZE: limit})
    torn = [f.name for f in files if f.read_bytes() != old[f]]
    left = [p.name for f in files for p in f.parent.glob(f".{f.name}.*.tmp")]
    return one_line_exit(r, 1, "is kept as it was", *needles) or (
        f"changed {torn}" if torn else None) or (f"left {left}" if left else None)


@holding("D-fsize-plot-runs-old-png", ENV)
def _(tmp):
    complete_run(tmp, "R")
    (tmp / "f.png").write_bytes(_OLD)
    return _kept_on_fault(tmp, ("plot-runs", "R", "--out", "f.png"), 4096, [tmp / "f.png"],
                          "f.png")


@holding("D-fsize-ladder-png", ENV)
def _(tmp):  # the JSON (6 KB) fits under the limit, the figures (20-30 KB) do not
    (tmp / "L").mkdir()
    pngs = [tmp / "L" / f"ladder_cpu_quick_{kind}.png" for kind in ("ladder", "phases",
                                                                     "learning")]
    for png in pngs:
        png.write_bytes(_OLD)
    return _kept_on_fault(tmp, ("ladder", "--device", "cpu", "--stages", "4", "--n-envs", "8",
                                "--n-steps", "8", "--iterations", "2", "--no-scaling",
                                "--no-progress", "--out", "L"), 12_000, pngs, ".png")


def _fsize_checkpoint(tmp: Path) -> str | None:
    """A partial run resumed under a 100-KB file-size limit: its checkpoint (500 KB) cannot be
    written, and the one it had is kept."""
    run = partial_run(tmp, "R")
    return _kept_on_fault(tmp, ("train", "--resume", "R", "--no-progress"), 100_000,
                          [run / "checkpoint.pt"], "checkpoint.pt")


holding("D-fsize-checkpoint-write", ENV)(_fsize_checkpoint)


@holding("D-fsize-checkpoint-then-resume", ENV)
def _(tmp):
    return _fsize_checkpoint(tmp) or trained(_resume(tmp / "R"), tmp / "R")


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted at ``where`` (None where this machine will not mount one),
    unmounted after."""
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    try:
        yield where if made.returncode == 0 else None
    finally:
        if made.returncode == 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def on_tmpfs(size: str) -> Callable:
    """A case ``fn(tmp, disk)`` run with a tmpfs of ``size`` at ``tmp/disk``; skipped where
    none can be mounted."""
    def wrap(fn: Callable[[Path, Path], str | None]) -> Callable[[Path], str | None]:
        def run(tmp: Path) -> str | None:
            with tmpfs(tmp / "disk", size) as disk:
                if disk is None:
                    return "skipped: cannot mount a tmpfs here (not root, or not permitted)"
                return fn(tmp, disk)
        return run
    return wrap


@holding("D-tmpfs-full-midrun", ENV)
@on_tmpfs("800k")
def _(tmp, disk):  # the first checkpoint (500 KB) fits, the second one's temporary does not
    r = labkit("train", *TINY, "--total-steps", "640", "--checkpoint-every", "1", "--out",
               str(disk / "R"), cwd=tmp)
    return one_line_exit(r, 1, "checkpoint.pt", "iteration") or (
        None if (disk / "R" / "checkpoint.pt").read_bytes().startswith(b"LABKITCK")
        else "the checkpoint is torn")


def _full(disk: Path) -> Path:
    """A partial run on ``disk``, the disk then filled but for 128 KB: the run's small files
    can be written, its checkpoint (500 KB) cannot."""
    run = disk / "R"
    shutil.copytree(partial_run(disk.parent, "R"), run)
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        f.truncate(max(0, os.fstat(f.fileno()).st_size - 131072))
    return run


def _resume_full(run: Path) -> str | None:
    """Resumed on the full disk: one line, exit 1, the checkpoint byte for byte as it was."""
    old = (run / "checkpoint.pt").read_bytes()
    return one_line_exit(_resume(run), 1, "checkpoint.pt", "is kept as it was") or (
        None if (run / "checkpoint.pt").read_bytes() == old else "the checkpoint changed")


@holding("D-tmpfs-full-resume-still-full", ENV)
@on_tmpfs("2m")
def _(tmp, disk):
    return _resume_full(_full(disk))


@holding("D-tmpfs-full-then-resume-after-space", ENV)
@on_tmpfs("2m")
def _(tmp, disk):
    run = _full(disk)
    failed = _resume_full(run)
    (disk / "filler").unlink()
    return failed or trained(_resume(run), run)


def _read_only(src: Path, check: Callable[[Path], str | None]) -> Callable[[Path], str | None]:
    """A case: ``src(tmp)`` copied to a tmpfs remounted read-only, ``check`` of the copy."""
    @on_tmpfs("4m")
    def run(tmp: Path, disk: Path) -> str | None:
        made = src(tmp)
        shutil.copytree(made, disk / made.name)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)
        return check(disk / made.name)
    return run


def _results_copy(tmp: Path) -> Path:
    (tmp / "res").mkdir()
    shutil.copy(ROOT / "results" / "ladder_cpu_quick.json", tmp / "res")
    return tmp / "res"


holding("D-readonly-resume-partial", ENV)(_read_only(
    lambda tmp: partial_run(tmp, "R"), lambda run: refused(
        run.parent, ("train", "--resume", "R", "--no-progress"), "--resume", "Read-only")))
holding("D-readonly-plot-runs-in", ENV)(_read_only(
    lambda tmp: complete_run(tmp, "R"),
    lambda run: _figure(run.parent.parent, str(run), "--out", "f.png")))
holding("D-readonly-report", ENV)(_read_only(_results_copy, lambda res: refused(
    res.parent, ("report", "--results", "res"), "res", "Read-only")))


# ------------------------------------------------------------------ hostile files (8)


def _bad_config(tmp: Path, rewrite: Callable[[dict], str], *needles: str) -> str | None:
    """A run that died before its first checkpoint (config.json alone), its config rewritten
    to ``rewrite(the config)``, resumed: refused in one line naming config.json."""
    run = partial_run(tmp, "R")
    for gone in ("checkpoint.pt", "metrics.jsonl", "summary.json"):
        (run / gone).unlink()
    (run / "config.json").write_text(rewrite(json.loads((run / "config.json").read_text())))
    return refused(tmp, ("train", "--resume", "R", "--no-progress"), "config.json", *needles)


def _set(path: tuple[str, ...], value: object) -> Callable[[dict], str]:
    def rewrite(data: dict) -> str:
        inner = data
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        return json.dumps(data)  # NaN as JSON's NaN literal (allow_nan: Python's default)
    return rewrite


for _name, _rewrite, _needles in (
        ("H-config-json-utf8-bom", lambda d: "\ufeff" + json.dumps(d), ()),
        ("H-config-json-spec-1e6-grid", _set(("run", "spec", "height"), 10**6), ("height",)),
        ("H-config-json-lr-NaN-literal", _set(("run", "ppo", "lr"), float("nan")), ("lr",)),
        ("H-config-json-gamma-7.5", _set(("run", "ppo", "gamma"), 7.5), ("gamma",))):
    holding(_name, HOS)(lambda tmp, w=_rewrite, n=_needles: _bad_config(tmp, w, *n))


@holding("H-plot-runs-mean-return-string", HOS)
def _(tmp):
    run = complete_run(tmp, "R")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "mean_return": "abc"})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return refused(tmp, ("plot-runs", "R", "--out", "f.png"), "metrics.jsonl", "mean_return")


def _results(tmp: Path, edit: Callable[[dict], None]) -> str | None:
    """A results folder whose ladder file ``edit`` changed, reported: refused in one line
    naming the file, nothing written."""
    data = json.loads((ROOT / "results" / "ladder_cpu_quick.json").read_text())
    edit(data)
    (tmp / "res").mkdir()
    (tmp / "res" / "ladder_cpu_quick.json").write_text(json.dumps(data))
    return refused(tmp, ("report", "--results", "res"), "ladder_cpu_quick.json")


for _name, _edit in (
        ("H-report-results-rows-strings", lambda d: d.update(ladder=["x", "y"])),
        ("H-report-results-ladder-null", lambda d: d.update(ladder=None)),
        ("H-report-results-nan-sps", lambda d: d["ladder"][0].update(sps=float("nan")))):
    holding(_name, HOS)(lambda tmp, e=_edit: _results(tmp, e))


# ------------------------------------------------------------------ notebook helpers (7)

_PLOTS, _SHOW = "from labkit.book import plots\n", "from labkit.book import show\n"
_META = "{'device': 'cpu', 'device_name': 'x', 'torch': '2', 'git_commit': 'abc1234', " \
        "'date': '2026-01-01'}"

for _name, _code, _errors, _needles in (
        ("B-ladder_bars-rows-no-sps", _PLOTS + f"plots.ladder_bars({{'meta': {_META}, "
         "'ladder': [{'stage': 0, 'name': 'python_loop', 'status': 'ok'}]})", "ValueError",
         ("ladder_bars",)),
        ("B-ladder_bars-none", _PLOTS + "plots.ladder_bars(None)", "ValueError",
         ("ladder_bars",)),
        ("B-learning_curves-none-values", _PLOTS + "plots.learning_curves({'a': None})",
         "ValueError", ("learning_curves",)),
        ("B-scaling_lines-list", _PLOTS + "plots.scaling_lines([1, 2])", "ValueError",
         ("scaling_lines",)),
        ("B-rows_table-none", _SHOW + "show.rows_table(None)", "ValueError", ("rows_table",)),
        ("B-rows_table-row-str", _SHOW + "show.rows_table(['x'])", "ValueError",
         ("rows_table",)),
        ("B-run_curve-dir-without-metrics", _PLOTS + "plots.run_curve('.')",
         "FileNotFoundError", ("metrics.jsonl",))):
    holding(_name, BOK)(lambda tmp, c=_code, e=_errors, n=_needles: api_refuses(tmp, c, e, *n))


def main(prefixes: list[str]) -> int:
    chosen = [c for c in CASES if not prefixes or c[0].startswith(tuple(prefixes))]
    verdicts: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="labkit-cases-") as root:
        shared = Path(root) / "shared"
        shared.mkdir()
        for name, what, listed, fn in chosen:
            tmp = shared / name
            tmp.mkdir()
            for src in SHARED_RUNS:  # the runs cases copy, made once
                if (shared / src).exists():
                    (tmp / src).symlink_to(shared / src)
            start = time.perf_counter()
            try:
                why = fn(tmp)
            except Exception as err:  # noqa: BLE001 - the case's own machinery broke
                why = f"the case raised {type(err).__name__}: {err}"
            for src in SHARED_RUNS:
                made = tmp / src
                if made.exists() and not made.is_symlink():
                    made.rename(shared / src)
            verdicts[name] = why
            word = "holds" if why is None else "skip" if why.startswith("skipped:") else "FAILS"
            print(f"{word:<6} {name:<44} {what:<25} {listed:<8} "
                  f"{time.perf_counter() - start:5.1f} s" + (f"\n       {why}" if why else ""),
                  flush=True)
        Worker.stop()
    return _figures(chosen, verdicts)


def _figures(chosen: list, verdicts: dict[str, str | None]) -> int:
    """Each list's figure and the whole set's (cases held of those run), then every case that
    did not hold, with why; 1 if any failed."""
    print()
    for listed, count in (*LISTS.items(), ("whole set", sum(LISTS.values()))):
        names = [c[0] for c in chosen if listed in (c[2], "whole set")]
        held = sum(verdicts[n] is None for n in names)
        skipped = sum((verdicts[n] or "").startswith("skipped:") for n in names)
        print(f"{listed if listed == 'whole set' else listed + ' list'}: {held} of "
              f"{len(names)} hold" + (f" ({skipped} skipped)" if skipped else "")
              + ("" if len(names) == count else f" (the review's list has {count})"))
    bad = [(n, why) for n, why in verdicts.items() if why is not None]
    for name, why in bad:
        print(f"  {'skipped' if why.startswith('skipped:') else 'fails'} {name}: {why}")
    return 1 if any(not why.startswith("skipped:") for _, why in bad) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
