"""What each fault kind does on the real stack, in the words --help, --dry-run, the run's
timeline and docs/chaos.md use."""

from __future__ import annotations

NETWORK_ONLY = "skipped: needs network control (simulator only)"
IN_UP = "skipped: controller runs inside gpumesh up"
IN_UP_HA = (
    "skipped: gpumesh up --ha runs two controllers and starts a killed one again itself: "
    "leader_crash is this fault there"
)
NEEDS_HA = "skipped: needs a stack of `gpumesh up --ha` (two controllers, three nats-servers)"
CANNOT_PARTITION = (
    "skipped: needs a stack of `gpumesh up --ha`, whose controllers reach NATS through relays "
    "it owns; elsewhere cutting one process off from NATS needs network control (root: "
    "iptables or a network namespace), and SIGSTOP would be leader_pause, not a partition"
)
NO_CONTROL = (
    "skipped: this `gpumesh up --ha` names no control socket in up-ha.json (an older `up`, or "
    "it could not make DATA_DIR/up-ha.sock): it cannot cut a controller off"
)
RESTARTS = "gpumesh up --ha starts it again after 1 s"
# against `gpumesh up --ha`
HA_KINDS = ("leader_crash", "leader_pause", "nats_server_loss", "controller_partition")
CRASH_LOOP_EVERY_S = 0.5

KIND_ACTIONS: dict[str, str] = {
    "power_loss": "SIGKILL the agent's process group and every workload's (a machine losing "
    "power); after duration_s the agent is started again with the command line, environment, "
    "working directory and log file read from /proc before the kill",
    "hang": "SIGSTOP the agent process (its workloads keep serving); SIGCONT after duration_s",
    "partition": "approximation: SIGSTOP the agent and its workloads, so nothing from the node "
    "arrives (but the kernel still accepts TCP connections and NATS keeps the session); "
    "SIGCONT after duration_s",
    "one_way_partition": NETWORK_ONLY,
    "flap": "approximation: the partition above, on and off every period_s, for duration_s "
    "(default 60 s)",
    "slow": NETWORK_ONLY,
    "thermal": "the fake-GPU fault subject, as `gpumesh agent fault NODE thermal VALUE`; "
    "`clear` after duration_s (agents with --fake-gpus only)",
    "ecc": "the fake-GPU fault subject, as `gpumesh agent fault NODE ecc 1`; `clear` after "
    "duration_s",
    "driver": "the fake-GPU fault subject, as `gpumesh agent fault NODE driver`; `clear` after "
    "duration_s",
    "crash_loop": "SIGKILL every workload of the node at once and again every "
    f"{CRASH_LOOP_EVERY_S:g} s, for duration_s (or until the faults stop)",
    "controller_crash": "SIGKILL a separate `gpumesh controller --nats URL` process, started "
    f"again after duration_s; with `gpumesh up` the controller is in-process: {IN_UP}",
    "nats_outage": "approximation: SIGSTOP the stack's nats-server (every client's connection "
    "goes silent); SIGCONT after duration_s",
    "gateway_partition": NETWORK_ONLY,
    "controller_partition": "gpumesh up --ha only: cut the controller that holds the leader "
    "lease off from NATS for duration_s (without one, until the run ends) through `up`'s "
    "control socket. Each controller reaches NATS only through relays `up` owns; the leader's "
    "stop carrying bytes both ways (a blackhole, not a refusal: its connections stay open and "
    "stall, new ones are held, so it finds out only by its own timeouts), then carry again, "
    "the held bytes arriving late as after a real partition. No root needed. Measured: the "
    "time until a controller leads in a new term",
    "leader_crash": "gpumesh up --ha only: SIGKILL the controller that holds the leader lease "
    "when the fault fires (gpumesh up --ha starts it again after 1 s, whatever duration_s); "
    "measured: the time until a controller leads in a new term",
    "leader_pause": "gpumesh up --ha only: SIGSTOP the controller that holds the leader lease, "
    "SIGCONT after duration_s (past the lease's 3 s: a standby takes over); measured: the time "
    "until a controller leads in a new term",
    "nats_server_loss": "gpumesh up --ha only: SIGKILL one of the three nats-servers, drawn "
    "from the seed (gpumesh up --ha starts it again after 1 s, whatever duration_s); measured: "
    "the time until the lease is written again (renewed, or a new term)",
    "churn": "every period_s for duration_s (default 60 s): power_loss of `count` nodes (started "
    "again when the run ends) and `count` new agents node-N with an existing agent's command line",
}
