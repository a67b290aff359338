"""NATS security for a gpumesh stack: a CA and TLS certificates, one NKEY identity per process,
per-role subject permissions rendered into the nats-server configuration, and revocation.
docs/security.md states the threat model and what each role may do."""
