"""Following a demo run on the console: the DAG run's task instances read from Airflow's metadata
database in a thread, a line per task once all its instances are done and a progress bar of the
whole run meanwhile."""

from __future__ import annotations

import threading
from typing import Any

from graphtrim.demo.console import Console

# what each stage task does, as its line says it
WHAT = {
    "plan": "the run's config from its params",
    "variants": "the variants to build",
    "export": "the registered model to ONNX",
    "optimize": "the graph passes, outputs verified",
    "quantize": "each variant built in a child process",
    "gate": "accuracy, latency and size gates",
    "register": "the variants that passed, with lineage",
    "promote": "the aliases",
    "summary": "the table",
}
FINAL = {"success", "failed", "skipped", "upstream_failed", "removed"}


class TaskWatcher:
    """The DAG run's task instances as ``dag.test`` runs them (read from Airflow's metadata
    database in a thread): a line per task when all its instances are done, a progress bar of
    the whole run while it goes on."""

    def __init__(self, console: Console, dag_id: str, variants: list[str]):
        self.console = console
        self.dag_id = dag_id
        self.variants = variants  # what the mapped stage tasks' indexes stand for
        self.after = self._last_run_id()
        self.reported: set[str] = set()
        self.skipped: list[str] = []
        self.rows: list[tuple[str, int, str, str | None, Any, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _last_run_id(self) -> int:
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import func, select

        with create_session() as session:
            last = session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == self.dag_id))
        return int(last or 0)

    def _poll(self) -> None:
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            run = session.scalars(
                select(DagRun)
                .where(DagRun.dag_id == self.dag_id, DagRun.id > self.after)
                .order_by(DagRun.id.desc())
                .limit(1)
            ).first()
            if run is None:
                return
            tis = session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == self.dag_id, TaskInstance.run_id == run.run_id
                )
            ).all()
            self.rows = [
                (
                    ti.task_id,
                    ti.map_index,
                    str(ti.state or ""),
                    ti.rendered_map_index,
                    ti.start_date,
                    ti.end_date,
                )
                for ti in tis
            ]

    def progress(self) -> tuple[float, str]:
        states = [r[2].rsplit(".", 1)[-1].lower() for r in self.rows]
        done = sum(s in FINAL for s in states)
        running = sorted({r[0] for r, s in zip(self.rows, states, strict=True) if s == "running"})
        note = f"{done}/{len(states)} tasks" + (
            f", {', '.join(running)} running" if running else ""
        )
        return (done / len(states) if states else 0.0), note

    def report(self) -> None:
        """A line for each stage (a task, a mapped task, the task group ``tune``) whose task
        instances are all done and that has none yet."""
        groups: dict[str, list[tuple[str, int, str, str | None, Any, Any]]] = {}
        for row in self.rows:
            groups.setdefault(row[0].split(".", 1)[0], []).append(row)
        for group, rows in groups.items():
            states = [r[2].rsplit(".", 1)[-1].lower() for r in rows]
            if group in self.reported or not all(s in FINAL for s in states):
                continue
            if group == "tune" and len({r[0] for r in rows}) < 2:
                continue  # the group's first task is done, the others not yet created
            self.reported.add(group)
            if all(s == "skipped" for s in states):
                self.skipped.append(group)
                continue
            mapped = sorted((r for r in rows if r[1] >= 0), key=lambda r: r[1])
            if group == "tune":
                trials = sum(
                    r[0].startswith("tune.trial") and s == "success"
                    for r, s in zip(rows, states, strict=True)
                )
                what = (
                    f"the settings search, {trials} trial(s)"
                    if trials
                    else ("no settings search was asked")
                )
            elif mapped and len(mapped) == len(self.variants):
                what = ", ".join(self.variants[r[1]] for r in mapped)
            else:
                what = WHAT.get(group, "")
            starts = [r[4] for r in rows if r[4] is not None]
            ends = [r[5] for r in rows if r[5] is not None]
            took = (
                f" ({(max(ends) - min(starts)).total_seconds():.1f} s)" if starts and ends else ""
            )
            ok = all(s in ("success", "skipped") for s in states)
            verdict = "done" if ok else "/".join(sorted(set(states)))
            self.console.line(f"      {group:<9} {what}: {verdict}{took}")

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._poll()
                self.report()
            except Exception:  # a busy SQLite database: the next poll reads it
                continue

    def __enter__(self) -> TaskWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._poll()
        except Exception:
            return
        self.report()
        if self.skipped:
            self.console.line(f"      skipped: {', '.join(self.skipped)}")
