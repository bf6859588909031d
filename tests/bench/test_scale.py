"""The scale benchmark's pure helpers: its percentiles and how a load run counts runs, variants
and memory."""

from __future__ import annotations

from bench.scale import _stats
from bench.scale_load import memory_figures, render_load, run_counts, variant_counts


def _run(name: str, version: str, state: str = "success", run_id: str = "r") -> dict:
    return {"conf": {"model_name": name, "version": version}, "state": state, "dag_run_id": run_id}


def test_stats_take_the_nearest_rank_below_for_each_percentile() -> None:
    s = _stats([float(x) for x in range(1, 101)])
    assert (s["median"], s["p90"], s["p95"], s["p99"]) == (50.5, 90.0, 95.0, 99.0)
    one = _stats([3.0])
    assert one["p99"] == one["median"] == 3.0
    assert _stats([]) == dict.fromkeys(("median", "mean", "p90", "p95", "p99"))


def test_each_version_counts_once_and_a_second_run_is_a_duplicate() -> None:
    arrived = [("m", "1"), ("m", "2"), ("n", "1"), ("n", "2")]
    runs = [
        _run("m", "1"),
        _run("m", "1", "failed"),  # the same version twice, whatever the states
        _run("m", "2", "failed"),  # ended: not lost, not succeeded
        _run("n", "1", "running"),  # not ended yet: lost if it stays so
        _run("x", "9", run_id="other"),  # no arrived version
    ]
    c = run_counts(arrived, runs)
    assert (c["arrived"], c["ended"], c["succeeded"]) == (4, 2, 1)
    assert (c["duplicates"], c["lost"], c["strays"]) == (1, 2, 1)
    assert c["duplicate_versions"] == ["m v1"]
    assert c["lost_versions"] == ["n v1", "n v2"]


def test_versions_are_matched_as_strings() -> None:
    assert run_counts([("m", 1)], [_run("m", "1")])["lost"] == 0  # type: ignore[list-item]


def test_variant_versions_are_counted_per_source_version_and_variant() -> None:
    tags = [
        {},  # a source version
        {
            "graphtrim.source.name": "m",
            "graphtrim.source.version": "1",
            "graphtrim.variant": "graph",
        },
        {
            "graphtrim.source.name": "m",
            "graphtrim.source.version": "1",
            "graphtrim.variant": "graph",
        },
        {
            "graphtrim.source.name": "m",
            "graphtrim.source.version": "1",
            "graphtrim.variant": "int8",
        },
        {
            "graphtrim.source.name": "m",
            "graphtrim.source.version": "2",
            "graphtrim.variant": "graph",
        },
    ]
    assert variant_counts(tags) == {"m v1 graph": 2, "m v1 int8": 1, "m v2 graph": 1}


def test_memory_is_reported_at_start_peak_and_end_in_mib() -> None:
    mib = 2**20
    assert memory_figures([100 * mib, 300 * mib, 200 * mib]) == {
        "start_mib": 100.0,
        "peak_mib": 300.0,
        "end_mib": 200.0,
    }
    assert memory_figures([])["peak_mib"] is None


def test_the_load_table_shows_the_counts_and_three_percentiles() -> None:
    stats = {"median": 1.0, "mean": 1.5, "p90": 2.0, "p95": 2.5, "p99": 3.0}
    result = {
        "via": ["events", "webhook"],
        "watch_interval_s": 5.0,
        "arrived": 100,
        "models": 10,
        "arrival_s": 240.0,
        "ended": 100,
        "succeeded": 100,
        "duplicates": 0,
        "variants_registered_twice": 0,
        "lost": 0,
        "runs": 100,
        "events_runs": 60,
        "webhook_answers": {"triggered": 100},
        "seconds": 1800.0,
        "versions_per_hour": 200.0,
        "queued_to_start_s": stats,
        "ready_to_start_s": stats,
        "stage_task_added_s": stats,
        "task_wall_s": stats,
        "memory": {"scheduler": {"start_mib": 300.0, "peak_mib": 420.0, "end_mib": 410.0}},
        "pg_connections_peak": 42,
    }
    table = render_load(result)
    assert "| runs ended | 100 / 100 (100 succeeded) |" in table
    assert "| added in a stage's task (s) | 1.00 / 2.00 / 3.00 |" in table
    assert "| scheduler RSS (MiB) | 300 / 420 / 410 |" in table
    assert "| API server RSS (MiB) | - |" in table
