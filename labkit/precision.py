"""Precision: what a stage's update runs in, behind one interface whatever the choice.

A stage's ``precision`` slot holds a component, :class:`Fp32` or :class:`Amp`. Built on a
device it gives a :class:`Precision`, the object the minibatch step calls:

* ``autocast()`` around the loss's forward (nothing for fp32);
* ``backward(loss)``, ``unscale_(optimizer, params)`` and ``step(optimizer)``: plain for fp32
  and bf16; through a GradScaler for fp16 (:class:`ScaledPrecision`), whose small gradients
  would underflow otherwise.

The step calls the same four methods for every precision, so it never asks which it has.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch

from . import debug
from .device import CPU_BF16, convs_in_tf32, cpu_bf16, has_bf16

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """fp32 or bf16 on one device type: the loss's forward under ``autocast()``, then a plain
    backward and optimizer step. ``name`` is what results and reports print; ``why``, what
    made a component choose it on this device (empty where nothing was chosen)."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu", why: str = "") -> None:
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {name!r}")
        self.name = name
        self.device_type = device_type
        self.why = why
        # cache off: cached casts of the parameters would be stale across graph replays
        self._autocast = contextlib.nullcontext if name == "fp32" else partial(
            torch.autocast, device_type, dtype=_DTYPES[name], cache_enabled=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.device_type!r})"

    def __str__(self) -> str:
        return self.name

    def describe(self) -> str:
        """``bf16 (this CPU has AMX)``: the name, and why where a component chose it."""
        return f"{self.name} ({self.why})" if self.why else self.name

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the loss's forward runs in."""
        return self._autocast()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
        """Make the gradients true gradients before they are clipped (here they are already),
        and run the debug checks on them (free when off: see labkit.debug)."""
        debug.check_grads(params)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict:
        """What training changes in the precision itself: nothing for fp32 and bf16."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict``; an empty one (fp32, bf16, or a state saved before precision
        state was kept) leaves the precision as it is."""


class ScaledPrecision(Precision):
    """fp16 autocast with a GradScaler: the loss is scaled before backward so that small
    gradients survive fp16, the gradients are unscaled before clipping, and a step whose
    gradients overflowed is skipped (the scale then shrinks). With an unfused optimizer the
    scaler reads ``found_inf`` on the host every step; a fused one skips on the device.
    Non-finite gradients are expected here, so the debug checks leave them to the scaler."""

    def __init__(self, name: str = "fp16", device_type: str = "cuda",
                 init_scale: float = 2.0**16, why: str = "") -> None:
        super().__init__(name, device_type, why)
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict:
        """Copies of the scaler's scale and growth tracker, on the device (no host read:
        ``GradScaler.state_dict`` would read both); empty while the scaler is disabled.
        Warmup, the compile choice and checkpoints keep them, so an iteration they undo leaves
        the scale as it was. The scaler's tensors are made here if no step has made them."""
        scaler = self.scaler
        if not scaler.is_enabled():
            return {}
        if scaler._scale is None:  # torch makes them lazily, at the first scale()
            scaler._lazy_init_scale_growth_tracker(torch.device(self.device_type))
        return {"scale": scaler._scale.detach().clone(),
                "growth_tracker": scaler._growth_tracker.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        if not state or not self.scaler.is_enabled():
            return
        scaler = self.scaler
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(torch.device(self.device_type))
        scaler._scale.copy_(state["scale"])  # in place, like every restore
        scaler._growth_tracker.copy_(state["growth_tracker"])


@dataclass(frozen=True)
class Fp32:
    """The precision slot's default: everything in float32, on every device."""

    requires: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __call__(self, device: torch.device) -> Precision:
        return Precision("fp32", device.type)


@dataclass(frozen=True, repr=False)
class Amp(Fp32):
    """Mixed precision for the loss's forward: bf16 autocast where the device has bf16 (a GPU
    of compute capability 8.0 or newer; a CPU with bf16 instructions, AVX-512 BF16 or AMX on
    x86, bf16 on Arm: :func:`labkit.device.cpu_bf16`), fp16 with a GradScaler on older GPUs,
    fp32 on a CPU without bf16 instructions (there bf16 is emulated). The choice and its reason
    are in the precision's ``why``, which runs and ladder rows print."""

    def __call__(self, device: torch.device) -> Precision:
        if device.type == "cuda":
            if has_bf16(device):
                return Precision("bf16", "cuda", why="this GPU has bf16")
            return ScaledPrecision("fp16", "cuda", why="this GPU has no bf16 (compute "
                                                       "capability below 8.0)")
        if has_bf16(device):
            return Precision("bf16", device.type, why=f"this CPU has {cpu_bf16()}")
        return Precision("fp32", device.type,
                         why=f"this CPU has no bf16 instructions ({CPU_BF16})")


@dataclass(frozen=True, repr=False)
class Bf16(Fp32):
    """bf16 autocast on any device, also one without bf16 instructions (there emulated, and
    slower): to see what bf16 does to the numbers on any machine."""

    def __call__(self, device: torch.device) -> Precision:
        return Precision("bf16", device.type)


fp32 = Fp32()
amp = Amp()


def update_agreement(start: Iterable[torch.Tensor], reference: Iterable[torch.Tensor],
                     other: Iterable[torch.Tensor]) -> dict[str, float]:
    """How closely an update at another precision follows the reference (fp32) update from the
    same ``start`` parameters: the cosine between the two parameter changes, and the L2 norm of
    their difference over the reference change's (0 for the same update). Element-wise
    tolerances are the wrong test here: bf16 moves single parameters by as much as Adam's
    own step, while the update as a whole goes the same way (labkit.precision.AGREEMENT)."""
    start = [t.detach().float().flatten() for t in start]
    d_ref = torch.cat([r.detach().float().flatten() - s for r, s in zip(reference, start)])
    d_oth = torch.cat([o.detach().float().flatten() - s for o, s in zip(other, start)])
    cosine = torch.nn.functional.cosine_similarity(d_ref, d_oth, dim=0)
    relative = (d_oth - d_ref).norm() / d_ref.norm()
    return {"cosine": float(cosine), "relative_l2": float(relative)}  # deliberate: reported


#: The criterion a bf16 update meets against fp32 (one PPO update, 16 Adam steps): measured on
#: the CPU with bf16 autocast at 8 envs x 16 steps and 64 x 64, four seeds each, the cosine was
#: 0.9970 at worst and the relative L2 difference 0.078 at worst, while single parameters
#: differed by up to 3.5e-3: close to the most 16 Adam steps of lr 2.5e-4 move one (4e-3).
AGREEMENT = {"cosine": 0.99, "relative_l2": 0.2}


def agrees(agreement: dict[str, float]) -> bool:
    """``update_agreement``'s figures meet :data:`AGREEMENT`."""
    return agreement["cosine"] >= AGREEMENT["cosine"] \
        and agreement["relative_l2"] <= AGREEMENT["relative_l2"]


#: How closely two float32 stages' outputs agree element-wise where they run the same float32
#: (compiled kernels reorder float operations): the CPU, or a GPU whose convolutions run in
#: full float32.
FP32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
#: ... where cuDNN runs float32 convolutions as TF32 (:func:`labkit.device.convs_in_tf32`,
#: torch's default on Ampere and newer): eager and compiled stages pick different convolution
#: kernels. Measured on an H200 (torch 2.11, ``python scripts/tf32_gap.py``): stage 4's and
#: stage 5's rollout values at N=1024, T=128 differed by up to 3.8e-4 with TF32 convolutions
#: and 4.2e-7 without. 5x the measured gap.
TF32_TOLERANCE = {"rtol": 1e-2, "atol": 2e-3}


def fp32_tolerance(device: torch.device) -> dict[str, float]:
    """The element-wise tolerance two float32 stages' outputs on ``device`` meet."""
    return TF32_TOLERANCE if convs_in_tf32(device) else FP32_TOLERANCE


def fp32_updates_agree(start: Iterable[torch.Tensor], a: Iterable[torch.Tensor],
                       b: Iterable[torch.Tensor], device: torch.device) -> bool:
    """Do two float32 stages' parameters after the same update from ``start`` agree? Element
    by element (:data:`FP32_TOLERANCE`) where they compute the same float32; where
    convolutions run as TF32, Adam turns their small gradient differences into differences
    as large as its own step in single parameters, so there the update as a whole is
    compared, by the criterion reduced precision meets (:data:`AGREEMENT`)."""
    a, b = list(a), list(b)
    if convs_in_tf32(device):
        return agrees(update_agreement(start, a, b))
    return all(torch.allclose(x, y, **FP32_TOLERANCE) for x, y in zip(a, b, strict=True))
