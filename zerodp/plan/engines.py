"""How plan/ builds the engines it simulates and measures without importing the package above it.

plan/ sits between the runtime and `zerodp.initialize` (zerodp/api.py): api imports the preflight and the
OOM doctor from here, so plan/ may not import api back. Whatever builds an engine in plan/ (a simulated
step, a measured one) takes an `initialize` argument, DeepSpeed's signature; left out, it is the factory
zerodp/api.py provides when it is imported, which is always before any of plan/ runs (importing
`zerodp.plan.X` imports the package `zerodp`, which imports api).
"""

from __future__ import annotations

from typing import Any, Callable

EngineFactory = Callable[..., tuple]
"""`initialize(model=..., config=...) -> (engine, optimizer, dataloader, lr_scheduler)`."""

_provided: list[EngineFactory] = []  # the factory zerodp/api.py provides at import


def provide(factory: EngineFactory) -> None:
    """Make `factory` the engine factory plan/ uses when its caller names none (zerodp/api.py calls this)."""
    _provided[:] = [factory]


def engine_factory(given: EngineFactory | None = None) -> EngineFactory:
    """`given`, or the provided factory."""
    if given is not None:
        return given
    if not _provided:
        raise AssertionError("no engine factory was provided: zerodp/api.py provides one when it is imported")
    return _provided[0]


def build_engine(initialize: EngineFactory | None, **kwargs: Any) -> Any:
    """The engine `initialize` (or the provided factory) builds from `kwargs`."""
    engine, *_ = engine_factory(initialize)(**kwargs)
    return engine
