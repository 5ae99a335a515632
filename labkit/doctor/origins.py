"""Where the tensors a step keeps were made, read from the code that made them.

A CPU rehearsal cannot tell a host tensor from a device tensor by looking at it: on the CPU
every tensor is both. The capture's own tensors are followed as they are made
(:mod:`labkit.doctor.hostmade`), but a step's state is made before: a CPU step counter in a
closure (``t = torch.zeros((), device="cpu")``), a host buffer kept as a module's attribute
(``self.host = torch.zeros(3)`` in ``__init__``). :func:`host_state` finds that state the way a
reader would: for each tensor the step holds (its closure's variables, the attributes of the
module or object it is a method of, the globals it names), the last assignment to that name in
the source that defines it; a constructor there that names the CPU, or names no device and takes
no tensor to copy one from, made a host tensor. Parameters and buffers are left out (``.to``
moves them with their module), and so is anything whose source cannot be read or whose last
assignment is not a plain constructor call: those stay device tensors, the cautious side for a
false alarm.
"""
from __future__ import annotations

import ast
import collections
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..measure.hostflow import call_device, source_tree, unnamed_is_host

#: torch's calls that make a tensor from nothing or from Python data.
_MAKERS = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
           "randint", "linspace", "logspace", "eye", "scalar_tensor", "zeros_like",
           "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}


def host_state(fn: Callable) -> list[tuple[torch.Tensor, str]]:
    """(tensor, ``file:line (name)`` where it was made) for each tensor ``fn`` holds that was
    made on the host (see the module docstring)."""
    found: list[tuple[torch.Tensor, str]] = []
    for value, name, scope in _held(fn):
        if isinstance(value, dict):  # st = {"t": torch.zeros(())}: the entries made there
            found += _dict_on_host(value, scope, name)
        if isinstance(value, torch.optim.Optimizer):  # Adam(params, lr=torch.tensor(1e-3))
            found += _lr_on_host(value, scope, name)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        site = _made_on_host(scope, name)
        if site is not None:
            found.append((value, site))
    return found


def _dict_on_host(value: dict, scope: tuple, name: str) -> list[tuple[torch.Tensor, str]]:
    """The tensors of dict ``value`` that its literal, assigned to ``name``, made on the host."""
    assigned = _assignment(scope, name)
    if assigned is None or not isinstance(assigned[0].value, ast.Dict):
        return []
    from ..measure.syncmeter import short_path

    node, path, first = assigned
    found = []
    for key, made in zip(node.value.keys, node.value.values):
        held = value.get(key.value) if isinstance(key, ast.Constant) else None
        if isinstance(held, torch.Tensor) and _host_constructor(made, path, first):
            found.append((held, f"{short_path(path)}:{made.lineno} ({name}[{key.value!r}])"))
    return found


def _lr_on_host(optimizer: torch.optim.Optimizer, scope: tuple, name: str
                ) -> list[tuple[torch.Tensor, str]]:
    """The tensor learning rate of the optimizer assigned to ``name``, where the call that made
    it was given one made on the host: ``lr=torch.tensor(1e-3)``, or ``lr=lr`` (``self.lr``)
    with the name last assigned such a tensor in the same scope."""
    assigned = _assignment(scope, name)
    call = assigned[0].value if assigned is not None else None
    if not isinstance(call, ast.Call):
        return []
    node, path, first = assigned
    given = next((k.value for k in call.keywords if k.arg == "lr"),
                 call.args[1] if len(call.args) > 1 else None)
    if _host_constructor(given, path, first):
        from ..measure.syncmeter import short_path

        site = f"{short_path(path)}:{given.lineno} ({name}'s lr)"
    elif isinstance(given, ast.Name):
        site = _made_on_host(scope, given.id)
    elif isinstance(given, ast.Attribute) and isinstance(given.value, ast.Name) \
            and given.value.id == "self" and scope[0] == "class":
        site = _made_on_host(scope, given.attr)
    else:
        return []
    return [] if site is None else [(group["lr"], site) for group in optimizer.param_groups
                                    if isinstance(group.get("lr"), torch.Tensor)]


def python_state(fn: Callable) -> dict[str, Any]:
    """The Python values ``fn`` holds, by name: numbers and bools, and the numbers in and
    lengths of the dicts, lists and deques it holds (a step counter, a history), so that a
    change made by an eager call can be seen (a replay runs no Python)."""
    state: dict[str, Any] = {}
    for value, name, _ in _held(fn):
        if isinstance(value, (bool, int, float)):
            state[name] = value
        elif isinstance(value, dict):
            state[f"len({name})"] = len(value)
            for key, item in list(value.items())[:64]:
                if isinstance(item, (bool, int, float)):
                    state[f"{name}[{key!r}]"] = item
        elif isinstance(value, (list, collections.deque)):
            state[f"len({name})"] = len(value)
        elif _is_host_generator(value):  # a draw moves its state
            state[f"the state of {name}, a host random generator"] = _generator_state(value)
    return state


class _Held:
    """A host random generator that a step holds, and how to read its state."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state(self) -> int:
        return _generator_state(self.generator)


def held_generators(fn: Callable) -> list[_Held]:
    """The host random generators (Python's, NumPy's) that ``fn`` holds."""
    return [_Held(v) for v, _, _ in _held(fn) if _is_host_generator(v)]


def _is_host_generator(value: Any) -> bool:
    import random
    import sys

    numpy = sys.modules.get("numpy")
    kinds = (random.Random,) + ((numpy.random.Generator, numpy.random.RandomState)
                                if numpy is not None else ())
    return isinstance(value, kinds)


def _generator_state(value: Any) -> int:
    """A fingerprint of a host generator's state: it changes with every draw."""
    import random

    if isinstance(value, random.Random):
        return hash(value.getstate())
    state = value.bit_generator.state if hasattr(value, "bit_generator") else value.get_state()
    return hash(repr(state))


def _held(fn: Callable) -> Iterator[tuple[Any, str, Any]]:
    """(value, the name it is bound to, where that name is assigned) for what ``fn`` holds:
    its closure's variables (assigned in the enclosing function), its globals (in its
    module), and, for a method or a module, its object's plain attributes (in its class)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, torch.nn.Module):
        owner, fn = fn, type(fn).forward
    func = getattr(fn, "__func__", fn)
    func = getattr(func, "func", func)  # functools.partial
    func = inspect.unwrap(func) if callable(func) else func  # @torch.no_grad() and kin
    code = getattr(func, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                yield cell.cell_contents, name, ("closure", func)
            except ValueError:  # an empty cell
                continue
        module = inspect.getmodule(func)
        for name in code.co_names:
            if name in getattr(func, "__globals__", {}):
                yield func.__globals__[name], name, ("module", module)
    if owner is not None:
        skip = set(getattr(owner, "_parameters", {})) | set(getattr(owner, "_buffers", {}))
        for name, value in vars(owner).items():
            if name not in skip:
                yield value, name, ("class", type(owner))


def _made_on_host(scope: tuple, name: str) -> str | None:
    """Where ``name`` was last assigned a host tensor in ``scope``, or None."""
    found = _assignment(scope, name)
    if found is None:
        return None
    node, path, first = found
    if not _host_constructor(node.value, path, first):
        return None
    from ..measure.syncmeter import short_path

    return f"{short_path(path)}:{node.lineno} ({name})"


def disabled_scalers(fn: Callable) -> list[Any]:
    """The ``GradScaler``s ``fn`` holds that its code made with ``enabled=False``: torch also
    disables a CUDA scaler where CUDA is missing, so only the code says which a GPU runs."""
    found = []
    for value, name, scope in _held(fn):
        if isinstance(value, torch.amp.GradScaler):
            made = _assignment(scope, name)
            call = made[0].value if made is not None else None
            if isinstance(call, ast.Call) and any(
                    k.arg == "enabled" and isinstance(k.value, ast.Constant)
                    and k.value.value is False for k in call.keywords):
                found.append(value)
    return found


def _assignment(scope: tuple, name: str) -> tuple[ast.stmt, str, int] | None:
    """(the last assignment to ``name`` in ``scope``'s source, its file, the first line of the
    function it is in, 0 for a class or a module), or None where the source cannot say. Line
    numbers are the file's: the source is parsed once per file (``source_tree``)."""
    kind, holder = scope
    try:
        path = inspect.getsourcefile(holder if kind != "closure" else holder.__code__)
    except TypeError:
        return None
    tree = source_tree(path) if path else None
    if tree is None:
        return None
    if kind == "closure":
        body, first = _enclosing(tree, holder.__code__.co_firstlineno)
    elif kind == "class":
        body, first = _class_node(tree, holder.__qualname__), 0
    else:
        body, first = tree, 0
    last = _last_assignments(body, kind).get(name) if body is not None else None
    return None if last is None else (last, path, first)


_ASSIGNED: dict[tuple[int, str], tuple[ast.AST, dict[str, ast.stmt]]] = {}


def _last_assignments(body: ast.AST, kind: str) -> dict[str, ast.stmt]:
    """The last assignment to each name in ``body`` (a module's own names only; a class's
    ``self.`` attributes), once per body: a rehearsal asks for every name a step holds. A class
    that rebinds attributes by name (``setattr``, a hand-written ``.to()``) has none: its source
    cannot say."""
    kept = _ASSIGNED.get((id(body), kind))
    if kept is not None and kept[0] is body:
        return kept[1]
    last: dict[str, ast.stmt] = {}
    nodes = body.body if kind == "module" else ast.walk(body)
    for node in nodes:
        if kind == "class" and isinstance(node, ast.Call) and \
                getattr(node.func, "id", None) == "setattr":
            last = {}
            break
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        for target in targets:
            assigned = target.attr if kind == "class" and isinstance(target, ast.Attribute) \
                and isinstance(target.value, ast.Name) and target.value.id == "self" else (
                target.id if kind != "class" and isinstance(target, ast.Name) else None)
            if assigned is not None and (assigned not in last
                                         or node.lineno > last[assigned].lineno):
                last[assigned] = node
    _ASSIGNED[(id(body), kind)] = (body, last)
    return last


_FUNCTIONS: dict[int, tuple[ast.Module, list]] = {}


def _enclosing(tree: ast.Module, line: int) -> tuple[ast.AST | None, int]:
    """The innermost function of ``tree`` around ``line`` (where a closure was defined), and
    its first line."""
    kept = _FUNCTIONS.get(id(tree))
    if kept is None or kept[0] is not tree:
        kept = _FUNCTIONS[id(tree)] = (tree, [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))])
    best = None
    for node in kept[1]:
        if node.lineno < line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno > best.lineno:
                best = node
    return best, (best.lineno if best is not None else 0)


_CLASSES: dict[int, tuple[ast.Module, dict[str, ast.ClassDef]]] = {}


def _class_node(tree: ast.Module, qualname: str) -> ast.ClassDef | None:
    """The class statement of ``tree`` whose qualified name is ``qualname`` (``Outer.Inner``,
    ``make.<locals>.Net``), as :func:`inspect.findsource` finds it; indexed once per tree."""
    kept = _CLASSES.get(id(tree))
    if kept is None or kept[0] is not tree:
        kept = _CLASSES[id(tree)] = (tree, dict(_classes(tree, "")))
    return kept[1].get(qualname)


def _classes(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.ClassDef]]:
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.stmt, ast.excepthandler)):
            continue
        if isinstance(child, ast.ClassDef):
            yield prefix + child.name, child
            yield from _classes(child, f"{prefix}{child.name}.")
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _classes(child, f"{prefix}{child.name}.<locals>.")
        else:
            yield from _classes(child, prefix)


def _host_constructor(node: ast.expr | None, path: str, first: int) -> bool:
    """A call of a tensor maker (in the function starting at line ``first`` of ``path``) that
    names the CPU (:func:`labkit.measure.hostflow.call_device`), or no device and no tensor to
    take one from."""
    if not isinstance(node, ast.Call):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else \
        getattr(node.func, "id", None)
    if name not in _MAKERS:
        return False
    said = call_device(node, path, first)
    if said != "none":
        return said == "cpu"
    if name.endswith("_like"):
        return False  # on its input's device
    if not unnamed_is_host():  # a default device is in force: it takes the tensor
        return False
    if name in ("tensor", "as_tensor"):  # from data, which could be a tensor on a device
        return all(isinstance(a, (ast.Constant, ast.Tuple, ast.List, ast.UnaryOp, ast.BinOp))
                   for a in node.args[:1])
    return True  # sizes and values: the default device, the CPU
