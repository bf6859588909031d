"""Extra links of the stage operators: the task's MLflow run, the model version it registered
and its report, as buttons on the task's page in Airflow's UI.

The stage operator works out the URLs when its stage is done
(:func:`graphtrim.integrations.links.record_links`) and keeps them on itself; Airflow asks
each link for its URL on the worker as the task ends and stores it in XCom, where the UI
reads it. A task that made nothing to link to (or an MLflow without a UI address) shows the
link disabled."""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.sdk import BaseOperatorLink
from graphtrim.integrations.links import LINKS


class _RecordLink(BaseOperatorLink):
    key: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return LINKS[self.key]

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return str((getattr(operator, "graphtrim_links", None) or {}).get(self.key, ""))


class MlflowRunLink(_RecordLink):
    """The task's MLflow run (the pipeline's run, which every stage logs into)."""

    key = "run"


class MlflowModelVersionLink(_RecordLink):
    """The version the task registered (the registered model's versions when several)."""

    key = "model"


class GraphtrimReportLink(_RecordLink):
    """The task's report in the run's artifacts: the comparison of every variant (register)
    or the gates of this task's variants (validate)."""

    key = "report"


EXTRA_LINKS = (MlflowRunLink(), MlflowModelVersionLink(), GraphtrimReportLink())
