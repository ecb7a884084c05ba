"""A Google Cloud Storage stand-in on 127.0.0.1, so that `gs://` run dirs are tested without network
through the very code a real bucket runs: every client below speaks HTTP to it.

- orbax writes and reads arrays through tensorstore's `gcs` kvstore driver (GCS JSON API), pointed here by
  its own test hooks `TENSORSTORE_GCS_HTTP_URL` and `GOOGLE_AUTH_TOKEN_FOR_TESTING`.
- `etils.epath` (orbax's step listing and commit markers, our metrics, dumps, exports) opens `gs://` with
  fsspec's `gs` protocol: gcsfs itself, pointed here by `STORAGE_EMULATOR_HOST` with anonymous
  credentials. The fake serves what gcsfs sends: object metadata, listings (prefix, delimiter),
  media downloads with ranges, multipart and resumable uploads, deletes, `rewriteTo` / `moveTo`.
  (gcsfs's default class probes a bucket's layout over gRPC to Google's control plane, which nothing here
  serves; the fake registers gcsfs's plain JSON-API class, the one it falls back to.)
- orbax asks `google.cloud.storage` whether a bucket has a hierarchical namespace: the real client,
  which `STORAGE_EMULATOR_HOST` also points here (anonymous there too).

Faults (`ObjectStore.faults`, for every client alike): every Nth request answered 503, requests held
without an answer for some seconds (a stalled connection), writes refused with 403 (lost write access).

Only objects in the fake's buckets exist; anything else is 404, like a missing bucket.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import fsspec


@dataclass
class Faults:
    """What the fake does wrong. `every`: every Nth request of each client (told apart by its User-Agent:
    tensorstore, gcsfs, google-cloud-storage) is answered 503, up to `limit` times per client;
    `stall_s` / `stalls`: that many requests are held `stall_s` seconds before any answer (a client with a
    shorter read timeout gives up and retries); `refuse`: object names whose writes get 403."""

    every: int = 0
    limit: int = 0  # at most this many 503s in all (0: no limit): backoffs add up to minutes otherwise
    stall_s: float = 0.0
    stalls: int = 0
    stall_agent: str = "gcsfs"  # only this client's requests are held (tensorstore has no read timeout to set)
    refuse: Callable[[str], bool] | None = None
    served_503: list[str] = field(default_factory=list)  # the User-Agent of each request answered 503
    stalled: int = 0
    _counts: dict[str, itertools.count] = field(default_factory=dict)


class ObjectStore:
    """Buckets of objects: name -> (bytes, generation). Thread-safe; generations only grow."""

    def __init__(self, buckets: tuple[str, ...]):
        self.buckets: dict[str, dict[str, tuple[bytes, int]]] = {b: {} for b in buckets}
        self.lock = threading.Lock()
        self._generation = 1000
        self.requests: list[tuple[str, str]] = []  # (method, path) seen by the HTTP server
        self.faults = Faults()
        self.uploads: dict[str, tuple[str, str, bytearray]] = {}  # resumable sessions: id -> (bucket, name, data)

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


# /storage/v1/b/<bucket>[/o[/<object>[/rewriteTo/b/<bucket>/o/<object> | /moveTo/o/<object>]]]
_OBJECT = re.compile(r"^(?:/upload|/download)?/storage/v1/b/([^/]+)"
                     r"(?:/o(?:/([^/]+)(?:/(rewriteTo|moveTo)(?:/b/([^/]+))?/o/([^/]+))?)?)?/?$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as tensorstore's curl client and aiohttp expect
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

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"code": status, "message": message}})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _start(self) -> tuple[urllib.parse.SplitResult, dict[str, str]] | None:
        """Logs the request and plays the faults; None when a fault answered it (its body already read)."""
        self.store.requests.append((self.command, self.path))
        faults = self.store.faults
        agent = self.headers.get("User-Agent", "")
        client = agent.split("/")[0]
        number = next(faults._counts.setdefault(client, itertools.count(1)))
        if faults.stalls > 0 and faults.stall_s > 0 and faults.stall_agent in agent:
            faults.stalls -= 1
            faults.stalled += 1
            time.sleep(faults.stall_s)  # the client has given up by now; it reads nothing from this one
        spent = faults.limit and sum(a.split("/")[0] == client for a in faults.served_503) >= faults.limit
        if faults.every and number % faults.every == 0 and not spent:
            self._body()
            faults.served_503.append(agent)
            self._error(503, "fake: service unavailable, try again")
            return None
        url = urllib.parse.urlsplit(self.path)
        return url, {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}

    def _refused(self, name: str) -> bool:
        refuse = self.store.faults.refuse
        if refuse is not None and refuse(name):
            self._error(403, "fake@test.iam does not have storage.objects.create access to the Google Cloud "
                             "Storage object")
            return True
        return False

    def do_GET(self) -> None:  # (http.server's naming)
        started = self._start()
        if started is None:
            return
        url, query = started
        match = _OBJECT.match(url.path)
        if match is None or urllib.parse.unquote(match.group(1)) not in self.store.buckets:
            return self._error(404, "no such bucket")
        bucket = urllib.parse.unquote(match.group(1))
        if match.group(2) is None:
            if url.path.rstrip("/").endswith("/o"):
                return self._list(bucket, query)
            return self._json(200, {"kind": "storage#bucket", "name": bucket, "id": bucket})
        name = urllib.parse.unquote(match.group(2))
        found = self.store.get(bucket, name)
        if found is None:
            return self._error(404, "no such object")
        data, generation = found
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != generation:
            return self._error(412, "precondition failed")
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
        started = self._start()
        if started is None:  # (the fault read the body)
            return
        body = self._body()
        url, query = started
        if url.path.startswith("/upload/resumable/"):
            return self._upload_chunk(url.path.rsplit("/", 1)[1], body)
        match = _OBJECT.match(url.path)
        if match is None or urllib.parse.unquote(match.group(1)) not in self.store.buckets:
            return self._error(404, "no such bucket")
        bucket = urllib.parse.unquote(match.group(1))
        if match.group(3) is not None:  # rewriteTo / moveTo: a copy within the fake (and a delete for moveTo)
            source = urllib.parse.unquote(match.group(2))
            target_bucket = urllib.parse.unquote(match.group(4) or match.group(1))
            target = urllib.parse.unquote(match.group(5))
            found = self.store.get(bucket, source)
            if found is None:
                return self._error(404, "no such object")
            if self._refused(target):
                return
            generation = self.store.put(target_bucket, target, found[0])
            if match.group(3) == "moveTo":
                self.store.delete(bucket, source)
                return self._json(200, _metadata(target_bucket, target, found[0], generation or 0))
            return self._json(200, {"kind": "storage#rewriteResponse", "done": True, "totalBytesRewritten":
                                    str(len(found[0])), "objectSize": str(len(found[0])),
                                    "resource": _metadata(target_bucket, target, found[0], generation or 0)})
        kind = query.get("uploadType")
        if kind == "multipart":
            metadata, data = _multipart(self.headers.get("Content-Type", ""), body)
            name = metadata["name"]
        elif kind == "resumable":
            name = query.get("name") or json.loads(body or b"{}").get("name")
            if self._refused(name):
                return
            session = os.urandom(8).hex()
            self.store.uploads[session] = (bucket, name, bytearray())
            host = self.headers.get("Host", "127.0.0.1")
            return self._reply(200, headers={"Location": f"http://{host}/upload/resumable/{session}"})
        elif kind == "media" and "name" in query:
            name, data = query["name"], body
        else:
            return self._error(400, f"upload type {kind!r} is not served")
        if self._refused(name):
            return
        match_generation = int(query["ifGenerationMatch"]) if "ifGenerationMatch" in query else None
        generation = self.store.put(bucket, name, data, match_generation)
        if generation is None:
            return self._error(412, "precondition failed")
        self._json(200, _metadata(bucket, name, data, generation))

    do_PUT = do_POST  # resumable chunks come as PUT from other clients

    def _upload_chunk(self, session: str, body: bytes) -> None:
        if session not in self.store.uploads:
            return self._error(404, "no such upload")
        bucket, name, data = self.store.uploads[session]
        span = self.headers.get("Content-Range", "")  # "bytes a-b/total", "bytes a-b/*" or "bytes */total"
        where, _, total = span.removeprefix("bytes ").partition("/")
        if where != "*":
            first = int(where.split("-")[0])
            del data[first:]
            data += body
        if total == "*":  # more to come
            return self._reply(308, headers={"Range": f"bytes=0-{len(data) - 1}"})
        del self.store.uploads[session]
        generation = self.store.put(bucket, name, bytes(data))
        self._json(200, _metadata(bucket, name, bytes(data), generation or 0))

    def do_DELETE(self) -> None:
        started = self._start()
        if started is None:
            return
        url, query = started
        if url.path.startswith("/upload/resumable/"):
            self.store.uploads.pop(url.path.rsplit("/", 1)[1], None)
            return self._reply(499)
        match = _OBJECT.match(url.path)
        if match is None or match.group(2) is None or urllib.parse.unquote(match.group(1)) not in self.store.buckets:
            return self._error(404, "no such object")
        bucket, name = urllib.parse.unquote(match.group(1)), urllib.parse.unquote(match.group(2))
        found = self.store.get(bucket, name)
        if found is None:
            return self._error(404, "no such object")
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != found[1]:
            return self._error(412, "precondition failed")
        if self._refused(name):
            return
        self.store.delete(bucket, name)
        self._reply(204)


def _multipart(content_type: str, body: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, data) of a `multipart/related` upload: a JSON part, then the object's bytes (gcsfs ends its
    lines with \\n, other clients with \\r\\n)."""
    boundary = re.search(r'boundary="?([^";]+)"?', content_type)
    assert boundary is not None, content_type
    parts = body.split(b"--" + boundary.group(1).encode())[1:3]
    metadata, data = (re.split(rb"\r?\n\r?\n", part, maxsplit=1)[1] for part in parts)
    return json.loads(metadata), re.sub(rb"\r?\n\Z", b"", data, count=1)


class FakeGCS:
    """Starts the server and points tensorstore, gcsfs (under fsspec's `gs` / `gcs`) and google-cloud-storage
    at it; `stop()` undoes it. Use as a context manager."""

    _ENV = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "STORAGE_EMULATOR_HOST")

    def __init__(self, buckets: tuple[str, ...] = ("test-bucket",)):
        self.store = ObjectStore(buckets)
        self._server: ThreadingHTTPServer | None = None
        self._saved: dict[str, Any] = {}

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_port}"

    def env(self) -> dict[str, str]:
        """What a subprocess needs to use the fake (its own fsspec reads FSSPEC_GS_TOKEN at import)."""
        return {"TENSORSTORE_GCS_HTTP_URL": self.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
                "STORAGE_EMULATOR_HOST": self.url, "FSSPEC_GS_TOKEN": "anon", "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def start(self) -> FakeGCS:
        from gcsfs.core import GCSFileSystem

        handler = type("Handler", (_Handler,), {"store": self.store})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        for key, value in self.env().items():
            if key in self._ENV:
                self._saved[key] = os.environ.get(key)
                os.environ[key] = value
        self._saved["conf"] = {p: fsspec.config.conf.get(p) for p in ("gs", "gcs")}
        for protocol in ("gs", "gcs"):
            fsspec.config.conf[protocol] = {**(fsspec.config.conf.get(protocol) or {}), "token": "anon"}
        self._saved["fsspec"] = {p: fsspec.registry.get(p) for p in ("gs", "gcs")}
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
        self._forget_clients()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for key in self._ENV:
            if self._saved.get(key) is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = self._saved[key]
        for protocol, conf in self._saved.get("conf", {}).items():
            if conf is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = conf
        for protocol, cls in self._saved.get("fsspec", {}).items():
            if cls is not None:
                fsspec.register_implementation(protocol, cls, clobber=True)
        self._forget_clients()

    @staticmethod
    def _forget_clients() -> None:
        """gcsfs and epath keep their clients (each bound to the endpoint it was made for)."""
        from etils.epath import backend
        from gcsfs.core import GCSFileSystem

        GCSFileSystem.clear_instance_cache()
        backend.fsspec_backend._get_filesystem.cache_clear()

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
