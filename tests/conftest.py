from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, settings

import gpumesh.cli

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("deep", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True)
def _reset_structlog(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    structlog.reset_defaults()
    # A test that runs `gpumesh.cli.main` in this process configures logging as the command
    # does, with loggers cached on first use: a module-level logger (gpumesh.nats, say) would
    # then keep that configuration for every later test, and structlog.testing.capture_logs()
    # would see nothing from it. The same configuration, never cached.
    real = gpumesh.cli.configure_logging

    def configure_uncached(**kwargs: Any) -> None:
        real(**kwargs)
        structlog.configure(cache_logger_on_first_use=False)

    monkeypatch.setattr(gpumesh.cli, "configure_logging", configure_uncached)
    yield
    structlog.reset_defaults()


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
