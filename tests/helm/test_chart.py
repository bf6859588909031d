"""The Helm chart, the Airflow chart overlay and the Dockerfile: rendered offline with several
value sets, linted, every manifest validated against the Kubernetes schemas."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.servers import stop_process_group

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
    "mlflow-auth": {"mlflow": {"auth": {"enabled": True, "existingSecret": "mlflow-auth"}}},
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


def _mlflow_container(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = next(d for d in render(values) if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    return pod, next(c for c in pod["containers"] if c["name"] == "mlflow")


@pytest.mark.parametrize("name", ["defaults", "mlflow-auth"])
def test_mlflow_backend_uri_is_never_on_the_command_line(name: str) -> None:
    """Kubernetes expands ``$(VAR)`` in command and args into the process's command line (the
    pod spec's resolved command, ``ps`` on the node): the URI, with its password, comes from a
    Secret into the environment only, where ``mlflow server`` reads it."""
    _, c = _mlflow_container(VALUE_SETS[name])
    line = [*c.get("command", []), *c.get("args", [])]
    assert not [a for a in line if "$(" in a or "backend-store" in a or "password" in a.lower()]
    env = {e["name"]: e for e in c["env"]}
    backend = env["MLFLOW_BACKEND_STORE_URI"]
    assert backend["valueFrom"]["secretKeyRef"] == {"name": "mlflow-backend", "key": "uri"}
    # mlflow server's --backend-store-uri falls back to that variable
    from mlflow.cli import server

    option = next(p for p in server.params if p.name == "backend_store_uri")
    assert option.envvar == "MLFLOW_BACKEND_STORE_URI"


def test_mlflow_auth_credentials_come_from_the_secret() -> None:
    pod, c = _mlflow_container(VALUE_SETS["mlflow-auth"])
    assert c["args"][:3] == ["server", "--app-name", "basic-auth"]
    env = {e["name"]: e for e in c["env"]}
    for name, key in [
        ("MLFLOW_AUTH_ADMIN_USERNAME", "admin-username"),
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
        ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key"),
    ]:
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-auth", "key": key}
    assert env["MLFLOW_AUTH_CONFIG_PATH"]["value"] == "/etc/mlflow-auth/basic_auth.ini"
    volume = next(v for v in pod["volumes"] if v["name"] == "auth-config")
    assert volume["secret"]["secretName"] == "mlflow-auth"
    assert volume["secret"]["items"] == [{"key": "basic_auth.ini", "path": "basic_auth.ini"}]
    # without auth: no basic-auth app, none of its variables
    _, plain = _mlflow_container({})
    assert "basic-auth" not in plain["args"]
    assert not [e for e in plain["env"] if e["name"].startswith("MLFLOW_AUTH")]


def test_mlflow_auth_without_existing_secret_is_refused() -> None:
    with pytest.raises(helm_python.HelmError, match="existingSecret"):
        render({"mlflow": {"auth": {"enabled": True}}})


def _as_kubernetes_runs(
    container: dict[str, Any], secrets: dict[tuple[str, str], str], over: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment Kubernetes gives the container: ``secretKeyRef``
    values from ``secrets``, ``$(VAR)`` in command and args expanded; ``over`` replaces
    variables (paths that are mounts in the pod)."""
    env = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
    env.update(over)

    def expand(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)

    return [expand(a) for a in [*container["command"], *container["args"]]], env


def _option(line: list[str], name: str, value: str) -> None:
    line[line.index(name) + 1] = value


@contextlib.contextmanager
def _run(line: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            line, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop_process_group(proc)


def _command_lines(root: int) -> list[str]:
    """The command lines of ``root`` and every process under it, as ``ps`` shows them."""
    import psutil

    procs = [psutil.Process(root)]
    procs += procs[0].children(recursive=True)
    lines = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            lines.append(" ".join(p.cmdline()))
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("name", ["defaults", "mlflow-auth"])
def test_mlflow_server_runs_as_rendered(name: str, tmp_path: Path) -> None:
    """The rendered MLflow container run here as Kubernetes would run it (Secret values in its
    environment, ``$(VAR)`` expanded): the server uses the backend store from the Secret, no
    process's command line shows it, and with ``mlflow.auth`` the registry wants credentials."""
    import requests

    from tests.servers import free_port

    _, c = _mlflow_container(VALUE_SETS[name])
    marker = "pw-" + os.urandom(6).hex()  # stands for the password inside a real URI
    store = tmp_path / f"store-{marker}.db"
    auth_ini = tmp_path / "basic_auth.ini"
    auth_ini.write_text(
        f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{tmp_path / 'auth.db'}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    secrets = {
        ("mlflow-backend", "uri"): f"sqlite:///{store}",
        ("mlflow-auth", "admin-username"): "admin",
        ("mlflow-auth", "admin-password"): "a-Long-admin-passw0rd!",
        ("mlflow-auth", "flask-secret-key"): os.urandom(16).hex(),
    }
    over = {"HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    if name == "mlflow-auth":
        assert c["env"][1]["value"] == "/etc/mlflow-auth/basic_auth.ini"  # the Secret's mount
        over["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_ini)
    line, env = _as_kubernetes_runs(c, secrets, over)
    line[0] = str(Path(sys.executable).with_name(line[0]))
    port = free_port()
    _option(line, "--host", "127.0.0.1")
    _option(line, "--port", str(port))
    _option(line, "--workers", "1")
    _option(line, "--artifacts-destination", str(tmp_path / "artifacts"))
    url = f"http://127.0.0.1:{port}"
    with _run(line, env, tmp_path / "mlflow.log") as proc:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        search = f"{url}/api/2.0/mlflow/registered-models/search"
        admin = ("admin", secrets[("mlflow-auth", "admin-password")])
        r = requests.get(search, auth=admin, timeout=60)
        assert r.status_code == 200, r.text
        assert store.exists()  # the server's store is the Secret's URI
        lines = _command_lines(proc.pid)
        assert lines and not [x for x in lines if marker in x], lines
        if name == "mlflow-auth":
            assert requests.get(search, timeout=60).status_code == 401
            assert requests.get(search, auth=("admin", "wrong"), timeout=60).status_code == 401


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

    from graphtrim.gates.policy import GatePolicy

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


def test_webhook_settings_include_the_body_limit() -> None:
    docs = render({**VALUE_SETS["webhook"], "webhook": {**VALUE_SETS["webhook"]["webhook"]}})
    cm = next(d for d in docs if d["metadata"]["name"] == "graphtrim-webhook")
    assert cm["data"]["GRAPHTRIM_WEBHOOK_MAX_BYTES"] == "1048576"
    assert "GRAPHTRIM_WEBHOOK_SECRET" not in cm["data"]
    with pytest.raises(helm_python.HelmError, match="maxBytes"):
        render({"webhook": {"maxBytes": 0}})


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


def test_airflow_overlay_gives_the_webhook_secret_to_the_api_server_only() -> None:
    """The endpoint runs in the API server; the official chart's top-level ``secret``, ``env``,
    ``extraEnv`` and ``extraEnvFrom`` (and the worker, scheduler, triggerer, DAG processor and
    pod-template sections) reach other pods, which must not be able to sign registry events."""
    overlay = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    elsewhere = {k: v for k, v in overlay.items() if k != "apiServer"}
    text = yaml.safe_dump(elsewhere)
    assert "GRAPHTRIM_WEBHOOK_SECRET" not in text
    assert not [
        s for s in overlay.get("secret") or [] if s.get("secretName") == "graphtrim-webhook"
    ]
    env = overlay["apiServer"]["env"]
    entry = next(e for e in env if e["name"] == "GRAPHTRIM_WEBHOOK_SECRET")
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "graphtrim-webhook", "key": "secret"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "api-server"},
        "spec": {"containers": [{"name": "api-server", "image": "x", "env": env}]},
    }
    kubernetes_validate.validate(pod, KUBE, strict=True)


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
    assert "ORT=gpu" in runs and '"$GPU" = "true"' in runs and "[${ORT},pipeline]" in runs
    assert "graphtrim --version" in runs
    assert "constraints.txt" in " ".join(runtime)
    airflow = stages["airflow"]
    assert [line for line in airflow if line.startswith("USER")][-1] == "USER airflow"
    # its GPU build: CUDA torch and the gpu extra (onnxruntime-gpu at its own pin)
    runs = " ".join(line for line in airflow if line.startswith("RUN"))
    assert '"$GPU" = "true"' in runs and "ORT=gpu" in runs and "[${ORT},pipeline,airflow]" in runs
    assert runs.index("torch==${TORCH_VERSION}") < runs.index("constraints.txt")


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["cpu", "gpu"])
def test_dockerfile_install_steps_resolve_with_the_constraints(runtime: str) -> None:
    """The image's pip step, CPU and GPU builds, dry-run in this venv (torch already pinned here
    as in the image): every pin, onnxruntime-gpu's included, is one the registry has."""
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
            f".[{runtime},pipeline,airflow]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Would install" not in proc.stdout or "torch" not in proc.stdout


def test_the_images_the_docs_build_are_the_ones_the_deployments_run() -> None:
    """The `docker build` tags of the deployment guide (docs/getting-started/helm.md), the
    chart's image, the Airflow overlay's image and the KFP steps' default image name the same
    images."""
    from graphtrim.kubeflow.pipeline import DEFAULT_IMAGE

    guide = REPO / "docs" / "getting-started" / "helm.md"
    built = set(re.findall(r"docker build .*?-t (\S+) \.", guide.read_text()))
    chart = yaml.safe_load((REPO / "helm" / "graphtrim" / "values.yaml").read_text())["image"]
    overlay = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    used = {
        f"{chart['repository']}:{chart['tag']}",
        f"{overlay['images']['airflow']['repository']}:{overlay['images']['airflow']['tag']}",
        # the GPU task pods' image
        next(e["value"] for e in overlay["env"] if e["name"] == "GRAPHTRIM_GPU_IMAGE"),
    }
    if "GRAPHTRIM_IMAGE" not in os.environ:
        used.add(DEFAULT_IMAGE)
    assert used <= built, (used, built)
