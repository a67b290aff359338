"""`gpumesh chaos` against `gpumesh up --ha`: the leading controller's SIGKILL, its SIGSTOP past
the lease, and the SIGKILL of one nats-server of three, once each, under client traffic.

The test starts `up --ha` (three nats-servers, two controllers, the gateway, three agents, each
its own process, marked with STACK_ENV), runs `gpumesh chaos` on its data directory (which finds
the stack, its gateway included, from up-ha.json), and reads the run's JSON: each fault has a
controller leading again (a new term after the crash and the pause), and the requests of its
window counted. Then `up` stops, and no process of the stack is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.integration.stack import kill_marked, marked_pids, pid_alive
from tests.integration.test_up_ha import processes, read_summary, start_up_ha
from tests.integration.up_process import reap, run_chaos, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOSS_LEADS_S = 15.0  # a NATS server's loss: a controller leads again within this, generously

SCENARIO = """
name = "chaos-ha"
duration_s = 36
settle_s = 4
controllers = 2

[fleet]
nodes = 3

[[clusters]]
name = "echo"
replicas = 3

[traffic]
rate_per_s = 10

[[faults]]
at_s = 3
kind = "leader_crash"

[[faults]]
at_s = 10
kind = "leader_pause"
duration_s = 5

[[faults]]
at_s = 19
kind = "nats_server_loss"
"""


@pytest.mark.timeout(240)
async def test_chaos_plays_the_leaders_and_a_nats_servers_loss_against_up_ha(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "stack"
    marker = f"chaos-ha-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up_ha(data_dir, marker)  # --demo: the echo cluster is ready before chaos runs
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, up), timeout=150)
        assert summary, (tmp_path / "up.log").read_text()[-3000:]
        scenario = tmp_path / "ha.toml"
        scenario.write_text(SCENARIO)
        done = await asyncio.to_thread(
            run_chaos,
            [str(scenario), "--data-dir", str(data_dir), "--json"],
            marker=marker,
            timeout=120,
        )
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 0, err
        (tmp_path / "chaos.json").write_bytes(done.stdout)  # for a failure's post-mortem
        result = json.loads(done.stdout)
        assert result["violations"] == [] and result["crashed"] == [], err
        assert result["invariants_checked"] == [
            "contiguous_versions", "spread", "placement_fits", "no_partial_group_serving",
            "no_gpu_held_twice", "liveness", "group_serving_or_unschedulable",
        ]  # fmt: skip
        timeline = "\n".join(result["timeline"])
        assert "cluster echo exists (3 replicas): left as it is" in timeline
        assert "skip" not in timeline, timeline

        crash, pause, loss = result["failovers"]
        assert [f["kind"] for f in (crash, pause, loss)] == [
            "leader_crash", "leader_pause", "nats_server_loss"
        ]  # fmt: skip
        for f in (crash, pause):
            # The standby leads in a new term, within the 5 s (3 s lease, 1 s renewal).
            assert f["new_leader"] and f["term_after"] > f["term_before"], f
            assert f["leads_again_s"] is not None and 1.0 < f["leads_again_s"] < 5.0, f
        # The paused leader cannot renew: the standby leads. After the crash, the standby or
        # the killed controller, which `up` starts again after 1 s, may be the first to lead.
        assert pause["leader_after"] != pause["leader_before"], pause
        assert crash["target"].startswith(f"controller {crash['leader_before']} (pid ")
        assert pause["leader_before"] == crash["leader_after"]
        assert loss["target"].startswith("nats-server nats-")
        # A controller leads again: at once when the server lost did not lead the lease's
        # stream (the leader renews through another); after the stream's election (about
        # 3-9 s) and a create when it did. The watch ends with the run (duration_s + settle_s:
        # 21 s after this fault; it was 9 s, shorter than some elections). Before each create
        # waited only 0.5 s for its answer, one sent into the election waited out its 5 s
        # timeout: 10.7 s were seen, reported as no leader.
        assert loss["leads_again_s"] is not None and loss["leads_again_s"] < LOSS_LEADS_S, loss
        for f in (crash, pause, loss):
            requests = f["requests"]
            assert requests["sent"] > 20, f
            assert set(requests) == {
                "sent", "failed", "failed_before_first_byte", "failed_by_kind", "failed_sent_s"
            }  # fmt: skip
            assert sum(requests["failed_by_kind"].values()) == requests["failed"]
        # The status line is the answer's first byte, so a failure before it is counted
        # exactly. The data plane serves through the leader's crash and a server's loss; the
        # leader's pause may cost a few (docs/chaos.md), which the run reports.
        assert crash["requests"]["failed_before_first_byte"] == 0, crash
        assert loss["requests"]["failed_before_first_byte"] == 0, loss
        assert f"end    leader_pause {pause['leader_before']} (term {pause['term_before']})" in (
            timeline
        )
        with capsys.disabled():
            print(
                "\nchaos on up --ha: "
                + "; ".join(
                    f"{f['kind']} "
                    + (
                        f"{f['leads_again_s']:.2f} s"
                        if f["leads_again_s"] is not None
                        else "no leader"
                    )
                    + f", {f['requests']['failed']}/"
                    f"{f['requests']['sent']} failed"
                    for f in (crash, pause, loss)
                )
            )

        # `up` started the killed controller and server again; chaos continued the paused one.
        async def all_back() -> bool:
            running = processes(data_dir)
            return len(running) == 9 and all(pid_alive(p["pid"]) for p in running.values())

        await until(all_back, 20, "every process of up --ha running again")
        up.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(up.wait, 60)
        assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
        assert [pid for pid in marked_pids(marker) if pid_alive(pid)] == []
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
