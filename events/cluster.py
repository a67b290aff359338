"""Events in a cluster's stream (`cluster/<name>`) and the spec they carry."""

from __future__ import annotations

import msgspec

from .replica import Candidate


class GpuRequirement(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    models: tuple[str, ...] = ()  # accepted GPU models; empty accepts any
    min_vram_mib: int = 0
    count: int = 1  # GPUs per replica


class RolloutPolicy(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a new revision replaces the replicas of older ones (a spec's `[rollout]` section)."""

    max_surge: int = 1  # replicas of the new revision beyond `replicas` while it rolls out
    max_unavailable: int = 0  # ready replicas the rollout may take below `replicas`


class ShardingSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A model's memory and the parallelism allowed, so the controller can work out the GPUs
    (a spec's `[sharding]` section; `model` is already the served name). docs/sharding.md has
    the formulas. Added after v1 was written: a spec without it decodes with None."""

    weights_gib: float = 0.0  # the weights' size; or params_b and precision
    params_b: float = 0.0  # parameters, in billions
    precision: str = ""  # fp32, fp16, bf16, fp8, int8, q8, int4, q4, nf4
    layers: int = 0  # transformer blocks; required when pipeline is allowed
    kv_cache_gib: float = 0.0  # the KV-cache budget; or the three fields below
    context_tokens: int = 0
    concurrent_sequences: int = 0
    kv_bytes_per_token: int = 0
    parallelism: tuple[str, ...] = ("tensor",)  # allowed: "tensor" (within a node), "pipeline"
    max_token_latency_ms: float = 0.0  # 0: no bound
    hidden_size: int = 0  # activation width crossing a pipeline boundary; 0: 8192
    link_gbps: float = 1.0  # assumed link bandwidth between nodes, Gbit/s
    link_rtt_ms: float = 1.0  # assumed round trip between nodes
    # How the workers (ranks >= 1) of a pipeline run: their command ("" runs the spec's own,
    # with the stage placeholders of docs/sharding.md) and how the agent knows one is up:
    # "tcp" (its {port} accepts connections: llama.cpp's ggml-rpc-server), "http" (the spec's
    # readiness path answers 200) or "none" (running for a second). The head (rank 0) runs the
    # spec's command and serves the API.
    worker_command: str = ""
    worker_probe: str = "tcp"
    # A pipeline's stages in one region (False, the default: a token crosses every stage
    # boundary, and links between regions are the slow ones) or across regions.
    cross_region: bool = False
    # How the head reaches its workers: "direct" (node to node, at the agents' addresses) or
    # "overlay" (carried over NATS by the agents: TLS and the nodes' own identities, for
    # engines whose link has no security of its own and nodes that take no inbound
    # connections; the plan counts its cost, docs/sharding.md).
    stage_links: str = "direct"


class ProbeSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the agent probes a replica (a spec's `[probes]` section). Every field is optional:
    unset (None), a path falls back as noted and a number to the agent's own setting
    (nodeagent/workload/probing.py ProbeSettings: 300 s, 2 s, 3 and 2 s unless the agent says
    otherwise). Added after v1 was written: older logs decode with every field unset, which
    probes as they always did (readiness and liveness on `health_path`)."""

    readiness_path: str | None = None  # None: the spec's health_path
    readiness_timeout_s: float | None = None  # how long a starting replica may take to be ready
    liveness_path: str | None = None  # None: the readiness path
    liveness_interval_s: float | None = None  # between liveness probes once ready
    liveness_failures: int | None = None  # failed probes in a row that end the workload
    liveness_timeout_s: float | None = None  # per liveness probe
    # "http" (None: the default), "tcp" (the port accepts a connection) or "none" (running for
    # a second is ready; liveness is the process staying up). Added with pipeline stages: set by
    # the agent for a worker stage from `sharding.worker_probe`.
    kind: str | None = None


class DockerOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the docker driver runs the spec's image (a spec's `[docker]` section): what the
    engines' own docs ask of `docker run` (vLLM and SGLang share tensors between their worker
    processes through /dev/shm, which docker caps at 64 MB unless told), and the model caches
    mounted into the container. Added after v1: older logs decode with the defaults, which run
    as they always did. The process driver ignores it."""

    ipc: str = ""  # "host": the host's IPC namespace (the engines' advice); "": docker's own
    shm_size: str = ""  # /dev/shm's size, docker's syntax ("16g"); "": docker's 64 MB
    volumes: tuple[str, ...] = ()  # `docker run -v` values: "/host/dir:/container/dir[:ro]"
    pull: str = "missing"  # "missing": pull when not on the node; "always"; "never"
    # Pull the image on every node that could host a replica as soon as the spec is recorded,
    # before any placement there (actors/controller.py prepull): a replica placed later starts
    # without the pull, and placement prefers nodes that have it.
    prepull: bool = False


class AutoscaleSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the leader's autoscaler sizes the cluster from the gateways' load reports (a spec's
    `[autoscale]` section; actors/autoscaler.py, docs/autoscaling.md). Absent: the replica count
    changes only by hand (`cluster scale`), as it always did.

    Wanted replicas are the in-flight and held requests of every gateway over
    `target_in_flight`, rounded up, kept within `min`..`max`. A change is made only when every
    evaluation for a window has wanted it (`up_window_s` to grow, `down_window_s` to shrink),
    counted from the last change: so no decision is reversed within its window. With `min = 0`
    the cluster goes to zero replicas after `scale_to_zero_after_s` without a request, and a
    request that arrives then is held by the gateway (up to `cold_start_timeout_s`) while one
    replica starts: the hold itself scales it up, at once."""

    min_replicas: int = msgspec.field(default=1, name="min")
    max_replicas: int = msgspec.field(default=4, name="max")
    target_in_flight: float = 2.0  # requests in flight (or held) per replica, as Ray Serve's
    up_window_s: float = 10.0
    down_window_s: float = 300.0
    scale_to_zero_after_s: float = 300.0  # with min = 0: idle this long, then zero replicas
    cold_start_timeout_s: float = 120.0  # how long a gateway holds a request for a cold start


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a user declares: what to run, on which GPUs, how many replicas."""

    name: str
    replicas: int = 1
    gpu: GpuRequirement = GpuRequirement()
    command: str = ""  # with {port}, {gpu_ids} and {model} substituted
    image: str = ""
    model: str = ""  # the model name clients send; defaults to the cluster name
    env: dict[str, str] = {}
    port: int = 0  # 0: the agent picks a free port
    health_path: str = "/health"
    preferred_region: str = ""  # a ranking preference among the nodes that pass the filters
    labels: dict[str, str] = {}  # node labels a placement requires
    # Regions a replica may be placed in (a hard filter); empty allows any. Added after v1 was
    # written, so older logs decode with the default and mean what they meant: anywhere.
    regions: tuple[str, ...] = ()
    # How a change of this spec rolls out. Added after v1 was written: older logs decode with
    # the default (one extra replica at a time, none taken away before its replacement is ready).
    rollout: RolloutPolicy = RolloutPolicy()
    # The model's memory, for `cluster plan` (actors/sharding.py). Added after v1: older logs
    # decode with None, and a spec without it asks for `gpu.count` GPUs as it always did.
    sharding: ShardingSpec | None = None
    # Readiness and liveness paths, timeouts and patience (the `[probes]` section). Added after
    # v1: older logs decode with every field unset and are probed as they always were.
    probes: ProbeSpec = ProbeSpec()
    # Sizing from load (the `[autoscale]` section). Added after v1: older logs decode with None,
    # which scales by hand only.
    autoscale: AutoscaleSpec | None = None
    # Environment variables whose values are secret (docs/security.md, Secrets). In a stored
    # or sent spec each value is a reference, never the value: `secret:sha256:<hex>` (the value
    # is in the controller's secret store, keyed by that digest, and reaches the node sealed to
    # its key) or `file:/path` (read by the agent on the node at start). The value a user
    # writes inline is replaced by its reference before anything is recorded. Added after v1:
    # older logs decode with none.
    secret_env: dict[str, str] = {}
    # Options of `docker run` (the `[docker]` section). Added after v1: older logs decode with
    # the defaults.
    docker: DockerOptions = DockerOptions()
    # What the engine loads, as a node's model cache names it (a Hugging Face repo id, or a file
    # or directory in the cache: nodeagent/model_cache.py): placement prefers a node that holds
    # it. Added after v1: older logs decode with "", which prefers none.
    model_files: str = ""


class ClusterCreated(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.created.v1"
):
    spec: ClusterSpec


class ClusterSpecChanged(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.spec_changed.v1"
):
    """A new revision of the cluster's spec (`cluster apply`, `cluster rollback`, or an automatic
    rollback): the whole spec, its revision number and why. Creating a cluster is revision 1.

    `revision`, `reason` and `rollback_to` were added after the tag was defined (nothing wrote
    it then); a row without `revision` is the revision after the one before it."""

    spec: ClusterSpec
    revision: int = 0
    reason: str = ""  # "applied", "rollback to revision 2", "automatic rollback ...: why"
    rollback_to: int = 0  # the earlier revision whose spec this one restores; 0: none


class ClusterRolledOut(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.rolled_out.v1"
):
    """Every replica the cluster wants runs `revision` and is ready: the revision an automatic
    rollback returns to."""

    name: str
    revision: int


class AutoscaleInputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the autoscaler saw when it decided: the gateways' reports combined."""

    gateways: int = 0  # gateways whose report was current
    in_flight: int = 0  # requests being served, summed over gateways
    held: int = 0  # requests held for a replica (a cluster at zero, or none ready)
    requests_per_s: float = 0.0
    ttft_p50_ms: float = 0.0  # the slowest gateway's median time to first byte
    wanted: int = 0  # the replicas those figures ask for, within min..max
    window_s: float = 0.0  # how long every evaluation wanted the change (0: at once)
    idle_s: float = 0.0  # how long the cluster had no request (a scale to zero)


class ClusterScaled(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.scaled.v1"
):
    """The cluster's replica count changed. `cause` and `inputs` were added after v1: older
    logs (and `cluster scale` by hand) decode with "" and None."""

    name: str
    replicas: int
    previous: int = 0
    cause: str = ""  # "" by hand; "autoscale: ..." with the reason in words
    inputs: AutoscaleInputs | None = None


class ClusterCanaryStarted(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.canary_started.v1"
):
    """`cluster canary`: a new spec serves beside the cluster's own as the cluster `canary`
    (created with it, in its own stream), and gateways send it `weight` percent of the
    cluster's requests. Ends with `cluster.canary_ended.v1`."""

    name: str
    canary: str  # the canary's cluster: `<name>-canary`
    weight: int  # percent of the cluster's requests, 1..99


class ClusterCanaryEnded(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.canary_ended.v1"
):
    """The canary is over: `promoted` (its spec is recorded as the cluster's next revision,
    which rolls out as `cluster apply` does) or `aborted`; its cluster is deleted either way."""

    name: str
    canary: str
    outcome: str  # "promoted" or "aborted"
    reason: str = ""


class ClusterDeleted(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.deleted.v1"
):
    name: str


class ClusterUnschedulable(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.unschedulable.v1"
):
    """The scheduler found no node for a replica the cluster wants: the decision and why."""

    name: str
    missing: int  # replicas wanted but not placed
    reason: str
    candidates: tuple[Candidate, ...] = ()
