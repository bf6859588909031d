"""Content-addressed artifact stores: a local directory (the embedded default) and S3.

A stored model lives under ``<prefix>/<model>/<version>/<stage>/<sha256>/`` as ``model.onnx``
(plus ``model.onnx.data`` when it has external data) and a ``manifest.json`` naming its files,
their hashes, its parents and the config hash. The sha256 covers every file of the model, so the
same bytes always land under the same key: a retried stage writes nothing new. The manifest is
written last and marks the entry complete; a half-written upload is never visible as an entry
(local files are staged and renamed; S3 objects only appear when their upload completes).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from graphtrim.errors import GraphtrimError, transient
from graphtrim.redact import redact, register_secret

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MANIFEST = "manifest.json"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class ArtifactStoreError(GraphtrimError):
    """The artifact store cannot be reached or refused an operation."""


@dataclasses.dataclass(frozen=True)
class S3Auth:
    """One S3 connection: its key pair, region and endpoint. A store or client built from it
    uses its own boto3 session; nothing goes through the process environment (without an
    ``S3Auth``, boto3's own chain applies: environment, config files, the instance's role)."""

    access_key_id: str | None = None
    secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)
    region_name: str | None = None
    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        register_secret(self.secret_access_key)
        register_secret(self.session_token)

    def session(self) -> Any:
        """A boto3 session with exactly these credentials."""
        import boto3

        return boto3.session.Session(
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            aws_session_token=self.session_token,
            region_name=self.region_name,
        )


def safe_part(part: str) -> str:
    """``part`` (a model name, a version) as one safe component of a key or a path."""
    cleaned = _SAFE.sub("_", str(part)).strip("._") or "_"
    return cleaned[:200]


def model_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a model: the ``.onnx`` and the external data files it references."""
    import onnx

    p = Path(path)
    files = [p]
    proto = onnx.load(str(p), load_external_data=False)
    seen: set[str] = set()
    for t in _external_tensors(proto):
        loc = next((e.value for e in t.external_data if e.key == "location"), "")
        if loc and loc not in seen:
            seen.add(loc)
            target = (p.parent / loc).resolve()
            if Path(loc).is_absolute() or not target.is_relative_to(p.parent.resolve()):
                raise ArtifactStoreError(
                    f"{p}: external data location '{loc}' points outside the model's folder"
                )
            if not target.is_file():
                raise ArtifactStoreError(f"{p}: external data file '{loc}' is missing")
            files.append(p.parent / loc)
    return files


def _external_tensors(proto: Any) -> list[Any]:
    """Every tensor of the model stored outside it: initializers and tensor attributes, in
    the main graph, in subgraphs (If / Loop / Scan bodies) and in functions."""
    import onnx

    out: list[Any] = []

    def graph(g: Any) -> None:
        out.extend(g.initializer)
        out.extend(s.values for s in g.sparse_initializer)
        nodes(g.node)

    def nodes(ns: Any) -> None:
        for n in ns:
            for a in n.attribute:
                if a.HasField("t"):
                    out.append(a.t)
                out.extend(a.tensors)
                if a.HasField("g"):
                    graph(a.g)
                for sub in a.graphs:
                    graph(sub)

    graph(proto.graph)
    for f in proto.functions:
        nodes(f.node)
    return [t for t in out if t.data_location == onnx.TensorProto.EXTERNAL]


def sha256_files(files: Sequence[Path], names: Sequence[str] | None = None) -> str:
    """One digest over the files' names inside an entry and their bytes. The names default to
    the entry's (``model.onnx`` for the first file, the data files' own names), so the same
    model has the same digest whatever its file is called."""
    h = hashlib.sha256()
    for f, name in zip(files, names or _staged_names(files), strict=True):
        h.update(name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class StoredModel:
    """Where a stored model lives and what it is."""

    uri: str  # the entry folder: file:///... or s3://bucket/key
    model_uri: str  # the model file within it
    sha256: str
    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "model_uri": self.model_uri, "sha256": self.sha256}


class ArtifactStore(Protocol):
    def put_model(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        version: str,
        stage: str,
        parents: Sequence[str] = (),
        config_hash: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> StoredModel: ...

    def fetch_model(self, uri: str, dest: str | os.PathLike[str]) -> Path: ...

    def put_file(self, path: str | os.PathLike[str], key: str) -> str: ...


def _manifest(
    files: Sequence[Path],
    sha: str,
    *,
    model: str,
    version: str,
    stage: str,
    parents: Sequence[str],
    config_hash: str | None,
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    names = _staged_names(files)
    return {
        "sha256": sha,
        "model": model,
        "version": str(version),
        "stage": stage,
        "files": {n: f.stat().st_size for n, f in zip(names, files, strict=True)},
        "parents": list(parents),
        "config_hash": config_hash,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **dict(extra or {}),
    }


def _staged_names(files: Sequence[Path]) -> list[str]:
    """Names inside an entry: the model is always ``model.onnx``; data files keep their names,
    which the model references (a model whose data file is not ``model.onnx.data`` is
    rewritten by the caller before storing)."""
    return [MODEL_FILE if i == 0 else f.name for i, f in enumerate(files)]


def _normalized(path: Path, tmp: Path) -> Path:
    """``path`` itself when its external data (if any) is ``model.onnx.data``; else a copy in
    ``tmp`` saved that way, so the stored entry is self-consistent."""
    files = model_files(path)
    if len(files) == 1 or (len(files) == 2 and files[1] == path.parent / DATA_FILE):
        return path
    import onnx

    proto = onnx.load(str(path))
    out = tmp / MODEL_FILE
    onnx.save(proto, str(out), save_as_external_data=True, location=DATA_FILE)
    return out


class LocalStore:
    """A directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalStore({self.root})"

    def _entry(self, model: str, version: str, stage: str, sha: str) -> Path:
        return self.root / safe_part(model) / safe_part(str(version)) / safe_part(stage) / sha

    def put_model(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        version: str,
        stage: str,
        parents: Sequence[str] = (),
        config_hash: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> StoredModel:
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".graphtrim-", dir=self.root) as tmp:
            src = _normalized(Path(path), Path(tmp))
            files = model_files(src)
            sha = sha256_files(files)
            entry = self._entry(model, version, stage, sha)
            if (entry / MANIFEST).is_file():
                return self._stored(entry)
            staging = Path(tmp) / "entry"
            staging.mkdir()
            for f, name in zip(files, _staged_names(files), strict=True):
                shutil.copyfile(f, staging / name)
            manifest = _manifest(
                files,
                sha,
                model=model,
                version=version,
                stage=stage,
                parents=parents,
                config_hash=config_hash,
                extra=extra,
            )
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(staging, entry)  # a folder appears whole or not at all
            except OSError:
                if not (entry / MANIFEST).is_file():  # not a concurrent writer of the same bytes
                    shutil.rmtree(entry, ignore_errors=True)
                    os.replace(staging, entry)
        return self._stored(entry)

    def _stored(self, entry: Path) -> StoredModel:
        manifest = json.loads((entry / MANIFEST).read_text())
        return StoredModel(
            entry.as_uri(), (entry / MODEL_FILE).as_uri(), manifest["sha256"], manifest
        )

    def fetch_model(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        entry = local_path(uri)
        if entry.name == MODEL_FILE:
            entry = entry.parent
        if not (entry / MANIFEST).is_file():
            raise ArtifactStoreError(f"{uri}: no complete model entry (manifest missing)")
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        manifest = json.loads((entry / MANIFEST).read_text())
        for name in manifest["files"]:
            shutil.copyfile(entry / name, out / name)
        return out / MODEL_FILE

    def put_file(self, path: str | os.PathLike[str], key: str) -> str:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)
        return target.as_uri()


def local_path(uri: str) -> Path:
    """The local path of a folder or file given as a path or a ``file://`` URI."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return Path(uri)


# the local disk, not the store: out of space, over the file size limit, over quota
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _disk_full(what: str, exc: OSError) -> ArtifactStoreError:
    """One line for an S3 transfer that the local disk stopped: the file and the reason."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return transient(ArtifactStoreError(f"S3 {what}: local disk full{where} ({exc.strerror})"))


class S3Store:
    """An S3 bucket (any S3-compatible endpoint) under a key prefix.

    Uploads use boto3's managed transfer (multipart above ``multipart_threshold``) with retries
    and exponential backoff on top of botocore's own.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        client: Any = None,
        auth: S3Auth | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        attempts: int = 4,
        backoff: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = (
            endpoint_url
            or (auth.endpoint_url if auth is not None else None)
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("MLFLOW_S3_ENDPOINT_URL")
        )
        self.attempts = attempts
        self.backoff = backoff
        self._sleep = sleep
        self.multipart_threshold = multipart_threshold
        if client is None:
            import boto3
            from botocore.config import Config

            # a connection's credentials stay in its own session (never the process's
            # environment, which every other task of this process would then use)
            client = (auth.session() if auth is not None else boto3).client(
                "s3",
                endpoint_url=self.endpoint_url,
                config=Config(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=5,
                    read_timeout=60,
                ),
            )
        self.client = client

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.prefix}, endpoint={self._where})"

    @property
    def _where(self) -> str:
        """The endpoint as messages show it (credentials masked)."""
        return redact(self.endpoint_url) if self.endpoint_url else "AWS"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        final = ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "403", "404")
        last: Exception | None = None
        for attempt in range(self.attempts):
            try:
                return fn()
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code in final:
                    raise ArtifactStoreError(
                        f"S3 {what} failed: {code} (bucket '{self.bucket}', endpoint {self._where})"
                    ) from exc
                last = exc
            except S3UploadFailedError as exc:  # the managed transfer wraps the client error
                code = next((c for c in final if f"({c})" in str(exc)), None)
                if code is not None:
                    raise ArtifactStoreError(
                        f"S3 {what} failed: {code} (bucket '{self.bucket}', endpoint {self._where})"
                    ) from exc
                last = exc
            except (BotoCoreError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
                    raise _disk_full(what, exc) from exc  # not S3's: no retry helps here
                last = exc
            if attempt + 1 < self.attempts:
                self._sleep(self.backoff * (2**attempt))
        raise transient(
            ArtifactStoreError(
                f"S3 {what} failed after {self.attempts} attempts (bucket '{self.bucket}', "
                f"endpoint {self._where}): {redact(last)}"
            )
        ) from last

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=key)
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

        return bool(self._retry(f"HEAD {key}", head))

    def _upload(self, path: Path, key: str) -> None:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(
            multipart_threshold=self.multipart_threshold, multipart_chunksize=16 << 20
        )
        self._retry(
            f"upload of {key}",
            lambda: self.client.upload_file(str(path), self.bucket, key, Config=cfg),
        )

    def put_model(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        version: str,
        stage: str,
        parents: Sequence[str] = (),
        config_hash: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> StoredModel:
        with tempfile.TemporaryDirectory(prefix="graphtrim-s3-") as tmp:
            src = _normalized(Path(path), Path(tmp))
            files = model_files(src)
            sha = sha256_files(files)
            base = self._key(safe_part(model), safe_part(str(version)), safe_part(stage), sha)
            manifest_key = f"{base}/{MANIFEST}"
            if self._exists(manifest_key):
                return self._stored(base)
            for f, name in zip(files, _staged_names(files), strict=True):
                self._upload(f, f"{base}/{name}")
            manifest = _manifest(
                files,
                sha,
                model=model,
                version=version,
                stage=stage,
                parents=parents,
                config_hash=config_hash,
                extra=extra,
            )
            body = json.dumps(manifest, indent=2).encode()
            self._retry(
                f"upload of {manifest_key}",
                lambda: self.client.put_object(Bucket=self.bucket, Key=manifest_key, Body=body),
            )
        return StoredModel(
            f"s3://{self.bucket}/{base}", f"s3://{self.bucket}/{base}/{MODEL_FILE}", sha, manifest
        )

    def _stored(self, base: str) -> StoredModel:
        obj = self._retry(
            f"GET {base}/{MANIFEST}",
            lambda: self.client.get_object(Bucket=self.bucket, Key=f"{base}/{MANIFEST}"),
        )
        manifest = json.loads(obj["Body"].read())
        return StoredModel(
            f"s3://{self.bucket}/{base}",
            f"s3://{self.bucket}/{base}/{MODEL_FILE}",
            manifest["sha256"],
            manifest,
        )

    def fetch_model(self, uri: str, dest: str | os.PathLike[str]) -> Path:
        bucket, key = split_s3(uri)
        if key.endswith("/" + MODEL_FILE):
            key = key[: -len(MODEL_FILE) - 1]
        obj = self._retry(
            f"GET {key}/{MANIFEST}",
            lambda: self.client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}"),
        )
        manifest = json.loads(obj["Body"].read())
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        names = list(manifest["files"])
        for name in names:
            self._retry(
                f"download of {key}/{name}",
                functools.partial(
                    self.client.download_file, bucket, f"{key}/{name}", str(out / name)
                ),
            )
        # hashed before anything parses the files: tampered bytes are this error, not a crash
        if sha256_files([out / n for n in names], names) != manifest["sha256"]:
            raise ArtifactStoreError(f"{uri}: downloaded files do not match the manifest's sha256")
        return out / MODEL_FILE

    def put_file(self, path: str | os.PathLike[str], key: str) -> str:
        full = self._key(key)
        self._upload(Path(path), full)
        return f"s3://{self.bucket}/{full}"


def split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ArtifactStoreError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[5:].partition("/")
    if len(bucket) < 3:
        raise ArtifactStoreError(f"{uri}: bucket names have at least 3 characters")
    return bucket, key.strip("/")


def open_store(
    location: str, *, endpoint_url: str | None = None, auth: S3Auth | None = None
) -> ArtifactStore:
    """``s3://bucket/prefix`` -> S3Store; a path or ``file://`` URI -> LocalStore."""
    if location.startswith("s3://"):
        bucket, prefix = split_s3(location)
        return S3Store(bucket, prefix, endpoint_url=endpoint_url, auth=auth)
    return LocalStore(local_path(location))


def fetch(
    uri: str,
    dest: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    auth: S3Auth | None = None,
) -> Path:
    """Download the model entry at ``uri`` (from either backend) into ``dest``."""
    if uri.startswith("s3://"):
        bucket, _ = split_s3(uri)
        return S3Store(bucket, endpoint_url=endpoint_url, auth=auth).fetch_model(uri, dest)
    return LocalStore("/").fetch_model(uri, dest)


def fetch_file(
    uri: str,
    dest: str | os.PathLike[str],
    *,
    endpoint_url: str | None = None,
    auth: S3Auth | None = None,
) -> Path:
    """A single file (evaluation data, a policy) from a local path, ``file://`` or ``s3://``
    URI, as a local path: local files are used in place, S3 objects downloaded to ``dest``."""
    if uri.startswith("s3://"):
        bucket, key = split_s3(uri)
        store = S3Store(bucket, endpoint_url=endpoint_url, auth=auth)
        out = Path(dest)
        out.parent.mkdir(parents=True, exist_ok=True)
        store._retry(
            f"download of {key}",
            functools.partial(store.client.download_file, bucket, key, str(out)),
        )
        return out
    path = local_path(uri)
    if not path.is_file():
        raise ArtifactStoreError(f"{uri}: no such file")
    return path
