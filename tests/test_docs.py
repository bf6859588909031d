"""The documentation site (``mkdocs.yml``, ``docs/``) and the README: cheap checks that the site's
navigation and the code agree. The strict build itself (every link, anchor and API reference)
is ``make docs``, which ``make test`` runs."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hooks() -> Any:
    spec = importlib.util.spec_from_file_location("graphtrim_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def _config() -> dict[str, Any]:
    # mkdocs.yml names a Python function for mermaid fences (!!python/name): read it as text
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    return dict(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader))


def test_every_page_in_the_navigation_exists_and_every_page_is_in_it() -> None:
    nav = _nav_pages(_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is listed twice"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, missing
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages == set(nav), f"pages outside the navigation: {sorted(pages - set(nav))}"


@pytest.mark.parametrize(
    "section",
    [
        "getting-started/cli.md",
        "getting-started/airflow.md",
        "getting-started/kubeflow.md",
        "getting-started/helm.md",
        "getting-started/ci.md",
        "concepts/passes.md",
        "concepts/variants.md",
        "concepts/gates.md",
        "concepts/promotion.md",
        "concepts/lineage.md",
        "architecture/index.md",
        "architecture/extending.md",
        "operations/credentials.md",
        "operations/webhook.md",
        "operations/timeouts.md",
        "operations/scaling.md",
        "operations/gpu.md",
        "reference/cli.md",
        "reference/exit-codes.md",
        "reference/environment.md",
        "reference/helm-values.md",
        "reference/run-parameters.md",
        "benchmarks/index.md",
    ],
)
def test_the_site_has_the_pages_people_look_for(section: str) -> None:
    assert section in _nav_pages(_config()["nav"])


def test_the_readme_is_short_and_links_into_the_site() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in ("make demo", "make test"):
        assert command in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links, "the README links into the site"
    assert not [link for link in links if not (ROOT / link).is_file()]


def test_the_cli_reference_covers_every_command_and_option() -> None:
    hooks = _hooks()
    text = hooks.cli_reference()
    commands = list(hooks.commands())
    assert len(commands) >= 15  # optimize, verify, ..., pipeline run, kfp compile, trigger
    for path, parser, _ in commands:
        assert f"## `graphtrim {' '.join(path)}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in text, f"graphtrim {' '.join(path)} {flag}"


def test_every_generated_marker_names_a_generator() -> None:
    hooks = _hooks()
    from bench.pages import BENCHES

    for page in DOCS.rglob("*.md"):
        for _, kind, name in hooks.MARKER.findall(page.read_text()):
            known = BENCHES if kind == "bench-results" else hooks.GENERATORS
            assert name in known, f"{page.relative_to(DOCS)}: no {kind} named {name!r}"


def test_every_benchmark_page_section_renders_or_says_pending(tmp_path: Path) -> None:
    """Without published data a section says pending; with it, it names machine, date and
    commit (the envelope of ``bench.publish``)."""
    from bench.pages import section

    assert "Results pending" in section("llm", data=tmp_path)
    doc = {
        "bench": "nodetests",
        "provenance": {
            "machine": {
                "cpu_model": "Test CPU",
                "cpu_count": 2,
                "cpu_usable": 2,
                "memory_gib": 8.0,
                "system": "Linux",
                "python": "3.11",
                "versions": {"onnx": "1.0"},
            },
            "date": "2026-01-02T03:04:05+00:00",
            "commit": "0123456789abcdef",
            "dirty": False,
            "command": "python -m bench.nodetests --publish",
        },
        "args": {},
        "results": {
            "onnx": "1.0",
            "onnxruntime": "1.0",
            "seconds": 1.0,
            "jobs": 1,
            "generated": 3,
            "skipped_ort_cannot_run": 1,
            "checked": 2,
            "ok": 1,
            "changed": 1,
            "refused": 0,
            "unloadable": 0,
            "crashed": 0,
            "passed_through": 0,
            "not_ok": [{"name": "test_x", "outcome": "changed", "detail": "differs"}],
        },
    }
    (tmp_path / "nodetests.json").write_text(json.dumps(doc))
    text = section("nodetests", data=tmp_path)
    for shown in ("Test CPU", "2026-01-02 03:04:05 UTC", "0123456789ab", "| changed results | 1 |"):
        assert shown in text


def test_published_benchmark_results_say_where_they_were_measured() -> None:
    from bench.pages import BENCHES

    for path in sorted((DOCS / "benchmarks" / "data").glob("*.json")):
        doc = json.loads(path.read_text())
        assert path.stem in BENCHES and doc["bench"] == path.stem
        prov = doc["provenance"]
        assert prov["commit"] and prov["date"] and prov["machine"]["cpu_model"], path.name


def _variables_in(*folders: str) -> set[str]:
    found: set[str] = set()
    for folder in folders:
        base = ROOT / folder
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in (".py", ".yaml", ".yml", ".json", "") or "__pycache__" in str(
                path
            ):
                continue
            found |= set(
                re.findall(r"GRAPHTRIM_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore"))
            )
    return found


def test_the_environment_page_names_exactly_the_variables_the_code_reads() -> None:
    page = (DOCS / "reference" / "environment.md").read_text()
    documented = set(re.findall(r"GRAPHTRIM_[A-Z0-9_]*[A-Z0-9]", page))
    read = _variables_in("optimizer_core", "operators", "demo", "dags", "helm", "Dockerfile")
    assert not read - documented, f"read but not documented: {sorted(read - documented)}"
    anywhere = read | _variables_in("tests")
    assert not documented - anywhere, (
        f"documented but read nowhere: {sorted(documented - anywhere)}"
    )


def test_the_lineage_page_names_tags_the_code_writes() -> None:
    page = (DOCS / "concepts" / "lineage.md").read_text()
    code = "\n".join(p.read_text() for p in (ROOT / "optimizer_core").rglob("*.py"))
    code += "\n".join(p.read_text() for p in (ROOT / "operators").rglob("*.py"))
    tags = sorted(set(re.findall(r"`graphtrim\.([a-z0-9_]+(?:\.[a-z0-9_]+)?)", page)))
    assert len(tags) > 20
    for tag in tags:
        # written as "graphtrim.<tag>", T + "<tag>" or f"{TAG}<tag>..."
        written = rf"(?:graphtrim\.|[\"'}}]){re.escape(tag)}\b"
        assert re.search(written, code), f"graphtrim.{tag} is written nowhere"
