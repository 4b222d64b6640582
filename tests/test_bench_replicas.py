"""The replicas bench's --repeat summary: ratios per round against that round's baseline row, their
median, the pooled ratios and the noise floor (the baseline against itself), on hand-made rounds."""

import pytest

from bench.routing.replicas import repeat_summary

pytestmark = pytest.mark.unit


def _row(name: str, ttfts: list[float]) -> dict:
    from bench.routing.client import pct

    return {"policy": name, "ttfts": ttfts, "ttft_p99": pct(ttfts, 99), "ttft_mean": sum(ttfts) / len(ttfts)}


def test_ratios_are_per_round_and_the_median_ignores_one_bad_round():
    rounds = [
        [_row("1 replica", [1.0] * 10), _row("4 replicas + redis", [1.1] * 10)],  # +10 %
        [_row("1 replica", [2.0] * 10), _row("4 replicas + redis", [2.0] * 10)],  # level, on a slow round
        [_row("1 replica", [1.0] * 10), _row("4 replicas + redis", [3.0] * 10)],  # +200 %: one noisy round
    ]
    s = repeat_summary(rounds)
    r = s["rows"]["4 replicas + redis"]
    assert s["base"] == "1 replica"
    assert r["p99"] == pytest.approx([0.1, 0.0, 2.0])
    assert r["mean"] == pytest.approx([0.1, 0.0, 2.0])
    assert r["p99_median"] == pytest.approx(0.1)
    # Pooled: 30 TTFTs per row; the 99th percentile is the worst of each.
    assert r["pooled_p99"] == pytest.approx(3.0 / 2.0 - 1)
    assert r["pooled_mean"] == pytest.approx((1.1 + 2.0 + 3.0) / (1.0 + 2.0 + 1.0) - 1)
    # The noise floor: the baseline's rounds against their median (1.0).
    assert s["floor"]["p99"] == pytest.approx([1.0, 2.0, 1.0])
    assert s["floor"]["p99_vs_median"] == pytest.approx([0.0, 1.0, 0.0])
    assert s["floor"]["mean_vs_median"] == pytest.approx([0.0, 1.0, 0.0])


def test_every_row_after_the_first_is_summarised_by_name():
    rounds = [[_row("1 replica", [1.0, 2.0]), _row("1 replica + redis", [1.0, 2.0]), _row("4 replicas + redis", [2.0, 4.0])]] * 2
    s = repeat_summary(rounds)
    assert list(s["rows"]) == ["1 replica + redis", "4 replicas + redis"]
    assert s["rows"]["1 replica + redis"]["p99_median"] == pytest.approx(0.0)
    assert s["rows"]["4 replicas + redis"]["mean_median"] == pytest.approx(1.0)


def test_state_errors_are_read_from_the_gateways_own_exposition():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from bench.routing.replicas import parse_state_errors
    from gateway.state import stats

    # The gateway's own counter, rendered as its /metrics renders it (a fresh registry of the same
    # metric, so other tests' counts do not leak in).
    registry = CollectorRegistry()
    errors = Counter(stats.STATE_ERRORS._name, stats.STATE_ERRORS._documentation, ["op"], registry=registry)
    errors.labels(op="load").inc(3)
    errors.labels(op="admit").inc()
    text = generate_latest(registry).decode()
    assert parse_state_errors(text) == {"load": 3, "admit": 1}
    assert parse_state_errors("# nothing failed\n") == {}
