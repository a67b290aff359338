"""`cmd.pull.v1` on the agent: a docker driver pulls ahead of placement and the node registers
again with the image; a process driver says it cannot; a failed pull is logged, nothing more."""

from __future__ import annotations

from structlog.testing import capture_logs

from events.contract.messages import PullImage
from nodeagent.workload import WorkloadStartError
from nodeagent.workload.fake import FakeDriver
from sim import run_simulation

from .harness import Harness, wait_until


class PullingDriver(FakeDriver):
    """The fake driver with the docker driver's `pull` and `images`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[str] = []
        self.pulls: list[tuple[str, str]] = []

    async def images(self) -> tuple[str, ...]:
        return tuple(sorted(self.held))

    async def pull(self, image: str, policy: str = "missing", *, replica: str = "") -> None:
        self.pulls.append((image, replica))
        if "no-such" in image:
            raise WorkloadStartError(f"docker pull {image} failed: not found")
        self.held.append(image)


def pull(image: str, command_id: str = "pull:big:1:n1") -> PullImage:
    return PullImage(command_id=command_id, image=image, cluster="big")


def test_a_prepull_pulls_and_the_node_registers_again_with_the_image() -> None:
    async def scenario() -> None:
        driver = PullingDriver()
        h = Harness(driver=driver)
        async with h.running():
            await wait_until(lambda: len(h.registrations) == 1)
            assert h.registrations[0][1].images == ()
            await h.send(pull("vllm/vllm-openai:v0.6.3"))
            await wait_until(lambda: len(h.registrations) == 2)
            assert h.registrations[1][1].images == ("vllm/vllm-openai:v0.6.3",)
            await h.send(pull("vllm/vllm-openai:v0.6.3"))  # the same command again: once
            await h.acked()
        assert driver.pulls == [("vllm/vllm-openai:v0.6.3", "prepull:big")]

    run_simulation(scenario())


def test_a_failed_prepull_is_logged_and_changes_nothing() -> None:
    async def scenario() -> None:
        driver = PullingDriver()
        h = Harness(driver=driver)
        with capture_logs() as logs:
            async with h.running():
                await wait_until(lambda: len(h.registrations) == 1)
                await h.send(pull("no-such/engine:1"))
                await wait_until(lambda: any(e["event"] == "prepull_failed" for e in logs))
        assert len(h.registrations) == 1
        failed = next(e for e in logs if e["event"] == "prepull_failed")
        assert failed["error"] == "docker pull no-such/engine:1 failed: not found"

    run_simulation(scenario())


def test_an_agent_without_the_docker_driver_says_it_cannot_prepull() -> None:
    async def scenario() -> None:
        h = Harness()  # the plain fake driver: no pull
        with capture_logs() as logs:
            async with h.running():
                await wait_until(lambda: len(h.registrations) == 1)
                await h.send(pull("vllm/vllm-openai:v0.6.3"))
                await wait_until(lambda: any(e["event"] == "prepull_ignored" for e in logs))
        assert "no docker driver here" in next(
            e["why"] for e in logs if e["event"] == "prepull_ignored"
        )

    run_simulation(scenario())


class StuckDockerDriver(PullingDriver):
    """A daemon too busy to answer: its commands time out."""

    async def pull(self, image: str, policy: str = "missing", *, replica: str = "") -> None:
        raise TimeoutError()


def test_a_pull_that_times_out_is_logged_and_the_agent_goes_on() -> None:
    async def scenario() -> None:
        h = Harness(driver=StuckDockerDriver())
        with capture_logs() as logs:
            async with h.running():
                await wait_until(lambda: len(h.registrations) == 1)
                await h.send(pull("vllm/vllm-openai:v0.6.3"))
                await wait_until(lambda: any(e["event"] == "prepull_failed" for e in logs))
                seen = h.registrations[-1][0]
                await h.heartbeat_after(seen + 2.0)  # still heartbeating: the agent lives
        assert next(e for e in logs if e["event"] == "prepull_failed")["error"] == "TimeoutError"

    run_simulation(scenario())
