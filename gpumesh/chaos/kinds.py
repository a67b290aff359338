"""What each fault kind does on the real stack, in the words --help, --dry-run, the run's
timeline and docs/chaos.md use."""

from __future__ import annotations

NETWORK_ONLY = "skipped: needs network control (simulator only)"
IN_UP = "skipped: controller runs inside gpumesh up"
NOT_YET = "skipped: not yet played against a real stack (simulator only; gpumesh up --ha)"
HA_KINDS = ("leader_crash", "leader_pause", "nats_server_loss")  # NOT_YET here
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
    "controller_partition": NETWORK_ONLY,
    **dict.fromkeys(HA_KINDS, NOT_YET),
    "churn": "every period_s for duration_s (default 60 s): power_loss of `count` nodes (started "
    "again when the run ends) and `count` new agents node-N with an existing agent's command line",
}
