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


class MissingEntryError(ArtifactStoreError):
    """No complete model entry at the URI (never stored, half-written or deleted)."""


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

    def delete(self, uri: str) -> bool: ...


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


class _EntryStore:
    """What both stores share: ``put_model`` over three primitives of the backend (where an
    entry goes, the entry if it is complete, writing a staged entry)."""

    def _scratch(self) -> tempfile.TemporaryDirectory[str]:
        raise NotImplementedError

    def _locate(self, model: str, version: str, stage: str, sha: str) -> Any:
        raise NotImplementedError

    def _complete(self, where: Any) -> StoredModel | None:
        raise NotImplementedError

    def _write(self, where: Any, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        raise NotImplementedError

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
        """Store the model at ``path`` (with its external data) under its content hash; the
        same bytes stored again write nothing and return the entry already there."""
        with self._scratch() as tmp:
            src = _normalized(Path(path), Path(tmp))
            files = model_files(src)
            sha = sha256_files(files)
            where = self._locate(model, str(version), stage, sha)
            done = self._complete(where)
            if done is not None:
                return done
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
            return self._write(where, files, manifest)


_SHA = re.compile(r"[0-9a-f]{64}")


class LocalStore(_EntryStore):
    """A directory on a local or mounted file system."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalStore({self.root})"

    def _entry(self, model: str, version: str, stage: str, sha: str) -> Path:
        return self.root / safe_part(model) / safe_part(str(version)) / safe_part(stage) / sha

    def _scratch(self) -> tempfile.TemporaryDirectory[str]:
        self.root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix=".graphtrim-", dir=self.root)

    def _locate(self, model: str, version: str, stage: str, sha: str) -> Path:
        return self._entry(model, version, stage, sha)

    def _complete(self, where: Path) -> StoredModel | None:
        return self._stored(where) if (where / MANIFEST).is_file() else None

    def _write(self, where: Path, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        staging = Path(tempfile.mkdtemp(prefix=".graphtrim-entry-", dir=self.root))
        try:
            for f, name in zip(files, _staged_names(files), strict=True):
                shutil.copyfile(f, staging / name)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
            where.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(staging, where)  # a folder appears whole or not at all
            except OSError:
                if not (where / MANIFEST).is_file():  # not a concurrent writer of the same bytes
                    shutil.rmtree(where, ignore_errors=True)
                    os.replace(staging, where)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self._stored(where)

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
            raise MissingEntryError(f"{uri}: no complete model entry (manifest missing)")
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        manifest = json.loads((entry / MANIFEST).read_text())
        for name in manifest["files"]:
            shutil.copyfile(entry / name, out / name)
        return out / MODEL_FILE

    def delete(self, uri: str) -> bool:
        """Remove the model entry at ``uri`` (its folder or its model file) from this store;
        False when there is none (deleting twice is not an error). The entry disappears whole
        (renamed away, then removed); anything that is not an entry of this store is refused."""
        entry = local_path(uri)
        if entry.name == MODEL_FILE:
            entry = entry.parent
        entry = entry.resolve()
        if not entry.is_relative_to(self.root) or not _SHA.fullmatch(entry.name):
            raise ArtifactStoreError(f"{uri}: not a model entry of {self!r}")
        if len(entry.relative_to(self.root).parts) != 4:
            raise ArtifactStoreError(f"{uri}: not a model entry of {self!r}")
        if not entry.exists():
            return False
        gone = self.root / f".graphtrim-deleted-{entry.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.replace(entry, gone)
        except FileNotFoundError:  # a concurrent delete
            return False
        shutil.rmtree(gone, ignore_errors=True)
        return True

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


class S3Store(_EntryStore):
    """An S3 bucket (any S3-compatible endpoint) under a key prefix.

    Uploads and downloads use boto3's managed transfer (in parts above ``multipart_threshold``)
    with retries and exponential backoff on top of botocore's own.
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
                last = exc
            if attempt + 1 < self.attempts:
                self._sleep(self.backoff * (2**attempt))
        raise transient(
            ArtifactStoreError(
                f"S3 {what} failed after {self.attempts} attempts (bucket '{self.bucket}', "
                f"endpoint {self._where}): {redact(last)}"
            )
        ) from last

    def _exists(self, key: str, bucket: str | None = None) -> bool:
        from botocore.exceptions import ClientError

        def head() -> bool:
            try:
                self.client.head_object(Bucket=bucket or self.bucket, Key=key)
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

    def _scratch(self) -> tempfile.TemporaryDirectory[str]:
        return tempfile.TemporaryDirectory(prefix="graphtrim-s3-")

    def _locate(self, model: str, version: str, stage: str, sha: str) -> str:
        return self._key(safe_part(model), safe_part(version), safe_part(stage), sha)

    def _complete(self, where: str) -> StoredModel | None:
        return self._stored(where) if self._exists(f"{where}/{MANIFEST}") else None

    def _write(self, where: str, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        for f, name in zip(files, _staged_names(files), strict=True):
            self._upload(f, f"{where}/{name}")
        body = json.dumps(manifest, indent=2).encode()
        manifest_key = f"{where}/{MANIFEST}"  # last: it marks the entry complete
        self._retry(
            f"upload of {manifest_key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=manifest_key, Body=body),
        )
        return StoredModel(
            f"s3://{self.bucket}/{where}",
            f"s3://{self.bucket}/{where}/{MODEL_FILE}",
            manifest["sha256"],
            manifest,
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
        from botocore.exceptions import ClientError

        def get() -> Any:
            try:
                return self.client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None  # no entry (a missing bucket stays the error it is)
                raise

        obj = self._retry(f"GET {key}/{MANIFEST}", get)
        if obj is None:
            raise MissingEntryError(f"{uri}: no complete model entry (manifest missing)")
        manifest = json.loads(obj["Body"].read())
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        names = list(manifest["files"])
        from boto3.s3.transfer import TransferConfig

        # ranged parts above the same threshold as uploads (boto3's own default: 8 MB)
        cfg = TransferConfig(
            multipart_threshold=self.multipart_threshold, multipart_chunksize=16 << 20
        )
        for name in names:
            self._retry(
                f"download of {key}/{name}",
                functools.partial(
                    self.client.download_file,
                    bucket,
                    f"{key}/{name}",
                    str(out / name),
                    Config=cfg,
                ),
            )
        # hashed before anything parses the files: tampered bytes are this error, not a crash
        if sha256_files([out / n for n in names], names) != manifest["sha256"]:
            raise ArtifactStoreError(f"{uri}: downloaded files do not match the manifest's sha256")
        return out / MODEL_FILE

    def delete(self, uri: str) -> bool:
        """Remove the model entry at ``uri`` (its folder or its model file) from this store;
        False when there is none (deleting twice is not an error). The manifest goes first,
        so a half-deleted entry is never visible as an entry; anything that is not an entry
        under this store's bucket and prefix is refused."""
        bucket, key = split_s3(uri)
        if key.endswith("/" + MODEL_FILE):
            key = key[: -len(MODEL_FILE) - 1]
        parts = key.split("/")
        inside = bucket == self.bucket and (not self.prefix or key.startswith(self.prefix + "/"))
        depth = len(parts) - (len(self.prefix.split("/")) if self.prefix else 0)
        if not inside or depth != 4 or not _SHA.fullmatch(parts[-1]):
            raise ArtifactStoreError(f"{uri}: not a model entry of {self!r}")
        found = self._exists(f"{key}/{MANIFEST}", bucket)
        self._retry(
            f"DELETE {key}/{MANIFEST}",
            lambda: self.client.delete_object(Bucket=bucket, Key=f"{key}/{MANIFEST}"),
        )

        def rest() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=key + "/"
            )
            return [o["Key"] for page in pages for o in page.get("Contents", [])]

        keys = self._retry(f"LIST {key}/", rest)
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._retry(
                f"DELETE {key}/",
                functools.partial(self.client.delete_objects, Bucket=bucket, Delete=batch),
            )
        return found or bool(keys)

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


CACHE_ENV = "GRAPHTRIM_INPUT_CACHE"  # the folder, or "off"
CACHE_SIZE_ENV = "GRAPHTRIM_INPUT_CACHE_GB"  # its size limit, 20 GB unless set


class InputCache:
    """A worker's copies of the inputs its tasks fetch (stored models, data files), each kept
    under its sha256: a content hash names the same bytes wherever they were read from, so a
    second task on this worker that needs them links them from here instead of fetching them
    again. A copy enters the cache whole (fetched into a folder of its own, checked against
    its hash, renamed into place) and is handed out as hard links (a copy across file
    systems), so evicting it never pulls a file from under a task. The least recently used
    copies go when the cache exceeds ``max_bytes``."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = 20 << 30):
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"InputCache({self.root})"

    @classmethod
    def from_env(cls, workdir: str | None = None) -> InputCache | None:
        """The cache ``GRAPHTRIM_INPUT_CACHE`` names (``off``: none); unset, a folder in the
        user's cache folder (``$XDG_CACHE_HOME/graphtrim/inputs``)."""
        where = os.environ.get(CACHE_ENV, "").strip()
        if where.lower() in ("off", "0", "false", "none"):
            return None
        if not where:
            base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
            where = str(Path(base) / "graphtrim" / "inputs")
        raw = os.environ.get(CACHE_SIZE_ENV, "").strip()
        try:
            size = float(raw) if raw else 20.0
        except ValueError:
            raise ArtifactStoreError(f"{CACHE_SIZE_ENV}={raw!r}: a number of GB") from None
        if size <= 0:
            raise ArtifactStoreError(f"{CACHE_SIZE_ENV}={raw!r}: a number of GB above 0")
        return cls(where, max_bytes=int(size * (1 << 30)))

    def model(
        self, uri: str, sha256: str, dest: str | os.PathLike[str], fetch: Callable[..., Path]
    ) -> Path:
        """The model entry at ``uri`` (content hash ``sha256``) in ``dest``, its model file
        returned; ``fetch(uri, folder)`` fetches it when this worker has no copy."""

        def get(folder: Path) -> None:
            path = fetch(uri, folder)
            names = [MODEL_FILE, *sorted(p.name for p in folder.iterdir() if p != path)]
            if sha256_files([folder / n for n in names], names) != sha256:
                raise ArtifactStoreError(f"{uri}: fetched files do not match sha256 {sha256}")

        entry = self._entry(sha256, get)
        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(entry.iterdir()):
            _link(f, out / f.name)
        return out / MODEL_FILE

    def file(
        self, uri: str, sha256: str, dest: str | os.PathLike[str], fetch: Callable[..., Path]
    ) -> Path:
        """The single file at ``uri`` (sha256 ``sha256``) as ``dest``; ``fetch(uri, path)``
        fetches it when this worker has no copy."""
        from graphtrim.hashing import file_sha256

        def get(folder: Path) -> None:
            got = fetch(uri, folder / "file")
            if got != folder / "file":  # a local file used in place
                shutil.copyfile(got, folder / "file")
            if file_sha256(folder / "file") != sha256:
                raise ArtifactStoreError(f"{uri}: fetched file does not match sha256 {sha256}")

        entry = self._entry(sha256, get)
        out = Path(dest)
        out.parent.mkdir(parents=True, exist_ok=True)
        _link(entry / "file", out)
        return out

    def _entry(self, sha256: str, get: Callable[[Path], None]) -> Path:
        if not _SHA.fullmatch(sha256):
            raise ArtifactStoreError(f"not a sha256: {sha256!r}")
        entry = self.root / sha256
        if entry.is_dir():
            os.utime(entry)  # recently used
            return entry
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=self.root) as tmp:
            folder = Path(tmp) / "entry"
            folder.mkdir()
            get(folder)
            for f in folder.iterdir():  # shared by links: no task may write into them
                f.chmod(0o444)
            try:
                os.replace(folder, entry)
            except OSError:  # a concurrent task of this worker put the same bytes first
                if not entry.is_dir():
                    raise
        self._evict(keep=entry)
        return entry

    def _evict(self, keep: Path) -> None:
        entries = []
        for e in self.root.iterdir():
            if e == keep or not _SHA.fullmatch(e.name):
                continue
            try:
                size = sum(f.stat().st_size for f in e.iterdir())
                entries.append((e.stat().st_mtime, size, e))
            except OSError:
                continue
        total = sum(s for _, s, _ in entries) + sum(f.stat().st_size for f in keep.iterdir())
        for _, size, e in sorted(entries, key=lambda t: t[0]):
            if total <= self.max_bytes:
                break
            gone = self.root / f".evicted-{e.name}-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.replace(e, gone)
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)
            total -= size


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a copy where the file systems differ)."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
