"""What the dispatch level cannot see of a CUDA kernel: ops that read the device from inside
their kernel (a capture on a GPU fails there), and ops whose host read happens on the CPU only
(CUDA checks on the device instead, so a capture succeeds).

Read from the torch below by two procedures. (1) torch's own docstrings: every public function
of ``torch`` and ``torch.linalg`` whose docstring notes that on CUDA it "synchronizes" with the
CPU (``[n for n in dir(torch.linalg) if "synchroniz" in getattr(torch.linalg, n).__doc__]``:
cholesky, cond, eig, eigh, eigvals, eigvalsh, inv, ldl_factor, lu_factor, matrix_rank, pinv,
solve, svd, svdvals and their ``_ex`` forms with ``check_errors=True``; ``torch.normal`` with
a tensor ``std``; nonzero and repeat_interleave, which torch tags already), mapped to the aten
ops it dispatches, traced on the CPU. (2) ATen's sources, for ops their docs do not mention:
find the CUDA implementation in ``aten/src/ATen/native`` and look for a host read in it
(``.item()``, ``item<T>()``, ``_local_scalar_dense``, ``memcpy_and_sync``, a synchronize), or a
read guarded by ``device().type() != kCUDA``. An op that neither names is not in the table: a
sync inside it goes unseen. A test fails when the installed torch is not this version, so the
table is read again.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: The torch these tables were read from.
READ_FROM = "2.13.0"


def _histc_reads(named: dict[str, Any]) -> bool:
    return named.get("min", 0) == named.get("max", 0)


#: aten op -> (when it syncs inside its CUDA kernel, what it reads and how to avoid it).
#: ``_linalg_check_errors`` is what ``torch.linalg.inv``/``solve``/``cholesky`` (and
#: ``torch.inverse``, ``Tensor.cholesky`` ...) call after the kernel: it copies ``info`` to
#: the host (aten/src/ATen/native/BatchLinearAlgebra.cpp, ``_linalg_check_errors``).
#: ``histc`` with ``min == max`` reads the input's min and max (aten/src/ATen/native/cuda/
#: SummaryOps.cu, ``_histc_cuda_template``).
IN_KERNEL: dict[str, tuple[Callable[[dict[str, Any]], bool], str]] = {
    "_linalg_check_errors": (
        lambda named: True,
        "the error check torch runs after a linalg kernel reads its info on the host (use "
        "the _ex variant, e.g. torch.linalg.inv_ex / cholesky_ex / solve_ex, and check info "
        "after the replay)"),
    "cholesky": (
        lambda named: True,
        "the deprecated torch.cholesky checks its info on the host after the kernel (use "
        "torch.linalg.cholesky_ex and check info after the replay)"),
    # aten/src/ATen/native/sparse/cuda/SparseCUDATensor.cu _coalesce_sparse_cuda: the new nnz
    # comes from a unique on the device and sizes the output on the host
    "_coalesce": (
        lambda named: True,
        "coalescing a sparse tensor counts its unique indices on the host (build it coalesced "
        "outside the step, or keep the graph dense)"),
    # SparseCUDATensorMath.cu s_addmm_out_sparse_dense_cuda: torch.sparse.mm coalesces an
    # uncoalesced sparse input first
    "_sparse_addmm": (
        lambda named: any(getattr(v, "layout", None) == torch.sparse_coo and not v.is_coalesced()
                          for v in named.values()),
        "torch.sparse.mm of an uncoalesced sparse tensor coalesces it first, counting its "
        "unique indices on the host (coalesce it once, outside the step)"),
    # aten/src/ATen/native/sparse/SparseTensor.cpp dense_to_sparse: its indices are nonzero()'s
    "_to_sparse": (
        lambda named: True,
        "to_sparse finds the nonzero entries, whose count the host reads"),
    # torch.linalg.eigh/eigvalsh (and pinv, matrix_rank with hermitian=True): "synchronizes
    # that device with the CPU" (their docstrings); the kernel checks its info
    "_linalg_eigh": (
        lambda named: True,
        "torch.linalg.eigh / eigvalsh synchronize with the CPU on CUDA (their docs: the error "
        "check of the kernel's info)"),
    # svd, svdvals, cond, matrix_rank, matrix_norm(ord=2): the same note
    "_linalg_svd": (
        lambda named: True,
        "torch.linalg.svd / svdvals (and cond, matrix_rank, matrix_norm(ord=2), which use "
        "them) synchronize with the CPU on CUDA (their docs)"),
    "linalg_eig": (
        lambda named: True,
        "torch.linalg.eig / eigvals synchronize with the CPU on CUDA (their docs)"),
    "linalg_pinv": (
        lambda named: True,
        "torch.linalg.pinv synchronizes with the CPU on CUDA (its docs: it uses svd or eigh)"),
    # torch.normal's docstring: "When std is a CUDA tensor, this function synchronizes";
    # DistributionTemplates.h CHECK_NORMAL_TENSOR_STD reads std.min() >= 0 on the host
    "normal": (
        lambda named: isinstance(named.get("std"), torch.Tensor),
        "torch.normal with a tensor std checks std >= 0 on the host (its docs: it "
        "synchronizes); so do Normal(...).sample() and rsample's callers of normal: draw "
        "mean + std * torch.randn_like(std) instead"),
    "histc": (
        _histc_reads,
        "histc without a range (min == max) reads the input's min and max on the host (give "
        "min= and max=)"),
}

#: torch function -> when its host reads happen on the CPU only: on CUDA the same checks are
#: device-side asserts, and the op captures. ``one_hot`` with ``num_classes`` given reads
#: min and max for its range checks on the CPU only (aten/src/ATen/native/Onehot.cpp,
#: ``one_hot``: the checks are skipped for CUDA, which relies on scatter's device assert);
#: without ``num_classes`` it reads the max on every device, and stays a host read.
#: ``quantile`` and ``nanquantile`` check that ``q`` is in [0, 1] on the host for CPU tensors
#: only (aten/src/ATen/native/Sorting.cpp, ``quantile_checks``); torch 2.11 does it with an
#: ``aten.equal`` the rehearsal saw as a host read (`make test-torch211`).
CPU_ONLY_CHECKS: dict[Callable, Callable[[tuple, dict], bool]] = {
    F.one_hot: lambda args, kwargs: (kwargs.get("num_classes", args[1] if len(args) > 1
                                                 else -1) != -1),
    **{fn: lambda args, kwargs: True for fn in (torch.quantile, torch.nanquantile,
                                                torch.Tensor.quantile, torch.Tensor.nanquantile)},
}


def in_kernel_sync(op_name: str, named: dict[str, Any]) -> str | None:
    """What ``op_name`` with arguments ``named`` reads on the host inside its CUDA kernel,
    or None."""
    entry = IN_KERNEL.get(op_name)
    if entry is None or not entry[0](named):
        return None
    return entry[1]


def checks_on_cpu_only(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the host reads inside ``func(*args, **kwargs)`` happen on the CPU only."""
    rule = CPU_ONLY_CHECKS.get(func)
    return rule is not None and bool(rule(args, kwargs))
