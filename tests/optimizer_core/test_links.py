"""Links into MLflow's UI made from stage records (what Airflow's extra links show)."""

from __future__ import annotations

import pytest

from graphtrim.integrations.links import UI_ENV, record_links, ui_base


def test_the_ui_address_prefers_the_override_then_the_environment_then_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UI_ENV, raising=False)
    assert ui_base("http://mlflow:5000/") == "http://mlflow:5000"
    assert ui_base("sqlite:///mlflow.db") is None  # a database has no UI
    assert ui_base("databricks") is None
    monkeypatch.setenv(UI_ENV, "https://mlflow.example.com")
    assert ui_base("http://mlflow:5000") == "https://mlflow.example.com"
    assert ui_base("http://mlflow:5000", "https://ui.example.com/") == "https://ui.example.com"
    # a credential in the tracking URI never reaches a link
    monkeypatch.delenv(UI_ENV)
    assert ui_base("https://user:secret@mlflow.example.com/x") == "https://mlflow.example.com/x"


def test_record_links() -> None:
    base = "http://mlflow:5000"
    register = {
        "run_id": "abc",
        "registered": {"graph": {"name": "my model", "version": "12"}},
        "reports": {"html": "s3://b/k/comparison.html"},
    }
    assert record_links(base, register, experiment_id="7") == {
        "run": f"{base}/#/runs/abc",
        "model": f"{base}/#/models/my%20model/versions/12",
        "report": f"{base}/#/experiments/7/runs/abc/artifacts/graphtrim/reports/comparison.html",
    }
    two = {
        **register,
        "registered": {**register["registered"], "fp16": {"name": "my model", "version": "9"}},
    }
    assert record_links(base, two)["model"] == f"{base}/#/models/my%20model"
    assert "report" not in record_links(base, two)  # the artifact view needs the experiment
    assert record_links(None, register) == {}
