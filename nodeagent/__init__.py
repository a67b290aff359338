"""The node agent: registers a GPU node, heartbeats its metrics, runs the replicas it is told to.

`agent.Agent` is the decision logic and takes time, randomness and messaging from its Env, so it
runs unchanged in the simulator; `gpu.NvmlProbe` and the drivers in `workload/` are the real
adapters that touch the OS.
"""
