"""What a published benchmark JSON records about how it was run."""

from __future__ import annotations


def test_published_arguments_name_paths_inside_the_checkout_relative_to_it() -> None:
    import argparse

    from bench import publish

    args = argparse.Namespace(
        corpus=str(publish.REPO / "bench" / "corpus-models"),
        out=publish.REPO / "bench" / "results-scale",
        elsewhere="/opt/models",
        via="events,webhook",
        empty="",
        versions=100,
        publish=True,
    )
    given = publish.envelope("scale", [], args)["args"]
    assert given == {
        "corpus": "bench/corpus-models",
        "out": "bench/results-scale",
        "elsewhere": "/opt/models",
        "via": "events,webhook",
        "empty": "",
        "versions": 100,
    }
