"""Running a pipeline with a fault at a named point, as an orchestrator would: the stage that
meets the fault runs in a process of its own (the fault point armed by its environment, see
:mod:`graphtrim.faults`) and is run again on failure, ``RETRIES`` times, as the DAGs configure."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import BUCKET, REPO
from tests.faults import state
from tests.faults.conftest import FaultEnv
from tests.faults.harness import Rule

RETRIES = 2  # dags/graphtrim_optimize_model.py default_args["retries"]
PG_DOWN = 5.0  # seconds PostgreSQL stays down in a restart
STAGE_LIMIT = 900  # seconds: a guard against a hang only
VARIANTS = "graph,int8-static"
NEEDS = {
    "export": [],
    "optimize": ["export"],
    "quantize": ["export", "optimize"],
    "validate": ["export", "quantize"],
    "register": ["optimize", "validate"],
    "promote": ["validate", "register"],
}
DATA = REPO / "docs" / "operations" / "data" / "faults.json"
ARTIFACTS = REPO / ".test-artifacts" / "faults"


@dataclass(frozen=True)
class Case:
    """One fault at one point.

    Attributes:
        fault: what fails (``pg-restart``, ``mlflow-kill``, ``mlflow-answer-lost``,
            ``s3-503``, ``s3-drop``, ``worker-kill``, ``disk-full``, ``clock``; ``none`` for the
            reference).
        point: where: a :func:`graphtrim.faults.point` name, or what the proxy or the limit
            stands for (``register.create_version.during``: the answer to the create call).
        short: part of the short form (``make test``).
        fatal: the fault lasts through every retry: the run must end with one clear line
            naming one of ``names``, and the next run complete it.
    """

    fault: str
    point: str
    short: bool = False
    fatal: bool = False
    names: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.fault}@{self.point}"

    @property
    def slug(self) -> str:
        return self.id.replace("@", "-").replace(".", "-").replace("_", "-")

    @property
    def stage(self) -> str:
        return self.point.split(".")[0]


# the line a full disk must give: the words, not only the errno text
DISK = ("local disk full",)

PIPELINE_CASES: list[Case] = [
    Case("pg-restart", "register.create_version.before"),
    Case("pg-restart", "register.create_version.after", short=True),
    Case("pg-restart", "promote.alias.after"),
    Case("mlflow-kill", "register.logged.after"),
    Case("mlflow-kill", "register.create_version.after"),
    Case("mlflow-kill", "promote.alias.before"),
    Case("mlflow-kill", "promote.alias.after", short=True),
    Case("mlflow-kill", "promote.history.after"),
    Case("mlflow-answer-lost", "register.create_version.during", short=True),
    Case("mlflow-answer-lost", "promote.alias.during"),
    Case("s3-503", "register.report.burst"),
    Case("s3-503", "register.report.outage", short=True),
    Case("worker-kill", "register.create_version.after"),
    Case("worker-kill", "promote.alias.after"),
    Case("worker-kill", "promote.history.after"),
    Case("disk-full", "quantize.staging", short=True, fatal=True, names=DISK),
    # the stage's worker runs 10 minutes ahead of the others and of the servers
    Case("clock", "validate.ahead"),
    Case("clock", "register.ahead"),
    Case("clock", "promote.ahead", short=True),
    # killed after the create on a worker with the servers' clock, retried on one 10 min ahead
    Case("clock", "register.retry.ahead"),
]

# a clock cell whose first attempt is killed at a point (on a worker with the servers' clock)
# and whose retries run on a worker 10 minutes ahead: point -> where the first attempt dies
RETRY_AHEAD = {"register.retry.ahead": "register.create_version.after"}

UPLOAD_CASES: list[Case] = [
    Case("s3-drop", "upload.part.2.once", short=True),
    Case("worker-kill", "upload.part.2.kill"),
    Case("s3-drop", "upload.part.2.outage"),
    Case("s3-503", "upload.part.burst"),
    Case("s3-503", "upload.complete.outage", fatal=True, names=("S3", "SlowDown", "503")),
    Case("disk-full", "upload.staging", fatal=True, names=DISK),
]


@dataclass
class Result:
    reached: bool = False
    attempts: int = 0
    line: str = ""  # the last error line of a stage that failed for good
    log: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHTRIM_FAULT", "PYTEST_"))}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / "cache"),
        TMPDIR=str(home / "tmp"),
        MLFLOW_DISABLE_TELEMETRY="true",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
CLOCK_AHEAD = "+10m"
CLOCK_SHIM = Path(__file__).parent / "clock"


def clock_ahead() -> dict[str, str]:
    """The environment of a process whose wall clock runs 10 minutes ahead (libfaketime:
    ``time.time``, ``datetime.now`` and the clocks of every library it loads; the monotonic
    clock, which measures durations, is left alone)."""
    if not FAKETIME.exists():
        raise AssertionError(
            f"{FAKETIME} is missing: the clock fault needs libfaketime (apt-get install faketime; "
            "`make test` installs it when run as root)"
        )
    path = [str(CLOCK_SHIM), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": CLOCK_AHEAD,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        # time.sleep as it works on a machine whose clock is ahead (clock/sitecustomize.py)
        "PYTHONPATH": os.pathsep.join(path),
    }


def _limit_files(size: int) -> Any:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


class PipelineRun:
    """One pipeline run into a registered model of its own (``--target-name``), so that runs
    compare one to one. Given ``base`` (the reference run), it takes that run's records of the
    stages before the one its fault meets, and its MLflow run (the stages it runs log there):
    only the stages from the fault on run again."""

    def __init__(
        self,
        env: FaultEnv,
        digits: Any,
        slug: str,
        tmp: Path,
        *,
        base: PipelineRun | None = None,
        broken: str = "",
    ) -> None:
        self.env = env
        self.slug = slug
        self.tmp = tmp
        self.target = f"t-{slug}"
        self.experiment = base.experiment if base is not None else f"e-{slug}"
        run_id = base.slug if base is not None else slug
        self.base = base
        self.records = tmp / "records"
        self.records.mkdir(parents=True, exist_ok=True)
        self.workdir = tmp / "work"
        self.home = tmp / "home"
        # what the stage processes get wrong on purpose: ``key``, the variant's identity
        # differs on every attempt; ``recent-only``, an earlier attempt's version is found only
        # if the worker's clock says it was created in the last 5 minutes
        self.broken = broken
        policy = tmp / "policy.json"
        # measured and recorded, never deciding: a timing bar fails on a busy machine, and these
        # tests are about the state a fault leaves
        relaxed = {"min_speedup": None, "runs": 20, "warmup": 5}
        policy.write_text(
            json.dumps(
                {
                    "variants": {v: {"latency": relaxed} for v in VARIANTS.split(",")},
                    "promotion": {"metric": "bytes", "margin": 0.5},
                }
            )
        )
        self.common = [
            "--tracking-uri", env.mlflow_proxy.url,
            "--artifacts", f"s3://{BUCKET}/faults",
            "--s3-endpoint-url", env.s3_proxy.url,
            "--variants", VARIANTS,
            "--calibration", str(digits.calibration),
            "--eval-data", str(digits.eval),
            "--policy", str(policy),
            "--target-name", self.target,
            "--experiment", self.experiment,
            "--orchestrator-run-id", f"faults:{run_id}",
            "--workdir", str(self.workdir),
            "-q",
        ]  # fmt: skip

    def _args(self, stage: str) -> list[str]:
        extra = ["--model", self.env.source] if stage == "export" else []
        for name in NEEDS[stage]:
            extra += ["--input", f"{name}={self.records / (name + '.json')}"]
        return ["pipeline", "stage", stage, *extra, "--output", str(self.records / f"{stage}.json")]

    # ------------------------------------------------------------------ one attempt

    def attempt(
        self,
        stage: str,
        *,
        case: Case | None = None,
        fsize: int | None = None,
        ahead: bool = False,
    ) -> tuple[int, str, bool]:
        """Run ``stage`` once in a process of its own; with ``case``, its fault is injected
        at its point; ``ahead``: on a clock 10 minutes ahead. Returns (exit code, stderr and
        stdout, whether the point was reached)."""
        env = _env(self.home)
        pause = self.tmp / f"pause-{time.monotonic_ns()}"
        if case is not None and case.fault in ("pg-restart", "mlflow-kill"):
            env.update(GRAPHTRIM_FAULT_POINT=case.point, GRAPHTRIM_FAULT_ACTION=f"pause:{pause}")
        elif case is not None and case.fault == "worker-kill":
            env.update(GRAPHTRIM_FAULT_POINT=case.point, GRAPHTRIM_FAULT_ACTION="kill")
        elif case is not None and case.point in RETRY_AHEAD:
            env.update(GRAPHTRIM_FAULT_POINT=RETRY_AHEAD[case.point], GRAPHTRIM_FAULT_ACTION="kill")
        elif case is not None and case.fault == "clock":
            env.update(clock_ahead())
        if ahead:
            env.update(clock_ahead())
        if self.broken == "key":
            # the variant's identity changes on every attempt, and nothing else finds the version
            # an earlier attempt registered (no lookup by source, variant and sha256)
            code = (
                "import sys, uuid, graphtrim.stages.register as r, graphtrim.integrations.lineage as l;"
                "k = lambda *a, **kw: uuid.uuid4().hex; r.lineage_key = k; l.identity_key = k;"
                "l.find_existing = lambda *a, **kw: None;"
                "from graphtrim.cli.main import main; sys.exit(main(sys.argv[1:]))"
            )
            cmd = [sys.executable, "-c", code]
        elif self.broken == "recent-only":
            # the version an earlier attempt registered is found only if it was created in the
            # last 5 minutes by this worker's clock (MLflow stamps it with the server's)
            code = (
                "import sys, time, graphtrim.integrations.registry.versions as v,"
                " graphtrim.integrations.lineage as l;"
                "recent = lambda mv: mv if mv is not None and"
                " mv.creation_timestamp > (time.time() - 300) * 1000 else None;"
                "f = v.Registry.find_by_key;"
                "v.Registry.find_by_key = lambda self, n, k: recent(f(self, n, k));"
                "e = l.find_existing; l.find_existing = lambda *a, **kw: recent(e(*a, **kw));"
                "from graphtrim.cli.main import main; sys.exit(main(sys.argv[1:]))"
            )
            cmd = [sys.executable, "-c", code]
        else:
            cmd = [sys.executable, "-m", "graphtrim.cli"]
        log = self.tmp / f"{stage}-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*cmd, *self._args(stage), *self.common],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.tmp,
                preexec_fn=_limit_files(fsize) if fsize else None,
                start_new_session=True,
            )
        reached = False
        try:
            end = time.monotonic() + STAGE_LIMIT
            while proc.poll() is None and time.monotonic() < end:
                if (pause / "hit").exists() and not reached:
                    reached = True
                    assert case is not None
                    self._inject(case, pause)
                time.sleep(0.1)
            if proc.poll() is None:
                raise AssertionError(f"{stage} still running after {STAGE_LIMIT} s")
            if env.get("GRAPHTRIM_FAULT_ACTION") == "kill" and proc.returncode == -9:
                reached = True  # killed at its point
            if case is not None and case.fault == "clock" and case.point not in RETRY_AHEAD:
                reached = True  # the whole stage ran on the clock ahead
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        return proc.returncode, log.read_text(errors="replace"), reached

    def _inject(self, case: Case, pause: Path) -> None:
        if case.fault == "pg-restart":
            # a restart as a failover looks: cut every connection, down for a few seconds
            self.env.pg.stop_fast()
            (pause / "go").write_text("")
            time.sleep(PG_DOWN)
            self.env.pg.start()
        elif case.fault == "mlflow-kill":
            self.env.mlflow.kill()
            (pause / "go").write_text("")  # the stage goes on against a dead server
            time.sleep(3)
            self.env.mlflow.start()

    # ------------------------------------------------------------------ the run

    def in_process(self, stage: str) -> None:
        from graphtrim.cli import main

        code = main([*self._args(stage), *self.common])
        assert code == 0, f"{stage} exited with {code}"

    def _proxy_rules(self, case: Case) -> None:
        mlflow, s3 = self.env.mlflow_proxy, self.env.s3_proxy
        if case.id == "mlflow-answer-lost@register.create_version.during":
            mlflow.rules.append(
                Rule(lambda m, p: m == "POST" and p.endswith("/model-versions/create"), "lose")
            )
        elif case.id == "mlflow-answer-lost@promote.alias.during":
            mlflow.rules.append(
                Rule(lambda m, p: m == "POST" and p.endswith("/registered-models/alias"), "lose")
            )
        elif case.id == "s3-503@register.report.burst":
            s3.rules.append(Rule(lambda m, p: m == "PUT", "503", times=2))
        elif case.id == "s3-503@register.report.outage":
            s3.rules.append(Rule(lambda m, p: m == "PUT", "503", times=10_000))

    def stage(self, stage: str, case: Case, result: Result) -> bool:
        """Run ``stage`` as a task with its retries; the fault in the first attempt (every
        attempt for a fatal one). Returns whether the stage ended well."""
        fsize = 64 * 1024 if case.fault == "disk-full" else None
        for attempt in range(1 + RETRIES):
            armed = attempt == 0 or case.fatal
            if armed:
                self._proxy_rules(case)
            rc, log, reached = self.attempt(
                stage,
                case=case if armed else None,
                fsize=fsize,
                ahead=not armed and case.point in RETRY_AHEAD,
            )
            proxied = self.env.mlflow_proxy.log + self.env.s3_proxy.log
            if armed and (
                reached
                or case.fault in ("disk-full",)
                or any(action != "pass" for _, _, action in proxied)
            ):
                result.reached = True
            self.env.mlflow_proxy.clear()
            self.env.s3_proxy.clear()
            result.attempts += 1
            result.log += f"\n--- {stage} attempt {attempt + 1}: exit {rc}\n{log[-4000:]}"
            if rc == 0:
                return True
            result.line = _last_line(log)
            if not case.fatal:
                result.notes.append(f"{stage} attempt {attempt + 1}: {result.line}"[:300])
        return False

    def run(self, case: Case) -> Result:
        """Every stage; the one at the case's point through :meth:`stage`; a fatal case is
        run again afterwards, the resource back, as the next run."""
        result = Result()
        start = time.monotonic()
        stages = list(NEEDS)
        if self.base is not None:  # the stages before the fault's: the reference's records
            first = min(stages.index(case.stage), stages.index("register"))
            for name in stages[:first]:
                shutil.copy(self.base.records / f"{name}.json", self.records / f"{name}.json")
            stages = stages[first:]
        for name in stages:
            if case.fault != "none" and name == case.stage:
                if not self.stage(name, case, result):
                    assert case.fatal, result.log
                    # the next run, the resource back: the same stage, no fault
                    assert self.stage(name, Case("none", "none"), Result()), result.log
            elif name in ("register", "promote") or self.broken:
                assert self.stage(name, Case("none", "none"), result), result.log
            else:
                self.in_process(name)
        result.seconds = time.monotonic() - start
        return result

    def snapshot(self) -> dict[str, Any]:
        return state.snapshot(
            self.env.mlflow.url,
            self.target,
            self.experiment,
            s3=self.env.s3,
            workdirs=[self.workdir, self.home / "tmp"],
            tmp=self.tmp / "snapshot",
        )

    def compare(self, reference: dict[str, Any]) -> list[str]:
        return state.compare(reference, self.snapshot())


# ---------------------------------------------------------------------------- as Celery tasks

# the fault met by a stage's task on a Celery worker of a deployment (tests/deployment.py): the
# whole worker, the task's process with it, SIGKILLed while the task stands at the point, and a
# worker started again in its place; Airflow declares the task dead and retries it, as the
# DAG's retries say
CELERY_CASES: list[Case] = [
    Case("celery-worker-kill", "register.create_version.after"),
    Case("celery-worker-kill", "promote.alias.after"),
]
CELERY_DAG = "graphtrim_optimize_model"
CELERY_WORKER = "cpu-worker"  # serves the default queue: every task of the CPU DAG


def _killed_everywhere(marker: str) -> int:
    """SIGKILL every process whose environment holds ``marker`` (what a lost node does to the
    task processes a worker started); returns how many."""
    n = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in (proc / "environ").read_bytes():
                os.kill(int(proc.name), 9)
                n += 1
    return n


class DagRun:
    """One run of the CPU DAG on a Celery deployment into a registered model of its own
    (``target_name``), with the case's fault met by the task of the case's stage."""

    def __init__(self, d: dict[str, Any], digits: Any, slug: str, tmp: Path) -> None:
        self.d = d
        self.slug = slug
        self.tmp = tmp
        self.target = f"t-{slug}"
        self.conf = {
            "model_name": "digits",
            "version": d["version"],
            "variants": VARIANTS.split(","),
            "calibration": str(digits.calibration),
            "eval_data": str(digits.eval),
            "target_name": self.target,
            # measured and recorded, never deciding (see PipelineRun)
            "policy": {
                "variants": {
                    v: {"latency": {"min_speedup": None, "runs": 20, "warmup": 5}}
                    for v in VARIANTS.split(",")
                },
                "promotion": {"metric": "bytes", "margin": 0.5},
            },
        }

    def run(self, case: Case) -> Result:
        import threading

        from tests.deployment import run_dag

        result = Result()
        start = time.monotonic()
        pause = self.tmp / "pause"
        procs, start_worker = self.d["procs"], self.d["start_worker"]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                if (pause / "hit").exists():
                    procs.kill(CELERY_WORKER)
                    _killed_everywhere(f"pause:{pause}")
                    result.reached = True
                    time.sleep(2)
                    start_worker(CELERY_WORKER)  # the replacement, without the fault
                    return
                time.sleep(0.2)

        watcher = None
        if case.fault != "none":
            procs.kill(CELERY_WORKER)
            start_worker(
                CELERY_WORKER,
                GRAPHTRIM_FAULT_POINT=case.point,
                GRAPHTRIM_FAULT_ACTION=f"pause:{pause}",
            )
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        try:
            run = run_dag(self.d, CELERY_DAG, self.conf)
        finally:
            done.set()
            if watcher is not None:
                watcher.join(timeout=60)
        tries = {t["task_id"]: t["try_number"] for t in run["tis"]}
        result.attempts = int(tries.get(case.stage, 1) or 1)
        states = {t["task_id"]: t["state"] for t in run["tis"]}
        result.log = f"DAG run {run['run_id']}: {run['state']}; tasks {states}, tries {tries}"
        if result.attempts > 1:
            result.notes.append(f"{case.stage}: {result.attempts} tries")
        if run["state"] != "success":
            logs = "\n".join(procs.log(n) for n in ("scheduler", CELERY_WORKER))
            raise AssertionError(f"{result.log}\n{logs[-6000:]}")
        result.seconds = time.monotonic() - start
        return result

    def snapshot(self) -> dict[str, Any]:
        return state.snapshot(
            self.d["mlflow"],
            self.target,
            "graphtrim",  # the DAG's runs log to the default experiment, all of them
            s3=self.d["s3"],
            workdirs=[],
            tmp=self.tmp / "snapshot",
        )


def compare_dag_runs(reference: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """:func:`state.compare` for two runs of the DAG, whose MLflow runs share one experiment:
    there, no run may be left RUNNING or have failed, whatever the count."""
    diffs = [d for d in state.compare(reference, got) if not d.startswith("runs:")]
    if set(got["runs"]) - {"FINISHED"}:
        diffs.append(f"runs: {got['runs']}")
    return diffs


# ---------------------------------------------------------------------------- the upload


def _big_model(folder: Path, data_name: str) -> Path:
    """An ONNX model with 40 MB of weights in an external file (a multipart upload)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal(10_000_000).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "big",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10_000_000])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location=data_name)
    return path


_PUT = """
import contextlib, json, os, shutil, sys, tempfile, uuid
from pathlib import Path
import graphtrim.integrations.entries as entries
from graphtrim.integrations.artifacts import S3Store
broken = os.environ.get("GRAPHTRIM_TEST_BROKEN", "")
if broken == "key":  # an entry key that differs on every attempt
    _locate = S3Store._locate
    S3Store._locate = lambda self, *a: _locate(self, *a) + "-" + uuid.uuid4().hex[:8]
elif broken == "scratch":  # a staging folder removed when the upload succeeds, not when it fails
    @contextlib.contextmanager
    def _scratch(self):
        folder = tempfile.mkdtemp(prefix="staging-")
        yield Path(folder)
        shutil.rmtree(folder)
    S3Store._scratch = _scratch
elif broken == "message":  # the file system's error passed on as it came
    entries.disk_full = lambda what, exc: exc
store = S3Store(sys.argv[1], sys.argv[2], endpoint_url=sys.argv[3], multipart_threshold=8 << 20,
                backoff=0.2)
try:
    stored = store.put_model(sys.argv[4], model="big", version="1", stage="optimized")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
    sys.exit(1)
print(json.dumps(stored.manifest, sort_keys=True))
"""


def _stored(s3: str, prefix: str) -> dict[str, int]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3)
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"].removeprefix(prefix + "/"): int(o["Size"]) for o in found}


def run_upload_case(
    env: FaultEnv, case: Case, tmp: Path, *, broken: str = ""
) -> tuple[Result, list[str]]:
    """``S3Store.put_model`` of a 40 MB model (three parts) through the S3 proxy with the
    case's fault, retried as a stage would be; compared with the same upload without it.
    ``broken``, what the uploads of the case get wrong on purpose: ``key``, the entry's key
    differs on every attempt (what a key built from a run id or a clock would do);
    ``scratch``, the staging folder is removed only when the upload succeeds; ``message``, a
    full disk's error is passed on as the file system gave it."""
    import boto3

    data_name = "weights.bin" if case.fault == "disk-full" else "model.onnx.data"
    model = _big_model(tmp / "model", data_name)
    home = tmp / "home"
    result = Result()
    start = time.monotonic()

    def put(
        prefix: str,
        *,
        through: str,
        fsize: int | None = None,
        kill: bool = False,
        broken: str = broken,
    ) -> tuple[int, str]:
        """One upload process; ``kill``: SIGKILLed while the proxy holds one of its parts."""
        with subprocess.Popen(
            [sys.executable, "-c", _PUT, BUCKET, prefix, through, str(model)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**_env(home), "GRAPHTRIM_TEST_BROKEN": broken},
            preexec_fn=_limit_files(fsize) if fsize else None,
        ) as proc:
            if kill:
                held = s3.holding.wait(STAGE_LIMIT)
                proc.kill()
                s3.release()
                if not held:
                    raise AssertionError("the upload never reached the held part")
            out, _ = proc.communicate(timeout=STAGE_LIMIT)
            return proc.returncode, out

    s3 = env.s3_proxy
    rc, out = put(f"ref-{case.slug}", through=env.s3, broken="")
    assert rc == 0, out
    reference = _stored(env.s3, f"ref-{case.slug}")
    part2 = lambda m, p: m == "PUT" and "partNumber=2" in p  # noqa: E731
    if case.point == "upload.part.2.once":
        s3.rules.append(Rule(part2, "drop"))
    elif case.point == "upload.part.2.outage":
        s3.rules.append(Rule(part2, "drop", times=4))
    elif case.point == "upload.part.2.kill":
        s3.rules.append(Rule(part2, "hold"))
    elif case.point == "upload.part.burst":
        s3.rules.append(Rule(lambda m, p: m == "PUT" and "partNumber=" in p, "503", times=2))
    elif case.point == "upload.complete.outage":
        # the parts went through; from then on S3 answers the upload's completion, and its
        # abort, with 503: the attempt leaves its multipart upload open
        after_parts = lambda m, p: m in ("POST", "DELETE") and "uploadId=" in p  # noqa: E731
        s3.rules.append(Rule(after_parts, "503", times=10_000))
    fsize = 16 << 20 if case.fault == "disk-full" else None
    prefix = f"case-{case.slug}" + (f"-broken-{broken}" if broken else "")
    for attempt in range(1 + RETRIES):
        armed = attempt == 0 or case.fatal
        kill = attempt == 0 and case.fault == "worker-kill"
        rc, out = put(prefix, through=s3.url, fsize=fsize if armed else None, kill=kill)
        if armed and (fsize or any(a != "pass" for _, _, a in s3.log)):
            result.reached = True
        if not case.fatal or attempt == RETRIES:
            s3.clear()
        result.attempts += 1
        result.log += f"\n--- attempt {attempt + 1}: exit {rc}\n{out[-3000:]}"
        if rc == 0:
            break
        result.line = _last_line(out)
    if case.fatal:
        s3.clear()
        rc, out = put(prefix, through=s3.url)  # the next run, the resource back
        result.log += f"\n--- next run: exit {rc}\n{out[-3000:]}"
    diffs = []
    if rc != 0:
        diffs.append(f"the upload did not complete: {_last_line(out)}")
    got = _stored(env.s3, prefix)
    if got != reference:
        diffs.append(f"stored objects: expected {reference}, found {got}")
    client = boto3.client("s3", endpoint_url=env.s3)
    for up in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []):
        diffs.append(f"unfinished multipart upload {up['Key']}")
        if broken and up["Key"].startswith(prefix + "/"):  # nothing left to the cells after it
            client.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])
    left = sorted(str(p) for p in (home / "tmp").iterdir() if p.name[0] != ".")
    if left:
        diffs.append(f"staging left: {left}")
    result.seconds = time.monotonic() - start
    return result, diffs


# ---------------------------------------------------------------------------- the table


def _commit() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return "unknown"


class Outcomes:
    """The fault x point -> outcome rows of one suite run; written to
    ``.test-artifacts/faults/outcomes.json`` and, with ``$GRAPHTRIM_FAULTS_PUBLISH`` (``make
    faults``), to the documentation's data file (rendered by :func:`tests.faults.table.render`)."""

    def __init__(self, *, full: bool) -> None:
        self.full = full
        self.rows: list[dict[str, Any]] = []

    def add(self, case: Case, result: Result, diffs: list[str]) -> None:
        if diffs:
            outcome = "DIFFERENT: " + "; ".join(diffs)[:500]
        elif case.fatal:
            outcome = "one clear line, completed by the next run"
        else:
            outcome = "same state"
        self.rows.append(
            {
                "fault": case.fault,
                "point": case.point,
                "outcome": outcome,
                "attempts": result.attempts,
                "line": result.line if case.fatal else "",
                "retried": result.notes,
                "seconds": round(result.seconds, 1),
            }
        )
        self.write()  # row by row: a run cut short still shows what it measured

    def write(self) -> None:
        if not self.rows:
            return
        doc = {
            "commit": _commit(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} ({os.cpu_count()} cores)",
            "form": "full" if self.full else "short",
            "rows": sorted(self.rows, key=lambda r: (r["fault"], r["point"])),
        }
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "outcomes.json").write_text(json.dumps(doc, indent=2) + "\n")
        if os.environ.get("GRAPHTRIM_FAULTS_PUBLISH"):
            DATA.parent.mkdir(parents=True, exist_ok=True)
            DATA.write_text(json.dumps(doc, indent=2) + "\n")
