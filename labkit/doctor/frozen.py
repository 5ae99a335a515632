"""What a CUDA graph freezes at capture, found by comparing eager calls with the capture op by op.

A graph replays the kernels its capture recorded, with the arguments they had then: a Python
number passed to an op (a row index, a learning rate), the tensor a name was bound to, the
branch the Python code took. :class:`Tracer` records a call's ops as (op, its Python arguments,
where its tensors come from); :func:`frozen_values` compares the call before the capture with the
capture and reports the first difference at its line (a branch at its ``if``). Used by
:func:`labkit.doctor.rehearsal.rehearse`, which traces its last two warm-up calls and the
capture.
"""
from __future__ import annotations

import ast
import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..measure.syncmeter import call_site, parse_site, source_lines
from .kinds import CAUSES, KINDS, Finding
from .recorder import dense_storage, storage_key


class Tracer(TorchDispatchMode):
    """The ops of one call, each as (op, its Python arguments, where its tensors come from),
    to compare an eager call with the capture that follows it: a value that differs is one a
    graph freezes at capture. A tensor input is named by the op of this call that made it, or,
    made before the call, by its memory (the tracer holds every input, so no address is reused
    while it lives); ``sites`` also notes each op's line in the caller's code."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.sites = sites
        self.ops: list[tuple] = []
        self.where: list[str] = []
        self._made: dict[int, tuple[int, int]] = {}  # id(tensor) -> (op, output) in this call
        self._held: list[Any] = []
        self.read: set[int] = set()  # the ops whose result the host read (.item(), bool())
        self.results: set[int] = set()  # the ops whose result the call returned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _READS:  # a host read is no device work a graph
            for t in args:                          # would hold: what it read is noted
                made = self._made.get(id(t)) if isinstance(t, torch.Tensor) else None
                if made is not None:
                    self.read.add(made[0])
            return func(*args, **kwargs)
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        self._held.append((args, kwargs))
        if func.overloadpacket.__name__ in _LIFTS:  # Python data made a tensor: its values
            self.ops.append((func, tuple(_data(v) for v in args), self._plain(kwargs)))
        else:
            self.ops.append((func, self._plain(args), self._plain(kwargs)))
        if self.sites:
            self.where.append(call_site(internal=(__file__,)))
        out = func(*args, **kwargs)
        self._held.append(out)
        for i, value in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(value, torch.Tensor):
                self._made[id(value)] = (len(self.ops) - 1, i)
        return out

    def returned(self, value: Any) -> None:
        """The call returned ``value``: the ops that made its tensors are the call's results,
        whoever else reads them."""
        for leaf in _flat_args(value):
            made = self._made.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if made is not None:
                self.results.add(made[0])

    def site_of(self, tensor: torch.Tensor) -> str | None:
        """The line of the op that made ``tensor`` in the traced call (None: not made there,
        or no lines noted)."""
        made = self._made.get(id(tensor))
        return self.where[made[0]] if made is not None and self.where else None

    def _plain(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            made = self._made.get(id(value))
            if made is not None:
                return ("made", made)
            offset = value.storage_offset() if dense_storage(value) else 0
            return ("before", storage_key(value), offset)
        if isinstance(value, (list, tuple)):
            return type(value)(self._plain(v) for v in value)
        if isinstance(value, dict):
            return {k: self._plain(v) for k, v in value.items()}
        if isinstance(value, float) and value != value:
            return "nan"
        return value


#: A tensor's value read on the host (``.item()``, ``bool(t)``): the capture reports such a
#: read itself, and one that only an eager call makes (``if not capturing: log(x.item())``,
#: torch's own idiom) changes nothing a replay computes.
_READS = {"_local_scalar_dense", "is_nonzero"}
#: The ops that make a tensor of Python data (``torch.tensor(...)``, a scalar in ``y[m] = 0.0``).
_LIFTS = {"lift_fresh", "lift", "lift_fresh_copy"}


def _data(value: Any) -> Any:
    """A fresh tensor of Python data, by its values (read without an op, and with no torch
    function mode told: the rehearsal's own look at the data is no read of the step's)."""
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        with torch._C.DisableTorchFunction():
            return ("data", value.dtype, torch._C.TensorBase.tolist(value))
    return value


def _for_the_host_only(trace: Tracer) -> set[int]:
    """The ops whose results only the host reads: they write nothing and draw nothing, the
    call does not return what they make, and it goes into a host read or into other such ops
    (``y.sum().item()`` for a log line). Under ``if not
    torch.cuda.is_current_stream_capturing():``, torch's idiom for work an eager call does and
    a capture skips, they change nothing a replay computes. An op whose result goes nowhere
    the tracer sees is kept: it may be state the call keeps (``stats["total"] =
    stats["total"] + r.sum()``), which a replay would freeze."""
    used: dict[int, set[int]] = {}
    for j, op in enumerate(trace.ops):
        for ref in _made_refs(op[1:]):
            used.setdefault(ref, set()).add(j)
    host_only: set[int] = set()
    for j in range(len(trace.ops) - 1, -1, -1):
        users = used.get(j, set())
        if (j in trace.read or users) and users <= host_only \
                and j not in trace.results and not _writes(trace.ops[j][0]):
            host_only.add(j)
    return host_only


def _made_refs(value: Any) -> list[int]:
    """The ops of this call whose results ``value`` (an op's plain arguments) takes."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "made":
        return [value[1][0]]
    if isinstance(value, (list, tuple)):
        return [j for v in value for j in _made_refs(v)]
    if isinstance(value, dict):
        return [j for v in value.values() for j in _made_refs(v)]
    return []


@functools.cache
def _writes(func: Any) -> bool:
    """``func`` writes a tensor argument, or draws from a generator (moves its state)."""
    return torch.Tag.nondeterministic_seeded in func.tags or any(
        a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _renumbered(value: Any, new: dict[int, int]) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "made":
        return ("made", (new[value[1][0]], value[1][1]))
    if isinstance(value, (list, tuple)):
        return type(value)(_renumbered(v, new) for v in value)
    if isinstance(value, dict):
        return {k: _renumbered(v, new) for k, v in value.items()}
    return value


def _device_work(trace: Tracer) -> tuple[list[tuple], list[str]]:
    """(ops, their lines) of ``trace`` without the ops only the host reads, the ops' references
    to each other renumbered to match."""
    gone = _for_the_host_only(trace)
    if not gone:
        return trace.ops, trace.where
    kept = [j for j in range(len(trace.ops)) if j not in gone]
    new = {j: i for i, j in enumerate(kept)}
    ops = [(trace.ops[j][0], *_renumbered(trace.ops[j][1:], new)) for j in kept]
    return ops, [trace.where[j] for j in kept if j < len(trace.where)]


def frozen_values(before: Tracer, capture: Tracer) -> list[Finding]:
    """What the capture froze that differs from the eager call before it: a Python value
    passed to an op (an index, a learning rate, a seed), a tensor made by an earlier call read
    in place of the one before (state rebound each call: replays read the warm-up's), or
    other ops altogether (a Python branch). Ops whose results only the host reads are left
    out of both (:func:`_for_the_host_only`)."""
    (b_ops, b_where), (c_ops, c_where) = _device_work(before), _device_work(capture)
    for i, (b, c) in enumerate(zip(b_ops, c_ops)):
        if b == c:
            continue
        where = c_where[i] if i < len(c_where) else "<unknown>"
        if b[0] != c[0]:
            return [Finding("frozen_value", _branch((c_where, b_where), i) or where, (
                f"{CAUSES['frozen_branch']}: the call before ran {b[0]}, the capture {c[0]}"))]
        what = _first_change(b[1:], c[1:])
        return [Finding("frozen_value", where, f"{KINDS['frozen_value'].means}: {c[0]} {what}")]
    if len(b_ops) != len(c_ops):
        i = min(len(b_ops), len(c_ops))
        where = c_where[-1] if c_where else "<unknown>"
        return [Finding("frozen_value", _branch((c_where, b_where), i) or where, (
            f"{CAUSES['frozen_branch']}: the call before ran {len(b_ops)} ops, the "
            f"capture {len(c_ops)}"))]
    return []


def _branch(lines: tuple[list[str], list[str]], i: int) -> str | None:
    """The ``if`` or ``while`` whose taken branch differs between the two calls: the innermost
    one enclosing the first op that differs, in the capture or in the call before (``lines``:
    each call's op lines)."""
    for where in lines:
        if i < len(where):
            found = _enclosing_branch(where[i])
            if found:
                return found
    return None


def _enclosing_branch(site: str) -> str | None:
    """``site`` moved to the line of the innermost ``if``/``while`` (or ``x if c else y``)
    around it in its function's source, or None."""
    parsed = parse_site(site)
    if parsed is None:
        return None
    path, line, func, _ = parsed
    tree = _syntax(path)
    inner = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and \
                node.lineno < line <= (node.end_lineno or node.lineno) or \
                isinstance(node, ast.IfExp) and node.lineno == line:
            if inner is None or node.lineno >= inner.lineno:
                inner = node
    return f"{path}:{inner.lineno} ({func})" if inner is not None else None


@functools.lru_cache(maxsize=256)
def _syntax(path: str) -> Any:
    """The parsed source of a call site's file (None where it cannot be read)."""
    text = "".join(source_lines(path))
    try:
        return ast.parse(text) if text else None
    except SyntaxError:
        return None


def _first_change(before: Any, after: Any) -> str:
    """The first argument that differs, said for people."""
    flat_b, flat_a = _flat_args(before), _flat_args(after)
    for x, y in zip(flat_b, flat_a):
        if x != y:
            if isinstance(x, tuple) and x and x[0] in ("made", "before") or \
                    isinstance(y, tuple) and y and y[0] in ("made", "before"):
                return ("reads another tensor than in the call before (state rebound to a new "
                        "tensor each call: replays read the one the capture saw; update it in "
                        "place)")
            return f"was given {x!r} in the call before and {y!r} at capture"
    return "changed"


def _flat_args(value: Any) -> list:
    if isinstance(value, tuple) and value and value[0] in ("made", "before"):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat_args(v)]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _flat_args(value[k])]
    return [value]
