"""Configuration: typed, validated, derived values computed once, named presets.

One spine: ``RunConfig`` is what a pipeline runs (shape, seed, env, PPO); ``BenchConfig`` adds
how the ladder measures it, and ``labkit.app.train.TrainConfig`` how long a training run goes.
"""
from __future__ import annotations

import ast
import functools
import inspect
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .envs.spec import ForageSpec, check_n_envs, check_seed
from .policy import CONV_MATHS, VALUE_HEADS, check_body
from .ppo import PPOConfig
from .validate import check_int, check_type

if TYPE_CHECKING:
    import torch

PROFILES = ("quick", "full", "tiny")
COMPILE_CHOICES = ("auto", "compiled", "eager")
CONV_MATH_CHOICES = ("auto", *CONV_MATHS)
COMPILE_UNITS = ("model", "step")
CAPTURE_UNITS = ("minibatch", "update")
OBS_STORAGES = ("float32", "uint8")


def default_profile(device: torch.device) -> str:
    """The profile a command measures with when none is named: ``full`` on CUDA, ``quick``
    elsewhere (the full profile's sizes take minutes per stage on a CPU)."""
    return "full" if device.type == "cuda" else "quick"


@dataclass
class RunConfig:
    """What one pipeline runs: N envs x T steps per iteration, the env, the agent and PPO."""

    n_envs: int = 64
    """Environments stepped in parallel (N)."""
    n_steps: int = 32
    """Rollout length per iteration (T); one iteration = N*T env steps + one PPO update."""
    seed: int = 1
    """Seed for the envs, the model init and action sampling."""
    value_head: str = "plain"
    """Value head: plain, or popart (normalized value targets)."""
    model: str = "conv"
    """The agent's body: conv (the reference), or attention (one self-attention layer over the
    view's cells through F.scaled_dot_product_attention; chapter 08)."""
    lr_horizon: int = 1000
    """Iterations over which the LR anneals linearly to 0 (when ``ppo.anneal_lr``). A training
    run sets it to its own length, as CleanRL does."""
    compile: str = "auto"
    """How the stages that compile only where it pays (fused_amp) run their model math: auto
    (time eager against compiled at warmup; keep compiled unless eager is faster by more than
    the spread), compiled or eager (forced: a reproducible choice). Stages 5-6 always compile;
    0-4 never do."""
    compile_unit: str = "model"
    """What a stage whose rollout compiles (compile_warmup onwards) compiles of its rollout:
    model (the policy network alone; the sampling, the storage writes, the env step and the
    episode statistics run eagerly, one launch per op), or step (the whole rollout step past
    the sampling noise as one region, ``DeviceCollector.advance``: the policy, the sampling,
    the storage writes, the env step and device-side episode statistics). The update is
    compiled the same way in both."""
    capture_unit: str = "minibatch"
    """What a stage that replays its update as a CUDA graph (cuda_graphs) captures: minibatch
    (one graph for a minibatch step, replayed epochs x minibatches times, the permutation drawn
    and each minibatch gathered outside it), or update (one graph for the whole update: every
    epoch and minibatch, the permutations drawn and the minibatches gathered inside it)."""
    obs_storage: str = "float32"
    """The dtype the rollout stores its observations in: float32 (as the env returns them), or
    uint8 (a quarter of the bytes; exact, since every observation entry is 0 or 1: the agent
    reads them as float, ``Agent.forward``). What each stage computes is bit-identical either
    way; the update reads a quarter of the observation bytes when it gathers its minibatches."""
    conv_math: str = "auto"
    """How the conv body runs its convolutions (``labkit.policy.ConvBody``): auto (the stages
    whose executors choose by timing, fused_amp, also time conv2d against matmul at warmup,
    for the rollout and the update apart, even with ``compile`` forced, and keep conv2d unless
    matmul is faster by more than the spread; every other stage, and a view too large for the
    dense matrices, runs conv2d), conv2d or matmul (forced, in any stage: a reproducible
    choice)."""
    spec: ForageSpec = field(default_factory=ForageSpec)
    """The environment."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO hyperparameters (CleanRL's defaults)."""
    batch_size: int = field(init=False)
    """N*T, derived."""

    def __post_init__(self) -> None:
        check_n_envs(self.n_envs)
        check_int("n_steps", self.n_steps, 1, 2**20)
        check_seed(self.seed)
        if self.value_head not in VALUE_HEADS:
            raise ValueError(f"value_head must be one of {', '.join(VALUE_HEADS)}; "
                             f"got {self.value_head!r}")
        check_body(self.model)
        check_int("lr_horizon", self.lr_horizon, 1)
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)}; got "
                             f"{self.compile!r}")
        if self.compile_unit not in COMPILE_UNITS:
            raise ValueError(f"compile_unit must be one of {', '.join(COMPILE_UNITS)}; got "
                             f"{self.compile_unit!r}")
        if self.capture_unit not in CAPTURE_UNITS:
            raise ValueError(f"capture_unit must be one of {', '.join(CAPTURE_UNITS)}; got "
                             f"{self.capture_unit!r}")
        if self.obs_storage not in OBS_STORAGES:
            raise ValueError(f"obs_storage must be one of {', '.join(OBS_STORAGES)}; got "
                             f"{self.obs_storage!r}")
        if self.conv_math not in CONV_MATH_CHOICES:
            raise ValueError(f"conv_math must be one of {', '.join(CONV_MATH_CHOICES)}; got "
                             f"{self.conv_math!r}")
        if self.model != "conv" and self.conv_math == "matmul":
            raise ValueError(f"conv_math=matmul needs the conv body; model is {self.model!r}")
        check_type("spec", self.spec, ForageSpec)
        check_type("ppo", self.ppo, PPOConfig)
        self.ppo.check_batch(self.n_envs, self.n_steps)
        self.batch_size = self.n_envs * self.n_steps

    def replace(self, **changes) -> RunConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) if f.name not in ("spec", "ppo")
                else asdict(getattr(self, f.name)) for f in fields(self) if f.init}

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        init = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - init
        if unknown:
            raise ValueError(f"unknown RunConfig fields {sorted(unknown)}; allowed: "
                             f"{sorted(init)}")
        kwargs = dict(data)
        kwargs["spec"] = ForageSpec(**data.get("spec", {}))
        kwargs["ppo"] = PPOConfig(**data.get("ppo", {}))
        return cls(**kwargs)


@dataclass
class BenchConfig:
    """How the ladder measures: the run, the timed iterations, the scaling sweep."""

    run: RunConfig = field(default_factory=RunConfig)
    """What each stage runs (N, T, seed, env, PPO)."""
    iterations: int = 3
    """Rounds of steady-state iterations timed per stage, one plain and one phase-marked each,
    interleaved with the other stages at the same N (the warmup is extra); 3 or more give each
    figure a min / median / max, 5 an interquartile range that one stray iteration barely
    moves."""
    scaling_n_envs: tuple[int, ...] = (64, 256, 1024)
    """N values of the scaling sweep (the stages whose env is vectorized on the device)."""
    stage_timeout_s: float = 120.0
    """A stage stops adding rounds once this much of its time was spent (3 rounds run, or all
    if fewer)."""
    loop_steps_bound: int = 8192
    """Env steps an iteration at most for a stage whose env steps one env at a time in Python
    (stages 0 and 2): at a larger N x T its ladder row is timed over whole iterations (rollout
    and update) of fewer steps per env, the bound said in the row."""

    def __post_init__(self) -> None:
        check_type("run", self.run, RunConfig)
        check_int("iterations", self.iterations, 2, 10_000)
        check_int("loop_steps_bound", self.loop_steps_bound, 1)
        if not isinstance(self.scaling_n_envs, tuple):
            raise TypeError(f"scaling_n_envs must be a tuple of ints, got "
                            f"{type(self.scaling_n_envs).__name__}")
        for n in self.scaling_n_envs:
            check_n_envs(n, "scaling_n_envs")
            self.run.ppo.check_batch(n, self.run.n_steps)
        if isinstance(self.stage_timeout_s, bool) or not isinstance(
                self.stage_timeout_s, (int, float)):
            raise TypeError(f"stage_timeout_s must be a number of seconds, got "
                            f"{type(self.stage_timeout_s).__name__}")
        if not (math.isfinite(self.stage_timeout_s) and self.stage_timeout_s > 0):
            raise ValueError(f"stage_timeout_s must be a finite number > 0, got "
                             f"{self.stage_timeout_s}")

    @classmethod
    def from_profile(cls, name: str, **overrides) -> BenchConfig:
        """Named presets: ``quick`` (CPU/CI, minutes on 2 cores), ``full`` (GPU) and ``tiny``
        (seconds: for tests). ``overrides`` may name fields of BenchConfig or of its RunConfig."""
        presets = {
            "tiny": dict(run=dict(n_envs=8, n_steps=16), iterations=2, scaling_n_envs=(8,),
                         stage_timeout_s=10.0),
            "quick": dict(run=dict(n_envs=32, n_steps=64), iterations=5,
                          scaling_n_envs=(16, 64, 256), stage_timeout_s=30.0),
            "full": dict(run=dict(n_envs=1024, n_steps=128), iterations=5,
                         scaling_n_envs=(256, 1024, 4096, 16384, 65536), stage_timeout_s=120.0),
        }
        if name not in presets:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}; got {name!r}")
        preset = presets[name]
        run, own = split_run_fields(overrides)
        return cls(run=RunConfig(**{**preset.pop("run"), **run}), **{**preset, **own})

    def replace(self, **changes) -> BenchConfig:
        """A copy with ``changes`` to fields of BenchConfig or of its RunConfig."""
        run, own = split_run_fields(changes)
        return replace(self, run=self.run.replace(**run), **own)

    def to_dict(self) -> dict:
        return {"run": self.run.to_dict(), "iterations": self.iterations,
                "scaling_n_envs": list(self.scaling_n_envs),
                "stage_timeout_s": self.stage_timeout_s, "loop_steps_bound": self.loop_steps_bound}


def memory_estimate(run: RunConfig) -> int:
    """Bytes a pipeline of ``run`` needs at its peak, roughly and on the generous side: the
    (T, N) rollout storage (observations 4 B x 3 x V x V per sample plus six scalars), the
    activations of one update minibatch and their gradients, and per-env state and scratch."""
    obs = 4 * 3 * run.spec.view ** 2
    side = run.spec.view - 2
    activations = 4 * 2 * (16 * side ** 2 + 32 * (side - 2) ** 2 + 128)  # saved + their grads
    per_sample = obs + 6 * 8 + 2 * activations / run.ppo.n_minibatches
    grid = (run.spec.height + run.spec.view) * (run.spec.width + run.spec.view)
    per_env = 4 * grid + 6 * obs + 2 * activations
    return int(run.batch_size * per_sample + run.n_envs * per_env)


#: cgroup v1 writes a huge number for "no limit" (the largest page-aligned int64).
_V1_UNLIMITED = 2**62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_headroom(root: str | os.PathLike = "/sys/fs/cgroup",
                    proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup lets it allocate still: the smallest of
    ``memory.max - memory.current`` over its cgroup and every parent (v2), or
    ``memory.limit_in_bytes - memory.usage_in_bytes`` (v1); None without a limit."""
    try:
        lines = Path(proc_cgroup).read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    root, room = Path(root), []
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: the unified hierarchy, limits of every ancestor apply
            folder = root / rel.lstrip("/")
            while True:
                limit, used = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
                if limit is not None and used is not None:
                    room.append(limit - used)
                if folder == root or root not in folder.parents:
                    break
                folder = folder.parent
        elif "memory" in controllers.split(","):  # v1
            folder = root / "memory" / rel.lstrip("/")
            limit = _read_int(folder / "memory.limit_in_bytes")
            used = _read_int(folder / "memory.usage_in_bytes")
            if limit is not None and used is not None and limit < _V1_UNLIMITED:
                room.append(limit - used)
    return max(min(room), 0) if room else None


def address_space_headroom() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS`` (``ulimit -v``):
    the limit less its current size (importing torch alone maps gigabytes); None without one."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(soft - size, 0)


def host_memory() -> tuple[int | None, str]:
    """(bytes, what limits them) this process can still allocate on the host: the smallest of
    free RAM (MemAvailable), the room under its address-space limit and under its memory
    cgroup's limit (a container's); (None, "") if none is known."""
    found = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "free"))
    except OSError:
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free"))
        except (AttributeError, OSError, ValueError):
            pass
    for room, what in ((address_space_headroom(), "left under the address-space limit "
                                                  "(RLIMIT_AS, ulimit -v)"),
                       (cgroup_headroom(), "left under the memory cgroup's limit "
                                           "(memory.max)")):
        if room is not None:
            found.append((room, what))
    return min(found) if found else (None, "")


def available_memory(device) -> int | None:
    """Free bytes on ``device`` (CUDA: ``mem_get_info``; CPU: :func:`host_memory`, the
    smallest of free RAM and the process's limits), None if unknown."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_memory()[0]


def memory_shortfall(run: RunConfig, device) -> str | None:
    """Why ``run`` cannot fit in ``device``'s free memory (None if it can or if free memory is
    unknown), judged before anything is allocated."""
    need = memory_estimate(run)
    free, what = (available_memory(device), "free") if device.type == "cuda" else host_memory()
    if free is None or need <= free:
        return None
    return (f"n_envs={run.n_envs} x n_steps={run.n_steps} needs about {need / 2**30:.1f} GiB "
            f"on {device}, and {free / 2**30:.1f} GiB is {what}; use fewer envs or a shorter "
            "rollout")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``, whitespace folded: one source for
    the documentation and for the CLI's ``--help`` (read once per class: parsing the source
    is most of what building the CLI's parser costs)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def split_run_fields(kwargs: dict) -> tuple[dict, dict]:
    """(the items of ``kwargs`` that are RunConfig fields, the others)."""
    names = {f.name for f in fields(RunConfig) if f.init}
    return ({k: v for k, v in kwargs.items() if k in names},
            {k: v for k, v in kwargs.items() if k not in names})
