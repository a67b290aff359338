"""How the gateway reaches a replica: direct HTTP, or tunnelled over NATS to the node's agent."""
