"""The content-addressed artifact stores: ``LocalStore`` on a temporary folder and ``S3Store``
against a real S3 endpoint (moto's server), plus the module's helpers.

Models are tiny MatMul graphs built with ``onnx.helper``; the one that checks multipart uploads
carries ~18 MB of external data so that it is split into two 16 MiB-chunk parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from graphtrim.integrations import entries, input_cache
from graphtrim.integrations.artifacts import (
    S3Store,
    fetch,
    fetch_file,
    open_store,
    split_s3,
)
from graphtrim.integrations.entries import LocalStore
from graphtrim.integrations.model_files import (
    DATA_FILE,
    MANIFEST,
    MODEL_FILE,
    ArtifactStoreError,
    model_files,
    sha256_files,
)
from tests.servers import free_port, moto_server

boto3 = pytest.importorskip("boto3")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

N = 32  # a 32x32 float32 weight: 4 KiB, above onnx's 1 KiB external-data threshold
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# models


def _weight(seed: int, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, n)).astype(np.float32)


def _matmul(w: np.ndarray) -> onnx.ModelProto:
    n = w.shape[0]
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, n])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])],
        [onh.from_array(w, "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def save_model(
    folder: Path, *, seed: int = 0, name: str = MODEL_FILE, location: str | None = None, n: int = N
) -> Path:
    """A MatMul model in ``folder/name``; with ``location`` its weight is external data."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    model = _matmul(_weight(seed, n))
    if location is None:
        onnx.save(model, str(path))
    else:
        onnx.save(model, str(path), save_as_external_data=True, location=location, size_threshold=0)
    return path


def external_ref_model(folder: Path, location: str, name: str = MODEL_FILE) -> Path:
    """A model whose initializer points at ``location`` (which the caller may or may not
    create), written by hand: no onnx helper would produce a ``..`` location."""
    folder.mkdir(parents=True, exist_ok=True)
    w = onnx.TensorProto()
    w.name = "w"
    w.data_type = onnx.TensorProto.FLOAT
    w.dims.extend([N, N])
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(N * N * 4))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    model = _matmul(_weight(0))
    del model.graph.initializer[:]
    model.graph.initializer.append(w)
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def run(path: Path) -> np.ndarray:
    x = np.arange(N, dtype=np.float32).reshape(1, N) / N
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def entry_dirs(stage_dir: Path) -> list[Path]:
    return sorted(p for p in stage_dir.iterdir() if p.is_dir()) if stage_dir.exists() else []


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def local_entry(uri: str) -> Path:
    assert uri.startswith("file://")
    return Path(entries.local_path(uri))


# ---------------------------------------------------------------------------------------------
# S3 fixtures


@pytest.fixture(scope="module", autouse=True)
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fake credentials, a region, and no user config or endpoint overrides."""
    nowhere = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(nowhere))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
        for var in (
            "AWS_SESSION_TOKEN",
            "AWS_PROFILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "MLFLOW_S3_ENDPOINT_URL",
        ):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def s3_url(aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture(scope="module")
def s3(s3_url: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_url)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"art-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    resp = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


class Sleeps(list):
    """A ``sleep`` that records instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def requests_sent(store: S3Store) -> list[str]:
    """``METHOD URL`` of every HTTP request the store's client sends from now on, each retry of
    botocore's own included (what a fast failure is: few requests, not a short time)."""
    sent: list[str] = []

    def record(request: Any, **_: Any) -> None:
        sent.append(f"{request.method} {request.url}")

    store.client.meta.events.register("before-send.s3", record)
    return sent


# ---------------------------------------------------------------------------------------------
# 1. LocalStore basics


def test_local_put_is_content_addressed_and_round_trips(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    src = save_model(tmp_path / "a", seed=1)
    copy = save_model(tmp_path / "b", seed=1)  # same bytes, another folder
    assert src.read_bytes() == copy.read_bytes()

    first = store.put_model(
        src,
        model="net",
        version="3",
        stage="optimized",
        parents=["s3://x/parent"],
        config_hash="cfg123",
        extra={"note": "hi"},
    )
    second = store.put_model(copy, model="net", version="3", stage="optimized")
    assert (first.uri, first.sha256, first.model_uri) == (
        second.uri,
        second.sha256,
        second.model_uri,
    )
    stage_dir = tmp_path / "store" / "net" / "3" / "optimized"
    assert entry_dirs(stage_dir) == [local_entry(first.uri)]
    assert local_entry(first.uri).name == first.sha256
    assert first.model_uri == (local_entry(first.uri) / MODEL_FILE).as_uri()
    # the second put found the entry: the manifest is the first one's
    assert second.manifest["parents"] == ["s3://x/parent"]
    # no staging folders left in the store root
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["net"]

    other = store.put_model(
        save_model(tmp_path / "c", seed=2), model="net", version="3", stage="optimized"
    )
    assert other.sha256 != first.sha256
    assert len(entry_dirs(stage_dir)) == 2

    manifest = json.loads((local_entry(first.uri) / MANIFEST).read_text())
    assert manifest == first.manifest
    assert manifest["sha256"] == first.sha256
    assert manifest["files"] == {MODEL_FILE: src.stat().st_size}
    assert manifest["parents"] == ["s3://x/parent"]
    assert manifest["config_hash"] == "cfg123"
    assert (manifest["model"], manifest["version"], manifest["stage"]) == (
        "net",
        "3",
        "optimized",
    )
    assert manifest["note"] == "hi"
    assert sorted(p.name for p in local_entry(first.uri).iterdir()) == [MANIFEST, MODEL_FILE]

    out = store.fetch_model(first.uri, tmp_path / "out")
    assert out == tmp_path / "out" / MODEL_FILE
    assert out.read_bytes() == src.read_bytes()
    # the model file's URI works as well as the entry's
    out2 = store.fetch_model(first.model_uri, tmp_path / "out2")
    assert out2.read_bytes() == src.read_bytes()
    # and the module-level fetch picks the local backend
    out3 = fetch(first.uri, tmp_path / "out3")
    assert out3.read_bytes() == src.read_bytes()
    np.testing.assert_array_equal(run(out3), run(src))


def test_local_names_are_sanitized(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    stored = store.put_model(
        save_model(tmp_path / "m"), model="../../evil name", version="1/2", stage="st age"
    )
    rel = local_entry(stored.uri).relative_to((tmp_path / "store").resolve())
    assert rel.parts == ("evil_name", "1_2", "st_age", stored.sha256)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "store"]


# ---------------------------------------------------------------------------------------------
# 2. crashes leave no visible entry


def test_local_leftover_partial_entry_is_invisible_and_replaced(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    src = save_model(tmp_path / "m", seed=3, location=DATA_FILE)
    sha = sha256_files(model_files(src))
    entry = root / "net" / "1" / "opt" / sha
    # what a writer killed mid-way could leave: a half copy without a manifest, and a
    # staging folder of a TemporaryDirectory that was never cleaned up
    entry.mkdir(parents=True)
    (entry / MODEL_FILE).write_bytes(src.read_bytes()[:10])
    (root / ".graphtrim-dead" / "entry").mkdir(parents=True)
    (root / ".graphtrim-dead" / "entry" / MODEL_FILE).write_bytes(b"junk")

    with pytest.raises(ArtifactStoreError, match="manifest"):
        store.fetch_model(entry.as_uri(), tmp_path / "out-bad")
    with pytest.raises(ArtifactStoreError):
        fetch(entry.as_uri(), tmp_path / "out-bad2")

    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert local_entry(stored.uri) == entry
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, MODEL_FILE, DATA_FILE]
    out = store.fetch_model(stored.uri, tmp_path / "out")
    assert out.read_bytes() == src.read_bytes()
    assert (out.parent / DATA_FILE).read_bytes() == (src.parent / DATA_FILE).read_bytes()
    np.testing.assert_array_equal(run(out), run(src))


def test_local_crash_during_copy_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    src = save_model(tmp_path / "m", seed=4, location=DATA_FILE)
    sha = sha256_files(model_files(src))
    entry = root / "net" / "1" / "opt" / sha

    real_copy = shutil.copyfile
    calls: list[str] = []

    def crashing_copy(a: Any, b: Any, *args: Any, **kw: Any) -> Any:
        calls.append(str(b))
        if len(calls) == 2:  # model.onnx copied, the data file fails half-way
            Path(b).write_bytes(b"partial")
            raise OSError("disk full")
        return real_copy(a, b, *args, **kw)

    monkeypatch.setattr(shutil, "copyfile", crashing_copy)
    with pytest.raises(OSError, match="disk full"):
        store.put_model(src, model="net", version="1", stage="opt")
    monkeypatch.setattr(shutil, "copyfile", real_copy)
    assert len(calls) == 2

    assert not entry.exists()
    assert files_under(root) == []  # the staging folder went with its TemporaryDirectory
    with pytest.raises(ArtifactStoreError):
        store.fetch_model(entry.as_uri(), tmp_path / "out-bad")

    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert local_entry(stored.uri) == entry
    assert (entry / MANIFEST).is_file()
    assert store.fetch_model(stored.uri, tmp_path / "out").read_bytes() == src.read_bytes()


# ---------------------------------------------------------------------------------------------
# 3. external data


def test_local_external_data_entry_and_sha(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    src = save_model(tmp_path / "m", seed=5, location=DATA_FILE)
    data = src.parent / DATA_FILE
    assert model_files(src) == [src, data]

    stored = store.put_model(src, model="net", version="1", stage="opt")
    entry = local_entry(stored.uri)
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, MODEL_FILE, DATA_FILE]
    assert stored.manifest["files"] == {
        MODEL_FILE: src.stat().st_size,
        DATA_FILE: data.stat().st_size,
    }
    assert (entry / DATA_FILE).read_bytes() == data.read_bytes()

    # change only the data file's bytes (same size, same model.onnx)
    model_bytes = src.read_bytes()
    raw = bytearray(data.read_bytes())
    raw[:4] = np.float32(123.0).tobytes()
    data.write_bytes(bytes(raw))
    assert src.read_bytes() == model_bytes
    changed = store.put_model(src, model="net", version="1", stage="opt")
    assert changed.sha256 != stored.sha256
    assert changed.uri != stored.uri
    # the first entry is untouched
    assert (entry / DATA_FILE).read_bytes() != bytes(raw)
    out = store.fetch_model(changed.uri, tmp_path / "out")
    assert (out.parent / DATA_FILE).read_bytes() == bytes(raw)
    np.testing.assert_array_equal(run(out), run(src))


def test_local_external_data_is_normalized_to_model_onnx_data(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    src = save_model(tmp_path / "m", seed=6, name="net.onnx", location="weights.bin")
    assert [p.name for p in model_files(src)] == ["net.onnx", "weights.bin"]
    expected = run(src)

    stored = store.put_model(src, model="net", version="1", stage="opt")
    entry = local_entry(stored.uri)
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, MODEL_FILE, DATA_FILE]
    assert set(stored.manifest["files"]) == {MODEL_FILE, DATA_FILE}
    stored_proto = onnx.load(str(entry / MODEL_FILE), load_external_data=False)
    locations = {
        e.value
        for t in stored_proto.graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert locations == {DATA_FILE}
    # the source is left as it was
    assert sorted(p.name for p in src.parent.iterdir()) == ["net.onnx", "weights.bin"]

    out = store.fetch_model(stored.uri, tmp_path / "out")
    assert sorted(p.name for p in out.parent.iterdir()) == [MODEL_FILE, DATA_FILE]
    np.testing.assert_array_equal(run(out), expected)
    # storing it again is a no-op
    again = store.put_model(src, model="net", version="1", stage="opt")
    assert again.uri == stored.uri
    assert len(entry_dirs(entry.parent)) == 1


def test_a_full_disk_while_staging_is_one_line_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose data is not model.onnx.data is copied into a staging folder first; a disk
    that fills there says so, with the folder, as an error worth a retry, and stores nothing.
    (The fault suite's disk-full cell does it with a real file size limit.)"""
    import errno

    root = tmp_path / "store"
    store = LocalStore(root)
    src = save_model(tmp_path / "m", seed=7, name="net.onnx", location="weights.bin")
    real_save = onnx.save

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(onnx, "save", full)
    with pytest.raises(ArtifactStoreError) as caught:
        store.put_model(src, model="net", version="1", stage="opt")
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("staging net.onnx for the store in ") and line.endswith(
        ": local disk full (File too large)"
    ), line
    assert getattr(caught.value, "transient", False)
    assert files_under(root) == []
    monkeypatch.setattr(onnx, "save", real_save)
    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert (local_entry(stored.uri) / MANIFEST).is_file()


# ---------------------------------------------------------------------------------------------
# 4. unsafe or missing external data


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_external_data_outside_the_model_folder_is_refused(
    tmp_path: Path, kind: str, s3: Any, bucket: str
) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(_weight(0).tobytes())
    folder = tmp_path / "sub"
    if kind == "dotdot":
        location = "../outside.bin"
    elif kind == "absolute":
        location = str(outside)
    else:
        folder.mkdir()
        (folder / "link.bin").symlink_to(outside)
        location = "link.bin"
    src = external_ref_model(folder, location)

    with pytest.raises(ArtifactStoreError, match="outside"):
        model_files(src)

    root = tmp_path / "store"
    with pytest.raises(ArtifactStoreError, match="outside"):
        LocalStore(root).put_model(src, model="net", version="1", stage="opt")
    assert files_under(root) == []
    assert not (root / "net").exists()

    store = S3Store(bucket, "pre", client=s3, endpoint_url="moto", sleep=Sleeps())
    with pytest.raises(ArtifactStoreError, match="outside"):
        store.put_model(src, model="net", version="1", stage="opt")
    assert keys(s3, bucket) == []


def test_missing_external_data_file_is_an_error(tmp_path: Path) -> None:
    src = external_ref_model(tmp_path / "m", "gone.bin")
    with pytest.raises(ArtifactStoreError, match="missing"):
        model_files(src)
    root = tmp_path / "store"
    with pytest.raises(ArtifactStoreError, match="missing"):
        LocalStore(root).put_model(src, model="net", version="1", stage="opt")
    assert files_under(root) == []

    # a data file deleted after a normal save
    src2 = save_model(tmp_path / "m2", location="weights.bin")
    (src2.parent / "weights.bin").unlink()
    with pytest.raises(ArtifactStoreError, match="missing"):
        LocalStore(root).put_model(src2, model="net", version="1", stage="opt")
    assert files_under(root) == []


# ---------------------------------------------------------------------------------------------
# 5. S3Store against moto


def test_s3_round_trip_and_no_reupload(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = S3Store(bucket, "/models/", endpoint_url=s3_url)
    src = save_model(tmp_path / "m", seed=7, location=DATA_FILE)
    stored = store.put_model(
        src, model="net", version="2", stage="opt", parents=["p1"], config_hash="c1"
    )
    base = f"models/net/2/opt/{stored.sha256}"
    assert stored.uri == f"s3://{bucket}/{base}"
    assert stored.model_uri == f"s3://{bucket}/{base}/{MODEL_FILE}"
    assert stored.sha256 == sha256_files(model_files(src))
    assert keys(s3, bucket) == [f"{base}/{n}" for n in (MANIFEST, MODEL_FILE, DATA_FILE)]
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"{base}/{MANIFEST}")["Body"].read())
    assert manifest == stored.manifest
    assert manifest["files"] == {
        MODEL_FILE: src.stat().st_size,
        DATA_FILE: (src.parent / DATA_FILE).stat().st_size,
    }
    assert (manifest["parents"], manifest["config_hash"]) == (["p1"], "c1")
    body = s3.get_object(Bucket=bucket, Key=f"{base}/{MODEL_FILE}")["Body"].read()
    assert body == src.read_bytes()

    before = {
        o["Key"]: (o["ETag"], o["LastModified"])
        for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
    }
    uploads: list[tuple[Any, ...]] = []
    puts: list[dict[str, Any]] = []
    real_upload, real_put = store.client.upload_file, store.client.put_object
    monkeypatch.setattr(
        store.client, "upload_file", lambda *a, **k: uploads.append(a) or real_upload(*a, **k)
    )
    monkeypatch.setattr(store.client, "put_object", lambda **k: puts.append(k) or real_put(**k))
    time.sleep(1.1)  # LastModified has a resolution of one second
    again = store.put_model(src, model="net", version="2", stage="opt")
    assert (again.uri, again.sha256) == (stored.uri, stored.sha256)
    assert again.manifest == stored.manifest
    assert uploads == [] and puts == []
    after = {
        o["Key"]: (o["ETag"], o["LastModified"])
        for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
    }
    assert after == before

    for uri in (stored.uri, stored.model_uri):
        dest = tmp_path / f"out-{len(uri)}"
        out = store.fetch_model(uri, dest)
        assert out == dest / MODEL_FILE
        assert out.read_bytes() == src.read_bytes()
        assert (dest / DATA_FILE).read_bytes() == (src.parent / DATA_FILE).read_bytes()
        np.testing.assert_array_equal(run(out), run(src))
    # the module-level fetch picks the S3 backend
    out = fetch(stored.uri, tmp_path / "out-fetch", endpoint_url=s3_url)
    assert out.read_bytes() == src.read_bytes()


def test_s3_normalizes_external_data_name(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    store = S3Store(bucket, endpoint_url=s3_url)
    src = save_model(tmp_path / "m", seed=8, location="weights.bin")
    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert keys(s3, bucket) == [
        f"net/1/opt/{stored.sha256}/{n}" for n in (MANIFEST, MODEL_FILE, DATA_FILE)
    ]
    out = store.fetch_model(stored.uri, tmp_path / "out")
    np.testing.assert_array_equal(run(out), run(src))


def test_s3_multipart_upload_round_trips(tmp_path: Path, s3_url: str, s3: Any, bucket: str) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    w = np.random.default_rng(9).standard_normal((2200, 2200)).astype(np.float32)  # 19.4 MB
    src = folder / MODEL_FILE
    onnx.save(_matmul(w), str(src), save_as_external_data=True, location=DATA_FILE)
    data = folder / DATA_FILE
    assert data.stat().st_size > 16 * MIB  # more than one 16 MiB part

    store = S3Store(bucket, "mp", endpoint_url=s3_url, multipart_threshold=5 * MIB)
    stored = store.put_model(src, model="big", version="1", stage="opt")
    head = s3.head_object(Bucket=bucket, Key=f"mp/big/1/opt/{stored.sha256}/{DATA_FILE}")
    assert head["ContentLength"] == data.stat().st_size
    assert head["ETag"].strip('"').endswith("-2")  # a two-part multipart upload

    out = store.fetch_model(stored.uri, tmp_path / "out")
    assert digest(out.parent / DATA_FILE) == digest(data)
    assert out.read_bytes() == src.read_bytes()


def test_s3_put_aborts_the_uploads_a_killed_attempt_left_under_its_entry(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    """A process killed mid multipart upload leaves the upload open (S3 keeps and bills its
    parts); the next put of the same bytes aborts it. Uploads of other entries stay."""
    store = S3Store(bucket, "mp", endpoint_url=s3_url)
    src = save_model(tmp_path / "m", seed=12, location=DATA_FILE)
    sha = sha256_files(model_files(src))
    left = {}
    for key in (f"mp/net/1/opt/{sha}/{DATA_FILE}", f"mp/other/1/opt/{'0' * 64}/{DATA_FILE}"):
        up = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        s3.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * 1024)
        left[key] = up

    stored = store.put_model(src, model="net", version="1", stage="opt")

    open_now = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in open_now] == [
        (k, v) for k, v in left.items() if "/other/" in k
    ]
    assert stored.sha256 == sha
    np.testing.assert_array_equal(run(store.fetch_model(stored.uri, tmp_path / "out")), run(src))


def test_s3_fetch_detects_tampering(tmp_path: Path, s3_url: str, s3: Any, bucket: str) -> None:
    store = S3Store(bucket, endpoint_url=s3_url)
    src = save_model(tmp_path / "m", seed=10, location=DATA_FILE)
    stored = store.put_model(src, model="net", version="1", stage="opt")
    key = stored.uri.split(f"s3://{bucket}/", 1)[1]
    store.fetch_model(stored.uri, tmp_path / "ok")  # intact: fine

    # another valid model in place of model.onnx
    other = save_model(tmp_path / "other", seed=11, n=16, location=DATA_FILE)
    assert other.read_bytes() != src.read_bytes()
    s3.put_object(Bucket=bucket, Key=f"{key}/{MODEL_FILE}", Body=other.read_bytes())
    with pytest.raises(ArtifactStoreError, match="sha256"):
        store.fetch_model(stored.uri, tmp_path / "bad1")

    # the model restored, the data file altered
    s3.put_object(Bucket=bucket, Key=f"{key}/{MODEL_FILE}", Body=src.read_bytes())
    store.fetch_model(stored.uri, tmp_path / "ok2")
    raw = bytearray((src.parent / DATA_FILE).read_bytes())
    raw[0] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=f"{key}/{DATA_FILE}", Body=bytes(raw))
    with pytest.raises(ArtifactStoreError, match="sha256"):
        store.fetch_model(stored.uri, tmp_path / "bad2")


def test_s3_missing_bucket_fails_fast(tmp_path: Path, s3_url: str) -> None:
    sleeps = Sleeps()
    store = S3Store(f"nope-{uuid.uuid4().hex[:8]}", endpoint_url=s3_url, sleep=sleeps)
    src = save_model(tmp_path / "m")
    sent = requests_sent(store)
    with pytest.raises(ArtifactStoreError) as put_err:
        store.put_model(src, model="net", version="1", stage="opt")
    with pytest.raises(ArtifactStoreError) as get_err:
        store.fetch_model(f"s3://{store.bucket}/net/1/opt/abc", tmp_path / "out")
    with pytest.raises(ArtifactStoreError) as file_err:
        store.put_file(src, "x/model.onnx")
    assert sleeps == []  # a missing bucket is final: no retries
    # neither by botocore: no request was sent twice
    assert sent and len(sent) == len(set(sent)), sent
    for err in (put_err, get_err, file_err):
        assert store.bucket in str(err.value)
        assert s3_url in str(err.value)
    assert "NoSuchBucket" in str(get_err.value)


def test_s3_down_fails_naming_the_endpoint(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sleeps = Sleeps()
    store = S3Store("some-bucket", endpoint_url=endpoint, attempts=2, backoff=0.01, sleep=sleeps)
    src = save_model(tmp_path / "m")
    sent = requests_sent(store)
    with pytest.raises(ArtifactStoreError, match="2 attempts") as err:
        store.put_model(src, model="net", version="1", stage="opt")
    assert endpoint in str(err.value)
    assert "some-bucket" in str(err.value)
    assert sleeps == [0.01]
    # what bounds the wait: two attempts of one request, each retried by botocore only as often
    # as its configuration says
    per_attempt = store.client.meta.config.retries["total_max_attempts"]
    assert len(sent) == 2 * per_attempt and len(set(sent)) == 1, sent

    with pytest.raises(ArtifactStoreError, match=re.escape(endpoint)):
        store.fetch_model("s3://some-bucket/net/1/opt/abc", tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# 6. retries (a flaky wrapper around the real client)


class FlakyUploads:
    """The real moto client, except that ``upload_file`` fails ``failures`` times first."""

    def __init__(self, real: Any, failures: int):
        self._real = real
        self.failures = failures
        self.calls = 0

    def upload_file(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise botocore_exceptions.EndpointConnectionError(endpoint_url="x")
        return self._real.upload_file(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_s3_upload_retries_with_growing_backoff(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    flaky = FlakyUploads(s3, failures=2)
    sleeps = Sleeps()
    store = S3Store(
        bucket, endpoint_url=s3_url, client=flaky, attempts=4, backoff=0.25, sleep=sleeps
    )
    src = save_model(tmp_path / "m", seed=12)
    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert flaky.calls == 3
    assert sleeps == [0.25, 0.5]
    assert sleeps == sorted(sleeps) and sleeps[0] < sleeps[1]
    assert keys(s3, bucket) == [f"net/1/opt/{stored.sha256}/{n}" for n in (MANIFEST, MODEL_FILE)]
    out = store.fetch_model(stored.uri, tmp_path / "out")
    assert out.read_bytes() == src.read_bytes()

    # more failures than attempts: an error naming the cause, and no manifest
    flaky2 = FlakyUploads(s3, failures=10)
    sleeps2 = Sleeps()
    store2 = S3Store(
        bucket, "p2", endpoint_url=s3_url, client=flaky2, attempts=3, backoff=0.1, sleep=sleeps2
    )
    with pytest.raises(ArtifactStoreError, match="after 3 attempts"):
        store2.put_model(src, model="net", version="1", stage="opt")
    assert flaky2.calls == 3
    assert sleeps2 == [0.1, 0.2]
    assert keys(s3, bucket, "p2/") == []


# ---------------------------------------------------------------------------------------------
# 7. open_store, split_s3, fetch_file


def test_open_store_and_split_s3(tmp_path: Path) -> None:
    store = open_store("s3://my-bucket/pre", endpoint_url="http://127.0.0.1:1")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url) == (
        "my-bucket",
        "pre",
        "http://127.0.0.1:1",
    )
    deep = open_store("s3://my-bucket/a/b/")
    assert isinstance(deep, S3Store)
    assert deep.prefix == "a/b"
    assert deep._key("m", "v") == "a/b/m/v"
    bare = open_store("s3://my-bucket")
    assert isinstance(bare, S3Store)
    assert bare.prefix == ""
    assert bare._key("m", "v") == "m/v"

    local = open_store(str(tmp_path / "store"))
    assert isinstance(local, LocalStore)
    assert local.root == (tmp_path / "store").resolve()
    via_uri = open_store((tmp_path / "store2").as_uri())
    assert isinstance(via_uri, LocalStore)
    assert via_uri.root == (tmp_path / "store2").resolve()

    assert split_s3("s3://bucket/a/b/") == ("bucket", "a/b")
    assert split_s3("s3://bucket") == ("bucket", "")
    for bad in ("s3://ab", "s3://ab/key", "http://bucket/key", "/local/path", "S3://bucket/k"):
        with pytest.raises(ArtifactStoreError):
            split_s3(bad)
    with pytest.raises(ArtifactStoreError):
        open_store("s3://ab/x")


def test_fetch_file_local_and_s3(tmp_path: Path, s3_url: str, s3: Any, bucket: str) -> None:
    local = tmp_path / "data.npz"
    local.write_bytes(b"local bytes")
    dest = tmp_path / "dl" / "unused.npz"
    assert fetch_file(str(local), dest) == local
    assert fetch_file(local.as_uri(), dest) == local
    assert not dest.exists()  # local files are used in place
    with pytest.raises(ArtifactStoreError, match="no such file"):
        fetch_file(str(tmp_path / "missing.npz"), dest)
    with pytest.raises(ArtifactStoreError):
        fetch_file(str(tmp_path), dest)  # a folder is not a file

    payload = os.urandom(3000)
    s3.put_object(Bucket=bucket, Key="eval/data.npz", Body=payload)
    out = fetch_file(
        f"s3://{bucket}/eval/data.npz", tmp_path / "dl" / "sub" / "data.npz", endpoint_url=s3_url
    )
    assert out == tmp_path / "dl" / "sub" / "data.npz"
    assert out.read_bytes() == payload
    with pytest.raises(ArtifactStoreError):
        fetch_file(
            f"s3://{bucket}/eval/missing.npz", tmp_path / "dl" / "m.npz", endpoint_url=s3_url
        )


# ---------------------------------------------------------------------------------------------
# 8. put_file


def test_put_file_local(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    src = tmp_path / "report.json"
    src.write_text('{"a": 1}')
    uri = store.put_file(src, "runs/r1/report.json")
    target = (tmp_path / "store" / "runs" / "r1" / "report.json").resolve()
    assert uri == target.as_uri()
    assert target.read_text() == '{"a": 1}'
    src.write_text('{"a": 2}')
    assert store.put_file(src, "runs/r1/report.json") == uri  # overwrites in place
    assert target.read_text() == '{"a": 2}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]  # no .tmp left
    assert fetch_file(uri, tmp_path / "unused") == target


def test_put_file_s3(tmp_path: Path, s3_url: str, s3: Any, bucket: str) -> None:
    store = S3Store(bucket, "pre/", endpoint_url=s3_url)
    src = tmp_path / "policy.yaml"
    src.write_bytes(b"rules: []\n")
    uri = store.put_file(src, "runs/r1/policy.yaml")
    assert uri == f"s3://{bucket}/pre/runs/r1/policy.yaml"
    assert s3.get_object(Bucket=bucket, Key="pre/runs/r1/policy.yaml")["Body"].read() == (
        b"rules: []\n"
    )
    assert fetch_file(uri, tmp_path / "back.yaml", endpoint_url=s3_url).read_bytes() == (
        b"rules: []\n"
    )


# ---------------------------------------------------------------------------------------------
# regressions: bugs these tests found once


def test_s3_round_trip_of_model_not_named_model_onnx(
    tmp_path: Path, s3_url: str, bucket: str
) -> None:
    store = S3Store(bucket, endpoint_url=s3_url)
    src = save_model(tmp_path / "m", seed=13, name="tiny.onnx")
    stored = store.put_model(src, model="net", version="1", stage="opt")
    out = store.fetch_model(stored.uri, tmp_path / "out")
    assert out.read_bytes() == src.read_bytes()


def test_local_external_data_in_subfolder_round_trips(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    (tmp_path / "m" / "data").mkdir(parents=True)
    src = save_model(tmp_path / "m", seed=14, location="data/model.onnx.data")
    assert [p.relative_to(src.parent).as_posix() for p in model_files(src)] == [
        MODEL_FILE,
        "data/model.onnx.data",
    ]
    expected = run(src)
    stored = store.put_model(src, model="net", version="1", stage="opt")
    out = store.fetch_model(stored.uri, tmp_path / "out")
    np.testing.assert_array_equal(run(out), expected)


def _if_model_with_subgraph_weight() -> onnx.ModelProto:
    then_graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w_then"], ["t"])],
        "then",
        [],
        [oh.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [1, N])],
        [onh.from_array(_weight(15), "w_then")],
    )
    else_graph = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [oh.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [1, N])],
    )
    graph = oh.make_graph(
        [oh.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)],
        "g",
        [
            oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, N]),
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, N])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_external_data_of_subgraph_initializers_is_stored(tmp_path: Path) -> None:
    src = tmp_path / "m" / MODEL_FILE
    src.parent.mkdir()
    onnx.save(
        _if_model_with_subgraph_weight(),
        str(src),
        save_as_external_data=True,
        location=DATA_FILE,
        size_threshold=0,
    )
    assert (src.parent / DATA_FILE).is_file()
    store = LocalStore(tmp_path / "store")
    stored = store.put_model(src, model="net", version="1", stage="opt")
    assert DATA_FILE in stored.manifest["files"]
    out = store.fetch_model(stored.uri, tmp_path / "out")
    onnx.load(str(out))  # loads the external data


def test_traversal_via_constant_attribute_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside.bin").write_bytes(_weight(0).tobytes())
    value = onnx.TensorProto()
    value.name = "c"
    value.data_type = onnx.TensorProto.FLOAT
    value.dims.extend([N, N])
    value.data_location = onnx.TensorProto.EXTERNAL
    for key, v in (("location", "../outside.bin"), ("offset", "0"), ("length", str(N * N * 4))):
        entry = value.external_data.add()
        entry.key, entry.value = key, v
    graph = oh.make_graph(
        [
            oh.make_node("Constant", [], ["w"], value=value),
            oh.make_node("MatMul", ["x", "w"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, N])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, N])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    src = tmp_path / "sub" / MODEL_FILE
    src.parent.mkdir()
    src.write_bytes(model.SerializeToString())
    with pytest.raises(ArtifactStoreError, match="outside"):
        model_files(src)


def test_s3_fetch_detects_non_onnx_tampering(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    store = S3Store(bucket, endpoint_url=s3_url)
    stored = store.put_model(save_model(tmp_path / "m", seed=16), model="n", version="1", stage="s")
    key = stored.uri.split(f"s3://{bucket}/", 1)[1]
    s3.put_object(Bucket=bucket, Key=f"{key}/{MODEL_FILE}", Body=b"not an onnx model")
    with pytest.raises(ArtifactStoreError, match="sha256"):
        store.fetch_model(stored.uri, tmp_path / "bad")


# ---------------------------------------------------------------------------------------------
# 8. delete


def test_local_delete_removes_one_entry_whole_and_only_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    one = store.put_model(save_model(tmp_path / "a", seed=1), model="m", version="1", stage="t")
    two = store.put_model(save_model(tmp_path / "b", seed=2), model="m", version="1", stage="t")
    assert store.delete(one.model_uri) is True  # the model file's URI names its entry too
    assert not entries.local_path(one.uri).exists()
    with pytest.raises(entries.MissingEntryError, match="no complete model entry"):
        store.fetch_model(one.uri, tmp_path / "gone")
    assert store.delete(one.uri) is False  # a retried clean-up is not an error
    np.testing.assert_array_equal(
        run(store.fetch_model(two.uri, tmp_path / "kept")), run(tmp_path / "b" / MODEL_FILE)
    )
    # nothing left over beside the entries (the entry is renamed away, then removed)
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["m"]


def test_local_delete_refuses_what_is_not_an_entry(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    stored = store.put_model(save_model(tmp_path / "a", seed=1), model="m", version="1", stage="t")
    entry = entries.local_path(stored.uri)
    other = LocalStore(tmp_path / "other")
    for uri in (str(entry.parent), str(tmp_path / "store"), (tmp_path / "a").as_uri()):
        with pytest.raises(ArtifactStoreError, match="not a model entry"):
            store.delete(uri)
    with pytest.raises(ArtifactStoreError, match="not a model entry"):
        other.delete(stored.uri)
    assert (entry / MANIFEST).is_file()


def test_s3_delete_removes_every_object_of_the_entry(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    store = S3Store(bucket, "pre", endpoint_url=s3_url)
    gone = store.put_model(
        save_model(tmp_path / "a", seed=1, location=DATA_FILE), model="m", version="1", stage="t"
    )
    kept = store.put_model(save_model(tmp_path / "b", seed=2), model="m", version="1", stage="t")
    base = f"pre/m/1/t/{gone.sha256}"
    assert keys(s3, bucket, base) == [f"{base}/{n}" for n in (MANIFEST, MODEL_FILE, DATA_FILE)]
    s3.put_object(Bucket=bucket, Key=f"pre/m/1/t/{gone.sha256}x/keep", Body=b"x")  # a sibling
    assert store.delete(gone.uri) is True
    assert keys(s3, bucket, base + "/") == []
    assert keys(s3, bucket) == sorted(
        [f"pre/m/1/t/{gone.sha256}x/keep"]
        + [f"pre/m/1/t/{kept.sha256}/{n}" for n in (MANIFEST, MODEL_FILE)]
    )
    with pytest.raises(entries.MissingEntryError):
        store.fetch_model(gone.uri, tmp_path / "out")
    assert store.delete(gone.model_uri) is False
    out = store.fetch_model(kept.uri, tmp_path / "kept")
    np.testing.assert_array_equal(run(out), run(tmp_path / "b" / MODEL_FILE))


def test_s3_delete_refuses_what_is_not_an_entry(
    tmp_path: Path, s3_url: str, s3: Any, bucket: str
) -> None:
    store = S3Store(bucket, "pre", endpoint_url=s3_url)
    stored = store.put_model(save_model(tmp_path / "a", seed=1), model="m", version="1", stage="t")
    before = keys(s3, bucket)
    for uri in (
        f"s3://{bucket}/pre/m/1/t",  # a folder of entries
        f"s3://{bucket}/pre",
        stored.uri.replace(bucket, "another-bucket"),
        stored.uri.replace("/pre/", "/elsewhere/"),
    ):
        with pytest.raises(ArtifactStoreError, match="not a model entry"):
            store.delete(uri)
    assert keys(s3, bucket) == before


# ---------------------------------------------------------------------------------------------
# 9. the per-worker input cache


def test_input_cache_fetches_each_content_once_and_links_it(
    tmp_path: Path, s3_url: str, bucket: str
) -> None:
    store = S3Store(bucket, "pre", endpoint_url=s3_url)
    src = save_model(tmp_path / "a", seed=1, location=DATA_FILE)
    stored = store.put_model(src, model="m", version="1", stage="t")
    cache = input_cache.InputCache(tmp_path / "cache")
    fetched: list[str] = []

    def counted(uri: str, dest: Path) -> Path:
        fetched.append(uri)
        return store.fetch_model(uri, dest)

    outs = [
        cache.model(stored.uri, stored.sha256, tmp_path / f"task{i}", counted) for i in range(3)
    ]
    assert fetched == [stored.uri]
    for out in outs:
        assert out.read_bytes() == src.read_bytes()
        assert (out.parent / DATA_FILE).read_bytes() == (src.parent / DATA_FILE).read_bytes()
        np.testing.assert_array_equal(run(out), run(src))
    # each task has its own names for the one copy: removing a task's folder keeps the cache
    shutil.rmtree(tmp_path / "task0")
    again = cache.model(stored.uri, stored.sha256, tmp_path / "task3", counted)
    assert fetched == [stored.uri] and again.read_bytes() == src.read_bytes()


def test_input_cache_refuses_bytes_that_do_not_match_the_hash(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    one = store.put_model(save_model(tmp_path / "a", seed=1), model="m", version="1", stage="t")
    two = store.put_model(save_model(tmp_path / "b", seed=2), model="m", version="1", stage="t")
    cache = input_cache.InputCache(tmp_path / "cache")
    with pytest.raises(ArtifactStoreError, match="do not match sha256"):
        cache.model(two.uri, one.sha256, tmp_path / "task", store.fetch_model)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing entered the cache
    data = tmp_path / "eval.bin"
    data.write_bytes(b"0123")
    with pytest.raises(ArtifactStoreError, match="does not match sha256"):
        cache.file(str(data), "0" * 64, tmp_path / "task" / "eval.bin", fetch_file)
    digest = hashlib.sha256(b"0123").hexdigest()
    out = cache.file(str(data), digest, tmp_path / "task" / "eval.bin", fetch_file)
    assert out.read_bytes() == b"0123"


def test_input_cache_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    entries = [
        store.put_model(save_model(tmp_path / f"m{i}", seed=i), model="m", version="1", stage="t")
        for i in range(3)
    ]
    size = (tmp_path / "m0" / MODEL_FILE).stat().st_size
    cache = input_cache.InputCache(tmp_path / "cache", max_bytes=2 * size + size // 2)
    for i, e in enumerate(entries[:2]):
        cache.model(e.uri, e.sha256, tmp_path / f"t{i}", store.fetch_model)
    os.utime(tmp_path / "cache" / entries[1].sha256, (1, 1))  # the older one now
    cache.model(entries[0].uri, entries[0].sha256, tmp_path / "t0b", store.fetch_model)
    cache.model(entries[2].uri, entries[2].sha256, tmp_path / "t2", store.fetch_model)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [entries[0].sha256, entries[2].sha256]
    )
    # a task still holding the evicted copy keeps its files
    assert run(tmp_path / "t1" / MODEL_FILE) is not None


def test_input_cache_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(input_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv(input_cache.CACHE_SIZE_ENV, raising=False)
    cache = input_cache.InputCache.from_env()
    assert cache is not None and cache.root == (tmp_path / "xdg" / "graphtrim" / "inputs")
    monkeypatch.setenv(input_cache.CACHE_ENV, str(tmp_path / "c"))
    monkeypatch.setenv(input_cache.CACHE_SIZE_ENV, "0.5")
    cache = input_cache.InputCache.from_env()
    assert cache is not None and (cache.root, cache.max_bytes) == (tmp_path / "c", 1 << 29)
    monkeypatch.setenv(input_cache.CACHE_SIZE_ENV, "lots")
    with pytest.raises(ArtifactStoreError, match="a number of GB"):
        input_cache.InputCache.from_env()
    monkeypatch.setenv(input_cache.CACHE_ENV, "off")
    assert input_cache.InputCache.from_env() is None
