"""``make record``: re-record every result and notebook on the machine at hand, in parts that
each fit a short stay on a GPU. Its parts and their estimated minutes are
:mod:`labkit.app.plan`; the files it writes into are :mod:`labkit.app.results`; the report part
is :mod:`labkit.app.report` (``results/RESULTS.md`` and the README's results section
generated from the JSON); a notebook part executes its chapter with :mod:`labkit.app.notebooks`.

A record is a list of **parts** (``python -m labkit record --plan`` prints them with their
estimated minutes), each one command's worth of work or less:

===============  ========================================================================
part             what it measures or writes (device D, profile P)
===============  ========================================================================
``ladder-S``     stage S at the profile's N and T: a row of ``results/ladder_D_P.json``;
                 the ladder parts of one command are timed together, interleaved
``scaling-N``    every stage that scales, at N envs: rows of the same file's sweep
``bench_env``    env steps/s of each Forage implementation: ``bench_env_D_P.json``
``learning``     a training curve per stage: ``learning_D_P.json`` and ``.png``
``notebook-NN``  chapter NN executed in place (on a GPU into ``chapters_cuda/NN_x.ipynb``)
``report``       ``RESULTS.md`` and the README's results, from the JSON
===============  ========================================================================

``--part`` takes part names and groups (``ladder``, ``scaling``, ``bench_env``, ``learning``,
``notebooks``, ``report``, ``all``), comma-separated. Work is kept as it finishes: each ladder
row is merged into its file by (stage, N) the moment it is measured (with the figures after
each part), the learning file after each stage, a notebook when it has run; Ctrl-C, SIGTERM and
SIGHUP (``timeout -s INT``) keep all of that and exit 128 + the signal. A later part merges its
rows into the same file. Every row names its **run** (``row["run"]``) and ``runs`` holds each
run's machine, commit, date and parts: a run is one record command, or several that pass the
same ``--run ID`` on the same kind of machine at the same commit. Ratios (x stage 0, x prev)
are taken only between rows of the same run. ``results/record_log_D_P.json`` keeps how long
each part took, which the plan shows instead of its estimate.

Every output carries the same commit: a record refuses to start when the code is modified
(``--allow-dirty`` records the commit as ``<hash>-dirty``; a tree without git names its commit
with ``LABKIT_GIT_COMMIT``). CPU and CUDA results live side by side, and a CPU record leaves
notebooks last recorded on a GPU as they are.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..device import git_commit, run_metadata
from ..files import check_output_dir, parse_json, save_figure, write_json
from .flags import device_and_profile, device_flag, path, run_id
from .notebooks import execute_notebook, recorded_on
from .plan import LEARNING, Part, plan, select
from .report import write_report
from .results import (
    ROOT,
    LadderFile,
    RecordError,
    check_run_id,
    new_run_id,
    read_json,
    record_log_path,
)

if TYPE_CHECKING:
    from ..config import BenchConfig

#: Code whose changes make recorded results stale: a record refuses to mix them in.
CODE_PATHS = ("labkit", "examples", "pyproject.toml")


def _dirty_code() -> list[str]:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", *CODE_PATHS], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


def commit_for_record(allow_dirty: bool) -> str:
    """The commit every output of this record carries; refuses modified code unless allowed."""
    dirty = _dirty_code()
    commit = git_commit()
    if dirty and not allow_dirty:
        shown = ", ".join(dirty[:5]) + (" ..." if len(dirty) > 5 else "")
        raise RecordError(f"the code is modified ({shown}): commit first, so that every "
                          "recorded result names the code that made it (or --allow-dirty)")
    return f"{commit}-dirty" if dirty else commit


# ---------------------------------------------------------------- the parts


class _Ladder(NamedTuple):
    """What the ladder and scaling parts of one command share."""

    cfg: BenchConfig
    book: LadderFile
    calibration: dict
    swept: list


class _Session:
    """One record command: its device, profile, folder, commit and run, the parts it records
    and how long each took, the record log and the progress bar."""

    def __init__(self, device: torch.device, profile: str, out: Path, commit: str, run: str,
                 say: Callable[[str], None], parts: list[Part], stages: list | None = None,
                 overwrite_gpu_notebooks: bool = False) -> None:
        from tqdm.auto import tqdm

        self.device, self.profile, self.out, self.commit, self.run = \
            device, profile, out, commit, run
        self.say, self.overwrite_gpu_notebooks = say, overwrite_gpu_notebooks
        self.meta = {**run_metadata(device, profile), "git_commit": commit, "run": run}
        self.log_path = record_log_path(out, device, profile)
        self.seconds: dict[str, float] = {}
        self.bar = tqdm(total=len(parts), desc=f"record {device.type} {profile}", unit="part")
        measured = [p for p in parts if p.kind in ("ladder", "scaling")]
        self._ladder = self._prepare_ladder(measured, stages) if measured else None

    def log(self, part: str, seconds: float, status: str) -> None:
        log = read_json(self.log_path) or {}
        parts = log.get("parts") if isinstance(log.get("parts"), dict) else {}
        parts[part] = {"seconds": round(seconds, 1), "status": status, "run": self.run,
                       "git_commit": self.commit, "date": self.meta["date"],
                       "device_name": self.meta["device_name"]}
        write_json(self.log_path, {"meta": self.meta, "parts": parts})

    def record(self, batch: list[Part]) -> None:
        """Record ``batch`` (one part, or parts timed together) by the runner of its kind,
        timed: each part is logged done, with the files written named, or interrupted, the stop
        raised again."""
        self.bar.set_postfix_str(",".join(p.name for p in batch))
        start = time.perf_counter()
        try:
            written = self.RUNNERS[batch[0].kind](self, batch)
        except KeyboardInterrupt:
            for part in batch:
                self.log(part.name, (time.perf_counter() - start) / len(batch), "interrupted")
            raise
        took = (time.perf_counter() - start) / len(batch)  # shared, for the plan
        for part in batch:
            if written is not None:  # None: the part kept what was there
                self.seconds[part.name] = took
                self.log(part.name, took, "done")
                for path in written if part is batch[-1] else []:
                    self.say(f"wrote {_rel(path)}")
                self.say(f"{part.name}: {took:.0f} s")
            self.bar.update()

    def _prepare_ladder(self, measured: list[Part], stages: list | None) -> _Ladder:
        """The ladder file and one calibration for every stage that ``measured`` (this
        command's ladder and scaling parts) times, made before the first is timed."""
        from ..config import BenchConfig
        from ..measure.bench import calibrate
        from ..stages import STAGES

        cfg = BenchConfig.from_profile(self.profile)
        book = LadderFile(self.out / f"ladder_{self.device.type}_{self.profile}.json", cfg,
                          self.meta, self.run, self.say)
        swept = [s for s in (stages or STAGES)]
        cal = calibrate(self.device, {p.item for p in measured if p.kind == "ladder"}
                        | ({s for s in swept} if any(p.kind == "scaling" for p in measured)
                           else set()))
        return _Ladder(cfg, book, cal, swept)

    # the runners: each records a batch of its parts and returns the files it wrote

    def ladder(self, batch: list[Part]) -> list[Path]:
        """Stages at the profile's N. The ladder parts of one command form one batch: their
        stages are timed together, in interleaved rounds, so a machine that slows down slows
        them alike."""
        return self._measure(batch, self._ladder.cfg, stages=[p.item for p in batch],
                             scaling=False)

    def scaling(self, batch: list[Part]) -> list[Path]:
        """Every stage that scales (of the record's stages) at the part's N."""
        (part,) = batch
        return self._measure(batch, self._ladder.cfg.replace(scaling_n_envs=(part.item,)),
                             stages=self._ladder.swept, ladder=False)

    def _measure(self, batch: list[Part], cfg: BenchConfig, **which) -> list[Path]:
        """One ``run_ladder`` call with the command's calibration, every row merged into the
        ladder file as it is measured; the figures after (and after an interruption, which is
        raised again once the finished rows are kept)."""
        from ..measure.bench import run_ladder
        from ..signals import Stop, signum_of

        book = self._ladder.book
        for part in batch:
            book.begin(part.name)
        try:
            result = run_ladder(cfg, self.device, profile=self.profile, on_row=book.add,
                                calibration=self._ladder.calibration, **which)
            if result.get("interrupted"):  # run_ladder kept its rows and said why
                raise Stop(_signum(result["interrupted"]))
            return [book.path, *self._figures(book)]
        except KeyboardInterrupt as stop:
            book.interrupted(signal.Signals(signum_of(stop)).name,
                             ",".join(p.name for p in batch))
            self._figures(book, reraise=False)
            raise

    def _figures(self, book: LadderFile, reraise: bool = True) -> list[Path]:
        from .ladder import write_figures

        if not book.rows:
            return []
        return write_figures(book.data, self.out, book.path.stem, reraise=reraise)

    def bench_env(self, batch: list[Part]) -> list[Path]:
        """Env steps/s of each Forage implementation; a stopped benchmark writes nothing."""
        from ..measure.envbench import bench_envs

        if self.profile == "tiny":
            result = bench_envs(device=self.device, repeats=1, n_envs=(64,), loop_envs=4)
        else:
            result = bench_envs(device=self.device, repeats=5)
        if result.get("interrupted"):  # a recorded file holds whole runs only
            from ..signals import Stop
            raise Stop(_signum(result["interrupted"]))
        result["meta"] = self.meta
        return [write_json(self.out / f"bench_env_{self.device.type}_{self.profile}.json",
                           result)]

    def learning(self, batch: list[Part]) -> list[Path]:
        """Train each of the part's stages that runs here for the profile's budget, the same
        seed for all: mean return against env steps and wall time; the file is written after
        each."""
        import tempfile

        from ..envs.policies import mean_return
        from ..stages import StageSkipped, get_stage
        from .train import TrainConfig, train

        (part,) = batch
        budget = LEARNING[self.profile]
        result = {"meta": self.meta, "budget": budget, "stages": {}}
        episodes = 1 if self.profile == "tiny" else 4
        for policy in ("oracle", "random"):
            result[policy] = mean_return(policy, n_envs=256, episodes=episodes, seed=1,
                                         device=self.device)
        path = self.out / f"learning_{self.device.type}_{self.profile}.json"
        for name in (get_stage(s).name for s in part.item):
            cfg = TrainConfig.flat(stage=name, device=str(self.device), seed=1,
                                   checkpoint_every=0, **budget)
            try:
                get_stage(name).check(self.device, cfg.run)
            except StageSkipped as err:
                result["stages"][name] = {"status": f"skipped: {err.reason}"}
                continue
            with tempfile.TemporaryDirectory(prefix="labkit-learning-") as tmp:
                summary = train(cfg, Path(tmp) / "run", progress=False)
                lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
            records = [parse_json(line, "metrics.jsonl") for line in lines]
            curve = [{"steps": r["step"], "wall_s": r["wall_s"],
                      "mean_return": r["mean_return"]} for r in records]
            result["stages"][name] = {"status": "ok", "curve": curve, **{
                k: summary[k] for k in ("final_mean_return", "steps", "wall_s", "steps_per_s",
                                        "steady_steps_per_s")}}
            write_json(path, result)  # each finished stage is kept
        write_json(path, result)
        return [path, self._learning_figure(result)]

    def _learning_figure(self, result: dict) -> Path:
        import matplotlib.pyplot as plt

        from ..book.plots import learning_curves

        budget = result["budget"]
        axes = learning_curves({k: v["curve"] for k, v in result["stages"].items()
                                if "curve" in v}, oracle=result["oracle"],
                               random=result["random"])
        axes[0].figure.suptitle(f"Same learning, less time: {result['meta']['device_name']}, "
                                f"seed 1, {budget['n_envs']} envs x {budget['n_steps']} steps",
                                fontsize=10)
        axes[0].figure.tight_layout()
        png = self.out / f"learning_{self.device.type}_{self.profile}.png"
        save_figure(axes[0].figure, png, dpi=110)
        plt.close(axes[0].figure)
        return png

    def notebook(self, batch: list[Part]) -> list[Path] | None:
        """The part's notebook executed: on a CPU in place (what nbval compares), on a GPU
        into its GPU copy, ``chapters_cuda/`` in the output folder, which the book shows where
        its code is the chapter's (:mod:`labkit.book.gpu_copies`). On a CPU, a chapter whose
        outputs were recorded on a GPU is kept as it is (None) unless
        ``overwrite_gpu_notebooks``."""
        (part,) = batch
        if self.device.type == "cuda":
            return [execute_notebook(part.item, self.device, self.commit,
                                     out=self.out / "chapters_cuda" / part.item.name)]
        if recorded_on(part.item) == "cuda" and not self.overwrite_gpu_notebooks:
            self.say(f"kept {part.item.name}: its outputs were recorded on a GPU")
            return None
        return [execute_notebook(part.item, self.device, self.commit)]

    def report(self, batch: list[Part]) -> list[Path]:
        return write_report(self.out)

    #: The runner of each kind of part (labkit.app.plan.GROUPS).
    RUNNERS = {"ladder": ladder, "scaling": scaling, "bench_env": bench_env,
               "learning": learning, "notebooks": notebook, "report": report}


def _signum(name: str) -> int:
    return int(signal.Signals[name])


def _batches(parts: list[Part]) -> list[list[Part]]:
    """``parts`` in the batches they are recorded in: consecutive parts that are timed together
    (the ladder's) form one, every other part its own."""
    batches: list[list[Part]] = []
    for part in parts:
        if part.together and batches and batches[-1][-1].kind == part.kind:
            batches[-1].append(part)
        else:
            batches.append([part])
    return batches


# ---------------------------------------------------------------- record


def record(device: torch.device, profile: str, out: str | Path = "results",
           parts: str | Iterable[str] = ("all",), notebooks: str = "[0-9]*.ipynb",
           allow_dirty: bool = False, overwrite_gpu_notebooks: bool = False,
           stages: list | None = None, run: str | None = None,
           say: Callable[[str], None] = print) -> dict[str, float]:
    """Record ``parts`` (names or groups of :func:`plan`'s parts) on ``device``; returns the
    seconds each part took. Everything a part finishes is written at once (see the module
    docstring); a stop signal keeps it and is raised again. ``stages`` limits the ladder, the
    sweep and the learning runs; ``run`` continues a run recorded by an earlier command."""
    todo = select(plan(profile, notebooks, stages), parts)
    run = check_run_id(run) if run is not None else new_run_id()
    out = check_output_dir(out)
    commit = commit_for_record(allow_dirty)
    session = _Session(device, profile, out, commit, run, say, todo, stages,
                       overwrite_gpu_notebooks)
    for batch in _batches(todo):
        session.record(batch)
    session.bar.close()
    return session.seconds


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------ the command


def cmd_record(args: argparse.Namespace) -> int:
    from ..signals import Stop, signum_of, stop_signals
    from .plan import format_plan, plan, select

    device, profile = device_and_profile(args)
    todo = select(plan(profile, args.notebooks), args.parts)
    if args.plan:
        print(format_plan(todo, device, profile, args.out))
        return 0
    out = args.out
    try:
        with stop_signals():
            seconds = record(device, profile, out, parts=args.parts, notebooks=args.notebooks,
                             allow_dirty=args.allow_dirty, run=args.run,
                             overwrite_gpu_notebooks=args.overwrite_gpu_notebooks)
    except KeyboardInterrupt as stop:
        signum = signum_of(stop)
        raise Stop(signum, said=f"interrupted by {Stop(signum)}: every part listed above as "
                                f"written is kept, and so is each ladder row measured (in "
                                f"{out})") from None
    print(f"recorded {', '.join(seconds)} in {sum(seconds.values()):.0f} s")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("record", help="re-record results and notebooks on this machine")
    device_flag(p)
    p.add_argument("--profile", choices=("quick", "full", "tiny"), default=None,
                   help="default: full on CUDA, quick otherwise (tiny: seconds, for tests)")
    p.add_argument("--part", "--parts", dest="parts", default="all",
                   help="comma-separated parts (ladder-3, scaling-1024, notebook-08, ...: see "
                        "--plan) or groups (ladder, scaling, bench_env, learning, notebooks, "
                        "report); default: all")
    p.add_argument("--plan", action="store_true",
                   help="print the parts with their estimated minutes and commands that fit "
                        "in 9 minutes each; run nothing")
    p.add_argument("--run", type=run_id, default=None, metavar="ID",
                   help="the run these parts belong to: several commands on one machine at "
                        "one commit with the same ID count as one run, whose rows' ratios "
                        "compare (default: a new run)")
    p.add_argument("--notebooks", default="[0-9]*.ipynb",
                   help="glob of the notebooks to execute in notebooks/ ('none': none)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="record although the code is modified (commit marked -dirty)")
    p.add_argument("--overwrite-gpu-notebooks", action="store_true",
                   help="on a CPU, also re-execute notebooks last recorded on a GPU")
    p.add_argument("--out", type=path, default="results", help="results folder")
    p.set_defaults(func=cmd_record)


