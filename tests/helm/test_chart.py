"""The Helm chart, the Airflow chart overlay and the Dockerfile: rendered offline with several
value sets, linted, every manifest validated against the Kubernetes schemas."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = REPO / "helm" / "graphtrim"
KUBE = "1.33.0"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no-mlflow": {
        "mlflow": {"enabled": False},
        "connections": {"mlflow": {"trackingUri": "https://mlflow.example.com"}},
    },
    "webhook": {"webhook": {"enabled": True, "existingSecret": "graphtrim-webhook"}},
    "minio-and-placement": {
        "connections": {"aws": {"endpointUrl": "http://minio:9000"}},
        "mlflow": {
            "artifacts": {"s3EndpointUrl": "http://minio:9000", "credentialsSecret": "minio-keys"},
            "nodeSelector": {"pool": "system"},
            "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(str(CHART))
    out = chart.render(values, name="graphtrim", namespace="ml")
    docs = []
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def test_chart_lints_clean() -> None:
    report = helm_python.lint(str(CHART), strict=True, kube_version=f"v{KUBE}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_are_valid_kubernetes(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE, strict=True)
    kinds = {d["kind"] for d in docs}
    assert {"Secret", "ConfigMap", "ServiceAccount"} <= kinds
    assert ("Deployment" in kinds) == (name != "no-mlflow")


def test_mlflow_runs_non_root_with_secrets_from_secret_refs() -> None:
    docs = render(VALUE_SETS["minio-and-placement"])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["limits"] and c["resources"]["requests"]
    backend = next(e for e in c["env"] if e["name"] == "MLFLOW_BACKEND_STORE_URI")
    assert backend["valueFrom"]["secretKeyRef"] == {"name": "mlflow-backend", "key": "uri"}
    assert c["envFrom"] == [{"secretRef": {"name": "minio-keys"}}]
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"][0]["key"] == "system"


def test_connections_secret_and_policy_configmap() -> None:
    import json

    from optimizer_core.gates.policy import GatePolicy

    docs = render(VALUE_SETS["minio-and-placement"])
    secret = next(d for d in docs if d["kind"] == "Secret")
    mlflow_conn = json.loads(secret["stringData"]["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    assert mlflow_conn == {"conn_type": "graphtrim_mlflow", "host": "http://graphtrim-mlflow:5000"}
    aws = json.loads(secret["stringData"]["AIRFLOW_CONN_AWS_DEFAULT"])
    assert aws["extra"]["endpoint_url"] == "http://minio:9000"
    assert "password" not in aws and "login" not in aws
    policy = next(d for d in docs if d["kind"] == "ConfigMap" and "gates.yaml" in d["data"])
    GatePolicy(yaml.safe_load(policy["data"]["gates.yaml"]), source="chart")  # graphtrim accepts it


def test_no_secret_in_configmaps_or_plain_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: Any, path: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if re.search(r"password|token|secretkey|accesskey", k, re.I):
                    assert not v, f"{path}.{k} holds a secret value"
                walk(v, f"{path}.{k}")

    walk(values)
    for name, vals in VALUE_SETS.items():
        for doc in render(vals):
            if doc["kind"] == "ConfigMap":
                text = yaml.safe_dump(doc["data"]).lower()
                assert "aws_secret" not in text and "password" not in text, name


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"mlflow": {"port": "http"}}, "port"),
        ({"mlflow": {"replicas": -1}}, "replicas"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"unknownKey": 1}, "unknownKey"),
        ({"connections": {"mlflow": {"connId": "has-dash"}}}, "connId"),
    ],
)
def test_invalid_values_are_refused_by_the_schema(values: dict[str, Any], match: str) -> None:
    with pytest.raises(helm_python.HelmError, match=match):
        render(values)


def test_webhook_without_existing_secret_is_refused() -> None:
    with pytest.raises(helm_python.HelmError, match="existingSecret"):
        render({"webhook": {"enabled": True}})


# ---------------------------------------------------------------------------- Airflow overlay


def test_airflow_overlay_defines_cpu_and_gpu_worker_sets() -> None:
    overlay = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    sets = {s["name"]: s for s in overlay["workers"]["celery"]["sets"]}
    assert overlay["workers"]["celery"]["enableDefault"] is False
    assert sets["cpu"]["queue"] == "default"
    gpu = sets["gpu"]
    assert gpu["queue"] == "gpu"  # the queue graphtrim's device="gpu" operators use
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["nodeSelector"] and gpu["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu" not in sets["cpu"]["resources"]["limits"]
    pod = yaml.safe_load(overlay["podTemplate"])
    kubernetes_validate.validate(pod, KUBE, strict=True)
    assert pod["spec"]["containers"][0]["name"] == "base"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # it reads what helm/graphtrim creates under the release name "graphtrim"
    rendered = {d["metadata"]["name"] for d in render({})}
    assert "graphtrim-airflow-connections" in rendered
    assert "graphtrim-gate-policy" in rendered
    assert "graphtrim-airflow-connections" in overlay["extraEnvFrom"]


# ---------------------------------------------------------------------------- Dockerfile


def _stages(text: str) -> dict[str, list[str]]:
    joined = re.sub(r"\\\n\s*", " ", text)
    stages: dict[str, list[str]] = {}
    current = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def test_dockerfile_runtime_stage() -> None:
    stages = _stages((REPO / "Dockerfile").read_text())
    runtime = stages["runtime"]
    users = [line.split()[1] for line in runtime if line.startswith("USER")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["graphtrim"]' in runtime
    runs = " ".join(line for line in runtime if line.startswith("RUN"))
    # torch pinned before the project, the project under the committed constraints
    assert runs.index("torch==${TORCH_VERSION}") < runs.index("-c constraints.txt")
    assert "onnxruntime-gpu" in runs and '"$GPU" = "true"' in runs
    assert "graphtrim --version" in runs
    assert "constraints.txt" in " ".join(runtime)
    airflow = stages["airflow"]
    assert [line for line in airflow if line.startswith("USER")][-1] == "USER airflow"


@pytest.mark.slow
def test_dockerfile_install_steps_resolve_with_the_constraints() -> None:
    """The image's pip step, dry-run in this venv (torch already pinned here as in the image)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "-c",
            "constraints.txt",
            ".[pipeline,airflow]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Would install" not in proc.stdout or "torch" not in proc.stdout
