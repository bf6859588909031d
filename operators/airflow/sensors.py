"""A deferrable sensor that waits for a registered model version or alias."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from graphtrim.airflow.hooks import MlflowRegistryHook
from graphtrim.airflow.triggers import MlflowModelVersionTrigger, find_version
from graphtrim.errors import GraphtrimError


class MlflowModelVersionSensor(BaseSensorOperator):
    """Wait until ``models:/model_name/version`` (or ``@alias``) exists and is READY.

    Deferrable by default: the wait happens in the triggerer, not in a worker slot. XCom:
    ``{"name", "version"}``.
    """

    template_fields: Sequence[str] = ("model_name", "version", "alias")

    def __init__(
        self,
        *,
        model_name: str,
        version: str | None = None,
        alias: str | None = None,
        mlflow_conn_id: str = MlflowRegistryHook.default_conn_name,
        deferrable: bool = True,
        poll_interval: float = 30.0,
        **kwargs: Any,
    ):
        kwargs.setdefault("poke_interval", poll_interval)
        super().__init__(**kwargs)
        if (version is None) == (alias is None):
            raise ValueError("give exactly one of version or alias")
        self.model_name = model_name
        self.version = version
        self.alias = alias
        self.mlflow_conn_id = mlflow_conn_id
        self.deferrable = deferrable
        self.poll_interval = poll_interval

    def _check(self) -> str | None:
        client = MlflowRegistryHook(self.mlflow_conn_id).get_client()
        return find_version(client, self.model_name, self.version, self.alias)

    def poke(self, context: Any) -> PokeReturnValue:
        found = self._check()
        return PokeReturnValue(
            is_done=found is not None,
            xcom_value={"name": self.model_name, "version": found} if found else None,
        )

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        found = self._check()
        if found is not None:
            return {"name": self.model_name, "version": found}
        self.defer(
            trigger=MlflowModelVersionTrigger(
                name=self.model_name,
                version=self.version,
                alias=self.alias,
                # the connection, not its URI: the trigger reads the credentials itself, so
                # they are neither serialized with it nor left in any process's environment
                mlflow_conn_id=self.mlflow_conn_id,
                poll_interval=self.poll_interval,
                timeout=float(self.timeout) if self.timeout else None,
            ),
            method_name="execute_complete",
            timeout=dt.timedelta(seconds=float(self.timeout)) if self.timeout else None,
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "found":
            what = f"version {self.version}" if self.version else f"alias '{self.alias}'"
            raise GraphtrimError(f"{what} of '{self.model_name}' did not appear in time")
        return {"name": event["name"], "version": event["version"]}
