"""Whether a block is being recomputed in the backward. A module that counts or records something
in its forward (the router's expert load) must do it once, not twice: it reads ``recomputing()``.
The technique that recomputes (``engine.memory``'s Swap Core) raises the flag around each
recompute, so that model code imports no technique."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0


def recomputing() -> bool:
    """True while a block is being recomputed in the backward."""
    return _depth > 0


def begin() -> None:
    global _depth
    _depth += 1


def end() -> None:
    global _depth
    _depth -= 1


@contextmanager
def flagged() -> Iterator[None]:
    """The flag raised for the body."""
    begin()
    try:
        yield
    finally:
        end()
