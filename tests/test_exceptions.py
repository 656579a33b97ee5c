"""Every exception zerodp raises survives pickling: a process pool (DeepSpeed's test harness,
concurrent.futures, torch.multiprocessing) sends a worker's exception to the parent by pickle, and an
exception that cannot be rebuilt there kills the pool's result thread, so the parent waits forever."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import zerodp

_SKIP = ("zerodp.__main__", "zerodp.cli.__main__")


def _zerodp_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(zerodp.__path__, "zerodp."):
        if info.name in _SKIP:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


def _sample(parameter: inspect.Parameter) -> object:
    """A value of the parameter's annotated type (annotations are strings: `from __future__`)."""
    annotation = str(parameter.annotation)
    if annotation.startswith("int"):
        return 3
    if annotation.startswith("dict"):
        return {}
    if annotation.startswith("list"):
        return ["a problem"]
    return f"a {parameter.name}"


def _instance(cls: type[BaseException]) -> BaseException:
    parameters = [p for p in inspect.signature(cls.__init__).parameters.values()
                  if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return cls("a message")
    return cls(*(_sample(p) for p in parameters))


EXCEPTIONS = _zerodp_exceptions()


def test_the_walk_finds_the_exceptions_users_meet() -> None:
    names = {cls.__name__ for cls in EXCEPTIONS}
    assert {"ConfigError", "CheckpointError", "PeerFailed", "OutOfMemoryDiagnosed", "SchedulerParamsError"} <= names


# OutOfMemoryDiagnosed's one argument is the doctor's report, which its message is formatted from
_OOM_REPORT = {"phase": "backward", "rank": 1, "world_size": 2, "error": "CUDA out of memory", "held": {},
               "beyond_model_states_bytes": 10**9, "dominant": "activations", "remedies": []}


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda cls: cls.__name__)
def test_an_exception_pickles_back_to_the_same_type_and_message(cls: type[BaseException]) -> None:
    error = cls(_OOM_REPORT) if cls.__name__ == "OutOfMemoryDiagnosed" else _instance(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
