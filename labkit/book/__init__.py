"""What the chapters (the book) use to show things: labkit's own source and what changed
between stages (``show``), figures (``plots``) and the interactive controls (``widgets``)."""

import functools
from collections.abc import Callable
from typing import Any


def expects(what: str) -> Callable:
    """A chapter helper given empty or foreign input says so in one sentence, naming the helper,
    what it takes and what was missing, instead of an internal KeyError or IndexError."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except KeyError as err:
                raise ValueError(f"{fn.__name__} takes {what}; this one has no "
                                 f"{err.args[0]!r}") from None
            except (IndexError, TypeError, AttributeError) as err:
                got = type(args[0]).__name__ if args else "nothing"
                empty = " (empty)" if args and hasattr(args[0], "__len__") \
                    and not len(args[0]) else ""
                raise ValueError(f"{fn.__name__} takes {what}; got a {got}{empty} "
                                 f"({err})") from None
        return checked
    return wrap
