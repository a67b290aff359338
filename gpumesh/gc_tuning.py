"""The cyclic garbage collector's settings for gpumesh's long-running processes.

A controller holds one actor, one mailbox and one projection entry per node, and allocates a
few hundred short-lived objects per heartbeat (messages, envelopes, futures). At CPython's
default thresholds (700, 10, 10) the young collection runs every few heartbeats and a full
collection rescans that whole heap every 70,000 allocations: measured with
`bench/heartbeats.py --gc default` against `--gc tuned`, see docs/performance.md.

Almost everything young dies young here (reference counting frees it; cycles are rare), so
collecting less often loses little memory: at most about one young generation (50,000
objects) of cyclic garbage waits a little longer.
"""

from __future__ import annotations

import gc

# The simulator picks the same numbers for the same reason (sim/loop.py).
DAEMON_THRESHOLD = (50_000, 20, 100)


def tune_collector() -> None:
    """Call once, after imports and before the event loop starts."""
    # What importing built (modules, classes, functions) lives as long as the process: moved
    # to the permanent generation, no collection scans it again.
    gc.freeze()
    gc.set_threshold(*DAEMON_THRESHOLD)
