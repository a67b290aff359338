"""GPU model names: what a spec asks for (`H100`, `RTX4090`) against what NVML reports.

NVML names a card the way its vendor markets it: "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB
HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4". A spec names the card the way people say it. Both
are compared here, in three steps (docs/gpus.md, "Model names"):

1. `normalise`: upper case, only letters and digits, the vendor's words in front dropped
   ("NVIDIA", "GeForce", "Tesla", "Quadro"; "AMD", "Instinct", "Radeon"): "NVIDIA GeForce RTX
   4090" and "rtx-4090" are both `RTX4090`. Two names that normalise alike are the same card.
2. `family`: the card's family, from the first words after the vendor's: a data-centre id
   (`H100`, `A100`, `A10G`, `L40S`, `T4`, `GH200`, `MI300X`), or `RTX`/`GTX` with its number
   and the words that make it another card (`Ti`, `SUPER`, `D`, `Ada`, `Laptop`: the RTX
   3090 Ti is not an RTX 3090). "NVIDIA RTX A6000" is the family `A6000`. A name none of this
   fits is its own family (its normalised form).
3. `matches`: a requested name matches a reported one when the two normalise alike, or when
   they are of one family and every further word of the request is among the reported
   name's: `A100 80GB` matches "NVIDIA A100-SXM4-80GB" and "NVIDIA A100 80GB PCIe" but not
   "NVIDIA A100-PCIE-40GB"; `H100 PCIe` matches "NVIDIA H100 PCIe" only. `SXM` stands for any
   `SXM<n>`, and an H100 that names HBM memory, or an H200, with no PCIe or NVL form is SXM (NVML
   calls the SXM5 H100 "NVIDIA H100 80GB HBM3", the SXM H200 "NVIDIA H200"). `80G` is `80GB`.

Pure and dependency-free, so the scheduler (actors/) and the agent (nodeagent/) share it.
"""

from __future__ import annotations

import re

__all__ = ["family", "matches", "normalise"]

_VENDOR_WORDS = ("NVIDIA", "GEFORCE", "TESLA", "QUADRO", "AMD", "INSTINCT", "RADEON")
# A data-centre card's id: H100, A10G, L40S, T4, V100, B200, GH200, GB200, MI300X.
_ID = re.compile(r"^(?:GH|GB|MI|[A-Z])\d+[A-Z]?$")
# Words after an RTX/GTX number that name another card, not a variant of the same one.
_SUFFIXES = frozenset({"TI", "SUPER", "D", "ADA", "LAPTOP"})
_GLUED = re.compile(r"^(RTX|GTX)(\d+)((?:TI|SUPER|D|ADA|LAPTOP)*)$")
_GIGS = re.compile(r"^\d+G$")
_SXM = re.compile(r"^SXM\d+$")


def normalise(name: str) -> str:
    """`name` in upper case, letters and digits only, the vendor's words in front dropped.
    Idempotent: normalise(normalise(x)) == normalise(x)."""
    key = re.sub(r"[^0-9A-Z]", "", name.upper())
    stripped = True
    while stripped:
        stripped = False
        for word in _VENDOR_WORDS:
            if key.startswith(word):
                key = key[len(word) :]
                stripped = True
    return key


def family(name: str) -> str:
    """The card's family: `H100` for "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe",
    `RTX4090` for "NVIDIA GeForce RTX 4090"; the normalised name when no rule fits."""
    return _parse(name)[0]


def matches(requested: str, reported: str) -> bool:
    """Whether a spec asking for `requested` accepts a GPU NVML calls `reported`."""
    want = normalise(requested)
    if want == normalise(reported):
        return True
    want_family, qualifiers = _parse(requested)
    have_family, have = _parse(reported)
    if want_family != have_family:
        return False
    offered = set(have) | _implied(have_family, have)
    return all(q in offered for q in qualifiers)


def _tokens(name: str) -> list[str]:
    tokens = re.findall(r"[0-9A-Z]+", name.upper())
    while tokens and tokens[0] in _VENDOR_WORDS:
        tokens.pop(0)
    return tokens


def _parse(name: str) -> tuple[str, tuple[str, ...]]:
    """(family, the further words, canonical) of `name`."""
    tokens = _tokens(name)
    if tokens:
        glued = _GLUED.match(tokens[0])
        if glued:  # "RTX4090", "RTX3090Ti": as if written apart
            return glued[1] + glued[2] + glued[3], _qualifiers(tokens[1:])
        if tokens[0] in ("RTX", "GTX") and len(tokens) > 1:
            if tokens[1].isdigit():
                end = 2
                while end < len(tokens) and tokens[end] in _SUFFIXES:
                    end += 1
                return "".join(tokens[:end]), _qualifiers(tokens[end:])
            if _ID.match(tokens[1]):  # "NVIDIA RTX A6000"
                return tokens[1], _qualifiers(tokens[2:])
        elif _ID.match(tokens[0]):
            return tokens[0], _qualifiers(tokens[1:])
    return normalise(name), ()


def _qualifiers(tokens: list[str]) -> tuple[str, ...]:
    return tuple(t + "B" if _GIGS.match(t) else t for t in tokens)


def _implied(card: str, words: tuple[str, ...]) -> set[str]:
    """Words a reported name stands for without writing them."""
    implied = {"SXM" for w in words if _SXM.match(w)}
    forms = {"PCIE", "NVL"}
    hbm = any(w.startswith("HBM") for w in words)
    if card in ("H100", "H200") and not forms & set(words) and (hbm or card == "H200"):
        implied |= {"SXM", "SXM5"}  # NVML: "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    return implied
