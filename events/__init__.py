"""The event log: domain events, the envelope, the codec and the stores.

This package imports no other gpumesh package: the log knows no actors, HTTP or simulator.
"""

from .catalog import (
    EVENT_TYPES as EVENT_TYPES,
    HEARTBEAT_TYPE as HEARTBEAT_TYPE,
    DomainEvent as DomainEvent,
    stream_name as stream_name,
    stream_of as stream_of,
    type_tag as type_tag,
)
from .cluster import (
    AutoscaleInputs as AutoscaleInputs,
    AutoscaleSpec as AutoscaleSpec,
    ClusterCanaryEnded as ClusterCanaryEnded,
    ClusterCanaryStarted as ClusterCanaryStarted,
    ClusterCreated as ClusterCreated,
    ClusterDeleted as ClusterDeleted,
    ClusterRolledOut as ClusterRolledOut,
    ClusterScaled as ClusterScaled,
    ClusterSpec as ClusterSpec,
    ClusterSpecChanged as ClusterSpecChanged,
    ClusterUnschedulable as ClusterUnschedulable,
    DockerOptions as DockerOptions,
    GpuRequirement as GpuRequirement,
    ProbeSpec as ProbeSpec,
    RolloutPolicy as RolloutPolicy,
    ShardingSpec as ShardingSpec,
)
from .controller import (
    TERMS_STREAM as TERMS_STREAM,
    ControllerGrace as ControllerGrace,
    LeaderTermBegan as LeaderTermBegan,
)
from .envelope import (
    Envelope as Envelope,
    NewEvent as NewEvent,
    Undecodable as Undecodable,
    new_event as new_event,
)
from .errors import (
    ConcurrencyConflict as ConcurrencyConflict,
    DuplicateEventId as DuplicateEventId,
    EventStoreError as EventStoreError,
    InvalidAppend as InvalidAppend,
    StoreClosed as StoreClosed,
    StoreFull as StoreFull,
    TermEnded as TermEnded,
)
from .memory_store import MemoryEventStore as MemoryEventStore
from .node import (
    GpuInfo as GpuInfo,
    GpuMetrics as GpuMetrics,
    LinkMeasurement as LinkMeasurement,
    NodeCordoned as NodeCordoned,
    NodeDrained as NodeDrained,
    NodeHealthChanged as NodeHealthChanged,
    NodeHeartbeat as NodeHeartbeat,
    NodeLinksMeasured as NodeLinksMeasured,
    NodeRegistered as NodeRegistered,
    NodeRemoved as NodeRemoved,
    NodeUncordoned as NodeUncordoned,
    NodeUndrained as NodeUndrained,
)
from .replica import (
    Candidate as Candidate,
    ReplicaFailed as ReplicaFailed,
    ReplicaPlaced as ReplicaPlaced,
    ReplicaReady as ReplicaReady,
    ReplicaStageReady as ReplicaStageReady,
    ReplicaStarting as ReplicaStarting,
    ReplicaStopped as ReplicaStopped,
    ReplicaStopping as ReplicaStopping,
    ReplicaSuspected as ReplicaSuspected,
    StagePlacement as StagePlacement,
)
from .store import (
    ANY as ANY,
    NO_STREAM as NO_STREAM,
    EventStore as EventStore,
    Snapshot as Snapshot,
)
