"""How gpumesh's processes reach each other and their workloads: NATS (the bus adapter, the
embedded server, JetStream command queues, credentials), HTTP/1.1 (a strict codec and a
keep-alive client), and what every command shares to find and join a running stack.
"""
