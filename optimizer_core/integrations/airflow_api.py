"""Airflow 3's REST API v2, as CI uses it: authenticate, trigger the optimize DAG, wait, read the
summary. Plain HTTP (``requests``): nothing of Airflow is imported.

Credentials come from the environment, never from arguments that land in shell history:
``GRAPHTRIM_AIRFLOW_TOKEN`` (a ready bearer token), else ``GRAPHTRIM_AIRFLOW_USERNAME`` and
``GRAPHTRIM_AIRFLOW_PASSWORD`` (exchanged at ``/auth/token``), else none (a deployment where
every user is an admin).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from optimizer_core.errors import GraphtrimError
from optimizer_core.redact import redact, register_secret

TERMINAL = ("success", "failed")


class AirflowApiError(GraphtrimError):
    """The Airflow API refused a request or cannot be reached."""


@dataclasses.dataclass
class DagRun:
    dag_id: str
    run_id: str
    state: str
    conf: dict[str, Any]


class AirflowClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 30.0,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        env = os.environ
        self._token = token or env.get("GRAPHTRIM_AIRFLOW_TOKEN")
        self._username = username or env.get("GRAPHTRIM_AIRFLOW_USERNAME")
        self._password = password or env.get("GRAPHTRIM_AIRFLOW_PASSWORD")
        register_secret(self._token)
        register_secret(self._password)

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        import requests

        headers = dict(kw.pop("headers", {}))
        if self._token is None and self._username:
            self._token = self._login()
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            r = requests.request(
                method, self.url + path, headers=headers, timeout=self.timeout, **kw
            )
        except requests.RequestException as exc:
            raise AirflowApiError(
                f"cannot reach the Airflow API at {redact(self.url)}: {type(exc).__name__}"
            ) from exc
        if r.status_code in (401, 403):
            how = (
                "the token or credentials were refused"
                if self._token
                else "it needs credentials: set GRAPHTRIM_AIRFLOW_USERNAME and "
                "GRAPHTRIM_AIRFLOW_PASSWORD, or GRAPHTRIM_AIRFLOW_TOKEN"
            )
            raise AirflowApiError(f"Airflow API {method} {path}: {r.status_code}, {how}")
        if r.status_code == 404:
            raise AirflowApiError(f"Airflow API {method} {path}: not found ({_detail(r)})")
        if r.status_code >= 400:
            raise AirflowApiError(f"Airflow API {method} {path}: {r.status_code} {_detail(r)}")
        return r.json() if r.content else None

    def _login(self) -> str:
        import requests

        try:
            r = requests.post(
                f"{self.url}/auth/token",
                json={"username": self._username, "password": self._password or ""},
                timeout=self.timeout,
            )
        except requests.RequestException as exc:
            raise AirflowApiError(
                f"cannot reach the Airflow API at {redact(self.url)}: {type(exc).__name__}"
            ) from exc
        if r.status_code in (401, 403):
            raise AirflowApiError(
                f"Airflow refused the credentials of user '{self._username}' "
                "(GRAPHTRIM_AIRFLOW_USERNAME / GRAPHTRIM_AIRFLOW_PASSWORD)"
            )
        if r.status_code >= 400:
            raise AirflowApiError(f"Airflow /auth/token: {r.status_code} {_detail(r)}")
        token = (r.json() or {}).get("access_token")
        if not token:
            raise AirflowApiError("Airflow /auth/token answered without an access_token")
        register_secret(str(token))
        return str(token)

    def trigger(self, dag_id: str, conf: Mapping[str, Any], *, unpause: bool = True) -> DagRun:
        if unpause:
            self._request("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})
        doc = self._request(
            "POST",
            f"/api/v2/dags/{dag_id}/dagRuns",
            json={"logical_date": None, "conf": dict(conf)},
        )
        return DagRun(dag_id, doc["dag_run_id"], doc["state"], doc.get("conf") or {})

    def run(self, dag_id: str, run_id: str) -> DagRun:
        doc = self._request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        return DagRun(dag_id, run_id, doc["state"], doc.get("conf") or {})

    def wait(
        self,
        dag_id: str,
        run_id: str,
        *,
        timeout: float = 3600.0,
        poll: float = 5.0,
        progress: Callable[[str], None] | None = None,
    ) -> DagRun:
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            run = self.run(dag_id, run_id)
            if run.state != last and progress is not None:
                progress(f"{dag_id} {run_id}: {run.state}")
            last = run.state
            if run.state in TERMINAL:
                return run
            if time.monotonic() > deadline:
                raise AirflowApiError(
                    f"{dag_id} run {run_id} still '{run.state}' after {timeout:.0f} s"
                )
            time.sleep(poll)

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        doc = self._request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        out = {}
        for t in doc.get("task_instances", []):
            label = (
                t["task_id"] if t.get("map_index", -1) < 0 else f"{t['task_id']}[{t['map_index']}]"
            )
            out[label] = str(t.get("state"))
        return out

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        try:
            doc = self._request(
                "GET",
                f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                params={"deserialize": "true", "stringify": "false"},
            )
        except AirflowApiError:
            return None
        return (doc or {}).get("value")


def _detail(r: Any) -> str:
    try:
        doc = r.json()
    except ValueError:
        return redact(r.text[:300])
    detail = doc.get("detail") if isinstance(doc, dict) else doc
    return redact(str(detail)[:300])
