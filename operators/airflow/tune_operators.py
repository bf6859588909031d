"""The operators of the settings search's steps (plan, a trial, select), one task each, as
:mod:`graphtrim.airflow.pipeline` lays them out when a run tunes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphtrim.airflow.operators import GraphtrimStageOperator, _records


class _TuneStepOperator(GraphtrimStageOperator):
    """A step of the settings search over the worker pool (:mod:`graphtrim.stages.tune`)."""

    ui_color = "#f4efe0"

    def step(self, ctx: Any, config: Any) -> Any:
        raise NotImplementedError

    def execute(self, context: Any) -> Any:
        out = self.delegate(self.step, self.stage_context(context), self.pipeline_config())
        if isinstance(out, Mapping) and "batch" in out:
            # the state for the next select and the quantize tasks; the round's trials are
            # what the next trial task is mapped over (a mapped task reads return values only)
            # ({} for no search: Airflow reads an XCom of None as one never pushed)
            context["ti"].xcom_push(key="search", value=out["search"] or {})
            return out["batch"]
        return out


class TunePlanOperator(_TuneStepOperator):
    """Plan the run's settings search (none without ``tune`` in the config). XCom: the first
    round's trials; ``search``: the search's state."""

    template_fields = (*GraphtrimStageOperator.template_fields, "exported", "optimized")

    def __init__(self, *, exported: Any, optimized: Any, rounds: int | None = None, **kw: Any):
        super().__init__(exported=exported, optimized=optimized, **kw)
        self.rounds = rounds

    def step(self, ctx: Any, config: Any) -> Any:
        from graphtrim.stages.tune import tune_plan

        return tune_plan(
            ctx,
            config,
            self.stage_input("export"),
            self.stage_input("optimize"),
            rounds=self.rounds,
        )


class TuneTrialOperator(_TuneStepOperator):
    """Build and screen one trial of the settings search on this worker (map it over a
    round's trials). XCom: the trial's result."""

    template_fields = (*GraphtrimStageOperator.template_fields, "exported", "optimized", "trial")

    def __init__(self, *, exported: Any, optimized: Any, trial: Any = None, **kw: Any):
        super().__init__(exported=exported, optimized=optimized, **kw)
        self.trial = trial

    def step(self, ctx: Any, config: Any) -> Any:
        from graphtrim.stages.tune import tune_trial

        return tune_trial(
            ctx, config, self.stage_input("export"), self.stage_input("optimize"), self.trial
        )


class TuneSelectOperator(_TuneStepOperator):
    """Take a round's trials (a mapped task's results; none when the round had no trial) and
    choose the next round. XCom: its trials; ``search``: the search's state."""

    template_fields = (*GraphtrimStageOperator.template_fields, "search", "trials")

    def __init__(self, *, search: Any = None, trials: Any = None, **kw: Any):
        kw.setdefault("trigger_rule", "none_failed")  # a round with no trial is skipped
        super().__init__(**kw)
        self.search = search
        self.trials = trials

    def step(self, ctx: Any, config: Any) -> Any:
        from graphtrim.stages.tune import tune_select

        trials = _records(self.trials) if self.trials is not None else []
        return tune_select(ctx, config, dict(self.search) if self.search else None, trials)
