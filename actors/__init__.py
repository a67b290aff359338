"""The controller: node, cluster and replica actors, the scheduler, failure detection, the
heartbeat recorder, the live state, the outbox and the control API, built on runtime/.
"""
