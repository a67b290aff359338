"""What a scenario's clients do, in the simulator (sim/world.py) and in `gpumesh chaos` alike:
deploy each of its clusters (`cluster_spec`), and send requests to each at the scenario's rate
from a second after its deploy (`poisson_traffic`), with arrivals drawn from the seed's
`traffic:<cluster>` stream, so one seed sends at the same instants in both. How a request goes
out (the simulated dispatcher, HTTP to a real gateway) and what it is answered is the caller's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

from events import ClusterSpec, GpuRequirement
from runtime.env import RandomSource

from .scenario import ClusterPlan, TrafficShape

TRAFFIC_AFTER_S = 1.0  # clients come once the deploy was announced


def cluster_spec(plan: ClusterPlan, command: str) -> ClusterSpec:
    """The spec a scenario's cluster is created with; `command` is the workload to run."""
    return ClusterSpec(
        name=plan.name,
        replicas=plan.replicas,
        model=plan.name,
        command=command,
        gpu=GpuRequirement(
            models=(plan.gpu_model,) if plan.gpu_model else (), count=plan.gpu_count
        ),
        autoscale=plan.autoscale,
        sharding=plan.sharding,
    )


async def shaped_traffic(
    rng: RandomSource,
    shape: TrafficShape,
    now: Callable[[], float],
    request: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    """Like `poisson_traffic`, at the rate `shape` gives for each instant (`now()`: seconds
    since the run began): arrivals are drawn at the shape's peak and each kept with the
    probability rate/peak (thinning), so the draws, and so the instants, depend on the seed
    alone. A steady shape is `poisson_traffic` itself: the runs of scenarios written before
    shapes stay what they were, seed for seed."""
    if shape.kind == "steady":
        await poisson_traffic(rng, shape.rate_per_s, request)
        return
    peak = shape.peak()
    if peak <= 0:
        return
    async with asyncio.TaskGroup() as requests:
        while True:
            gap = -math.log(1.0 - rng.random()) / peak
            await asyncio.sleep(gap)
            if rng.random() * peak < shape.rate(now()):
                requests.create_task(request())


async def poisson_traffic(
    rng: RandomSource,
    rate_per_s: float,
    request: Callable[[], Coroutine[Any, Any, None]],
) -> None:
    """Start `request()` at Poisson arrivals (exponential gaps drawn from `rng`), each as its
    own task, until cancelled; the requests in flight are cancelled with it, and one that
    raises ends the traffic with its error. `request` is called at the arrival itself (count
    the request there: it may be cancelled before its first step)."""
    async with asyncio.TaskGroup() as requests:
        while True:
            gap = -math.log(1.0 - rng.random()) / rate_per_s
            await asyncio.sleep(gap)
            requests.create_task(request())
