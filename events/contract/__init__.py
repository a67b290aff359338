"""The wire contract: the NATS subjects, the messages on them and the tunnel's frames.

These are not events (nothing here is appended to the log); they are what integrators, agents,
gateways and the controller exchange. docs/subjects.md documents them, versioned.
"""
