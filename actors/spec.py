"""Cluster specs from TOML, validated so a bad spec names the field and the problem."""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any

import msgspec

from events import AutoscaleSpec, ClusterSpec, DockerOptions, ProbeSpec, ShardingSpec
from events.ids import valid_id
from events.secret_store import FILE_PREFIX, SECRET_PREFIX, is_file, is_reference

from .errors import ControllerError
from .sharding import BYTES_PER_PARAM, PARALLELISM


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
    if isinstance(raw, dict) and isinstance(raw.get("docker"), dict):
        docker = dict(raw["docker"])
        if isinstance(docker.get("volumes"), list):
            docker["volumes"] = tuple(docker["volumes"])
        raw = {**raw, "docker": docker}
    if isinstance(raw, dict) and isinstance(raw.get("regions"), list):
        raw = {**raw, "regions": tuple(raw["regions"])}
    if isinstance(raw, dict) and isinstance(raw.get("sharding"), dict):
        sharding = dict(raw["sharding"])
        if isinstance(sharding.get("parallelism"), list):
            sharding["parallelism"] = tuple(sharding["parallelism"])
        raw = {**raw, "sharding": sharding}
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
    _validate_secret_env(spec)
    if spec.sharding is not None:
        validate_sharding(spec.sharding)
    _validate_probes(spec.probes)
    _validate_docker(spec.docker)
    if spec.model_files and (
        not _MODEL_FILES.fullmatch(spec.model_files) or ".." in spec.model_files.split("/")
    ):
        raise SpecError(
            f"model_files: {spec.model_files[:80]!r} is not a repo id (ORG/NAME) or a file name "
            "in a model cache"
        )
    if spec.autoscale is not None:
        validate_autoscale(spec.autoscale)


def validate_autoscale(a: AutoscaleSpec) -> None:
    """The `[autoscale]` section: bounds that cannot hold, or windows that are not times."""
    if not 0 <= a.min_replicas <= 1000:
        raise SpecError(f"autoscale.min: must be 0..1000, got {a.min_replicas}")
    if not 1 <= a.max_replicas <= 1000:
        raise SpecError(f"autoscale.max: must be 1..1000, got {a.max_replicas}")
    if a.min_replicas > a.max_replicas:
        raise SpecError(
            f"autoscale.min: must not exceed autoscale.max ({a.min_replicas} > {a.max_replicas})"
        )
    if not (math.isfinite(a.target_in_flight) and a.target_in_flight > 0):
        raise SpecError(f"autoscale.target_in_flight: must be > 0, got {a.target_in_flight}")
    for name in ("up_window_s", "down_window_s"):
        value = getattr(a, name)
        if not (math.isfinite(value) and 0 <= value <= 86_400):
            raise SpecError(f"autoscale.{name}: must be 0..86400 seconds, got {value}")
    for name in ("scale_to_zero_after_s", "cold_start_timeout_s"):
        value = getattr(a, name)
        if not (math.isfinite(value) and 0 < value <= 86_400):
            raise SpecError(f"autoscale.{name}: must be > 0 and at most 86400 seconds, got {value}")


# A Hugging Face repo id or a file or directory name in a node's model cache.
_MODEL_FILES = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?")
DOCKER_IPC = ("", "host", "private", "shareable")
DOCKER_PULL = ("missing", "always", "never")
# docker's own size syntax (go-units RAMInBytes): 16g, 512m, 1.5g, 16gb, 16GiB.
_SHM_SIZE = re.compile(r"[0-9]+(\.[0-9]+)? ?[kKmMgGtTpP]?[iI]?[bB]?")
# A host path (or a named volume), an absolute path in the container, and optionally ro/rw.
# `{model_cache}` is the node's model cache directory, filled in by its agent.
_VOLUME = re.compile(
    r"(/[^:\0]*|\{model_cache\}[^:\0]*|[A-Za-z0-9][A-Za-z0-9_.-]*):(/[^:\0]*)"
    r"(:(ro|rw|z|Z)(,(ro|rw|z|Z))*)?"
)


def _validate_docker(d: DockerOptions) -> None:
    """The `[docker]` section: values `docker run` would refuse, refused here with the field."""
    if d.ipc not in DOCKER_IPC:
        raise SpecError(f"docker.ipc: {d.ipc!r} is not one of host, private, shareable")
    if d.shm_size and (
        not _SHM_SIZE.fullmatch(d.shm_size) or float(re.sub(r"[^0-9.]", "", d.shm_size)) == 0
    ):
        raise SpecError(f"docker.shm_size: {d.shm_size!r} is not a size such as 16g or 512m")
    if d.pull not in DOCKER_PULL:
        raise SpecError(f"docker.pull: {d.pull!r} is not one of missing, always, never")
    for i, volume in enumerate(d.volumes):
        if not _VOLUME.fullmatch(volume):
            raise SpecError(
                f"docker.volumes[{i}]: {volume!r} is not HOST:CONTAINER[:ro|rw] with an "
                "absolute container path"
            )


def _validate_probes(p: ProbeSpec) -> None:
    """The `[probes]` section: unset fields are the defaults; set ones must make sense."""
    for name in ("readiness_path", "liveness_path"):
        path = getattr(p, name)
        if path is not None and not path.startswith("/"):
            raise SpecError(f"probes.{name}: must start with /, got {path!r}")
    for name in ("readiness_timeout_s", "liveness_interval_s", "liveness_timeout_s"):
        value = getattr(p, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise SpecError(f"probes.{name}: must be a finite number > 0, got {value}")
    if p.liveness_failures is not None and p.liveness_failures < 1:
        raise SpecError(f"probes.liveness_failures: must be at least 1, got {p.liveness_failures}")
    if p.kind is not None and p.kind not in PROBE_KINDS:
        raise SpecError(f"probes.kind: {p.kind!r} is not one of {', '.join(PROBE_KINDS)}")


def validate_sharding(s: ShardingSpec) -> None:
    """The `[sharding]` section: one line naming the field, as for the rest of the spec."""
    for name in ("weights_gib", "params_b", "kv_cache_gib", "max_token_latency_ms"):
        value = getattr(s, name)
        if not math.isfinite(value) or value < 0:
            raise SpecError(f"sharding.{name}: must be a finite number >= 0, got {value}")
    for name in ("layers", "context_tokens", "concurrent_sequences", "kv_bytes_per_token"):
        if getattr(s, name) < 0:
            raise SpecError(f"sharding.{name}: must not be negative, got {getattr(s, name)}")
    if not math.isfinite(s.link_gbps) or s.link_gbps <= 0:
        raise SpecError(f"sharding.link_gbps: must be > 0, got {s.link_gbps}")
    if not math.isfinite(s.link_rtt_ms) or s.link_rtt_ms < 0:
        raise SpecError(f"sharding.link_rtt_ms: must be a finite number >= 0, got {s.link_rtt_ms}")
    if s.hidden_size < 0:
        raise SpecError(f"sharding.hidden_size: must not be negative, got {s.hidden_size}")
    if s.precision and s.precision not in BYTES_PER_PARAM:
        known = ", ".join(BYTES_PER_PARAM)
        raise SpecError(f"sharding.precision: {s.precision!r} is not one of {known}")
    by_params = s.params_b > 0 or bool(s.precision)
    if s.weights_gib > 0 and by_params:
        raise SpecError(
            "sharding.weights_gib: give weights_gib, or params_b and precision, not both"
        )
    if s.weights_gib == 0 and not (s.params_b > 0 and s.precision):
        missing = "precision" if s.params_b > 0 else "params_b"
        if not by_params:
            raise SpecError("sharding.weights_gib: give weights_gib, or params_b and precision")
        raise SpecError(f"sharding.{missing}: params_b needs a precision and precision a params_b")
    per_token = (s.context_tokens, s.concurrent_sequences, s.kv_bytes_per_token)
    if any(per_token):
        if s.kv_cache_gib > 0:
            raise SpecError(
                "sharding.kv_cache_gib: give kv_cache_gib, or context_tokens, "
                "concurrent_sequences and kv_bytes_per_token, not both"
            )
        names = ("context_tokens", "concurrent_sequences", "kv_bytes_per_token")
        for name, value in zip(names, per_token, strict=True):
            if value == 0:
                raise SpecError(f"sharding.{name}: required with the other KV-cache figures")
    seen: list[str] = []
    for way in s.parallelism:
        if way not in PARALLELISM:
            raise SpecError(f"sharding.parallelism: {way!r} is not one of tensor, pipeline")
        if way in seen:
            raise SpecError(f"sharding.parallelism: {way!r} is listed twice")
        seen.append(way)
    if "pipeline" in s.parallelism and s.layers == 0:
        raise SpecError("sharding.layers: required when parallelism allows pipeline")
    if s.stage_links not in ("direct", "overlay"):
        raise SpecError(f"sharding.stage_links: {s.stage_links!r} is not one of direct, overlay")
    if s.worker_probe not in PROBE_KINDS:
        raise SpecError(
            f"sharding.worker_probe: {s.worker_probe!r} is not one of {', '.join(PROBE_KINDS)}"
        )


PROBE_KINDS = ("http", "tcp", "none")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _validate_secret_env(spec: ClusterSpec) -> None:
    """`secret_env`: variable names, not also in `env`; a value, a `secret:sha256:`
    reference or `file:` and an absolute path on the node. Never quotes a value."""
    for name, value in spec.secret_env.items():
        if not _ENV_NAME.match(name):
            raise SpecError(f"secret_env.{name}: not an environment variable name")
        if name in spec.env:
            raise SpecError(f"secret_env.{name}: also in env (give it in one of them)")
        if not value:
            raise SpecError(f"secret_env.{name}: empty")
        if is_file(value) and not value.removeprefix(FILE_PREFIX).startswith("/"):
            raise SpecError(f"secret_env.{name}: a file reference needs an absolute path")
        if value.startswith(SECRET_PREFIX) and not is_reference(value):
            raise SpecError(f"secret_env.{name}: a secret reference is secret:sha256:<64 hex>")


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
