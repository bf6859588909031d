"""Content-addressed artifact stores: a local directory (the embedded default) and S3.

A stored model lives under ``<prefix>/<model>/<version>/<stage>/<sha256>/`` as ``model.onnx``
(plus ``model.onnx.data`` when it has external data) and a ``manifest.json`` naming its files,
their hashes, its parents and the config hash. The sha256 covers every file of the model, so the
same bytes always land under the same key: a retried stage writes nothing new. The manifest is
written last and marks the entry complete; a half-written upload is never visible as an entry
(local files are staged and renamed; S3 objects only appear when their upload completes).

The entry, the store protocol and the local store are in :mod:`graphtrim.integrations.entries`;
this module holds the S3 store and opens either by its URI (:func:`open_store`, :func:`fetch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graphtrim.errors import transient
from graphtrim.integrations.entries import (
    _SHA,
    DISK_FULL,
    ArtifactStore,
    LocalStore,
    MissingEntryError,
    StoredModel,
    _EntryStore,
    disk_full,
    local_path,
    safe_part,
)
from graphtrim.integrations.model_files import (
    MANIFEST,
    MODEL_FILE,
    ArtifactStoreError,
    _staged_names,
    sha256_files,
)
from graphtrim.redact import redact, register_secret
from graphtrim.scratch import scratch

logger = logging.getLogger("graphtrim.artifacts")


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
                if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                    raise disk_full(f"S3 {what}", exc) from exc  # not S3's: no retry helps here
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

    def _scratch(self) -> contextlib.AbstractContextManager[Path]:
        # named for this process: the next upload on this host removes it if the process is
        # killed (a worker lost mid-upload)
        return scratch("s3")

    def _locate(self, model: str, version: str, stage: str, sha: str) -> str:
        return self._key(safe_part(model), safe_part(version), safe_part(stage), sha)

    def _complete(self, where: str) -> StoredModel | None:
        return self._stored(where) if self._exists(f"{where}/{MANIFEST}") else None

    def _abort_unfinished(self, where: str) -> None:
        """Abort the multipart uploads an earlier attempt at this entry left open (a process
        killed mid-upload): S3 keeps and bills their parts until they are aborted. The entry's
        key holds its content hash, so an upload under it is of these same bytes."""

        def abort() -> int:
            n, page = 0, {"Bucket": self.bucket, "Prefix": f"{where}/"}
            while True:
                found = self.client.list_multipart_uploads(**page)
                for up in found.get("Uploads", []):
                    self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )
                    n += 1
                if not found.get("IsTruncated"):
                    return n
                page.update(
                    KeyMarker=found["NextKeyMarker"], UploadIdMarker=found["NextUploadIdMarker"]
                )

        if n := self._retry(f"listing unfinished uploads under {where}", abort):
            logger.info("aborted %d unfinished multipart upload(s) under %s", n, where)

    def _write(self, where: str, files: Sequence[Path], manifest: dict[str, Any]) -> StoredModel:
        self._abort_unfinished(where)
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
