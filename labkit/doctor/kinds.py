"""The doctor wing's one vocabulary: :class:`Finding` is what every instrument reports
(``labkit doctor``, ``labkit.watch``, the capture rehearsal), and :data:`KINDS` names each kind
of finding once, with the chapter that teaches its fix and what it means. A finding of a kind
the table does not name is refused; one that names no chapter or fix gets its kind's."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple


class Kind(NamedTuple):
    """A kind of finding: the chapter that teaches the fix, what it means (the rehearsal's
    explanation), and the fix where ``means`` does not say it."""

    chapter: str
    means: str
    fix: str = ""


_DEVICE = "03_tensors_on_the_device, 'Factories without device='"
_COMPILE = "06_compile_and_warm_up"
_GRAPHS = "09_cuda_graphs"
_FIRST = "00_measure_first"
_NO_BRANCHES = ("no Python branches on tensors or on changing Python values in compiled code: "
                "give each variant one interface (labkit.policy's value heads)")

#: Every kind, in the order reports list them: what the loop does in each iteration (measured
#: by the doctor and ``watch``), then what only a CUDA graph capture refuses (the rehearsal).
KINDS: dict[str, Kind] = {
    "device_read": Kind(
        "07_metrics_on_the_device (and 02, 'Sampling an action without a sync')",
        "reads tensor data on the host (.item(), .tolist(), a tensor used as a Python number, "
        "bool or index, .cpu()): a capture cannot wait for a result",
        "keep the value on the device; read it once per update"),
    "host_scalar_read": Kind(
        "08_fused_optimizers_and_amp",
        "reads a tensor that lives on the host in a GPU run too (a non-fused Adam's step "
        "count): Python time, no wait for the GPU", "a fused optimizer keeps its state on "
                                                   "the device"),
    "no_device": Kind(
        _DEVICE, "a factory that names no device (or the CPU): a host tensor",
        "create tensors on the device: torch.zeros(..., device=x.device), or zeros_like / "
        "new_zeros of a device tensor, once, outside the loop"),
    "host_to_device": Kind(
        _DEVICE, "a host-to-device copy",
        "create tensors on the device: torch.zeros(..., device=x.device), or zeros_like / "
        "new_zeros of a device tensor, once, outside the loop"),
    "from_data": Kind(
        _DEVICE, "a tensor made from Python or NumPy data (a host-to-device copy each where it "
                 "then goes to a GPU)", "keep the data in device tensors"),
    "clone": Kind(
        "04_batch_everything, 'Clones: when a copy is needed, and when it is waste'",
        "a clone: a full copy",
        "update state in place; clone only what a later in-place write would change"),
    "memory_growth": Kind(
        "10_the_regression_hunt", "tensors held without bound, more after every iteration",
        "keep a bounded window (a fixed-size buffer, deque(maxlen=...)) or aggregates"),
    "excess_ops": Kind(
        _FIRST, "more ops (or kernel launches) per step than the clean stage's",
        "compute shared work once and reuse it (the reference Agent runs its body once for "
        "both heads); count model ops per step with the profiler"),
    "recompile": Kind(_COMPILE, "a new graph compiled after warm-up", _NO_BRANCHES),
    "graph_break": Kind(_COMPILE, "dynamo split the compiled code (its reason is given)",
                        _NO_BRANCHES),
    "graph_growth": Kind(_COMPILE, "new graphs keep being compiled after warm-up",
                         "mark the changing value dynamic, or keep it out of the guards"),
    "recompile_limit": Kind(_COMPILE, "torch._dynamo.config.recompile_limit reached: it runs "
                                      "eagerly from then on, silently",
                            "find the guard that keeps failing"),
    "precision": Kind("08_fused_optimizers_and_amp",
                      "fp32 where the clean stage runs reduced precision on this device",
                      "bf16 autocast where the device has it (labkit.precision.Amp)"),
    "error": Kind(_FIRST, "the stage raised",
                  "fix the error at the last frame of user_code, then diagnose again"),
    # what a real capture refuses or replays wrong (the rehearsal)
    "data_dependent": Kind(_GRAPHS, "an op whose result the host must read (torch tags it "
                                    "data_dependent_output)"),
    "dynamic_shape": Kind(_GRAPHS, "an op whose output shape depends on the data "
                                   "(dynamic_output_shape): a graph's shapes are fixed at "
                                   "capture"),
    "cudagraph_unsafe": Kind(_GRAPHS, "an op torch tags as unsafe inside a CUDA graph"),
    "kernel_sync": Kind(_GRAPHS, "an op whose CUDA kernel reads the device on the host"),
    "host_tensor": Kind(_GRAPHS, "inside the capture: a host-to-device copy of Python or NumPy "
                                 "data, baked in at capture (make it once, outside, and update "
                                 "it in place)"),
    "host_op": Kind(_GRAPHS, "an op on host tensors only runs on the CPU, once, at capture: "
                             "replays skip it, so a CPU step counter or learning rate updated "
                             "in place stays where the capture left it (keep it on the "
                             "device)"),
    "host_copy": Kind(_GRAPHS, "a copy from the device into a host tensor that waits for the "
                               "device (into pageable memory, or without non_blocking=True), "
                               "and a capture cannot wait (copy with non_blocking=True into a "
                               "pinned buffer made once)"),
    "host_mix": Kind(_GRAPHS, "a tensor made without device= is a host tensor on a GPU, and an "
                              "op mixing it with device tensors raises there (give it device=, "
                              "e.g. device=x.device)"),
    "stream_sync": Kind(_GRAPHS, "a synchronize inside the capture: on a GPU it ends the "
                                 "capture (\"operation not permitted when stream is "
                                 "capturing\"); drop it, or move it after the replay"),
    "seed": Kind(_GRAPHS, "a seed set inside the captured step: a CUDA generator ignores a seed "
                          "equal to its own during a capture and raises for another, so eager "
                          "calls restart the random stream at every call while replays go on "
                          "drawing new numbers (seed once, outside; register a generator with "
                          "graph.register_generator_state)"),
    "unregistered_generator": Kind(_GRAPHS, "a generator the graph does not know: a real "
                                            "capture raises (register it: "
                                            "graph.register_generator_state)"),
    "optimizer": Kind(_GRAPHS, "optimizer.step() of an optimizer built with capturable=False: "
                               "torch raises \"Attempting CUDA graph capture of step() ... but "
                               "param_groups' capturable is False\" (build it with "
                               "capturable=True and a tensor learning rate)"),
    "frozen_value": Kind(_GRAPHS, "a value that changes between eager calls is frozen at "
                                  "capture: every replay uses the capture's (keep it in a "
                                  "device tensor updated in place)"),
    "shape": Kind(_GRAPHS, "the capture's inputs or outputs differ in shape from the warm-up "
                           "call's"),
    "not_static": Kind(_GRAPHS, "an output that is not a tensor and changed between calls: "
                                "every replay returns the capture's value"),
    "unsupported": Kind(_GRAPHS, "the rehearsal cannot model this step, so it cannot say "
                                 "whether it captures"),
}


@dataclass
class Finding:
    """One thing an instrument found: its ``kind`` (a key of :data:`KINDS`), ``where``
    (``file:line (function)``, a component, or dynamo's reason), a one-line ``summary``, the
    ``evidence`` (counts, sites; a ``watch`` finding's ``total`` and ``per_iteration``), the
    doctor's estimate of its ``cost``, and the ``chapter`` and ``fix`` (the kind's, unless the
    instrument knows the component's)."""

    kind: str
    where: str
    summary: str
    evidence: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    chapter: str = ""
    fix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Finding.kind must be one of {', '.join(KINDS)}; got "
                             f"{self.kind!r}")
        kind = KINDS[self.kind]
        self.chapter = self.chapter or kind.chapter
        self.fix = self.fix or kind.fix or kind.means

    def __str__(self) -> str:
        return f"[{self.kind}] {self.where}: {self.summary}"

    to_dict = asdict


#: Why a finding of a kind (:data:`KINDS`) happened, where the kind has several causes;
#: ``pageable`` is a host-to-device copy's.
CAUSES = {
    "item": "reads a tensor's value on the host, as .item() does (a 0-d tensor used as an "
            "index or a Python number is read so): a capture cannot wait for it; index with "
            "index_select, gather or torch.where instead",
    "mask": "a boolean mask as an index (x[mask], x[mask] = values) finds its True entries "
            "with nonzero, whose count the host reads; use torch.where(mask, values, x) or "
            "x.masked_fill_(mask, value) (a Python number, or a 0-d host scalar, as the value "
            "takes that path)",
    "host_random": "a number drawn from a host random generator (random, numpy.random) inside "
                   "the capture is drawn once, at capture: every replay reuses it (draw on the "
                   "device with a torch.Generator the graph registers)",
    "scaler": "GradScaler.step(optimizer) reads found_inf on the host (.item()) before it steps "
              "an optimizer that is not fused: a capture cannot wait for it (use a fused "
              "optimizer, which takes the scale and found_inf on the device)",
    "python_state": "the step changes Python state (eager calls move it on; a replay runs no "
                    "Python, so it stays where the capture left it)",
    "frozen_branch": "the capture ran other ops than the eager call before it (Python control "
                     "flow that changes between calls): every replay repeats the capture's",
    "host_lr": "a fused optimizer given a learning rate that lives on the host reads it once, "
               "when its kernel is launched (lr.item() in torch's CUDA code): the capture bakes "
               "that value in, and a schedule that changes the tensor between replays changes "
               "nothing (make the lr tensor on the device: lr=torch.tensor(1e-3, "
               "device=device))",
    "pageable": "a host tensor copied to the device inside the capture: a copy from pageable "
                "host memory, which a capture cannot record (copy it once, outside, into a "
                "device tensor, and update that in place)",
}
