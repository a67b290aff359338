"""`gpumesh chaos SCENARIO`: a simulator scenario applied to the running local stack.

The TOML files `gpumesh sim run` plays on virtual time (sim/scenario.py) are played here on wall
time against real processes: the clusters are created (echo workloads), client traffic goes
through the gateway at the scenario's rate, and each fault is applied at its time by signals to
the stack's processes (found in /proc) or through the fake-GPU fault subject. The event log is
followed (`events.list`, heartbeats included) and folded by the simulator's own Checker, so the
detection and replacement times and the per-event invariants are computed the same way, and the
summary is printed by the simulator's `render`: a simulated run and a real one read alike.

What is the simulator's is the simulator's code, not a copy: the fault timeline
(sim/timeline.py), the liveness rule (sim/liveness.py), the clusters' specs and the traffic's
arrivals (sim/clients.py), the victims' draw (sim.world.draw_victims) and the summary
(sim/run.py). Victims and request arrivals are drawn from `--seed` with the simulator's
streams, so on a stack with the scenario's node names and count, a seed picks the same victims
as in `gpumesh sim run`. Times in the summary are wall seconds since the start of the run.

A run always leaves the stack as it found it: what it stopped is continued and what it killed is
started again, at the fault's end, at the end of the run (faults with no end, churn), and on
Ctrl-C. A task of the run that raises fails the run with its error, in the result and the
report.

One job per module:
- `procfs.py`: the stack's processes in /proc, signals, starting one again (gpumesh/keeper.py);
- `stack.py`: the processes in chaos's hands (what is stopped, killed) and `restore`;
- `faults.py`: each fault kind on the real stack, on the simulator's timeline;
- `gateway.py`: the traffic's requests to the gateway, and their failures' names;
- `run.py`: `ChaosRun`, one scenario from start to result;
- `plan.py`: `--dry-run`;
- `cli.py`: the command, its report and exit status; `kinds.py`: what each kind does here.
"""

from __future__ import annotations

from .cli import register

__all__ = ["register"]
