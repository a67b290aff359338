"""Cluster specs from TOML, validated so a bad spec names the field and the problem."""

from __future__ import annotations

import tomllib
from typing import Any

import msgspec

from events import ClusterSpec
from events.ids import valid_id

from .errors import ControllerError


class SpecError(ControllerError, ValueError):
    """A cluster spec the controller will not take; one line: `field: problem`."""


def parse_toml(text: str, *, source: str = "spec") -> ClusterSpec:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    return from_mapping(raw)


def from_mapping(raw: Any) -> ClusterSpec:
    if isinstance(raw, dict) and isinstance(raw.get("gpu"), dict):
        gpu = dict(raw["gpu"])
        if isinstance(gpu.get("models"), list):
            gpu["models"] = tuple(gpu["models"])
        raw = {**raw, "gpu": gpu}
    if isinstance(raw, dict) and isinstance(raw.get("regions"), list):
        raw = {**raw, "regions": tuple(raw["regions"])}
    try:
        spec = msgspec.convert(raw, ClusterSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise SpecError(_field_message(str(exc))) from None
    validate(spec)
    return spec


def validate(spec: ClusterSpec) -> None:
    problems = [
        ("name", not valid_id(spec.name), "use 1-128 of [A-Za-z0-9_-]"),
        ("replicas", not 0 <= spec.replicas <= 1000, f"must be 0..1000, got {spec.replicas}"),
        ("gpu.count", not 1 <= spec.gpu.count <= 16, f"must be 1..16, got {spec.gpu.count}"),
        ("gpu.min_vram_mib", spec.gpu.min_vram_mib < 0, "must not be negative"),
        ("port", not 0 <= spec.port <= 65535, f"must be 0..65535, got {spec.port}"),
        ("command", not spec.command and not spec.image, "give a command or an image"),
        ("health_path", not spec.health_path.startswith("/"), "must start with /"),
        ("rollout.max_surge", spec.rollout.max_surge < 0, "must not be negative"),
        ("rollout.max_unavailable", spec.rollout.max_unavailable < 0, "must not be negative"),
        (
            "rollout",
            spec.rollout.max_surge == 0 and spec.rollout.max_unavailable == 0,
            "max_surge and max_unavailable cannot both be 0 (nothing could be replaced)",
        ),
    ]
    for field_name, bad, why in problems:
        if bad:
            raise SpecError(f"{field_name}: {why}")
    _validate_regions(spec.regions)


def _validate_regions(regions: tuple[str, ...]) -> None:
    # A blank or repeated entry is a typo, not a constraint: it would silently match nothing or
    # say the same twice, and the operator would only find out when nothing is placed.
    seen: set[str] = set()
    for region in regions:
        if not region.strip():
            raise SpecError("regions: entries must be non-empty region names")
        if region in seen:
            raise SpecError(f"regions: {region!r} is listed twice")
        seen.add(region)


def _field_message(text: str) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.gpu.count`": lead with the field.
    message, sep, where = text.partition(" - at `$.")
    if sep:
        return f"{where.rstrip('`')}: {message}"
    return message
