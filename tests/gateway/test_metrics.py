"""gateway/metrics.py: the exposition text, label checks, buckets and collectors."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, strategies as st

from gateway.metrics import CONTENT_TYPE, DEFAULT_BUCKETS, Registry, Sample


def test_golden_text_counter_gauge_histogram_with_labels_and_escaping() -> None:
    r = Registry()
    requests = r.counter(
        "http_requests_total", 'Requests by path.\nQuotes " stay; a \\ doubles.', ("path", "code")
    )
    requests.inc("/a\\b\nc", "500", amount=2)
    requests.inc('/a"b', "200")
    requests.labels("/a", "200").inc()
    requests.inc("/a", "200")
    temperature = r.gauge("temperature_celsius", "A gauge without labels.")
    temperature.set(21.5)
    temperature.dec(amount=0.5)
    temperature.inc(amount=2)
    latency = r.histogram("latency_seconds", "Latency.", ("cluster",), buckets=(0.25, 1, 10))
    latency.observe(5, "b")
    latency.observe(0.25, "b")
    latency.labels("b").observe(0.125)
    latency.observe(100, "a")
    r.histogram("empty_seconds", "Nothing observed yet.", ("cluster",), buckets=(1,))

    assert r.render().decode() == (
        '# HELP http_requests_total Requests by path.\\nQuotes " stay; a \\\\ doubles.\n'
        "# TYPE http_requests_total counter\n"
        'http_requests_total{path="/a",code="200"} 2.0\n'
        'http_requests_total{path="/a\\"b",code="200"} 1.0\n'
        'http_requests_total{path="/a\\\\b\\nc",code="500"} 2.0\n'
        "# HELP temperature_celsius A gauge without labels.\n"
        "# TYPE temperature_celsius gauge\n"
        "temperature_celsius 23.0\n"
        "# HELP latency_seconds Latency.\n"
        "# TYPE latency_seconds histogram\n"
        'latency_seconds_bucket{cluster="a",le="0.25"} 0\n'
        'latency_seconds_bucket{cluster="a",le="1.0"} 0\n'
        'latency_seconds_bucket{cluster="a",le="10.0"} 0\n'
        'latency_seconds_bucket{cluster="a",le="+Inf"} 1\n'
        'latency_seconds_sum{cluster="a"} 100.0\n'
        'latency_seconds_count{cluster="a"} 1\n'
        'latency_seconds_bucket{cluster="b",le="0.25"} 2\n'
        'latency_seconds_bucket{cluster="b",le="1.0"} 2\n'
        'latency_seconds_bucket{cluster="b",le="10.0"} 3\n'
        'latency_seconds_bucket{cluster="b",le="+Inf"} 3\n'
        'latency_seconds_sum{cluster="b"} 5.375\n'
        'latency_seconds_count{cluster="b"} 3\n'
        "# HELP empty_seconds Nothing observed yet.\n"
        "# TYPE empty_seconds histogram\n"
    )


def test_golden_text_without_labels() -> None:
    r = Registry()
    r.counter("starts_total", "Starts.")
    h = r.histogram("size_bytes", "Sizes.", buckets=(10, 100, math.inf))
    h.observe(50)
    h.observe(-1)
    assert r.render() == (
        b"# HELP starts_total Starts.\n"
        b"# TYPE starts_total counter\n"
        b"starts_total 0.0\n"
        b"# HELP size_bytes Sizes.\n"
        b"# TYPE size_bytes histogram\n"
        b'size_bytes_bucket{le="10.0"} 1\n'
        b'size_bytes_bucket{le="100.0"} 2\n'
        b'size_bytes_bucket{le="+Inf"} 2\n'
        b"size_bytes_sum 49.0\n"
        b"size_bytes_count 2\n"
    )
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_special_values_are_written_the_prometheus_way() -> None:
    r = Registry()
    g = r.gauge("g", "G.", ("k",))
    g.set(math.inf, "a")
    g.set(-math.inf, "b")
    g.set(math.nan, "c")
    g.set(1e-7, "d")
    lines = r.render().decode().splitlines()[2:]
    assert lines == ['g{k="a"} +Inf', 'g{k="b"} -Inf', 'g{k="c"} NaN', 'g{k="d"} 1e-07']


def test_families_in_registration_order_children_sorted() -> None:
    r = Registry()
    z = r.counter("z_total", "Z.", ("k",))
    a = r.counter("a_total", "A.", ("k",))
    for value in ("m", "b", "x", "a"):
        z.inc(value)
        a.inc(value)
    names = [line.split("{")[0] for line in r.render().decode().splitlines() if line[0] != "#"]
    assert names == ["z_total"] * 4 + ["a_total"] * 4
    keys = re.findall(r'k="(.)"', r.render().decode())
    assert keys == ["a", "b", "m", "x"] * 2


def test_bucket_counts_are_cumulative_and_bounds_inclusive() -> None:
    r = Registry()
    h = r.histogram("h", "H.", buckets=(1, 2, 3))
    for value in (0.5, 1, 1.5, 2, 2, 3, 3.5, 99):
        h.observe(value)
    buckets = re.findall(r'h_bucket\{le="([^"]+)"\} (\d+)', r.render().decode())
    # An observation equal to a bound falls in that bound's bucket (le: less or equal).
    assert buckets == [("1.0", "2"), ("2.0", "5"), ("3.0", "6"), ("+Inf", "8")]
    assert "h_count 8\n" in r.render().decode()
    assert h.labels().count == 8


@given(st.lists(st.floats(min_value=-1e3, max_value=1e3), max_size=60))
def test_histogram_buckets_match_a_plain_count(values: list[float]) -> None:
    r = Registry()
    h = r.histogram("h", "H.", buckets=DEFAULT_BUCKETS)
    for value in values:
        h.observe(value)
    text = r.render().decode()
    found = {le: int(n) for le, n in re.findall(r'h_bucket\{le="([^"]+)"\} (\d+)', text)}
    for bound in DEFAULT_BUCKETS:
        assert found[repr(float(bound))] == sum(v <= bound for v in values)
    assert found["+Inf"] == len(values)
    assert f"h_count {len(values)}\n" in text
    assert list(found.values()) == sorted(found.values())


def test_default_buckets_span_llm_latencies() -> None:
    assert DEFAULT_BUCKETS[0] == 0.005
    assert DEFAULT_BUCKETS[-1] == 120
    assert list(DEFAULT_BUCKETS) == sorted(set(DEFAULT_BUCKETS))


def test_collector_samples_appear_grouped_and_sorted_after_families() -> None:
    r = Registry()
    r.counter("first_total", "First.")
    state = {"n": 1.0}

    def replicas() -> list[Sample]:
        return [
            Sample("in_flight", {"replica": "r2", "node": "n1"}, state["n"], help="In flight."),
            Sample("ejected", (("replica", "r1"),), 0),
            Sample("in_flight", {"replica": "r1", "node": 'n"2'}, 3),
            Sample("restarts_total", (), 7, type="counter"),
        ]

    r.collector(replicas)
    expected = (
        "# HELP first_total First.\n"
        "# TYPE first_total counter\n"
        "first_total 0.0\n"
        "# HELP in_flight In flight.\n"
        "# TYPE in_flight gauge\n"
        'in_flight{replica="r1",node="n\\"2"} 3.0\n'
        'in_flight{replica="r2",node="n1"} {n}\n'
        "# TYPE ejected gauge\n"
        'ejected{replica="r1"} 0.0\n'
        "# TYPE restarts_total counter\n"
        "restarts_total 7.0\n"
    )
    assert r.render().decode() == expected.replace("{n}", "1.0")
    state["n"] = 4  # computed at each scrape
    assert r.render().decode() == expected.replace("{n}", "4.0")


def test_collector_sample_names_are_checked_at_scrape() -> None:
    r = Registry()
    r.counter("taken_total", "Taken.")
    r.collector(lambda: [Sample("taken_total", {}, 1)])
    with pytest.raises(ValueError, match="registered metric"):
        r.render()
    bad = Registry()
    bad.collector(lambda: [Sample("in-flight", {}, 1)])
    with pytest.raises(ValueError, match="metric name"):
        bad.render()
    bad_label = Registry()
    bad_label.collector(lambda: [Sample("ok", {"bad-label": "x"}, 1)])
    with pytest.raises(ValueError, match="label name"):
        bad_label.render()


def test_label_count_mismatch_raises_everywhere() -> None:
    r = Registry()
    c = r.counter("c_total", "C.", ("a", "b"))
    g = r.gauge("g", "G.", ("a",))
    h = r.histogram("h", "H.", ("a",))
    plain = r.counter("plain_total", "Plain.")
    message = r"metric c_total: 1 label values for 2 labels \('a', 'b'\)"
    with pytest.raises(ValueError, match=message):
        c.inc("x")
    with pytest.raises(ValueError):
        c.labels("x", "y", "z")
    with pytest.raises(ValueError):
        g.set(1.0)
    with pytest.raises(ValueError):
        g.inc("x", "y")
    with pytest.raises(ValueError):
        h.observe(1.0)
    with pytest.raises(ValueError):
        h.labels("x", "y")
    with pytest.raises(ValueError):
        plain.inc("x")
    # Nothing half-made was left behind by the failures.
    assert "c_total{" not in r.render().decode()


def test_label_values_must_be_strings() -> None:
    c = Registry().counter("c_total", "C.", ("status",))
    with pytest.raises(TypeError, match="not a str"):
        c.inc(200)  # type: ignore[arg-type]


def test_children_are_cached_and_shared_with_the_parent_calls() -> None:
    r = Registry()
    c = r.counter("c_total", "C.", ("k",))
    child = c.labels("x")
    assert c.labels("x") is child
    child.inc()
    c.inc("x", amount=2.5)
    assert child.value == 3.5
    g = r.gauge("g", "G.", ("k",))
    g.set(5, "x")
    g.labels("x").dec(2)
    g.inc("x")
    assert g.labels("x").value == 4.0


def test_counters_only_go_up() -> None:
    c = Registry().counter("c_total", "C.", ("k",))
    with pytest.raises(ValueError, match="only goes up"):
        c.inc("x", amount=-1)
    with pytest.raises(ValueError, match="only goes up"):
        c.labels("x").inc(-0.5)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda r: r.counter("bad-name", "x"), "metric name 'bad-name'"),
        (lambda r: r.counter("0starts_with_digit", "x"), "metric name"),
        (lambda r: r.gauge("g", "x", ("bad label",)), "label name 'bad label'"),
        (lambda r: r.gauge("g", "x", ("__reserved",)), "label name '__reserved'"),
        (lambda r: r.gauge("g", "x", ("a", "a")), "duplicate label names"),
        (lambda r: r.histogram("h", "x", ("le",)), "`le` is reserved"),
        (lambda r: r.histogram("h", "x", buckets=()), "at least one finite bucket"),
        (lambda r: r.histogram("h", "x", buckets=(1, 1)), "strictly increasing"),
        (lambda r: r.histogram("h", "x", buckets=(2, 1)), "strictly increasing"),
        (lambda r: r.histogram("h", "x", buckets=(math.nan,)), "finite"),
        (lambda r: r.counter("taken_total", "again"), "taken_total is already registered"),
        (lambda r: r.gauge("hist_count", "x"), "hist_count is already registered"),
    ],
)
def test_bad_registrations_raise(build: object, message: str) -> None:
    r = Registry()
    r.counter("taken_total", "Taken.")
    r.histogram("hist", "Hist.")
    with pytest.raises(ValueError, match=re.escape(message)):
        build(r)  # type: ignore[operator]


def test_colons_are_allowed_in_metric_names() -> None:
    r = Registry()
    r.gauge("job:ratio:rate5m", "Recording-rule style.")
    assert b"job:ratio:rate5m 0.0" in r.render()
