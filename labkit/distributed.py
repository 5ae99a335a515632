"""Data-parallel PPO on ``torch.distributed``, launched by ``torchrun``.

Each rank simulates its own envs (global env index = rank x N + i, so the counter-based RNG
gives every rank distinct, reproducible envs) and samples with its own generator; parameters
start equal (same seed) and stay equal because every minibatch's gradients are averaged over
the ranks before clipping and the optimizer step; episode statistics are summed over the ranks
before their one read. Rank 0 alone writes logs and checkpoints.

A pipeline takes a :class:`Group`; the single-process one (``SINGLE``) does nothing at each
of these points, so the same code runs with and without torchrun.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .signals import default_stop_signals

#: The sampling generator of rank r is seeded with seed + SEED_STRIDE * r (rank 0: the seed).
SEED_STRIDE = 1_000_003
#: The most processes a run may have (a WORLD_SIZE above it is a typo, not a cluster).
MAX_WORLD = 65_536
#: How long a rank waits for the others to join, in seconds, unless LABKIT_RENDEZVOUS_TIMEOUT
#: says otherwise; torch also gives each collective this long.
RENDEZVOUS_TIMEOUT_S = 300


@dataclass(frozen=True)
class Group:
    """This process's place in the run: ``rank`` of ``world`` processes."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def env_offset(self, n_envs: int) -> int:
        """Hash counter index of this rank's first env."""
        return self.rank * n_envs

    def sampling_seed(self, seed: int) -> int:
        return (seed + SEED_STRIDE * self.rank) % 2**32

    def device(self, device: torch.device) -> torch.device:
        """One GPU per process on a node: cuda:LOCAL_RANK."""
        if self.world > 1 and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def average_grads(self, clip_grad: Callable) -> Callable:
        """``clip_grad`` preceded by averaging the gradients over the ranks (one all-reduce of
        one flat buffer per minibatch step); ``clip_grad`` itself alone."""
        if self.world == 1:
            return clip_grad
        world = self.world

        def all_reduce_then_clip(params: Iterable[torch.Tensor], max_norm: float):
            params = list(params)
            grads = [p.grad for p in params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            chunks = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(chunks, grads)])
            return clip_grad(params, max_norm)

        return all_reduce_then_clip

    def reduce_metrics(self, metrics: Any) -> None:
        """Make ``metrics`` hold every rank's episodes (before its summary reads them)."""
        if self.world > 1:
            metrics.all_reduce_()

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (decisions that all ranks must share)."""
        return any(self.all_gather(bool(flag)))


SINGLE = Group()


def _env_int(name: str, default: int | None, low: int, high: int | None = None,
             why: str = "") -> int:
    """The integer environment variable ``name``, checked: a ValueError naming it, its value
    and the allowed range (``why`` says where the bound comes from) otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        if default is None:
            raise ValueError(f"{name} is not set, but WORLD_SIZE={os.environ.get('WORLD_SIZE')} "
                             "says this is one of several processes: start them with torchrun, "
                             "which sets RANK, LOCAL_RANK and WORLD_SIZE together")
        return default
    if len(text) > 30 and text.lstrip("+-").isdigit():  # past int()'s digit limit, or near it
        raise ValueError(f"{name} is an integer of {len(text):,} digits: it must be "
                         + (f">= {low}" if high is None else f"in {low}..{high}") + why)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text[:40]!r} must be an integer") from None
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}={value} must be {allowed}{why}")
    return value


def world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return _env_int("WORLD_SIZE", 1, 1, MAX_WORLD)


def current() -> Group:
    """This process's place, from torchrun's environment variables (no communication), each
    checked: a rank outside the world would wait for the others forever."""
    world = world_size()
    if world == 1:
        return SINGLE
    rank = _env_int("RANK", None, 0, world - 1, f" (WORLD_SIZE={world})")
    local_world = _env_int("LOCAL_WORLD_SIZE", world, 1, world, f" (WORLD_SIZE={world})")
    local_rank = _env_int("LOCAL_RANK", 0, 0, local_world - 1,
                          f" (LOCAL_WORLD_SIZE={local_world})")
    _env_int("MASTER_PORT", 0, 0, 65535)
    return Group(rank=rank, world=world, local_rank=local_rank)


def join(device_type: str = "cpu") -> Group:
    """This process's group: under torchrun, join the process group for a run on
    ``device_type``: NCCL (and gloo for CPU tensors) on this rank's GPU, cuda:LOCAL_RANK, for a
    CUDA run; gloo for a CPU run, GPU or not (its ranks never touch CUDA). Without torchrun, the
    single group. A CUDA run with more processes on a node than it has GPUs is refused."""
    group = current()
    if group.world > 1 and not dist.is_initialized():
        if device_type == "cuda":
            count = torch.cuda.device_count()
            if group.local_rank >= count:
                raise ValueError(
                    f"LOCAL_RANK {group.local_rank} has no GPU: this node has {count} CUDA "
                    f"device(s); start at most {count} process(es) per node "
                    f"(torchrun --nproc-per-node {max(count, 1)}) or train with --device cpu")
            torch.cuda.set_device(group.local_rank)
        _rendezvous(group, "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo")
    return group


def _rendezvous(group: Group, backend: str) -> None:
    """``init_process_group`` bounded in time and stoppable: MASTER_ADDR resolved first (one
    line where it cannot be), the wait bounded by LABKIT_RENDEZVOUS_TIMEOUT (said when it
    starts), and a stop signal ending it at once. torch waits in C++, where no Python signal
    handler runs until it returns, so the stop signals have their default action meanwhile:
    the process ends, killed by the signal (exit 128 + n in a shell); nothing of the run has
    been written yet."""
    timeout = _env_int("LABKIT_RENDEZVOUS_TIMEOUT", RENDEZVOUS_TIMEOUT_S, 1, 86_400)
    addr = os.environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ValueError("MASTER_ADDR is not set: start the processes with torchrun, which "
                         "sets it")
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"MASTER_ADDR={addr[:80]!r} cannot be resolved ({err}): name the "
                         "host of rank 0, e.g. MASTER_ADDR=127.0.0.1 on one machine") from None
    where = f"{addr}:{os.environ.get('MASTER_PORT', '').strip() or '?'}"
    # torch.distributed.nn.functional gives ten functions the default argument
    # group=group.WORLD, evaluated when it is first imported: after the group is made (the
    # first optimizer or compile imports it, through torch._dynamo), those defaults hold the
    # group, destroy_process_group cannot free it, and gloo's C++ threads live on into the
    # interpreter's teardown, where a rank sometimes died of SIGABRT ("terminate called
    # without an active exception"). Imported before the group exists, the defaults are None.
    import torch.distributed.nn  # noqa: F401
    with default_stop_signals():
        if group.is_main:
            print(f"rank 0 of {group.world}: waiting up to {timeout} s for the other ranks at "
                  f"{where} (LABKIT_RENDEZVOUS_TIMEOUT; a stop signal ends the wait)",
                  file=sys.stderr, flush=True)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except dist.DistError as err:
            if "time" not in str(err).lower():
                raise
            said = (f"rank {group.rank} of {group.world}: the other ranks did not join at "
                    f"{where} within {timeout} s (LABKIT_RENDEZVOUS_TIMEOUT): start every rank "
                    "with the same MASTER_ADDR and MASTER_PORT")
            if not group.is_main:  # the CLI speaks for rank 0 alone; a rank alone says it
                print(f"error: {said}", file=sys.stderr, flush=True)
            raise TimeoutError(said) from None


def leave(group: Group) -> None:
    if group.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def parameter_checksum(module: torch.nn.Module) -> str:
    """A digest of the parameters' bytes (a deliberate host read: once, at the end of a run),
    to show that every rank ends with the same model."""
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
