"""Pure folds from the event log to read models. Imports nothing of ours but events/."""

from .fleet import (
    apply as apply,
    copy as copy,
    rebuild as rebuild,
    restore as restore,
    snapshot as snapshot,
)
from .views import (
    ClusterView as ClusterView,
    FleetState as FleetState,
    NodeView as NodeView,
    ReplicaView as ReplicaView,
    Route as Route,
    RoutingTable as RoutingTable,
)
