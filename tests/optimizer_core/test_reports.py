"""The Markdown and self-contained HTML reports of an evaluation, their files, ``graphtrim
report``, and building and judging variants in one call (``build_and_evaluate``).

The reports are rendered from real evaluations of the digits CNN and its variants.
"""

from __future__ import annotations

import base64
import html
import html.parser
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from graphtrim.cli import main
from graphtrim.data import EvalData, input_specs, load_npz
from graphtrim.examples.digits import DigitsTask
from graphtrim.gates import GatePolicy, evaluate
from graphtrim.gates.report import HEADER, render_html, render_markdown
from graphtrim.stages.pipeline import VariantsResult, build_and_evaluate
from tests.optimizer_core.test_gates import break_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_TITLES = {
    "Latency distributions",
    "Speed against accuracy",
    "Accuracy per variant",
    "Nodes removed per pass",
    "Op types before and after",
}
HEADER_LINE = "| " + " | ".join(HEADER) + " |"


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def parse_tags(text: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(text)
    parser.close()
    return parser.tags


def table_rows(markdown: str) -> list[list[str]]:
    """The summary table's body rows, cell by cell."""
    lines = markdown.splitlines()
    start = lines.index(HEADER_LINE) + 2  # past the header and the alignment row
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def eval_data(digits_task: DigitsTask) -> EvalData:
    return load_npz(digits_task.eval, input_specs(digits_task.model))


@pytest.fixture(scope="module")
def built(digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory) -> VariantsResult:
    """graph and int8-static variants, built and judged, latency measured but not judged (its
    verdict would depend on the machine), so every plot has data."""
    unjudged = {"min_speedup": None}
    policy = GatePolicy(
        {
            "defaults": {"latency": {**unjudged, "runs": 20, "warmup": 2}},
            # the built-in graph entry has a speedup threshold of its own
            "variants": {"graph": {"latency": unjudged}},
        }
    )
    return build_and_evaluate(
        digits_task.model,
        tmp_path_factory.mktemp("built"),
        ["graph", "int8-static"],
        calibration=digits_task.calibration,
        eval_data=digits_task.eval,
        policy=policy,
    )


@pytest.fixture(scope="module")
def doc(built: VariantsResult) -> dict[str, Any]:
    """The evaluation's JSON document, as a reader of the JSON file gets it."""
    return json.loads(json.dumps(built.evaluation.to_json()))


# ---------------------------------------------------------------------------------------------
# Markdown


def test_markdown_has_the_summary_table(doc: dict[str, Any]) -> None:
    text = render_markdown(doc)
    assert text.startswith("# graphtrim evaluation")
    assert text.count(HEADER_LINE) == 1
    rows = table_rows(text)
    assert [r[:2] for r in rows] == [["graph", "PASS"], ["int8-static", "PASS"]]
    assert all(len(r) == len(HEADER) for r in rows)
    int8 = rows[1]
    measured = next(g for g in doc["variants"][1]["gates"] if g["gate"] == "accuracy")["measured"]
    assert int8[HEADER.index("cosine")] == f"{measured['cosine']:.6f}"
    assert "## graph: PASS" in text and "## int8-static: PASS" in text
    assert f"Policy {doc['policy_hash']}" in text
    assert doc["fingerprint"]["eval_data_sha256"][:16] in text


def test_markdown_marks_a_failed_variant(
    digits_task: DigitsTask, built: VariantsResult, eval_data: EvalData, tmp_path: Path
) -> None:
    broken = break_model(digits_task.model, tmp_path / "broken.onnx")
    evaluation = evaluate(
        digits_task.model,
        {"graph": built.outputs["graph"], "broken": broken},
        policy=GatePolicy({"defaults": {"latency": False}}),
        data=eval_data,
    )
    text = render_markdown(evaluation.to_json())
    assert [r[:2] for r in table_rows(text)] == [["graph", "PASS"], ["broken", "FAIL"]]
    assert "## broken: FAIL" in text
    line = next(x for x in text.splitlines() if x.startswith("- **accuracy** FAIL"))
    assert "accuracy dropped" in line and "cosine" in line
    assert "Passed: graph." in text


def test_a_passing_gate_shows_its_numbers_against_its_thresholds(doc: dict[str, Any]) -> None:
    """Not only "within thresholds": the measured value beside each threshold applied."""
    gate = next(g for g in doc["variants"][1]["gates"] if g["gate"] == "accuracy")
    assert gate["status"] == "pass" and gate["thresholds"]["min_cosine"] is not None
    cosine = (
        f"cosine {gate['measured']['cosine']:.4g} (limit >= {gate['thresholds']['min_cosine']:.4g})"
    )
    line = next(
        x
        for x in render_markdown(doc).split("## int8-static")[1].splitlines()
        if x.startswith("- **accuracy** PASS")
    )
    assert "within thresholds: " in line and cosine in line, line
    size = next(g for g in doc["variants"][1]["gates"] if g["gate"] == "size")
    page = html.unescape(render_html(doc))
    assert f"size ratio {size['measured']['ratio']:.4g} (limit <= " in page and cosine in page


def test_html_without_matplotlib_has_its_tables_and_says_how_to_get_the_plots(
    doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    text = render_html(doc)
    assert not [a for t, a in parse_tags(text) if t == "img"]
    assert "pip install 'graphtrim[reports]'" in text
    assert text.count('<td class="ok">PASS</td>') == 2


# ---------------------------------------------------------------------------------------------
# HTML


def test_html_is_self_contained_and_shows_the_plots(doc: dict[str, Any]) -> None:
    import matplotlib.image

    text = render_html(doc)
    tags = parse_tags(text)
    images = [attrs for tag, attrs in tags if tag == "img"]
    assert len(images) == 5
    assert {a["alt"] for a in images} == PLOT_TITLES
    for attrs in images:
        src = attrs["src"] or ""
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix), src[:40]
        data = base64.b64decode(src[len(prefix) :], validate=True)
        assert data.startswith(PNG_SIGNATURE)
        pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
        assert pixels.ndim == 3 and pixels.shape[1] > 200 and pixels.shape[0] > 100
    # nothing is fetched when the report is opened
    for tag, attrs in tags:
        assert tag not in ("script", "link", "iframe")
        for key in ("src", "href"):
            value = (attrs.get(key) or "").lower()
            assert not value.startswith(("http:", "https:", "//")), (tag, value)
    # the summary table: one row per variant with its verdict cell marked
    assert text.count('<td class="ok">PASS</td>') == 2


def test_html_leaves_out_plots_without_data(doc: dict[str, Any]) -> None:
    """Without latency samples or a build record there is nothing to draw for those plots (the
    speed-accuracy plot takes the gates' numbers)."""
    bare = json.loads(json.dumps(doc))
    bare["latency_samples_ms"] = {}
    for v in bare["variants"]:
        v["build"] = None
    images = [a for t, a in parse_tags(render_html(bare)) if t == "img"]
    assert {a["alt"] for a in images} == {
        "Speed against accuracy",
        "Accuracy per variant",
        "Op types before and after",
    }


def _with_variant(doc: dict[str, Any], like: str, name: str, **changes: Any) -> dict[str, Any]:
    """``doc`` plus a copy of variant ``like`` named ``name`` with its speedup, cosine, bytes
    or verdict changed."""
    out = json.loads(json.dumps(doc))
    v = json.loads(json.dumps(next(x for x in out["variants"] if x["name"] == like)))
    v["name"] = name
    for g in v["gates"]:
        if g["gate"] == "latency" and "speedup" in changes:
            g["measured"]["speedup_p50"] = changes["speedup"]
        if g["gate"] == "accuracy" and "cosine" in changes:
            g["measured"]["cosine"] = changes["cosine"]
            g["measured"].pop("metric_drop", None)
    if "bytes" in changes:
        v["model"]["bytes"] = changes["bytes"]
    if changes.get("failed"):
        v["passed"] = False
    out["variants"].append(v)
    out["passed"] = [x["name"] for x in out["variants"] if x["passed"]]
    return out


def test_the_pareto_front_holds_the_passing_variants_nothing_beats(doc: dict[str, Any]) -> None:
    from graphtrim.gates.readings import pareto_front, points

    base = next(v for v in doc["variants"] if v["name"] == "int8-static")
    speed, _, ratio = points(doc)["int8-static"]
    nbytes = base["model"]["bytes"]
    # a copy that is slower and larger at the same accuracy is dominated; a copy that beats
    # everything but failed its gates is neither on the front nor pushes others off it
    worse = _with_variant(doc, "int8-static", "worse", speedup=speed * 0.5, bytes=nbytes * 2)
    failed = _with_variant(
        worse, "int8-static", "failed", speedup=speed * 10, bytes=nbytes // 10, failed=True
    )
    front = pareto_front(failed)
    assert "worse" not in front and "failed" not in front
    assert "int8-static" in front, points(failed)
    # a passing variant that is faster and smaller with the same accuracy takes its place
    better = _with_variant(doc, "int8-static", "better", speedup=speed * 2, bytes=nbytes // 2)
    assert "int8-static" not in pareto_front(better) and "better" in pareto_front(better)
    # a variant the reference itself beats (slower, larger, less accurate) is never on it
    slow = _with_variant(
        doc, "int8-static", "slow", speedup=0.5, bytes=doc["reference"]["bytes"] * 2, cosine=0.9
    )
    assert "slow" not in pareto_front(slow)
    assert ratio > 0


def test_evaluations_made_apart_combine_into_one_comparison(doc: dict[str, Any]) -> None:
    """One task per variant writes its own evaluation; the comparison puts them side by side
    under the reference's registry name, each with its own interleaved reference samples."""
    from graphtrim.gates.report import combine

    parts = []
    for v in doc["variants"]:
        part = json.loads(json.dumps(doc))
        part["variants"] = [v]
        part["passed"] = [v["name"]] if v["passed"] else []
        part["latency_samples_ms"] = {
            "reference": doc["latency_samples_ms"]["reference"],
            v["name"]: doc["latency_samples_ms"][v["name"]],
        }
        parts.append(part)
    merged = combine(parts, label="models:/digits/1")
    assert [v["name"] for v in merged["variants"]] == ["graph", "int8-static"]
    assert set(merged["passed"]) == set(doc["passed"])
    assert set(merged["latency_samples_ms"]) == {
        "reference (with graph)",
        "graph",
        "reference (with int8-static)",
        "int8-static",
    }
    page = html.unescape(render_html(merged))
    assert "<title>graphtrim comparison: models:/digits/1</title>" in page
    assert "Reference <code>models:/digits/1</code>" in page
    assert doc["reference"]["path"] not in page  # a temporary file means nothing to a reader
    assert "<h2>Builds</h2>" in page and "<h2>Op types</h2>" in page
    # the op table: the quantized variant's QuantizeLinear nodes against none in the reference
    assert re.search(r"<td>QuantizeLinear</td><td>0</td><td>0</td><td>\d+ \(\+\d+\)</td>", page)
    with pytest.raises(ValueError):
        combine([])


# ---------------------------------------------------------------------------------------------
# report files and ``graphtrim report``


def test_write_replaces_the_reports_and_leaves_no_temporary_files(
    built: VariantsResult, tmp_path: Path
) -> None:
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "evaluation.json").write_text("stale")
    written = built.evaluation.write(folder)
    assert set(written) == {"json", "markdown", "html"}
    assert sorted(os.listdir(folder)) == ["evaluation.html", "evaluation.json", "evaluation.md"]
    doc = json.loads(written["json"].read_text())
    assert doc == json.loads(json.dumps(built.evaluation.to_json()))
    assert written["markdown"].read_text() == render_markdown(doc)
    assert written["html"].read_text().count("<img ") == len(PLOT_TITLES)

    other = built.evaluation.write(folder, stem="again")
    assert other["json"] == folder / "again.json"
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]


def test_report_command_round_trips_the_json(
    built: VariantsResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = built.evaluation.write(tmp_path / "reports")
    doc = json.loads(written["json"].read_text())

    out_html = tmp_path / "again.html"
    assert main(["report", str(written["json"]), "-o", str(out_html)]) == 0
    text = out_html.read_text()
    assert text == written["html"].read_text()
    assert {a["alt"] for t, a in parse_tags(text) if t == "img"} == PLOT_TITLES

    out_md = tmp_path / "again.md"
    assert main(["report", str(written["json"]), "-o", str(out_md)]) == 0
    assert out_md.read_text() == render_markdown(doc)
    capsys.readouterr()

    assert main(["report", str(written["json"])]) == 0
    printed = capsys.readouterr().out
    assert printed == render_markdown(doc) + "\n"
    assert HEADER_LINE in printed


@pytest.mark.parametrize(
    "content",
    [None, "not json at all", "[1, 2, 3]", '{"input": "model.onnx", "optimization": {}}'],
    ids=["missing", "text", "list", "other-json"],
)
def test_report_refuses_what_is_not_an_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:
    path = tmp_path / "thing.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out.html"
    assert main(["report", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert str(path) in err
    assert not out.exists()


def test_report_refuses_a_partial_evaluation(tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    path.write_text('{"reference": {}, "variants": []}')
    assert main(["report", str(path)]) == 2


# ---------------------------------------------------------------------------------------------
# build_and_evaluate


def test_build_and_evaluate_digits(digits_task: DigitsTask, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    # the built-in graph entry brings its own latency section, which a file's defaults do not
    # switch off (see test_gates.test_false_in_file_defaults_beats_builtin_entries)
    policy_file.write_text("defaults:\n  latency: false\nvariants:\n  graph:\n    latency: false\n")
    out = tmp_path / "variants"
    result = build_and_evaluate(
        digits_task.model,
        out,
        ["graph", "int8-static"],
        calibration=digits_task.calibration,
        eval_data=digits_task.eval,
        policy=GatePolicy.load(policy_file),
    )
    evaluation = result.evaluation
    assert result.passed == ["graph", "int8-static"], [
        (v.name, [(g.gate, g.status, g.reasons) for g in v.gates]) for v in evaluation.variants
    ]
    assert set(result.outputs) == {"graph", "int8-static"}
    for name, path in result.outputs.items():
        assert path == out / f"digits_cnn.{name}.onnx" and path.is_file()
        v = evaluation.variant(name)
        assert {g.gate for g in v.gates} == {"size", "accuracy"}
        assert v.build is not None and v.build["variant"] == name
        assert v.build["accuracy_passed"] is True  # checked while building, too
    graph_acc = evaluation.variant("graph").gate("accuracy")
    assert graph_acc is not None and graph_acc.measured["metric_drop"] == 0.0
    assert graph_acc.measured["cosine"] >= 0.9999
    assert evaluation.variant("int8-static").gate("size").measured["ratio"] < 0.35  # type: ignore[union-attr]
    assert evaluation.latency_samples == {}
    assert (
        evaluation.fingerprint["eval_data_sha256"]
        == load_npz(digits_task.eval, input_specs(digits_task.model)).digest
    )
    assert {k: p.name for k, p in result.reports.items()} == {
        "json": "digits_cnn.evaluation.json",
        "markdown": "digits_cnn.evaluation.md",
        "html": "digits_cnn.evaluation.html",
    }
    for path in result.reports.values():
        assert path.parent == out and path.stat().st_size > 0
    saved = json.loads(result.reports["json"].read_text())
    assert saved["passed"] == ["graph", "int8-static"]
    assert saved["policy_hash"] == GatePolicy.load(policy_file).digest()
    leftovers = [n for n in os.listdir(out) if n.startswith(".") or n.endswith(".tmp")]
    assert leftovers == []
