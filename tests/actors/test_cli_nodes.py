"""`gpumesh nodes`: each node's GPUs by family and by the name NVML reports (actors/cli.py)."""

from __future__ import annotations

from typing import Any

from actors.cli import gpu_models, nodes_table, with_gpu_families


def a_node(node_id: str, *models: str, **fields: Any) -> dict[str, Any]:
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "model": m, "vram_mib": 81559}
        for i, m in enumerate(models)
    ]
    metrics = [{"index": i, "temperature_c": 40.0 + i} for i in range(len(models))]
    base = {"node_id": node_id, "health": "healthy", "health_reason": "registered", "region": "eu"}
    return {**base, "drained": False, "gpus": gpus, "metrics": metrics, **fields}


def test_the_model_column_shows_the_family_then_the_name_nvml_reports() -> None:
    assert gpu_models(a_node("n", *["NVIDIA H100 80GB HBM3"] * 8)["gpus"]) == (
        "8x H100 (NVIDIA H100 80GB HBM3)"
    )
    mixed = a_node("n", "NVIDIA GeForce RTX 4090", "NVIDIA L4", "NVIDIA L4")
    assert gpu_models(mixed["gpus"]) == "1x RTX4090 (NVIDIA GeForce RTX 4090), 2x L4 (NVIDIA L4)"
    # A fake GPU's name already is its family: said once.
    assert gpu_models(a_node("n", "RTX4090", "RTX4090")["gpus"]) == "2x RTX4090"
    assert gpu_models([]) == "-"


def test_the_table_lists_every_node() -> None:
    table = nodes_table([a_node("gpu-1", "NVIDIA H100 PCIe"), a_node("cpu-1")], 0).splitlines()
    assert table[0].split() == [
        "NODE", "HEALTH", "REASON", "REGION", "GPUS", "MAX", "TEMP", "MODEL"
    ]  # fmt: skip
    assert table[1].split()[:7] == ["gpu-1", "healthy", "registered", "eu", "1", "40", "C"]
    assert table[1].endswith("  1x H100 (NVIDIA H100 PCIe)")
    assert table[2].split()[-2:] == ["-", "-"]
    assert nodes_table([], 0) == "no nodes"


def test_json_gains_each_gpus_family_and_keeps_every_field() -> None:
    node = a_node("gpu-1", "NVIDIA A100-SXM4-80GB")
    (out,) = with_gpu_families([node])
    assert out["gpus"] == [
        {
            "index": 0,
            "uuid": "GPU-0",
            "model": "NVIDIA A100-SXM4-80GB",
            "vram_mib": 81559,
            "family": "A100",
        }
    ]
    assert out["metrics"] == a_node("gpu-1", "x")["metrics"]
