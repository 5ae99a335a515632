"""What the dispatch level cannot see of a CUDA kernel: ops that read the device from inside
their kernel (a capture on a GPU fails there), and ops whose host read happens on the CPU only
(CUDA checks on the device instead, so a capture succeeds).

Read from PyTorch's ATen sources at the version below, by this procedure: for every op a
training step commonly calls, find its CUDA implementation in ``aten/src/ATen/native`` (the
function named in ``native_functions.yaml``'s ``dispatch: CUDA`` entry, or the composite
function that calls it) and look for a host read inside it (``.item()``, ``item<T>()``,
``_local_scalar_dense``, ``at::cuda::memcpy_and_sync``, a stream synchronize), and for a
read guarded by ``device().type() != kCUDA``. The table names the function where the read is;
a test fails when the installed torch is not this version, so the table is read again.
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
CPU_ONLY_CHECKS: dict[Callable, Callable[[tuple, dict], bool]] = {
    F.one_hot: lambda args, kwargs: (kwargs.get("num_classes", args[1] if len(args) > 1
                                                 else -1) != -1),
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
