"""A Google Cloud Storage stand-in on 127.0.0.1, so that `gs://` run dirs are tested without network
through the very code a real bucket runs.

What a `gs://` run touches, and what stands in for it here:

- orbax writes and reads arrays through tensorstore's `gcs` kvstore driver (HTTP, GCS JSON API).
  `FakeGCS` serves that API (object media reads with ranges and generation preconditions, media
  uploads, listing, deletes) from an in-memory object store; tensorstore is pointed at it with its
  own test hooks `TENSORSTORE_GCS_HTTP_URL` and `GOOGLE_AUTH_TOKEN_FOR_TESTING`.
- `etils.epath` (orbax's step listing, commit markers, our metrics, dumps, exports) opens `gs://`
  through fsspec's `gcs` protocol (gcsfs in production). `FakeGCSFileSystem` is registered under
  that protocol and reads the same object store with GCS semantics: no real directories (a
  "folder" exists only while an object lies under it), `mkdir` is a no-op, rename = copy + delete,
  no append.
- orbax asks `google.cloud.storage` whether a bucket has a hierarchical namespace; a stub module
  answers "no" for the fake's buckets.

Only objects in the fake's buckets exist; anything else is 404, like a missing bucket.
"""
from __future__ import annotations

import importlib.machinery
import io
import json
import os
import sys
import threading
import types
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

_FSSPEC_REGISTRY = sys.modules["fsspec.registry"]._registry  # the package attribute is a read-only view


class ObjectStore:
    """Buckets of objects: name -> (bytes, generation). Thread-safe; generations only grow."""

    def __init__(self, buckets: tuple[str, ...]):
        self.buckets: dict[str, dict[str, tuple[bytes, int]]] = {b: {} for b in buckets}
        self.lock = threading.Lock()
        self._generation = 1000
        self.requests: list[tuple[str, str]] = []  # (method, path) seen by the HTTP server
        self.refuse_uploads = False  # a fault: media uploads answered 403 (a bucket that refuses writes)

    def put(self, bucket: str, name: str, data: bytes, if_generation_match: int | None = None) -> int | None:
        """Writes an object; None when the precondition fails."""
        with self.lock:
            objects = self.buckets[bucket]
            current = objects.get(name, (b"", 0))[1]
            if if_generation_match is not None and current != if_generation_match:
                return None
            self._generation += 1
            objects[name] = (bytes(data), self._generation)
            return self._generation

    def get(self, bucket: str, name: str) -> tuple[bytes, int] | None:
        with self.lock:
            return self.buckets[bucket].get(name)

    def delete(self, bucket: str, name: str) -> bool:
        with self.lock:
            return self.buckets[bucket].pop(name, None) is not None

    def names(self, bucket: str) -> list[str]:
        with self.lock:
            return sorted(self.buckets[bucket])


def _metadata(bucket: str, name: str, data: bytes, generation: int) -> dict[str, Any]:
    return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)),
            "generation": str(generation), "metageneration": "1", "contentType": "application/octet-stream",
            "timeCreated": "2024-01-01T00:00:00.000Z", "updated": "2024-01-01T00:00:00.000Z"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as tensorstore's curl client expects
    store: ObjectStore

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        self._reply(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _route(self) -> tuple[str, str | None, dict[str, str]] | None:
        """(bucket, object name or None for the bucket's object list, query) of a JSON API path."""
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        parts = url.path.split("/")
        # /storage/v1/b/<bucket>/o[/<object>]  or  /upload/storage/v1/b/<bucket>/o
        try:
            at = parts.index("b")
        except ValueError:
            return None
        bucket = urllib.parse.unquote(parts[at + 1])
        if bucket not in self.store.buckets:
            return None
        if len(parts) > at + 3 and parts[at + 3]:
            return bucket, urllib.parse.unquote(parts[at + 3]), query
        if len(parts) == at + 2:  # bucket metadata
            return bucket, "", query
        return bucket, None, query

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def do_GET(self) -> None:  # (http.server's naming)
        self.store.requests.append(("GET", self.path))
        route = self._route()
        if route is None:
            return self._json(404, {"error": {"code": 404, "message": "no such bucket"}})
        bucket, name, query = route
        if name == "":
            return self._json(200, {"kind": "storage#bucket", "name": bucket})
        if name is None:
            return self._list(bucket, query)
        found = self.store.get(bucket, name)
        if found is None:
            return self._json(404, {"error": {"code": 404, "message": "no such object"}})
        data, generation = found
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != generation:
            return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
        if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == generation:
            return self._reply(304, headers={"x-goog-generation": str(generation)})
        if query.get("alt") != "media":
            return self._json(200, _metadata(bucket, name, data, generation))
        headers = {"x-goog-generation": str(generation), "Content-Type": "application/octet-stream"}
        byte_range = self.headers.get("Range")
        if byte_range and byte_range.startswith("bytes="):
            first, _, last = byte_range[6:].partition("-")
            if first == "":  # suffix range: the last N bytes
                start, end = max(0, len(data) - int(last)), len(data) - 1
            else:
                start, end = int(first), (int(last) if last else len(data) - 1)
            if start >= len(data) and len(data) > 0:
                return self._reply(416, headers=headers)
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._reply(206, data[start:end + 1], headers)
        return self._reply(200, data, headers)

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        start, end = query.get("startOffset"), query.get("endOffset")
        items, prefixes = [], set()
        for name in self.store.names(bucket):
            if not name.startswith(prefix) or (start is not None and name < start) or (end and name >= end):
                continue
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                continue
            found = self.store.get(bucket, name)
            if found is not None:
                items.append(_metadata(bucket, name, *found))
        payload: dict[str, Any] = {"kind": "storage#objects", "items": items}
        if prefixes:
            payload["prefixes"] = sorted(prefixes)
        self._json(200, payload)

    def do_POST(self) -> None:
        self.store.requests.append(("POST", self.path))
        route = self._route()
        body = self._body()
        if route is None:
            return self._json(404, {"error": {"code": 404, "message": "no such bucket"}})
        bucket, _, query = route
        if self.store.refuse_uploads:
            return self._json(403, {"error": {"code": 403, "message": "fake@test.iam does not have "
                                              "storage.objects.create access to the Google Cloud Storage object"}})
        if query.get("uploadType") != "media" or "name" not in query:
            return self._json(400, {"error": {"code": 400, "message": "only media uploads are served"}})
        match = int(query["ifGenerationMatch"]) if "ifGenerationMatch" in query else None
        generation = self.store.put(bucket, query["name"], body, match)
        if generation is None:
            return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
        self._json(200, _metadata(bucket, query["name"], body, generation))

    def do_DELETE(self) -> None:
        self.store.requests.append(("DELETE", self.path))
        route = self._route()
        if route is None or not route[1]:
            return self._json(404, {"error": {"code": 404, "message": "no such object"}})
        bucket, name, query = route
        found = self.store.get(bucket, name)
        if found is None:
            return self._json(404, {"error": {"code": 404, "message": "no such object"}})
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != found[1]:
            return self._json(412, {"error": {"code": 412, "message": "precondition failed"}})
        self.store.delete(bucket, name)
        self._reply(204)


class _Upload(io.BytesIO):
    """A file opened for writing: the object is written in one piece on close, as GCS does."""

    def __init__(self, fs: FakeGCSFileSystem, bucket: str, name: str):
        super().__init__()
        self._target = (fs, bucket, name)

    def close(self) -> None:
        if not self.closed:
            fs, bucket, name = self._target
            fs.store.put(bucket, name, self.getvalue())
        super().close()


class FakeGCSFileSystem(AbstractFileSystem):
    """fsspec `gcs` protocol over the fake's object store (what gcsfs does against a real bucket)."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store: ObjectStore  # set by FakeGCS.start
    cachable = False

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path.rstrip("/")

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, name = self._strip_protocol(path).partition("/")
        if bucket not in self.store.buckets:
            raise FileNotFoundError(f"gs://{bucket}: no such bucket")
        return bucket, name

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        bucket, name = self._split(path)
        found = self.store.get(bucket, name) if name else None
        if found is not None:
            entries = [self._file(bucket, name, found[0])]
        else:
            prefix = f"{name}/" if name else ""
            files, dirs = {}, set()
            for key in self.store.names(bucket):
                if not key.startswith(prefix):
                    continue
                head, sep, _ = key[len(prefix):].partition("/")
                if sep:
                    dirs.add(f"{bucket}/{prefix}{head}")
                else:
                    files[key] = self.store.get(bucket, key)
            if not files and not dirs and name:
                raise FileNotFoundError(path)
            entries = [self._file(bucket, k, v[0]) for k, v in files.items() if v is not None]
            entries += [{"name": d, "size": 0, "type": "directory"} for d in sorted(dirs)]
        return entries if detail else [e["name"] for e in entries]

    @staticmethod
    def _file(bucket: str, name: str, data: bytes) -> dict[str, Any]:
        return {"name": f"{bucket}/{name}", "size": len(data), "type": "file"}

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        bucket, name = self._split(path)
        if not name:
            return {"name": bucket, "size": 0, "type": "directory"}
        found = self.store.get(bucket, name)
        if found is not None:
            return self._file(bucket, name, found[0])
        if any(k.startswith(name + "/") for k in self.store.names(bucket)):
            return {"name": f"{bucket}/{name}", "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        bucket, name = self._split(path)
        if "a" in mode or "+" in mode:
            raise NotImplementedError("GCS objects cannot be appended to or updated in place")
        if "w" in mode or "x" in mode:
            return _Upload(self, bucket, name)
        found = self.store.get(bucket, name)
        if found is None:
            raise FileNotFoundError(path)
        return io.BytesIO(found[0])

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._split(path)  # folders do not exist on GCS; only the bucket must

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._split(path)

    def rmdir(self, path: str) -> None:
        pass

    def rm_file(self, path: str) -> None:
        bucket, name = self._split(path)
        if not self.store.delete(bucket, name):
            raise FileNotFoundError(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in [path] if isinstance(path, str) else path:
            bucket, name = self._split(one)
            removed = self.store.delete(bucket, name) if name else False
            if recursive:
                for key in self.store.names(bucket):
                    if not name or key.startswith(name + "/"):
                        removed = self.store.delete(bucket, key) or removed
            if not removed:
                raise FileNotFoundError(one)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        bucket, name = self._split(path1)
        found = self.store.get(bucket, name)
        if found is None:
            if self.isdir(path1):
                return  # fsspec's recursive copy visits folders too; they hold nothing themselves
            raise FileNotFoundError(path1)
        dst_bucket, dst_name = self._split(path2)
        self.store.put(dst_bucket, dst_name, found[0])


class FakeGCS:
    """Starts the server and installs the hooks; `stop()` removes them. Use as a context manager."""

    def __init__(self, buckets: tuple[str, ...] = ("test-bucket",)):
        self.store = ObjectStore(buckets)
        self._server: ThreadingHTTPServer | None = None
        self._saved: dict[str, Any] = {}

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> FakeGCS:
        handler = type("Handler", (_Handler,), {"store": self.store})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        for key, value in (("TENSORSTORE_GCS_HTTP_URL", self.url), ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")):
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        FakeGCSFileSystem.store = self.store
        self._saved["fsspec"] = {p: _FSSPEC_REGISTRY.get(p) for p in ("gs", "gcs")}
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, FakeGCSFileSystem, clobber=True)
        self._clear_epath_cache()
        self._saved["modules"] = {m: sys.modules.get(m) for m in ("google.cloud", "google.cloud.storage")}
        sys.modules.update(_storage_stub(tuple(self.store.buckets)))
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for key in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
            if self._saved.get(key) is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = self._saved[key]
        for protocol, cls in self._saved.get("fsspec", {}).items():
            if cls is None:
                _FSSPEC_REGISTRY.pop(protocol, None)
            else:
                fsspec.register_implementation(protocol, cls, clobber=True)
        for name, module in self._saved.get("modules", {}).items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        self._clear_epath_cache()

    @staticmethod
    def _clear_epath_cache() -> None:
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _storage_stub(buckets: tuple[str, ...]) -> dict[str, types.ModuleType]:
    """`google.cloud.storage` as far as orbax uses it: a bucket without hierarchical namespace."""
    cloud = types.ModuleType("google.cloud")
    cloud.__spec__ = importlib.machinery.ModuleSpec("google.cloud", None, is_package=True)
    cloud.__path__ = []
    storage = types.ModuleType("google.cloud.storage")
    storage.__spec__ = importlib.machinery.ModuleSpec("google.cloud.storage", None)

    class Client:
        def get_bucket(self, name: str) -> Any:
            if name not in buckets:
                raise FileNotFoundError(f"gs://{name}: no such bucket")
            return types.SimpleNamespace(name=name, hierarchical_namespace_enabled=False)

    storage.Client = Client
    cloud.storage = storage
    return {"google.cloud": cloud, "google.cloud.storage": storage}
