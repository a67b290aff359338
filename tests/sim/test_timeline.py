"""The fault timeline the simulator, `gpumesh chaos` and its dry run all walk (sim/timeline.py)."""

from __future__ import annotations

from sim.scenario import FaultPlan
from sim.timeline import End, FaultTimeline, Start


def walk(faults: list[FaultPlan], *, until: float, victims: dict[int, list[str]]) -> list[str]:
    """What a runner does, as text: each fault applied strikes its victims, each lasting its
    duration from its planned start."""
    timeline: FaultTimeline[str] = FaultTimeline()
    done = []
    for step in timeline.steps(faults, until=until):
        if isinstance(step, End):
            done.append(f"{step.at:g} end {step.what} ({step.undo})")
            continue
        assert isinstance(step, Start)
        index = faults.index(step.fault)
        done.append(f"{step.at:g} start {step.fault.kind}")
        for node in victims.get(index, []):
            what = f"{step.fault.kind} {node}"
            timeline.ends_after(step.fault, step.at, what, f"undo #{index}")
    done += [f"cut {end.what}" for end in timeline.cut()]
    assert timeline.pending == 0
    return done


def test_ends_come_before_a_start_at_the_same_instant_and_by_name_among_themselves() -> None:
    faults = [
        FaultPlan(at_s=10, kind="power_loss", nodes="2", duration_s=20),
        FaultPlan(at_s=20, kind="hang", nodes="1", duration_s=10),
        FaultPlan(at_s=30, kind="thermal", nodes="1", duration_s=5),
        FaultPlan(at_s=40, kind="partition", nodes="1"),  # no end: cut when the faults stop
        FaultPlan(at_s=45, kind="ecc", nodes="1", duration_s=100),  # ends after they stop
    ]
    victims = {0: ["node-2", "node-10"], 1: ["node-1"], 2: ["node-3"], 3: ["node-4"],
               4: ["node-5"]}  # fmt: skip
    assert walk(faults, until=60, victims=victims) == [
        "10 start power_loss",
        "20 start hang",
        "30 end hang node-1 (undo #1)",  # "hang" < "power_loss"
        "30 end power_loss node-10 (undo #0)",
        "30 end power_loss node-2 (undo #0)",
        "30 start thermal",  # an end and a fault at one instant: the end first
        "35 end thermal node-3 (undo #2)",
        "40 start partition",
        "45 start ecc",
        "cut ecc node-5",
    ]


def test_cut_ends_the_rest_by_due_time_then_in_the_order_they_began() -> None:
    faults = [
        FaultPlan(at_s=1, kind="thermal", nodes="1", duration_s=50),
        FaultPlan(at_s=2, kind="hang", nodes="1", duration_s=49),
        FaultPlan(at_s=3, kind="ecc", nodes="1", duration_s=10),
    ]
    victims = {0: ["node-9"], 1: ["node-1"], 2: ["node-5"]}
    assert walk(faults, until=10, victims=victims)[-3:] == [
        "cut ecc node-5",  # due at 13
        "cut thermal node-9",  # due at 51, began first
        "cut hang node-1",
    ]


def test_an_end_registered_from_the_runners_own_clock() -> None:
    # The simulator registers from virtual time, which may be the planned instant's float
    # neighbour: the end is due from there, not from at_s.
    timeline: FaultTimeline[None] = FaultTimeline()
    fault = FaultPlan(at_s=0.3, kind="hang", duration_s=1.0)
    steps = timeline.steps([fault], until=5)
    assert next(steps) == Start(0.3, fault)
    timeline.ends_after(fault, 0.30000000000000004, "hang node-0", None)
    end = next(steps)
    assert isinstance(end, End) and end.at == 0.30000000000000004 + 1.0
    assert list(steps) == []
