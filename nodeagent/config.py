"""The agent's settings: who the node is, and how patient it is with workloads and the bus."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from events.ids import valid_id


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart a replica that exits on its own after `backoff_s`, doubling per recent failure;
    more than `max_restarts` failures within `window_s` is a crash loop: the replica is
    reported failed, so the controller places it elsewhere."""

    max_restarts: int = 3
    window_s: float = 60.0
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_s <= backoff_max_s")

    def backoff(self, failures: int) -> float:
        """Seconds before the restart that follows the `failures`-th failure in the window."""
        exponent = min(max(failures - 1, 0), 64)  # keeps the float finite on long streaks
        return min(self.backoff_max_s, self.backoff_s * 2.0**exponent)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_id: str
    hostname: str = ""
    address: str = "127.0.0.1"  # the host where this node's workloads are reachable
    region: str = ""
    zone: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    price_per_hour: float = 0.0
    heartbeat_interval: float = 1.0  # until the controller's RegisterReply says otherwise
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    stop_grace_s: float = 10.0  # SIGTERM to SIGKILL, on shutdown and after a failed probe
    # On SIGTERM: tell the controller this node is leaving and serve up to this long while its
    # replicas are replaced elsewhere (a spot preemption's notice); 0: stop at once.
    leave_grace_s: float = 0.0
    register_timeout_s: float = 2.0
    register_backoff_s: float = 0.5
    register_backoff_max_s: float = 10.0
    agent_version: str = ""
    # Advertise replicas behind the node's own HTTP front (nodeagent/fencing_front.py), which serves
    # a replica only while the controller's lease covers it: the direct transport's fence.
    direct_front: bool = False
    front_port: int = 0  # 0: any free port
    # The node's model cache directory (nodeagent/model_cache.py): listed for placement, and
    # `{model_cache}` in a spec's command and docker volumes; "": none.
    model_cache: str = ""

    def __post_init__(self) -> None:
        if not valid_id(self.node_id):
            raise ValueError(
                f"invalid node id {self.node_id!r}: use 1-128 of [A-Za-z0-9_-] "
                "(it becomes a NATS subject token)"
            )
        if not (math.isfinite(self.heartbeat_interval) and self.heartbeat_interval > 0):
            raise ValueError(f"heartbeat interval must be > 0 s, got {self.heartbeat_interval}")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop grace must be >= 0 s, got {self.stop_grace_s}")
        if not (math.isfinite(self.leave_grace_s) and self.leave_grace_s >= 0):
            raise ValueError(f"leave grace must be >= 0 s, got {self.leave_grace_s}")
