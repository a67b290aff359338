"""`gpumesh chaos` cuts the leading controller of `gpumesh up --ha` off from NATS, without root:
`up`'s relays between that controller and the three nats-servers stop carrying bytes (a
blackhole: its connections stay open and stall), then carry again.

The test starts `up --ha` (three nats-servers, two controllers, the gateway, three agents, each
its own process, marked with STACK_ENV), runs `gpumesh chaos` with one controller_partition
under client traffic, and reads the run's JSON: the standby leads in a new term, no request
failed, the old leader stepped down (its log says so) and, once healed, follows the log again as a
standby. Then `up` stops, and no process of the stack is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from actors.errors import ControllerError
from actors.roster import Roster, RosterEntry
from tests.integration.stack import kill_marked, marked_pids, pid_alive
from tests.integration.test_up_ha import read_summary, start_up_ha
from tests.integration.up_process import connect_admin, reap, run_chaos, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIO = """
name = "chaos-partition"
duration_s = 9
settle_s = 2
controllers = 2

[fleet]
nodes = 3

[[clusters]]
name = "echo"
replicas = 3

[traffic]
rate_per_s = 10

[[faults]]
at_s = 1
kind = "controller_partition"
duration_s = 6
"""


@pytest.mark.timeout(240)
async def test_the_leader_cut_off_from_nats_is_replaced_and_rejoins_as_a_standby(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "stack"
    marker = f"chaos-part-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up_ha(data_dir, marker)  # --demo: the echo cluster is ready before chaos runs
    bus = None
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, up), timeout=150)
        assert summary, (tmp_path / "up.log").read_text()[-3000:]
        controllers = [p for p in summary["processes"] if p["role"] == "controller"]
        # Each controller reaches NATS only through its own relays, one per server.
        servers = {p["port"] for p in summary["processes"] if p["role"] == "nats-server"}
        for ctl in controllers:
            assert sorted(ctl["relays"]) == ["nats-0", "nats-1", "nats-2"], ctl
            assert not set(ctl["relays"].values()) & servers, ctl
        scenario = tmp_path / "partition.toml"
        scenario.write_text(SCENARIO)
        done = await asyncio.to_thread(
            run_chaos,
            [str(scenario), "--data-dir", str(data_dir), "--json"],
            marker=marker,
            timeout=90,
        )
        healed_ns = time.time_ns()
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 0, err
        (tmp_path / "chaos.json").write_bytes(done.stdout)  # for a failure's post-mortem
        result = json.loads(done.stdout)
        assert result["violations"] == [] and result["crashed"] == [], err
        timeline = "\n".join(result["timeline"])
        assert "skip" not in timeline and "WARN" not in timeline, timeline

        (cut,) = result["failovers"]
        assert cut["kind"] == "controller_partition", cut
        old = cut["leader_before"]
        assert cut["target"].startswith(f"controller {old} (pid "), cut
        # The standby leads in a new term: the cut leader could renew nothing (generous bound:
        # a loaded CI machine; typically 2-3 s, docs/operations.md).
        assert cut["new_leader"] and cut["leader_after"] != old, cut
        assert cut["term_after"] > cut["term_before"], cut
        assert cut["leads_again_s"] is not None and cut["leads_again_s"] < 10.0, cut
        requests = cut["requests"]
        assert requests["sent"] > 20 and requests["failed"] == 0, cut
        assert f"end    controller_partition {old} (term {cut['term_before']}): healed" in (
            timeline
        )

        # The old leader stepped down on its own (no renewal got through: fencing), and once
        # healed it reports itself again, as a standby.
        log = data_dir / "logs" / f"controller-{old}.log"
        lost = [
            json.loads(line)
            for line in log.read_text().splitlines()
            if line.startswith("{") and '"leadership_lost"' in line
        ]
        assert lost and lost[-1]["term"] == cut["term_before"], lost
        assert "no renewal succeeded" in lost[-1]["reason"], lost[-1]

        bus = await connect_admin(data_dir, summary["nats"], "test-chaos-partition")
        roster = Roster(bus, timeout=2.0)

        entries: dict[str, RosterEntry] = {}

        async def reported() -> bool:
            nonlocal entries
            try:
                entries = {e.controller_id: e for e in await roster.entries()}
            except ControllerError:
                return False
            return True

        await until(reported, 20, "the roster")
        leader_applied = entries[cut["leader_after"]].applied

        async def rejoined() -> bool:
            # A standby again, following the log: it folded what the leader had at the heal
            # (the bytes held while cut arrive late, and the log's consumer goes on).
            entry = entries.get(old)
            if (
                entry is not None
                and entry.role == "standby"
                and entry.reported_ns > healed_ns
                and entry.applied >= leader_applied
            ):
                return True
            await reported()
            return False

        await until(rejoined, 20, f"{old} following the log as a standby after the heal")
        with capsys.disabled():
            print(
                f"\ncontroller_partition on up --ha: {cut['leader_after']} leads "
                f"{cut['leads_again_s']:.2f} s after {old} was cut off; "
                f"{requests['failed']}/{requests['sent']} requests failed; {old} rejoined as a "
                "standby"
            )

        await bus.close()
        bus = None
        up.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(up.wait, 60)
        assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert [pid for pid in marked_pids(marker) if pid_alive(pid)] == []
        assert not (data_dir / "up-ha.sock").exists()
    finally:
        if bus is not None:
            await bus.close()
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
