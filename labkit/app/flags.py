"""The command line's flag types and shared flags: each value is checked as it is parsed, and a
bad one is argparse's one-line ``error: ... argument --flag: expected ..., got ...`` (exit 2),
before any work starts."""
from __future__ import annotations

import argparse
import math
import unicodedata


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an integer >= ``low`` (and <= ``high``: counts of work that a typo
    would turn into hours are bounded)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            expected = f"an integer >= {low}" if high is None else \
                f"an integer in [{low}, {high:,}]"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _default(cls: type, name: str) -> object:
    """The default of dataclass ``cls``'s field ``name``: a flag's help shows the config's
    own value, never a copy of it."""
    import dataclasses

    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def field_flag(p: argparse.ArgumentParser, cls: type, name: str, parse, *,
               default_note: str | None = None, **kwargs) -> None:
    """``--name`` for field ``name`` of config dataclass ``cls``: its help is the field's
    docstring and the config's default (or ``default_note``). The flag itself defaults to None:
    unset, the config's value (or a resumed run's, or a profile's) applies."""
    from ..config import field_docs

    note = default_note if default_note is not None else f"default: {_default(cls, name)}"
    text = f"{field_docs(cls)[name]} ({note})".replace("%", "%%")
    p.add_argument("--" + name.replace("_", "-"), type=parse, default=None, help=text, **kwargs)


def path(text: str) -> str:
    """A path flag's value: an empty or blank string is refused (it would mean "here"), and so
    is one with a control character (an escape sequence, a newline), which every line that
    names the path would send to the terminal."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    control = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        raise argparse.ArgumentTypeError(f"{text!r} holds the control character {control!r}: "
                                         "name a path without one")
    return text


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def stage_list(text: str) -> list:
    """Comma-separated stages, each once (a stage named twice runs once)."""
    from ..stages import get_stage

    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated stages ({choices()}), got {text!r}")
    return [get_stage(name) for name in dict.fromkeys(map(stage, parts))]


def run_id(text: str) -> str:
    """A record's run id (:func:`labkit.app.results.check_run_id`)."""
    from .results import check_run_id
    try:
        return check_run_id(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def choices() -> str:
    from ..stages import describe_choices
    return describe_choices()


def default_stage_note() -> str:
    """The default stage, said once, by the recorded ladders: on the CPU the one that finishes
    the default run first (set-up counted), on CUDA the fastest."""
    from ..stages import DEFAULT_STAGE, REFERENCE_STAGE
    each = ", ".join(f"{name} on {kind}" for kind, name in DEFAULT_STAGE.items())
    return (f"default, by the recorded ladders: {each} "
            f"({REFERENCE_STAGE} on a GPU without bf16)")


def stage(text: str) -> str:
    """A stage's index or name, as its name."""
    from ..stages import get_stage
    try:
        return get_stage(text).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")


def stage_flags(p: argparse.ArgumentParser, default: str, what: str, n_envs: int,
                n_steps: int) -> None:
    """--stage, --plant, --n-envs and --n-steps: the doctor's and the rehearsal's."""
    from ..doctor.plants import PLANT_NAMES

    p.add_argument("--stage", type=stage, default=default, help=f"{what} (default: %(default)s)")
    p.add_argument("--plant", default=None,
                   help=f"plant a regression first: {', '.join(PLANT_NAMES)}")
    p.add_argument("--n-envs", type=positive_int, default=n_envs, help="N (default: %(default)s)")
    p.add_argument("--n-steps", type=positive_int, default=n_steps,
                   help="T (default: %(default)s)")


def check_environment() -> None:
    """The environment variables labkit reads, each checked before a command starts (and so
    before any rendezvous): torchrun's, LABKIT_DEBUG and LABKIT_GIT_COMMIT."""
    from ..debug import check_environment
    from ..device import commit_from_env
    from ..distributed import current

    current()
    check_environment()
    commit_from_env()


def device_and_profile(args: argparse.Namespace) -> tuple:
    """The device, and the profile: the flag's, or the device's default."""
    from ..config import default_profile
    from ..device import resolve_device

    device = resolve_device(args.device)
    return device, args.profile or default_profile(device)
