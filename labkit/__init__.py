"""labkit: a staged path from a naive Python PPO loop to a GPU-native pipeline.

The names a reader types are here, imported when first used (``import labkit`` stays light)::

    import labkit

    with labkit.Pipeline("fused_amp", labkit.RunConfig(n_envs=64)) as pipe:
        stats = pipe.iteration()  # one rollout and one PPO update

``Pipeline``, ``STAGES``, ``get_stage`` (the ladder), ``RunConfig`` (what a pipeline runs),
``train`` (a run with checkpoints), ``diagnose`` (the doctor), ``rehearse`` (a CUDA-graph
capture rehearsed on the CPU), ``SyncMeter`` (host reads, device apart from host-scalar) and
``watch`` (the doctor's meters around your own loop).
"""
from __future__ import annotations

from importlib import import_module

from .version import __version__

#: Each public name and the module that defines it.
_FACE = {"Pipeline": "labkit.stages", "STAGES": "labkit.stages", "get_stage": "labkit.stages",
         "RunConfig": "labkit.config", "train": "labkit.app.train",
         "diagnose": "labkit.doctor", "rehearse": "labkit.doctor.rehearsal",
         "SyncMeter": "labkit.measure.syncmeter", "watch": "labkit.doctor.watch"}

__all__ = ["__version__", *_FACE]


def __getattr__(name: str):
    """A public name, imported from its module when first used."""
    if name in _FACE:
        value = getattr(import_module(_FACE[name]), name)
        globals()[name] = value  # once imported, an attribute like any other
        return value
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FACE})
