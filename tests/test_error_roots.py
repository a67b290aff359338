"""One root per package: every exception a package defines descends from its root, so a caller
(the CLI's one-line error, a handler that logs and goes on) names one class per package."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from actors.errors import ControllerError
from nodeagent.errors import AgentError
from runtime.errors import ActorSystemError
from wire.errors import WireError

ROOTS: dict[str, type[Exception]] = {
    "runtime": ActorSystemError,
    "wire": WireError,
    "actors": ControllerError,
    "nodeagent": AgentError,
}


def defined_errors(package: str) -> list[type[BaseException]]:
    """Every public exception class a module of `package` defines (private ones are a
    module's own control flow and never leave it)."""
    found = []
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if info.name.endswith(".__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found.append(value)
    return found


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_every_public_error_descends_from_its_packages_root(package: str) -> None:
    errors = defined_errors(package)
    assert errors, package
    assert [e.__qualname__ for e in errors if not issubclass(e, ROOTS[package])] == []


def test_the_roots_keep_their_reason() -> None:
    for root in (WireError, ControllerError, AgentError):
        assert root("a one-line reason").reason == "a one-line reason"
