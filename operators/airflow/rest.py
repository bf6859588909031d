"""Airflow 3's REST API v2, as CI uses it: authenticate, trigger the optimize DAG, wait, read the
summary. Built on Airflow's own API client (``apache-airflow-client``): nothing of Airflow
itself is imported, so the command runs on a machine with only the client installed.

Credentials come from the environment, never from arguments that land in shell history:
``GRAPHTRIM_AIRFLOW_TOKEN`` (a ready bearer token), else ``GRAPHTRIM_AIRFLOW_USERNAME`` and
``GRAPHTRIM_AIRFLOW_PASSWORD`` (exchanged at ``/auth/token``), else none (a deployment where
every user is an admin). Both are registered with ``graphtrim.redact``: whatever graphtrim
prints masks them, and error messages mask the URL's userinfo.

A request that cannot connect, or that reads a gateway's 502 / 503 / 504, is tried again
(``retries`` times, with a growing pause): what an API server behind a restarting proxy or
being rolled out answers. A request that changes something (trigger a run) is retried only
when it never reached the server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from graphtrim.errors import GraphtrimError
from graphtrim.redact import redact, register_secret

TERMINAL = ("success", "failed")
RETRY_STATUSES = (502, 503, 504)

T = TypeVar("T")


class AirflowApiError(GraphtrimError):
    """The Airflow API refused a request or cannot be reached."""


@dataclasses.dataclass
class DagRun:
    dag_id: str
    run_id: str
    state: str
    conf: dict[str, Any]


def _state(value: Any) -> str:
    """A state of the client's models (an enum, or None) as the API spells it."""
    return str(getattr(value, "value", value))


class AirflowClient:
    """The DAG runs of one Airflow API server (``url``: its base, e.g.
    ``https://airflow.example.com``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        env = os.environ
        self._token = token or env.get("GRAPHTRIM_AIRFLOW_TOKEN")
        self._username = username or env.get("GRAPHTRIM_AIRFLOW_USERNAME")
        self._password = password or env.get("GRAPHTRIM_AIRFLOW_PASSWORD")
        register_secret(self._token)
        register_secret(self._password)
        self._api: Any = None

    def _client(self) -> Any:
        """The API client, made on first use: with a bearer token (logged in first when there
        are credentials and no token), retries and this client's timeout."""
        if self._api is None:
            from airflow_client.client import ApiClient, Configuration
            from urllib3.util.retry import Retry

            config = Configuration(
                host=self.url,
                retries=Retry(
                    total=self.retries,
                    connect=self.retries,
                    read=self.retries,
                    status=self.retries,
                    backoff_factor=0.5,
                    status_forcelist=RETRY_STATUSES,
                    # urllib3's default: the idempotent methods (not POST, not PATCH)
                    allowed_methods=Retry.DEFAULT_ALLOWED_METHODS,
                    raise_on_status=False,
                ),
            )
            api = ApiClient(config)
            if self._token is None and self._username:
                self._token = self._login(api)
            config.access_token = self._token or None
            self._api = api
        return self._api

    def _unreachable(self, exc: BaseException) -> AirflowApiError:
        reason = getattr(exc, "reason", None)
        cause = reason if isinstance(reason, BaseException) else exc
        return AirflowApiError(
            f"cannot reach the Airflow API at {redact(self.url)}: {type(cause).__name__}"
        )

    def _call(self, method: str, path: str, call: Callable[[Any], T]) -> T:
        """``call(api_client)``, the request ``method path``, with the API's refusals as an
        :class:`AirflowApiError` that says what to do about them."""
        from airflow_client.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        api = self._client()
        try:
            return call(api)
        except HTTPError as exc:
            raise self._unreachable(exc) from exc
        except ApiException as exc:
            status = exc.status or 0
            if status == 0:  # no answer: TLS or a request the client could not send
                raise self._unreachable(exc) from exc
            if status in (401, 403):
                how = (
                    "the token or credentials were refused"
                    if self._token
                    else "it needs credentials: set GRAPHTRIM_AIRFLOW_USERNAME and "
                    "GRAPHTRIM_AIRFLOW_PASSWORD, or GRAPHTRIM_AIRFLOW_TOKEN"
                )
                raise AirflowApiError(f"Airflow API {method} {path}: {status}, {how}") from exc
            if status == 404:
                raise AirflowApiError(
                    f"Airflow API {method} {path}: not found ({_detail(exc.body)})"
                ) from exc
            raise AirflowApiError(
                f"Airflow API {method} {path}: {status} {_detail(exc.body)}"
            ) from exc

    def _login(self, api: Any) -> str:
        """A bearer token for the username and password (simple and FAB auth managers'
        ``/auth/token``), through the API client's own connection pool."""
        from urllib3.exceptions import HTTPError

        try:
            r = api.rest_client.request(
                "POST",
                f"{self.url}/auth/token",
                headers={"Content-Type": "application/json", "Accept": "application/json"},
                body={"username": self._username, "password": self._password or ""},
                _request_timeout=self.timeout,
            )
            data = r.read()
        except HTTPError as exc:
            raise self._unreachable(exc) from exc
        if r.status in (401, 403):
            raise AirflowApiError(
                f"Airflow refused the credentials of user '{self._username}' "
                "(GRAPHTRIM_AIRFLOW_USERNAME / GRAPHTRIM_AIRFLOW_PASSWORD)"
            )
        text = data.decode("utf-8", "replace") if data else ""
        if r.status >= 400:
            raise AirflowApiError(f"Airflow /auth/token: {r.status} {_detail(text)}")
        try:
            token = (json.loads(text) or {}).get("access_token") if text else None
        except (ValueError, AttributeError):
            token = None
        if not token:
            raise AirflowApiError("Airflow /auth/token answered without an access_token")
        register_secret(str(token))
        return str(token)

    def trigger(self, dag_id: str, conf: Mapping[str, Any], *, unpause: bool = True) -> DagRun:
        from airflow_client.client import DAGApi, DAGPatchBody, DagRunApi, TriggerDAGRunPostBody

        if unpause:
            self._call(
                "PATCH",
                f"/api/v2/dags/{dag_id}",
                lambda api: DAGApi(api).patch_dag(
                    dag_id, DAGPatchBody(is_paused=False), _request_timeout=self.timeout
                ),
            )
        run = self._call(
            "POST",
            f"/api/v2/dags/{dag_id}/dagRuns",
            lambda api: DagRunApi(api).trigger_dag_run(
                dag_id,
                TriggerDAGRunPostBody(logical_date=None, conf=dict(conf)),
                _request_timeout=self.timeout,
            ),
        )
        return DagRun(dag_id, run.dag_run_id, _state(run.state), dict(run.conf or {}))

    def run(self, dag_id: str, run_id: str) -> DagRun:
        from airflow_client.client import DagRunApi

        run = self._call(
            "GET",
            f"/api/v2/dags/{dag_id}/dagRuns/{run_id}",
            lambda api: DagRunApi(api).get_dag_run(dag_id, run_id, _request_timeout=self.timeout),
        )
        return DagRun(dag_id, run_id, _state(run.state), dict(run.conf or {}))

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
        """``task_id`` (``task_id[map_index]`` for a mapped task) -> state."""
        from airflow_client.client import TaskInstanceApi

        doc = self._call(
            "GET",
            f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
            lambda api: TaskInstanceApi(api).get_task_instances(
                dag_id, run_id, _request_timeout=self.timeout
            ),
        )
        out = {}
        for t in doc.task_instances or []:
            index = -1 if t.map_index is None else t.map_index
            label = t.task_id if index < 0 else f"{t.task_id}[{index}]"
            out[label] = _state(t.state)
        return out

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        """The task's XCom value (deserialized), or None where there is none."""
        from airflow_client.client import XComApi

        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        try:
            doc = self._call(
                "GET",
                path,
                lambda api: XComApi(api).get_xcom_entry(
                    dag_id,
                    task_id,
                    run_id,
                    key,
                    deserialize=True,
                    stringify=False,
                    _request_timeout=self.timeout,
                ),
            )
        except AirflowApiError:
            return None
        entry = getattr(doc, "actual_instance", doc)
        return getattr(entry, "value", None)


def _detail(body: str | bytes | None) -> str:
    """The ``detail`` of an API error body (FastAPI's), or its first 300 characters; masked."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
    try:
        doc = json.loads(text)
    except ValueError:
        return redact(text[:300])
    detail = doc.get("detail") if isinstance(doc, dict) else doc
    return redact(str(detail)[:300])
