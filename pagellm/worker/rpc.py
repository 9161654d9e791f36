"""``collective_rpc``'s call on one rank, shared by the in-process and per-rank executors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_method(targets: tuple[Any, ...], method: str | Callable[..., Any], args: tuple,
               kwargs: dict[str, Any] | None) -> Any:
    """``collective_rpc``'s call on one rank: a callable gets the ModelRunner (``targets[-1]``)
    first; a name is the first of ``targets`` (worker, then runner) that has that method."""
    kwargs = kwargs or {}
    if callable(method):
        return method(targets[-1], *args, **kwargs)
    for target in targets:
        fn = getattr(target, method, None)
        if callable(fn) and not method.startswith("_"):
            return fn(*args, **kwargs)
    raise AttributeError(f"collective_rpc: no worker or model runner method {method!r}")
