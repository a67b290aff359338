"""Deterministic simulation: a virtual-time event loop and the Env that goes with it."""

from .bus import MemoryBus as MemoryBus
from .clock import (
    SIM_EPOCH_NS as SIM_EPOCH_NS,
    SimClock as SimClock,
    stamp_sim_time as stamp_sim_time,
)
from .env import SeededStreams as SeededStreams, sim_env as sim_env
from .loop import (
    Deadlock as Deadlock,
    SimEventLoop as SimEventLoop,
    SimulationError as SimulationError,
    run_simulation as run_simulation,
)
from .network import (
    LinkFaults as LinkFaults,
    NetworkStats as NetworkStats,
    SimEndpoint as SimEndpoint,
    SimNetwork as SimNetwork,
    TraceEntry as TraceEntry,
)
