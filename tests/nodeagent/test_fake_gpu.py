"""FakeGpuProbe: the --fake-gpus spec, deterministic idle metrics and every fault switch."""

from __future__ import annotations

import random

import pytest

from events.contract.messages import Fault
from nodeagent.gpu import FakeGpuProbe, FaultInjectable, GpuProbe, ProbeError, parse_fake_gpus


def test_parse_declares_every_gpu_with_its_model_and_vram() -> None:
    probe = FakeGpuProbe.parse("RTX4090:24GiB:2,A100:80GiB:1", node_id="n1")
    assert [(g.index, g.model, g.vram_mib) for g in probe.gpus] == [
        (0, "RTX4090", 24 * 1024),
        (1, "RTX4090", 24 * 1024),
        (2, "A100", 80 * 1024),
    ]
    assert all(g.uuid.startswith("GPU-") for g in probe.gpus)
    assert len({g.uuid for g in probe.gpus}) == 3


def test_uuids_are_stable_per_node_and_differ_between_nodes() -> None:
    first = FakeGpuProbe.parse("L4:24GB:2", node_id="n1").gpus
    again = FakeGpuProbe.parse("L4:24GB:2", node_id="n1").gpus
    other = FakeGpuProbe.parse("L4:24GB:2", node_id="n2").gpus
    assert [g.uuid for g in first] == [g.uuid for g in again]
    assert not {g.uuid for g in first} & {g.uuid for g in other}


@pytest.mark.parametrize(
    ("spec", "model", "vram_mib", "count"),
    [
        ("H100:81920MiB", "H100", 81920, 1),
        (" L4 : 24GB : 3 ", "L4", 24 * 1024, 3),
        ("T4:16g:1", "T4", 16 * 1024, 1),
        ("B200:0.5TiB:8", "B200", 512 * 1024, 8),
    ],
)
def test_parse_accepts_units_spaces_and_a_default_count(
    spec: str, model: str, vram_mib: int, count: int
) -> None:
    (entry,) = parse_fake_gpus(spec)
    assert (entry.model, entry.vram_mib, entry.count) == (model, vram_mib, count)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("", "empty"),
        ("RTX4090", "'RTX4090'"),
        ("RTX4090:24:2", "VRAM '24'"),
        ("RTX4090:lots:2", "VRAM 'lots'"),
        (":24GiB:1", "MODEL part is empty"),
        ("A100:80GiB:0", "COUNT '0'"),
        ("A100:80GiB:two", "COUNT 'two'"),
        ("A100:80GiB:1:9", "'A100:80GiB:1:9'"),
        ("RTX4090:24GiB:2,,A100:80GiB:1", "entry ''"),
        ("RTX4090:24GiB:2,A100:0GiB:1", "'A100:0GiB:1'"),
    ],
)
def test_malformed_specs_raise_a_value_error_naming_the_bad_part(spec: str, names: str) -> None:
    with pytest.raises(ValueError, match="fake-gpus") as caught:
        FakeGpuProbe.parse(spec)
    message = str(caught.value)
    assert names in message
    assert "\n" not in message


async def test_idle_metrics_are_deterministic_for_a_seed() -> None:
    a = FakeGpuProbe.parse("A100:80GiB:2", rng=random.Random(5))
    b = FakeGpuProbe.parse("A100:80GiB:2", rng=random.Random(5))
    first = await a.sample()
    assert first == await b.sample()
    assert [m.index for m in first] == [0, 1]
    for m in first:
        assert m.temperature_c == FakeGpuProbe.IDLE_TEMPERATURE_C
        assert 0.0 <= m.utilization_pct <= 3.0
        assert m.memory_total_mib == 80 * 1024
        assert (m.ecc_uncorrected, m.xid_errors, m.throttle_reasons) == (0, 0, ())
    inventory = await a.inventory()
    assert inventory.gpus == a.gpus
    assert inventory.driver_version and inventory.cuda_version


def test_the_fake_implements_both_protocols() -> None:
    probe: GpuProbe = FakeGpuProbe.parse("A100:80GiB:1")
    assert isinstance(probe, FaultInjectable)


async def test_set_temperature_on_one_gpu_or_all_and_throttles_when_hot() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:3")
    probe.set_temperature(95, gpu=1)
    hot = await probe.sample()
    assert [m.temperature_c for m in hot] == [35.0, 95.0, 35.0]
    assert [m.throttle_reasons for m in hot] == [(), ("sw_thermal_slowdown",), ()]
    probe.set_temperature(60)
    assert {m.temperature_c for m in await probe.sample()} == {60.0}


async def test_driver_error_makes_sampling_raise_until_switched_off() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:1")
    probe.set_driver_error(True)
    with pytest.raises(ProbeError, match="NVML"):
        await probe.sample()
    probe.set_driver_error(False)
    assert len(await probe.sample()) == 1


async def test_ecc_counts_and_xids_by_code_accumulate_per_gpu() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:2")
    probe.add_ecc(2, gpu=0)
    probe.add_ecc()
    probe.add_xid(79, gpu=1)
    probe.add_xid(13, gpu=1, times=2)
    metrics = await probe.sample()
    assert [m.ecc_uncorrected for m in metrics] == [3, 1]
    assert [(m.xid_errors, m.xids) for m in metrics] == [(0, ()), (3, (13, 79))]
    # Kept, as the NVML probe keeps them, until cleared.
    assert [m.xids for m in await probe.sample()] == [(), (13, 79)]


async def test_a_throttle_holds_until_cleared_and_clean_readings_are_counted() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:2")
    assert [m.unthrottled_readings for m in await probe.sample()] == [1, 1]
    probe.set_throttle(["hw_slowdown"], gpu=0)
    slowed = await probe.sample()
    assert [m.throttle_reasons for m in slowed] == [("hw_slowdown",), ()]
    assert [m.unthrottled_readings for m in slowed] == [0, 2]
    probe.set_throttle(0x80)  # NVML's bit for hw_power_brake_slowdown, every GPU
    assert {m.throttle_reasons for m in await probe.sample()} == {("hw_power_brake_slowdown",)}
    probe.set_throttle(())
    assert [m.unthrottled_readings for m in await probe.sample()] == [1, 1]
    with pytest.raises(ValueError, match="unknown throttle reason 'slow'"):
        probe.set_throttle(["slow"])


async def test_clear_resets_every_fault() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:2")
    probe.set_temperature(99)
    probe.add_ecc(1)
    probe.add_xid(79)
    probe.set_throttle(["hw_slowdown"])
    probe.set_driver_error(True)
    probe.clear()
    metrics = await probe.sample()
    assert all(m.temperature_c == 35.0 for m in metrics)
    assert all(m.ecc_uncorrected == m.xid_errors == 0 and m.xids == () for m in metrics)
    assert all(m.throttle_reasons == () for m in metrics)


def test_switches_reject_a_gpu_the_node_lacks_and_nonsense_values() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:2")
    with pytest.raises(ValueError, match="no GPU 2 on this node"):
        probe.set_temperature(90, gpu=2)
    with pytest.raises(ValueError, match="no GPU -3"):
        probe.add_ecc(1, gpu=-3)
    with pytest.raises(ValueError, match="an XID code is a whole number from 1"):
        probe.add_xid(0)
    with pytest.raises(ValueError, match="at least 1"):
        probe.add_xid(79, times=0)
    with pytest.raises(ValueError, match="finite"):
        probe.set_temperature(float("nan"))


async def test_apply_fault_maps_every_kind_to_its_switch() -> None:
    probe = FakeGpuProbe.parse("A100:80GiB:2")
    probe.apply_fault(Fault(kind="thermal", value=91, gpu=0))
    probe.apply_fault(Fault(kind="ecc", gpu=1))  # value 0 means one error
    probe.apply_fault(Fault(kind="xid", value=48))  # XID 48, on every GPU
    probe.apply_fault(Fault(kind="xid", gpu=1))  # value 0 means XID 79
    metrics = await probe.sample()
    assert [m.temperature_c for m in metrics] == [91.0, 35.0]
    assert [m.ecc_uncorrected for m in metrics] == [0, 1]
    assert [m.xids for m in metrics] == [(48,), (48, 79)]
    probe.apply_fault(Fault(kind="driver"))
    with pytest.raises(ProbeError):
        await probe.sample()
    probe.apply_fault(Fault(kind="clear"))
    assert [m.temperature_c for m in await probe.sample()] == [35.0, 35.0]
    probe.apply_fault(Fault(kind="throttle", value=0x8 | 0x80, gpu=1))
    assert [m.throttle_reasons for m in await probe.sample()] == [
        (),
        ("hw_slowdown", "hw_power_brake_slowdown"),
    ]
    probe.apply_fault(Fault(kind="throttle", gpu=1))  # 0: none
    assert [m.throttle_reasons for m in await probe.sample()] == [(), ()]
    with pytest.raises(ValueError, match="whole number"):
        probe.apply_fault(Fault(kind="ecc", value=1.5))
    with pytest.raises(ValueError, match="no GPU 7"):
        probe.apply_fault(Fault(kind="driver", gpu=7))
