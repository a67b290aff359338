"""The figures of `bench/failover.py --classes` (bench/_failover_ha.py): per class and run,
the summary over runs, the targets met, the printed table, and what the continued old leader
wrote, from its strace (a helper, not a benchmark)."""

from __future__ import annotations

import contextlib
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

TARGET_S = 5.0  # issue 16: a standby leads and accepts `cluster scale` within 5 s
_NOT_OWN = ("lease", "roster", "JetStream", "(", "events feed")
_STRACE_LINE = re.compile(r"^\d+\s+(\d+\.\d+)\s+(\w+)\((\d+)<(TCP:\[[^\]]*\]|[^>]*)>(.*)$")
_PUB = re.compile(r"H?PUB ([^ \\]+)")
_LOG_APPENDS = "gpumesh.v1.log (event log appends)"
_EVENT_RELAYS = "events feed (gpumesh.v1.events: relays of committed events)"
_PROTOCOL = re.compile(r'^, "(SUB|UNSUB|PING|PONG|CONNECT)')


def summarise(runs: list[dict[str, Any]], classes: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in classes:
        mine = [r for r in runs if r["class"] == kind]
        if not mine:
            continue

        def spread(key: str, rs: list[dict[str, Any]] = mine) -> dict[str, float | None]:
            values = [r[key] for r in rs if r[key] is not None]
            if not values:
                return {"median": None, "min": None, "max": None, "missing": len(rs)}
            return {
                "median": round(statistics.median(values), 3),
                "min": min(values),
                "max": max(values),
                "missing": len(rs) - len(values),
            }

        out[kind] = {
            "runs": len(mine),
            "leads_again_s": spread("leads_again_s"),
            "without_leader_s": spread("without_leader_s"),
            "scale_accepted_s": spread("scale_accepted_s"),
            "sent": [r["requests"]["sent"] for r in mine],
            "failed_before_first_byte": [r["requests"]["failed_before_first_byte"] for r in mine],
            "failed_after_first_byte": [r["requests"]["failed_after_first_byte"] for r in mine],
            "leader_changed": [r["leader_changed"] for r in mine],
            "offline_verdicts": [r["offline_verdicts"] for r in mine],
            "replicas_placed_again": [r["replicas_placed_again"] for r in mine],
            "old_leader_wrote": [_wrote(r["old_leader"]) for r in mine if "old_leader" in r],
        }
    return out


def _wrote(old: dict[str, Any]) -> str:
    if "event_log_writes" not in old:
        return f"? ({old['method']})"
    return (
        f"{old['event_log_writes']} log writes, {old['domain_publishes']} other own publishes "
        f"({', '.join(k for k in old['publishes'] if not k.startswith(_NOT_OWN)) or 'none'}), "
        f"{old.get('event_relays', 0)} event relays"
    )


def met(result: dict[str, Any]) -> bool:
    """Every class within the target, no request failed, no old leader wrote."""
    for r in result["runs"]:
        req = r["requests"]
        if req["failed_before_first_byte"] or req["failed_after_first_byte"]:
            return False
        if r["scale_accepted_s"] is None or r["scale_accepted_s"] > TARGET_S:
            return False
        if r["leads_again_s"] is None or r["leads_again_s"] > TARGET_S:
            return False
        old = r.get("old_leader")
        if old and (old.get("event_log_writes") or old.get("domain_publishes")):
            return False
    return True


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def print_class(r: dict[str, Any]) -> None:
    q = r["requests"]
    print(
        f"run {r['run']} {r['class']}: victim {r['victim']}"
        + (f" ({r['victim_why']})" if r.get("victim_why") else "")
        + f", leader {r['leader_before']} term {r['term_before']} -> {r['leader_after']} term "
        f"{r['term_after']}",
        flush=True,
    )
    print(
        f"  leads again {_s(r['leads_again_s'])} (none led for {_s(r['without_leader_s'])}), "
        f"cluster scale accepted "
        f"{_s(r['scale_accepted_s'])} ({r['scale_attempts']} attempts "
        f"{dict(r['scale_errors']) or ''}), lease absent from {_s(r['lease_absent_first_s'])}, "
        f"restored at {_s(r['restored_s'])}, steady "
        + (
            f"{r['steady_after_load_s']:.1f} s after the load"
            if r["steady_after_load_s"] is not None
            else f"NEVER ({r['not_steady']})"
        )
    )
    print(
        f"  requests {q['sent']:,}: failed before the first byte {q['failed_before_first_byte']}, "
        f"after it {q['failed_after_first_byte']}"
        + (
            f" {q['failed_kinds']} started {q['failed_started_s']} s from the fault"
            if q["failed_kinds"] or q["failed_after_first_byte"]
            else ""
        )
        + f"; p50/p99 from the fault {_ms(q['p50_ms_from_fault'])}/{_ms(q['p99_ms_from_fault'])}"
        f" ms; offline verdicts {r['offline_verdicts']}, replicas moved "
        f"{r['replicas_placed_again']}; gateway {r['gateway_counters'] or 'no retries'}"
    )
    old = r.get("old_leader")
    if old:
        wrote = (
            f"event log writes {old['event_log_writes']}, domain publishes "
            f"{old['domain_publishes']} {old['publishes']}, other {old['other_writes']}"
            if "event_log_writes" in old
            else old["method"]
        )
        print(
            f"  old leader after SIGCONT: leadership_lost after "
            f"{_s(old['leadership_lost_after_cont_s'])} ({old['reason']}); {wrote}"
        )
    if r.get("streams_short_of_copies_after"):
        print(f"  streams with fewer than 3 copies after: {r['streams_short_of_copies_after']}")
    for line in r["leadership_log"]:
        print(f"    {line}")
    for ex in q["examples"]:
        print(f"    e.g. {ex}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_table(result: dict[str, Any]) -> None:
    print()
    print(
        f"{result['clients']} clients ({result['streaming_clients']} streaming) through the "
        f"gateway, {result['class_seconds']:g} s of load per class, the fault at "
        f"{result['fault_at_s']:g} s; lease {result['lease']}; log {result['controller_log']}; "
        "per run, then median [min-max]"
    )
    print(
        "| class | runs | a controller leads again | none leads for | `cluster scale` accepted | "
        "requests | failed before the 1st byte | failed after it | leader changed | offline "
        "verdicts, replicas moved | old leader wrote |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |")
    for kind, s in result["summary"].items():

        def fmt(d: dict[str, Any]) -> str:
            if d["median"] is None:
                return "never"
            missing = f", {d['missing']} never" if d["missing"] else ""
            return f"{d['median']:.2f} s [{d['min']:.2f}-{d['max']:.2f}]{missing}"

        moved = zip(s["offline_verdicts"], s["replicas_placed_again"], strict=True)
        print(
            f"| {kind} | {s['runs']} | {fmt(s['leads_again_s'])} | {fmt(s['without_leader_s'])} "
            f"| {fmt(s['scale_accepted_s'])} "
            f"| {statistics.median(s['sent']):,.0f} | "
            f"{' '.join(map(str, s['failed_before_first_byte']))} | "
            f"{' '.join(map(str, s['failed_after_first_byte']))} | "
            f"{' '.join('yes' if c else 'no' for c in s['leader_changed'])} | "
            f"{' '.join(f'{o},{m}' for o, m in moved)} | "
            f"{'; '.join(s['old_leader_wrote']) or '-'} |"
        )
    print(f"target: leads again and accepts `cluster scale` within {TARGET_S:g} s; 0 failed")


def _old_leader_writes(trace: Path, cont_ns: int, db_name: str) -> dict[str, Any]:
    """The old leader's write system calls from SIGCONT on, by what they wrote to."""
    event_log = 0
    publishes: Counter[str] = Counter()
    other: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for line in trace.read_text(errors="replace").splitlines():
            m = _STRACE_LINE.match(line)
            if m is None or float(m.group(1)) * 1e9 < cont_ns:
                continue
            target, rest = m.group(4), m.group(5)
            if db_name in target:
                event_log += 1
            elif subjects := _PUB.findall(rest):
                for subject in subjects:
                    publishes[_subject_kind(subject)] += 1
            elif target.startswith("socket:[") and _PROTOCOL.search(rest):
                publishes["(NATS protocol: SUB, UNSUB, PING, PONG)"] += 1
            else:
                other[Path(target).name or target] += 1
    # Its own word: appends to the log (the SQLite file, or the JetStream log's subjects),
    # commands, replies (heartbeat acks, API answers), routing tables. Not its own word: the
    # lease campaign, its roster report, relays of committed events to the events feed
    # (idempotent: Nats-Msg-Id is the event's id), JetStream API calls, protocol lines.
    appends = publishes.get(_LOG_APPENDS, 0)
    domain = sum(n for k, n in publishes.items() if not k.startswith(_NOT_OWN)) - appends
    return {
        "method": "strace",
        "event_log_writes": event_log + appends,
        "domain_publishes": domain,
        "event_relays": publishes.get(_EVENT_RELAYS, 0),
        "publishes": dict(publishes),
        "other_writes": dict(other),
    }


def _subject_kind(subject: str) -> str:
    if subject.startswith("gpumesh.v1.leader."):
        return "lease (campaign)"
    if subject.startswith("gpumesh.v1.controllers."):
        return "roster (its role and term)"
    if subject.startswith("$JS.API."):
        return "JetStream API " + ".".join(subject.split(".")[2:4])
    if subject.startswith("gpumesh.v1.log."):
        return _LOG_APPENDS
    if subject.startswith("gpumesh.v1.events."):
        return _EVENT_RELAYS
    if subject.startswith("_INBOX."):
        return "replies (heartbeat acks, API answers)"
    parts = subject.split(".")
    return ".".join(parts[:3]) + (".*." + parts[-1] if len(parts) > 4 else "")
