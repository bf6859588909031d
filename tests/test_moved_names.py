"""Names that moved to modules of their own when large modules were split still import from
where they were: a DAG or a script written against the earlier layout keeps working."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("graphtrim.airflow.operators", "TunePlanOperator", "graphtrim.airflow.tune_operators"),
    ("graphtrim.airflow.operators", "TuneTrialOperator", "graphtrim.airflow.tune_operators"),
    ("graphtrim.airflow.operators", "TuneSelectOperator", "graphtrim.airflow.tune_operators"),
    ("graphtrim.airflow.operators", "plan_run", "graphtrim.airflow.run_plan"),
    ("graphtrim.airflow.operators", "variant_table", "graphtrim.airflow.run_plan"),
    ("graphtrim.data", "check_data", "graphtrim.data_check"),
    ("graphtrim.graph.framework", "FixedPointDriver", "graphtrim.graph.driver"),
    ("graphtrim.quantize.weight_only", "WeightOnlyError", "graphtrim.quantize.weight_settings"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_imports_from_its_old_module_as_the_same_object(
    old: str, name: str, new: str
) -> None:
    assert getattr(importlib.import_module(old), name) is getattr(
        importlib.import_module(new), name
    )


def test_a_name_that_never_existed_is_still_an_attribute_error() -> None:
    module = importlib.import_module("graphtrim.airflow.operators")
    with pytest.raises(AttributeError, match="no attribute 'NoSuchOperator'"):
        module.NoSuchOperator  # noqa: B018
