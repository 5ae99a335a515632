"""How a step runs: eagerly, compiled, or captured once and replayed as a CUDA graph.

A stage has two executor slots, ``rollout_executor`` and ``update_executor``, and both take the
same executors: anything that offers :class:`Executor`. An executor only wraps functions it is
handed; the code that calls them never changes (LeanRL's ``update = torch.compile(update)``,
then ``CudaGraphModule(update)``):

* ``wrap_model(fn)`` wraps the model math: the policy network in the rollout, the PPO loss
  (forward, and through autograd its backward) in the update.
* ``wrap_step(step, state=, generator=, after_replay=)`` wraps the whole step: one env step
  with the policy and its bookkeeping, or one minibatch's optimizer step. It is handed what a
  graph needs and nothing more: ``state`` to snapshot and restore around the warm-up calls (a
  :class:`labkit.capture.Stateful`), the ``generator`` the step draws from, and a callback to
  run after each replay.
"""
from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .capture import CapturedStep, Stateful, timed_phases, tree_map


def _tf32_choice_made() -> None:
    """labkit's fp32 is torch's default fp32: float32 matmuls in full precision, not TF32, and
    reduced precision by choice enters the ladder in one place, stage 7's bf16 (chapter 08).
    (torch's default lets cuDNN run float32 convolutions as TF32 on Ampere and newer, and
    labkit keeps it: there eager and compiled stages differ by TF32's rounding,
    ``labkit.precision.fp32_tolerance``.) Inductor advises TF32 once per process on GPUs that
    have it (sm >= 8.0), at the first fp32 compile; the choice is made, so that one message is
    silenced (at import, and again by each compiled executor, in case a ``catch_warnings``
    block around the import took the filter away). To run fp32 matmuls as TF32 anyway:
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (then inductor gives no advice)."""
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix "
                                              "multiplication available but not enabled")


_tf32_choice_made()


@runtime_checkable
class Executor(Protocol):
    """What an executor slot's value offers: what it ``requires`` of the device, and the two
    wrappers the pipeline and :func:`labkit.update.build_update` call."""

    @property
    def requires(self) -> tuple[str, ...]: ...

    def wrap_model(self, fn: Any) -> Any: ...

    def wrap_step(self, step: Callable, *, state: Stateful,
                  generator: torch.Generator | None = None,
                  after_replay: Callable[[], object] | None = None) -> Callable: ...


@dataclass(frozen=True)
class Eager:
    """Run everything as written: one Python call, one kernel launch per op."""

    requires: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def wrap_model(self, fn: Any) -> Any:
        return fn

    def wrap_step(self, step: Callable, *, state: Stateful,
                  generator: torch.Generator | None = None,
                  after_replay: Callable[[], object] | None = None) -> Callable:
        return step


@dataclass(frozen=True)
class Compiled(Eager):
    """``torch.compile`` the model math, ``fullgraph=True`` (a graph break here is a bug, so it
    should fail loudly). ``mode=None`` is inductor's default; ``"reduce-overhead"`` also replays
    the compiled code as CUDA graphs, torch's own alternative to :class:`Graphed`."""

    mode: str | None = None

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(mode={self.mode!r})" if self.mode else f"{name}()"

    def wrap_model(self, fn: Any) -> Any:
        _tf32_choice_made()
        compiled = torch.compile(fn, fullgraph=True, mode=self.mode)
        return compiled if self.mode != "reduce-overhead" else _CopiedOutputs(compiled)


class _CopiedOutputs:
    """A reduce-overhead compiled ``fn`` whose outputs are copies: it replays CUDA graphs whose
    outputs the next replay overwrites, and callers keep some (each minibatch's loss
    statistics). Any other attribute is ``fn``'s (a compiled module's ``value_head``: the
    rollout denormalizes values through it)."""

    def __init__(self, compiled: Callable) -> None:
        self._compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return tree_map(torch.clone, self._compiled(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


@dataclass(frozen=True, repr=False)
class CompiledIfFaster(Compiled):
    """Compile the model math, and keep it compiled only where that pays on this device: the
    pipeline's warmup times both (:func:`choose`) and each wrapped function runs whichever was
    kept. Compiled until then, and unless eager is faster by more than the spread; a run's
    ``RunConfig.compile`` ("compiled" or "eager") forces either without timing."""

    def wrap_model(self, fn: Any) -> Any:
        return Choice(fn, super().wrap_model(fn))


class Choice:
    """``fn`` run eagerly or compiled, whichever :meth:`keep` was told last ("compiled" until
    then). Any other attribute is ``fn``'s (the agent's ``value_head``)."""

    def __init__(self, eager: Callable, compiled: Callable) -> None:
        self.eager, self.compiled = eager, compiled
        self.keep("compiled")

    def keep(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        self.kept = kind
        self._run = self.compiled if kind == "compiled" else self.eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("eager", "compiled", "kept", "_run"):  # not set yet (unpickling, copying)
            raise AttributeError(name)
        return getattr(self.eager, name)


KINDS = ("compiled", "eager")
#: Rounds of the warmup's timing: each times one iteration eager and one compiled.
CHOICE_ROUNDS = 5
#: The phase of an iteration that each part's model math runs in (a rollout whose whole step
#: is one region, ``RunConfig.compile_unit="step"``: ``FUSED_ROLLOUT_PHASE``).
PART_PHASE = {"rollout": "policy", "update": "update"}
FUSED_ROLLOUT_PHASE = "step"


def compiles(executor: Executor) -> bool:
    """Whether ``executor`` compiles what it wraps (graphed: whether its base does)."""
    return isinstance(getattr(executor, "base", executor), Compiled)


def _time_kinds(pipeline: Any, keep: Callable[[str], None], kinds: tuple[str, ...],
                phases: dict[str, str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Milliseconds of each of ``phases`` ({phase: what runs in it, for the error}) in
    ``rounds`` rounds of one iteration per kind, ``keep(kind)`` before each, the order
    alternating, the state restored after each; before them, one untimed iteration of each
    kind but the first (its own first calls: allocations, lazy init, a compile)."""
    saved = pipeline.state_dict()
    for kind in kinds[1:]:
        keep(kind)
        pipeline.iteration()
        pipeline.load_state_dict(saved)
    ms: dict[str, dict[str, list[float]]] = {ph: {k: [] for k in kinds} for ph in phases}
    for r in range(rounds):
        for kind in kinds if r % 2 else kinds[::-1]:
            keep(kind)
            found = timed_phases(pipeline)
            pipeline.load_state_dict(saved)
            for phase, what in phases.items():
                if phase not in found:
                    raise RuntimeError(f"cannot time {what}: the iteration marked no "
                                       f"{phase!r} phase (marked: {', '.join(found) or 'none'})")
                ms[phase][kind].append(found[phase])
    return ms


def choose(pipeline: Any, choices: dict[str, Choice], rounds: int = CHOICE_ROUNDS,
           phases: dict[str, str] = PART_PHASE) -> dict[str, dict]:
    """Time ``pipeline``'s iterations with every ``choices`` entry eager and with every one
    compiled, ``rounds`` of each, interleaved (the order alternates), the state restored after
    each, and keep for each part the faster: compiled unless eager's slowest iteration beat
    compiled's fastest in the part's phase (``phases``). Call it once the compiled code
    has run (``labkit.capture.warmup`` does): compiling is not what it times. Returns per part
    what was kept, why, and the milliseconds per iteration of each kind."""
    def keep(kind: str) -> None:
        for choice in choices.values():
            choice.keep(kind)

    ms = _time_kinds(pipeline, keep, KINDS, {phases[part]: f"the {part}'s model math"
                                             for part in choices}, rounds)
    made = {}
    for part, choice in choices.items():
        eager, compiled = (ms[phases[part]][k] for k in ("eager", "compiled"))
        kept = "eager" if max(eager) < min(compiled) else "compiled"
        choice.keep(kept)
        made[part] = {"kept": kept, "why": "timed", "phase": phases[part],
                      "eager_ms": eager, "compiled_ms": compiled}
    return made


def choose_conv_math(pipeline: Any, body: Any, parts: Any, rounds: int = CHOICE_ROUNDS,
                     phases: dict[str, str] = PART_PHASE) -> dict[str, dict]:
    """Time ``pipeline``'s iterations with ``body``'s convolutions (a
    :class:`labkit.policy.ConvBody`) as conv2d and as matmul, ``rounds`` of each, interleaved,
    the state restored after each (one untimed matmul iteration first: its bases, and the
    compile of its variant where the model math is compiled), and keep for each of ``parts``
    conv2d unless matmul's slowest iteration beat conv2d's fastest in the part's phase
    (``phases``). Returns per part what was kept, why, and the milliseconds per iteration
    of each, and leaves ``body`` as last timed: the caller keeps the choice
    (``ModelMath.keep_conv_math``), and must not have kept one before (a pipeline that runs
    each part's kept convolutions would time those instead)."""
    def keep(math: str) -> None:
        body.conv_math = math

    ms = _time_kinds(pipeline, keep, CONV_KINDS, {phases[part]: f"the {part}'s model math"
                                                  for part in parts}, rounds)
    made = {}
    for part in parts:
        conv2d, matmul = (ms[phases[part]][k] for k in CONV_KINDS)
        made[part] = {"kept": "matmul" if max(matmul) < min(conv2d) else "conv2d",
                      "why": "timed", "phase": phases[part], "conv2d_ms": conv2d,
                      "matmul_ms": matmul}
    return made


#: The conv body's two ways to run its convolutions (``labkit.policy.CONV_MATHS``), the one
#: kept unless the other is faster by more than the spread first.
CONV_KINDS = ("conv2d", "matmul")


def describe_conv_math(made: dict[str, dict]) -> str:
    """"convolutions: rollout conv2d (policy 48.2 ms per iteration conv2d, 79.0 matmul;
    medians of 5), update matmul (...)", or "convolutions: rollout matmul (conv_math=matmul),
    update matmul (conv_math=matmul)"."""
    return "convolutions: " + ", ".join(describe_choice(part, m, CONV_KINDS)
                                        for part, m in made.items())


def describe_model_math(made: dict[str, dict] | None, convs: dict[str, dict] | None) -> str:
    """What a stage kept for its convolutions (``convs``) and its model math (``made``), each
    described, joined by "; " ("" where it kept nothing)."""
    return "; ".join(([describe_conv_math(convs)] if convs else [])
                     + ([describe_choices(made)] if made else []))


def describe_choices(made: dict[str, dict]) -> str:
    """Every part's :func:`describe_choice`, joined by "; "."""
    return "; ".join(describe_choice(part, m) for part, m in made.items())


def describe_choice(part: str, made: dict, kinds: tuple[str, str] = ("eager", "compiled")
                    ) -> str:
    """"update eager (update 217.3 ms per iteration eager, 353.0 compiled; medians of 5)"
    (``kinds``: the two timed, as the record's ``<kind>_ms`` names them); a choice a run
    remembered from an earlier one (:mod:`labkit.app.remembered`) adds ", remembered: timed
    <date>"."""
    if made["why"] != "timed":
        return f"{part} {made['kept']} ({made['why']})"
    a, b = (statistics.median(made[f"{k}_ms"]) for k in kinds)
    when = f", remembered: timed {made['remembered'][:10]}" if made.get("remembered") else ""
    return (f"{part} {made['kept']} ({made['phase']} {a:.1f} ms per iteration {kinds[0]}, "
            f"{b:.1f} {kinds[1]}; medians of {len(made[f'{kinds[0]}_ms'])}{when})")


@dataclass(frozen=True)
class Graphed:
    """Capture the whole step as a CUDA graph and replay it: one launch for hundreds of small
    kernels. ``base`` runs the model math inside the graph (``Graphed(Compiled())`` replays
    compiled kernels). The ladder's graphed update asks for bf16: it is built and tested for
    bf16 autocast, while fp16 brings a GradScaler whose step skipping would have to be captured
    as well (with an unfused optimizer it even reads the host)."""

    base: Executor = Eager()
    requires: tuple[str, ...] = ("cuda",)

    def __post_init__(self) -> None:
        if isinstance(self.base, CompiledIfFaster):  # a replayed graph cannot switch kernels
            raise TypeError("Graphed needs a base that runs one way (Eager() or Compiled()), "
                            "not CompiledIfFaster(): a captured graph replays what it captured")

    def __repr__(self) -> str:
        extra = [n for n in self.requires if n != "cuda"]
        return f"Graphed({self.base!r}" + (f", needs {'+'.join(extra)})" if extra else ")")

    def wrap_model(self, fn: Any) -> Any:
        return self.base.wrap_model(fn)

    def wrap_step(self, step: Callable, *, state: Stateful,
                  generator: torch.Generator | None = None,
                  after_replay: Callable[[], object] | None = None) -> Callable:
        return CapturedStep(step, state, generator=generator, after_replay=after_replay)


class ModelMath:
    """How a pipeline's two parts run their model math, and why: each part that chooses
    (a :class:`Choice`, from a ``CompiledIfFaster`` slot) eager or compiled, and the conv
    body's convolutions (:class:`labkit.policy.ConvBody`) as conv2d or matmul. Each is timed at
    warm-up (:meth:`choose`), forced by the run's config (``compile``, ``conv_math``), or kept
    from a resumed run (:meth:`keep_choices`, :meth:`keep_conv_math`); a checkpoint and a
    summary keep ``executor_choices`` and ``conv_choices``, as the pipeline's ``math``.

    ``parts``: each part's model math as its executor wrapped it ({"rollout": the policy, or
    the whole rollout step where ``fused``, "update": the loss}); ``agent``: the model whose
    body may be a conv body; ``compile`` and ``conv_math``: the run's choices ("auto": timed)."""

    def __init__(self, stage: Any, parts: dict[str, Any], agent: Any, compile: str = "auto",
                 conv_math: str = "auto", fused: bool = False) -> None:
        from .policy import ConvBody

        self.stage, self.parts, self.conv_math = stage, tuple(parts), conv_math
        #: The phase each part's model math is timed in.
        self.phases = dict(PART_PHASE, **({"rollout": FUSED_ROLLOUT_PHASE} if fused else {}))
        #: The parts whose executor keeps compiled or eager, whichever pays.
        self.choices: dict[str, Choice] = {p: fn for p, fn in parts.items()
                                           if isinstance(fn, Choice)}
        #: What each choosing part kept, why, and (timed) both timings.
        self.executor_choices: dict[str, dict] = {}
        body = getattr(agent, "body", None)
        #: The agent's conv body, if it has one.
        self.conv_body = body if isinstance(body, ConvBody) else None
        #: How each part runs its convolutions and why ({}: conv2d, nothing chosen).
        self.conv_choices: dict[str, dict] = {}
        self._agent = type(agent).__name__
        if self.choices and compile != "auto":
            self.keep_choices({part: {"kept": compile, "why": f"compile={compile}"}
                               for part in self.choices})
        if conv_math == "matmul" and self.conv_body is None:
            raise ValueError(f"conv_math=matmul needs an agent with the conv body "
                             f"(labkit.policy.ConvBody); {self._agent} has none")
        if conv_math != "auto" and self.conv_body is not None:
            self.keep_conv_math({part: {"kept": conv_math, "why": f"conv_math={conv_math}"}
                                 for part in self.parts})

    @property
    def chooses_conv_math(self) -> bool:
        """Whether the warm-up times the conv body's conv2d against matmul: a stage that
        chooses its model math (even with ``compile`` forced), a conv body whose dense
        matrices fit (``ConvBody.matmul_fits``), ``conv_math`` "auto". The two choices are
        made one after the other: the convolutions first, each part compiled (or as
        ``compile`` forces), then eager against compiled with the convolutions kept."""
        return bool(self.choices) and self.conv_body is not None and \
            self.conv_body.matmul_fits and self.conv_math == "auto"

    def choose(self, pipeline: Any) -> dict[str, dict]:
        """Time what is not yet decided on ``pipeline``'s iterations (:func:`choose_conv_math`,
        then :func:`choose`: off the clock, the state restored) and keep the faster; returns
        ``executor_choices``. Run once the compiled code has compiled
        (``labkit.capture.warmup`` calls it)."""
        if self.chooses_conv_math and not self.conv_choices:
            self.keep_conv_math(choose_conv_math(pipeline, self.conv_body, self.parts,
                                                 phases=self.phases))
        undecided = {p: c for p, c in self.choices.items() if p not in self.executor_choices}
        if undecided:
            self.executor_choices.update(choose(pipeline, undecided, phases=self.phases))
        return self.executor_choices

    def keep_choices(self, made: dict[str, dict]) -> None:
        """Keep what ``made`` says each part keeps (a resumed run's saved choices: the same
        kernels, the same numbers)."""
        unknown = set(made) - set(self.choices)
        if unknown:
            raise ValueError(f"this stage chooses nothing for {', '.join(sorted(unknown))}")
        for part, record in made.items():
            self.choices[part].keep(record["kept"])
        self.executor_choices.update(made)

    def keep_conv_math(self, made: dict[str, dict]) -> None:
        """Run each part's convolutions as ``made[part]["kept"]`` says (timed, a resumed run's
        saved choice, or a forced one): each part sets the conv body's ``conv_math`` as it
        starts (:meth:`convs_for`; compiled code keeps one graph for each)."""
        if self.conv_body is None:
            raise ValueError(f"{self._agent} has no conv body to run as {made!r:.100}")
        if set(made) != set(self.parts):
            raise ValueError(f"a choice of convolutions names {sorted(made)}, not the parts "
                             f"{', '.join(self.parts)}")
        self.conv_choices = dict(made)
        self.convs_for("rollout")

    def convs_for(self, part: str) -> None:
        """Set the conv body to run ``part``'s kept convolutions (nothing kept: as it is)."""
        if self.conv_choices:
            self.conv_body.conv_math = self.conv_choices[part]["kept"]

    def kinds(self) -> dict[str, str]:
        """What runs each part's model math: "eager", "compiled", "graphed compiled", ...
        (a choosing part: what it keeps now)."""
        def kind(part: str, executor: Any) -> str:
            if part in self.choices:
                return self.choices[part].kept
            if isinstance(executor, Graphed):
                return "graphed " + kind("", executor.base)
            return "compiled" if isinstance(executor, Compiled) else "eager"
        return {"rollout": kind("rollout", self.stage.rollout_executor),
                "update": kind("update", self.stage.update_executor)}

    def describe(self) -> str:
        """:func:`describe_model_math` of what was kept ("" where nothing was chosen)."""
        return describe_model_math(self.executor_choices, self.conv_choices)
