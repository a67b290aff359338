"""GPU model names (events/gpu_names.py): a spec's `H100` against NVML's "NVIDIA H100 80GB HBM3".

The names below are what NVML's nvmlDeviceGetName (and so `nvidia-smi --query-gpu=name`)
returns for each card, as printed by nvidia-smi in the cloud providers' GPU instance
documentation (AWS: p5 "NVIDIA H100 80GB HBM3", p4d "NVIDIA A100-SXM4-40GB", p4de
"NVIDIA A100-SXM4-80GB", g5 "NVIDIA A10G", g4dn "Tesla T4", p3 "Tesla V100-SXM2-16GB",
g6 "NVIDIA L4", g6e "NVIDIA L40S"; GCP: a2-ultragpu "NVIDIA A100-SXM4-80GB", g2 "NVIDIA L4"),
in NVIDIA's own datasheets and driver release notes' supported-product lists ("NVIDIA H100
PCIe", "NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA H200",
"NVIDIA B200", "NVIDIA GH200 480GB", "NVIDIA RTX A6000", "NVIDIA RTX 6000 Ada Generation"),
in nvidia-smi output posted for consumer cards ("NVIDIA GeForce RTX 3090", "... 3090 Ti",
"... 4090", "... 4090 D", "... 5090"), and as seen on this project's device machine
("NVIDIA H100 80GB HBM3", docs/performance.md). Drivers before R470 wrote "GeForce RTX 3090"
and "A100-SXM4-40GB" without "NVIDIA "; both spellings are listed where they differ.
"""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from events.gpu_names import family, matches, normalise

# (name NVML reports, its family)
REPORTED: tuple[tuple[str, str], ...] = (
    ("NVIDIA GeForce RTX 3090", "RTX3090"),
    ("GeForce RTX 3090", "RTX3090"),
    ("NVIDIA GeForce RTX 3090 Ti", "RTX3090TI"),
    ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("NVIDIA GeForce RTX 4090 D", "RTX4090D"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "RTX4090LAPTOP"),
    ("NVIDIA GeForce RTX 4080 SUPER", "RTX4080SUPER"),
    ("NVIDIA GeForce RTX 5090", "RTX5090"),
    ("NVIDIA RTX A6000", "A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX6000ADA"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40", "L40"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA A10G", "A10G"),
    ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-16GB", "V100"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("Tesla V100-PCIE-16GB", "V100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA H100 NVL", "H100"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA B200", "B200"),
    ("AMD Instinct MI300X", "MI300X"),
)


@pytest.mark.parametrize(("reported", "expected"), REPORTED)
def test_every_common_card_has_its_family(reported: str, expected: str) -> None:
    assert family(reported) == expected
    assert matches(expected, reported)


def accepted(requested: str) -> list[str]:
    return [name for name, _ in REPORTED if matches(requested, name)]


def test_a_spec_name_matches_what_nvml_reports() -> None:
    assert accepted("RTX4090") == ["NVIDIA GeForce RTX 4090"]
    assert accepted("rtx 4090") == accepted("RTX-4090") == accepted("GeForce RTX 4090")
    assert accepted("H100") == ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"]
    assert accepted("A100") == [
        "NVIDIA A100-SXM4-40GB",
        "A100-SXM4-40GB",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-PCIE-40GB",
        "NVIDIA A100 80GB PCIe",
    ]
    assert accepted("RTX3090") == ["NVIDIA GeForce RTX 3090", "GeForce RTX 3090"]
    assert accepted("T4") == ["Tesla T4"]
    assert accepted("V100") == [
        "Tesla V100-SXM2-16GB",
        "Tesla V100-SXM2-32GB",
        "Tesla V100-PCIE-16GB",
    ]
    assert accepted("A6000") == accepted("RTX A6000") == ["NVIDIA RTX A6000"]
    assert accepted("L4") == ["NVIDIA L4"]
    assert accepted("B200") == ["NVIDIA B200"]


def test_one_card_is_not_its_neighbour() -> None:
    """Names that share a prefix are other cards."""
    assert accepted("A10") == ["NVIDIA A10"]  # not the A100, not AWS's A10G
    assert accepted("A10G") == ["NVIDIA A10G"]
    assert accepted("L40") == ["NVIDIA L40"]  # not the L40S
    assert accepted("H200") == ["NVIDIA H200", "NVIDIA H200 NVL"]  # not the GH200
    assert accepted("RTX4090") == ["NVIDIA GeForce RTX 4090"]  # not the D, nor the laptop's
    assert not matches("H100", "NVIDIA H800 PCIe")


def test_further_words_narrow_the_family() -> None:
    assert accepted("A100 80GB") == ["NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"]
    assert accepted("A100-40G") == [
        "NVIDIA A100-SXM4-40GB",
        "A100-SXM4-40GB",
        "NVIDIA A100-PCIE-40GB",
    ]
    assert accepted("A100 SXM") == [
        "NVIDIA A100-SXM4-40GB",
        "A100-SXM4-40GB",
        "NVIDIA A100-SXM4-80GB",
    ]
    assert accepted("H100 PCIe") == accepted("H100PCIe") == ["NVIDIA H100 PCIe"]
    assert accepted("H100 SXM") == accepted("H100-SXM5") == ["NVIDIA H100 80GB HBM3"]
    assert accepted("H200 SXM") == ["NVIDIA H200"]
    assert accepted("V100 32GB") == ["Tesla V100-SXM2-32GB"]
    # The exact name NVML reports always works, and means that card only.
    assert accepted("NVIDIA H100 80GB HBM3") == ["NVIDIA H100 80GB HBM3"]
    assert accepted("NVIDIA A100-PCIE-40GB") == ["NVIDIA A100-PCIE-40GB"]


def test_names_from_the_fake_gpus_and_older_specs_still_match_exactly() -> None:
    """`--fake-gpus RTX4090:24GiB` reports `RTX4090`; specs written for it keep working."""
    assert matches("RTX4090", "RTX4090") and matches("H100", "H100")
    assert matches("A100-80GB", "A100-80GB")
    assert not matches("RTX4090", "H100")


def test_normalise_drops_the_vendor_case_and_punctuation() -> None:
    assert normalise("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert normalise("Tesla V100-SXM2-16GB") == "V100SXM216GB"
    assert normalise("nvidia h100 pcie") == "H100PCIE"


_WORDS = "NVIDIA GeForce RTX GTX 4090 Ti D A6000 H100 80GB HBM3 PCIe SXM4 - Tesla A10G Ada x 40G"
WORDS = tuple(_WORDS.split(" "))
NAMES = st.one_of(
    st.text(max_size=40),
    st.sampled_from([name for name, _ in REPORTED]),
    st.builds(
        " ".join,
        st.lists(
            st.sampled_from(WORDS),
            max_size=6,
        ),
    ),
)


@given(NAMES)
def test_normalisation_is_idempotent(name: str) -> None:
    assert normalise(normalise(name)) == normalise(name)


@given(NAMES)
def test_a_reported_name_always_matches_its_own_family_and_itself(name: str) -> None:
    assert matches(family(name), name)
    assert matches(name, name)
    assert family(family(name)) == family(name)
