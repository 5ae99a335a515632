"""Which tensors would live on the host in a GPU run: the data flow that classifies a read.

On a GPU, reading a CUDA tensor's values (``.item()``, ``.tolist()``, ``.cpu()``) waits for
every kernel queued before it: a **device read**, a sync. Reading a tensor that lives on the
CPU does not wait for the GPU: a **host-scalar read**. torch's default Adam keeps each step
counter on the CPU on purpose (``torch/optim/adam.py``, note "special device hosting for
step": a counter on the GPU would cost a launch per step), so its ``.item()`` never syncs.

On a CPU run every tensor is a CPU tensor, and neither ``tensor.device``, nor "made without
``device=``" (Adam names ``device="cpu"``), nor the line of the read can tell the two apart.
Where the data came from can. :class:`HostFlow`, a dispatch mode over the ops of the thread
that enters it, keeps the set of **host tensors**:

* **host-born**: made by a factory (``torch.tensor``, ``zeros``, ``from_numpy``, ...) whose
  call names no device, or names the CPU literally (``device="cpu"``,
  ``torch.device("cpu")``), read from the call's source; unless ``torch.set_default_device``
  is in force, which moves unnamed factories to the device;
* **computed from host tensors only** (and Python numbers); a tensor written in place with a
  non-host input stops being one;
* **torch's optimizer state that torch keeps on the CPU on every device**: ``step`` in a param
  group that is neither capturable nor fused (``Optimizer._process_value_according_to_param_
  policy`` in ``torch/optim/optimizer.py``), also when it was made before the meter started;
* **a host copy**: what ``.cpu()`` or ``.to("cpu")`` returned (on the CPU, where torch returns
  the tensor itself, an alias of it: the original stays a device tensor).

Every other tensor is a **device tensor**: parameters and buffers, what the code placed with
``device=`` or ``.to(device)``, whatever is computed from them, what a compiled region returns
(its ops are not seen), and, on the cautious side, any tensor made before the meter started
that is not an optimizer's host state: a read wrongly called a sync is a false alarm, a sync
wrongly called free is a false "ok". On a CUDA tensor the device decides, no flow needed.
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import sys
import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

#: torch's frames between an op call and the dispatch mode (never the code that made the call)
_PASS_THROUGH = (os.path.join("torch", "utils", "_python_dispatch.py"),
                 os.path.join("torch", "_ops.py"), os.path.join("_dynamo", "eval_frame.py"),
                 os.path.join("torch", "_compile.py"))
#: ops that wrap a freshly made tensor (``torch.tensor``, ``as_tensor``, ``from_numpy``)
_LIFTS = ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift")


def names_cpu(node: ast.expr) -> bool:
    """``"cpu"``, ``"cpu:0"``, ``torch.device("cpu")``: the CPU named in the code itself."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and node.args and not node.keywords:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else \
            getattr(node.func, "id", None)
        return name == "device" and names_cpu(node.args[0])
    return False


@functools.lru_cache(maxsize=4096)
def _call_device(filename: str, span: tuple) -> str:
    """What the call at ``span`` of ``filename`` says of its device: ``"none"`` (no device
    named), ``"cpu"`` (the CPU named literally), ``"other"`` (a device named by a value: a
    variable, ``p.device``), or ``"unknown"`` (no source, or no call there)."""
    line, end_line, col, end_col = span
    if None in span:
        return "unknown"
    lines = linecache.getlines(filename)[line - 1:end_line]
    if not lines:
        return "unknown"
    if len(lines) == 1:
        text = lines[0][col:end_col]
    else:
        text = "".join([lines[0][col:], *lines[1:-1], lines[-1][:end_col]])
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return "unknown"
    return _said(node) if isinstance(node, ast.Call) else "unknown"


def _said(node: ast.Call) -> str:
    """What the call ``node`` names as its device: "none", "cpu" (literally), "other", or
    "name:<variable>" (what the variable was assigned decides: :func:`call_device`)."""
    device = next((k.value for k in node.keywords if k.arg == "device"), None)
    if device is None and isinstance(node.func, ast.Attribute) and node.func.attr == "to" \
            and node.args:
        device = node.args[0]  # x.to("cpu"), x.to(device)
    if device is None:
        return "none"
    if isinstance(device, ast.Name):
        return f"name:{device.id}"
    return "cpu" if names_cpu(device) else "other"


def call_device(node: ast.Call, filename: str, first_line: int) -> str:
    """The one rule for what a call in source says of its device, for every instrument that
    asks (the meters by the frame that runs it, the rehearsal by the line that made a step's
    tensor): "none" (no device named), "cpu" (the CPU named literally, or by a variable last
    assigned the CPU literally, in the function starting at ``first_line`` of ``filename`` or
    at the module's top level: ``HOST = torch.device("cpu")``) or "other" (another device,
    ``device = "cuda" if ... else "cpu"``, a parameter)."""
    said = _said(node)
    return name_device(filename, first_line, said[5:]) if said.startswith("name:") else said


def frame_call_device(frame) -> str:
    """What the call ``frame`` is making says of its device (see :func:`_call_device`); a
    device named by a variable is the CPU when that variable was last assigned the CPU named
    literally (``HOST = torch.device("cpu")``), in the function or at the module's top level,
    and another device otherwise (``device = "cuda" if ... else "cpu"``, a parameter)."""
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    if index >= len(positions):
        return "unknown"
    said = _call_device(frame.f_code.co_filename, positions[index])
    if not said.startswith("name:"):  # the parse is cached by line; a name, by its function
        return said
    return name_device(frame.f_code.co_filename, frame.f_code.co_firstlineno, said[5:])


_TREES: dict[str, tuple[list, ast.Module | None]] = {}


def source_tree(filename: str) -> ast.Module | None:
    """``filename``'s source parsed, as :mod:`linecache` holds it now (None: no source, or not
    Python). Parsed once per version of the file: linecache gives the same list of lines until
    the file changes, and a rehearsal asks of one file for every name a step holds."""
    linecache.checkcache(filename)
    lines = linecache.getlines(filename)
    kept = _TREES.get(filename)
    if kept is not None and kept[0] is lines:
        return kept[1]
    try:
        tree = ast.parse("".join(lines)) if lines else None
    except (SyntaxError, ValueError):
        tree = None
    _TREES[filename] = (lines, tree)
    return tree


@functools.lru_cache(maxsize=1024)
def name_device(filename: str, first_line: int, name: str) -> str:
    """"cpu" if ``name``'s last assignment in the function starting at ``first_line`` of
    ``filename`` (or, not assigned there, at the module's top level) names the CPU."""
    tree = source_tree(filename)
    if tree is None:
        return "other"
    scope = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))
                  and n.lineno == first_line), None)
    for body in ([scope] if scope is not None else []) + [tree]:
        nodes = ast.walk(body) if body is scope else body.body
        values = [n.value for n in nodes if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
        if values:
            return "cpu" if names_cpu(values[-1]) else "other"
        if scope is not None and body is scope and name in {
                a.arg for a in scope.args.args + scope.args.kwonlyargs}:
            return "other"  # a parameter: its caller's value
    return "other"


def _caller_device() -> str:
    """What the call that reached the dispatch mode says of its device: the first frame
    outside this module and torch's dispatch plumbing made it."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.endswith(_PASS_THROUGH)):
        frame = frame.f_back
    return "unknown" if frame is None else frame_call_device(frame)


def unnamed_is_host() -> bool:
    """The one rule for a tensor factory that names no device: on a GPU it makes a host
    tensor, unless a default device is in force, ``torch.set_default_device(device)`` or
    ``with torch.device(device):`` (torch's documented ways to move such factories to the
    device; on the CPU that stands in for the GPU, the device a portable script names)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    context = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    if getattr(context, "device_context", None) is not None:
        return False
    return not any(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def _tensors(values, out: list) -> list:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) in (list, tuple):
            _tensors(v, out)
    return out


@functools.cache
def _written(func) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and names of the arguments ``func`` writes (in-place and ``out=`` ops)."""
    pos, names = [], []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            (names if arg.kwarg_only else pos).append(i if not arg.kwarg_only else arg.name)
    return tuple(pos), tuple(names)


class HostFlow(TorchDispatchMode):
    """The set of host tensors of one thread, kept by data flow (module docstring). Entered by
    the sync meter around what it meters; ``is_host(t)`` classifies a read of ``t``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code stays compiled (its outputs count as device tensors)

    def __init__(self) -> None:
        super().__init__()
        #: callables told each op as it runs, ``observe(func, args, kwargs, out, born)``, where
        #: ``born`` says whether a tensor the op made from nothing (a factory, or Python/NumPy
        #: data) is a host tensor (None for other ops): another meter's count, without a
        #: dispatch mode of its own (each mode costs a trip through torch's Python per op)
        self.observers: list = []
        self._host: dict[int, weakref.ref] = {}
        self._copies: dict[int, weakref.ref] = {}  # host copies that are the tensor itself

    # -- the set ------------------------------------------------------------------------
    def _add(self, table: dict, t: torch.Tensor) -> None:
        key = id(t)
        if key not in table:
            table[key] = weakref.ref(t, lambda _, k=key, d=table: d.pop(k, None))

    def add_host(self, t: torch.Tensor) -> None:
        self._add(self._host, t)

    def host_copy(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` is what ``src.cpu()`` or ``src.to("cpu")`` returned: a copy on the host. On
        the CPU torch returns ``src`` itself; the copy is then an alias of it (same storage,
        another tensor), so that ``src`` stays what it was and the alias is host data, as the
        copy would be on a GPU (a Parameter's alias is a plain tensor, as ``.cpu()`` of a CUDA
        Parameter is). Any other subclass stays itself, and its reads count as reads of the
        copy until it is next written."""
        if out is not src:
            self.add_host(out)
            return out
        if type(src) in (torch.Tensor, torch.nn.Parameter):
            try:
                out = src.view_as(src)
            except RuntimeError:  # a layout with no views
                out = src
            else:
                self.add_host(out)
                return out
        self._add(self._copies, out)
        return out

    def placed(self, t: torch.Tensor) -> None:
        """The code moved ``t`` to its device (``.to(device)``; on the CPU ``t`` itself)."""
        self._host.pop(id(t), None)
        self._copies.pop(id(t), None)

    def is_host(self, t: torch.Tensor) -> bool:
        """Would ``t`` live on the CPU in a GPU run? (a read of it then waits for no GPU)."""
        if t.device.type != "cpu":
            return False
        return id(t) in self._host or id(t) in self._copies

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Add the state that torch keeps on the CPU on every device: ``step`` of a param
        group that is neither capturable nor fused (torch's own placement policy,
        ``Optimizer._process_value_according_to_param_policy``)."""
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                    self.add_host(step)

    # -- the ops ------------------------------------------------------------------------
    def _born_on_host(self) -> bool:
        """A factory call: host unless it names a device by value (or no source is found:
        the cautious side), or a default device is set and it names none."""
        said = _caller_device()
        if said == "none":
            return unnamed_is_host()
        return said == "cpu"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # kept lean: every op of the metered code passes here (a few microseconds each)
        name, pos, names, lift = _op_info(func)
        inputs = _tensors(args, _tensors(kwargs.values(), []) if kwargs else [])
        hosts = self._host
        born = None
        if not inputs or lift:
            host = born = self._born_on_host()
        elif not hosts:
            host = False
        elif name == "aten::copy_" and id(args[0]) in hosts:
            host = True  # a copy into a host tensor: host data (a D2H copy on a GPU)
        else:
            host = all(id(t) in hosts for t in inputs)
        written = ()
        if pos or names:
            written = [args[i] for i in pos
                       if i < len(args) and isinstance(args[i], torch.Tensor)]
            written += _tensors([kwargs[n] for n in names if n in kwargs], [])
            for t in written:
                self._copies.pop(id(t), None)
                if host:
                    self.add_host(t)
                else:
                    hosts.pop(id(t), None)
        if host and not written:
            for t in _tensors(out if isinstance(out, (list, tuple)) else (out,), []):
                self.add_host(t)
        for observe in self.observers:
            observe(func, args, kwargs, out, born)
        return out


_INFO: dict[int, tuple] = {}  # id(op) -> (op, name, written positions, names, lift)


def _op_info(func) -> tuple[str, tuple, tuple, bool]:
    """An op's schema name, the arguments it writes (:func:`_written`) and whether it wraps
    fresh data (``lift_fresh``): looked up by ``id``, as an op's own hash is Python code (the
    op is kept beside, so that an id reused by another op is never taken for it)."""
    info = _INFO.get(id(func))
    if info is None or info[0] is not func:
        name = func._schema.name
        info = _INFO[id(func)] = (func, name, *_written(func), name in _LIFTS)
    return info[1:]


_flows: dict[int, tuple[HostFlow, int]] = {}  # thread -> (its flow, how many users)
_hook = None
_flow_lock = threading.Lock()


def current() -> HostFlow | None:
    """The host flow this thread is inside, if any."""
    entry = _flows.get(threading.get_ident())
    return entry[0] if entry else None


def _optimizer_pre_hook(optimizer, args, kwargs) -> None:
    flow = current()
    if flow is not None:
        flow.note_optimizer(optimizer)


class tracked:
    """Context manager: this thread's ops followed by one :class:`HostFlow` (nested users
    share it), and the optimizers that step in it noted."""

    def __enter__(self) -> HostFlow:
        global _hook
        tid = threading.get_ident()
        with _flow_lock:
            if _hook is None:
                _hook = register_optimizer_step_pre_hook(
                    _optimizer_pre_hook)
            flow, users = _flows.get(tid, (None, 0))
            if flow is None:
                flow = HostFlow()
            _flows[tid] = (flow, users + 1)
        if users == 0:
            flow.__enter__()
        return flow

    def __exit__(self, *exc) -> None:
        global _hook
        tid = threading.get_ident()
        flow, users = _flows[tid]
        if users == 1:
            flow.__exit__(*exc)
        with _flow_lock:
            if users == 1:
                del _flows[tid]
            else:
                _flows[tid] = (flow, users - 1)
            if not _flows and _hook is not None:
                _hook.remove()
                _hook = None
