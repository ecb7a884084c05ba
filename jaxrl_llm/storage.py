"""Where a run reads and writes: local folders or bucket URLs (`gs://bucket/run`).

Every path the run writes or reads (run dir, checkpoints, HF export, metrics, rollout/validation
dumps, resume paths, synthetic data) goes through `etils.epath`, the path layer orbax itself uses,
so a local folder and a bucket take the same code. A URL is never turned into a local folder:
`normalize` makes local paths absolute and leaves URLs alone.

A bucket is not a disk: no folders (a "folder" exists while objects lie under it), no append, no
atomic rename of a folder. Writers here therefore write whole objects (`write_text`,
`write_bytes`, `upload_dir`), and files a URL cannot hold in place (an HF export, a parquet file)
are built in a local temporary folder first and then uploaded.

Back-ends: `gs://` needs an epath back-end (gcsfs, or TensorFlow) and `google-cloud-storage`
(orbax lists checkpoint steps with it); see docs/multihost.md. `unavailable_reason` says what is
missing, so a config can fail at start with one clear message.

Faults: gcsfs retries 5xx / 408 / 429 answers and dropped connections itself (6 tries, backoff 1 s, 2 s,
4 s, ... ), as tensorstore does for the arrays. A stalled connection is only retried when the read times
out, and aiohttp's default is one 5-minute limit on the whole request, which gcsfs does not retry: so a
`gs://` run sets gcsfs's `requests_timeout` to `GCS_READ_TIMEOUT_S` without bytes (unless fsspec's own
config for `gs` sets one). What is left after the retries, or refused for good (403), leaves the helpers
here as one `StorageError` naming the operation, the URL and the bucket's words; `launch/train.py` prints
it as one line and exits `STORAGE_ERROR_EXIT_CODE`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath

# Run dirs and resume paths hold orbax checkpoints, whose arrays tensorstore writes: through its
# `gcs` driver for gs://, its `file` driver for local paths; orbax accepts no other URL scheme.
CHECKPOINT_SCHEMES = ("gs",)

# A local path or a bucket URL, as text or a path object (`pathlib.Path`, `epath.Path`).
PathLike = str | os.PathLike[str]


# sysexits.h EX_IOERR: the exit status of a run stopped by storage it cannot write (a crash is 1, preemption 75)
STORAGE_ERROR_EXIT_CODE = 74
# a gs:// request that receives no byte for this long is abandoned and retried by gcsfs (the environment
# variable sets it for a whole job, before its first gs:// path)
GCS_READ_TIMEOUT_S = float(os.environ.get("JAXRL_LLM_GCS_READ_TIMEOUT_S", "60"))


class StorageError(OSError):
    """A read or write of the run's storage failed for good (after the back-end's retries): the message is
    one line naming the operation, the path and the storage's own words."""


def reason(err: BaseException) -> str:
    """The storage's own words from an error of orbax, tensorstore, gcsfs or the OS, one line: "No space left
    on device (errno 28)", "the bucket answered HTTP 403: <its message>", "no answer from the bucket within
    60 s", else the error's first line."""
    text = str(err)
    os_error = re.search(r":\s*([^:\[]+?)\s*\[os_error_code='?(\d+)'?\]", text)  # tensorstore's file driver
    if os_error:
        return f"{os_error.group(1)} (errno {os_error.group(2)})"
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        return f"{err.strerror} (errno {err.errno})"
    python_os_error = re.search(r"\[Errno (\d+)\] ([^:'\"]+)", text)  # an OSError raised in orbax's own Python
    if python_os_error:
        return f"{python_os_error.group(2).strip()} (errno {python_os_error.group(1)})"
    http = re.search(r"\[http_response_code='?(\d+)'?\]", text) or re.search(r"HTTP response code: (\d+)", text)
    if http:  # tensorstore: '<STATUS>: Error writing <path>: <message> [http_response_code=...] [..._body=...]'
        body = re.search(r'message\\?"\s*:\s*\\?"([^"\\]+)', text)  # the JSON body's message, when it has one
        said = body.group(1) if body else text[:http.start()].strip().rsplit(": ", 1)[-1]
        return f"the bucket answered HTTP {http.group(1)}: {said[:200]}"
    forbidden = re.match(r"Forbidden: \S+\n(.*)", text, re.S)  # gcsfs: a 403, its URL, then the bucket's message
    if forbidden:
        return f"the bucket answered HTTP 403: {forbidden.group(1).strip().splitlines()[0][:200]}"
    code = getattr(err, "code", None)
    if type(err).__name__ == "HttpError" and code is not None:  # gcsfs: any other status, after its retries
        said = re.sub(rf",\s*{code}$", "", str(getattr(err, "message", text)))  # gcsfs appends the code
        return f"the bucket answered HTTP {code}: {said[:200]} (after retries)"
    if isinstance(err, TimeoutError) or type(err).__name__ in ("ServerTimeoutError", "ConnectionTimeoutError"):
        return f"no answer from the bucket within {GCS_READ_TIMEOUT_S:g} s (after retries)"
    if err.__cause__ is not None and err.__cause__ is not err:
        return reason(err.__cause__)
    first = text.splitlines()[0] if text else type(err).__name__
    return first[:300]


@contextlib.contextmanager
def _failing_as(action: str, path: PathLike) -> Iterator[None]:
    """Turns a failure of the storage into one `StorageError` line; a missing file stays a FileNotFoundError
    (callers test for it)."""
    try:
        yield
    except (StorageError, FileNotFoundError):
        raise
    except Exception as err:  # gcsfs raises OSError, its HttpError, aiohttp's errors; the OS raises OSError
        if not is_url(path) and not isinstance(err, OSError):
            raise  # a local path's non-OS error is a bug, not storage
        raise StorageError(f"{action} {path} failed: {reason(err)}") from err


def is_url(path: PathLike) -> bool:
    """`scheme://...` (gs://bucket/x); a Windows drive letter is not a scheme."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum()


def scheme(path: PathLike) -> str | None:
    return str(path).split("://", 1)[0] if is_url(path) else None


def normalize(path: PathLike) -> str:
    """Local: `~` expanded and absolute. URL: unchanged but for a trailing slash."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if is_url(text):
        return text.rstrip("/") if not text.endswith("://") else text
    return os.path.abspath(os.path.expanduser(text))


def as_path(path: PathLike) -> epath.Path:
    """An `epath.Path` of the normalized path (what orbax takes as well)."""
    if scheme(path) in ("gs", "gcs"):
        _configure_gcsfs()
    return epath.Path(normalize(path))


@functools.cache
def _configure_gcsfs() -> None:
    """gcsfs retries a read that times out, not a request that exceeds aiohttp's total limit: give it a read
    timeout (no bytes for GCS_READ_TIMEOUT_S) unless fsspec's config for `gs` already sets one. Runs once,
    before the first gs:// filesystem is made (fsspec applies its config when one is created)."""
    try:
        import aiohttp
        from fsspec.config import conf as fsspec_conf
    except ImportError:  # no gcsfs: unavailable_reason has said so at config time
        return
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=GCS_READ_TIMEOUT_S, sock_read=GCS_READ_TIMEOUT_S)
    for protocol in ("gs", "gcs"):
        conf = fsspec_conf.setdefault(protocol, {})
        conf.setdefault("requests_timeout", timeout)


def join(base: PathLike, *parts: str) -> str:
    """`os.path.join` for local paths, `/`-joined for URLs (never a local folder named `gs:`)."""
    text = str(base)
    return posixpath.join(text, *parts) if is_url(text) else os.path.join(text, *parts)


def split(path: PathLike) -> tuple[str, str]:
    """(parent, last name) of a normalized path or URL."""
    text = normalize(path)
    if is_url(text):
        parent, _, name = text.rpartition("/")
        return parent, name
    return os.path.dirname(text), os.path.basename(text)


def unavailable_reason(path: PathLike, *, checkpoints: bool = False) -> str | None:
    """Why no installed back-end can open `path`, or None when one can (always None for a local path).

    checkpoints: the path holds orbax checkpoints (run dir, resume path): only `gs://` URLs, and
    orbax's `google-cloud-storage` dependency is needed too.
    """
    name = scheme(path)
    if name is None:
        return None
    if checkpoints and name not in CHECKPOINT_SCHEMES:
        return (f"checkpoints (orbax) go to local paths or {', '.join(s + '://' for s in CHECKPOINT_SCHEMES)} "
                f"URLs only, not {name}://")
    try:
        epath.Path(f"{name}://probe")  # epath dispatches on the scheme; an unknown one is a KeyError
    except KeyError:
        return f"no filesystem back-end opens {name}:// URLs (etils.epath knows gs://, s3://, az://, hf://)"
    missing = []
    if not _epath_backend_installed(name):
        missing.append({"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}.get(name, name))
    if checkpoints and name == "gs" and not _module_available("google.cloud.storage"):
        missing.append("google-cloud-storage")
    if missing:
        return (f"{name}:// needs {' and '.join(missing)} installed "
                f"(pip install {' '.join(missing)}; see docs/multihost.md)")
    return None


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _epath_backend_installed(name: str) -> bool:
    """epath opens gs:// with TensorFlow's gfile when TensorFlow is installed, else with fsspec."""
    if name == "gs" and _module_available("tensorflow"):
        return True
    import fsspec

    try:
        fsspec.get_filesystem_class({"gs": "gcs"}.get(name, name))
    except (ImportError, ValueError):
        return False
    return True


def exists(path: PathLike) -> bool:
    with _failing_as("looking up", path):
        return as_path(path).exists()


def is_dir(path: PathLike) -> bool:
    with _failing_as("looking up", path):
        return as_path(path).is_dir()


def makedirs(path: PathLike) -> None:
    """Creates a local folder (and parents). A no-op for a URL: buckets have no folders, and
    gcsfs would create a missing *bucket* here (a typo would make one instead of failing)."""
    if not is_url(path):
        os.makedirs(normalize(path), exist_ok=True)


def read_text(path: PathLike) -> str:
    with _failing_as("reading", path):
        return as_path(path).read_text(encoding="utf-8")


def write_bytes(path: PathLike, data: bytes) -> None:
    """Writes a whole file at once: a temporary sibling renamed into place locally (a kill leaves
    the old file or the new one, never half of it); one object write on a bucket (atomic there)."""
    target = normalize(path)
    with _failing_as("writing", target):
        _write_bytes(target, data)


def _write_bytes(target: str, data: bytes) -> None:
    if is_url(target):
        with as_path(target).open("wb") as handle:
            handle.write(data)
        return
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def remove_tree(path: PathLike) -> None:
    """Deletes a folder (or a bucket prefix) and everything under it; missing is fine."""
    p = as_path(path)
    with _failing_as("deleting", path):
        if p.is_dir():
            p.rmtree(missing_ok=True)
        elif p.exists():
            p.unlink(missing_ok=True)


def upload_dir(local_dir: str, url: str, *, last: tuple[str, ...] = ()) -> None:
    """Copies a local folder's files to `url` (same relative names). Files named in `last` go last,
    so a reader that looks for them (`config.json`) never finds a half-uploaded folder."""
    files = []
    for root, _, names in os.walk(local_dir):
        files += [os.path.relpath(os.path.join(root, n), local_dir) for n in names]
    files.sort(key=lambda rel: (rel in last, rel))
    for rel in files:
        with open(os.path.join(local_dir, rel), "rb") as handle:
            write_bytes(join(url, *rel.split(os.sep)), handle.read())


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path with the file's content: the file itself when local, else a temporary download
    (same base name, so suffix-based readers work) removed on exit."""
    if not is_url(path):
        yield path
        return
    tmp = tempfile.mkdtemp(prefix="jaxrl_llm-")
    try:
        local = os.path.join(tmp, posixpath.basename(str(path).rstrip("/")))
        with _failing_as("reading", path), as_path(path).open("rb") as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst)
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
