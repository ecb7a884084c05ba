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
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath

# Run dirs and resume paths hold orbax checkpoints, whose arrays tensorstore writes: through its
# `gcs` driver for gs://, its `file` driver for local paths; orbax accepts no other URL scheme.
CHECKPOINT_SCHEMES = ("gs",)

# A local path or a bucket URL, as text or a path object (`pathlib.Path`, `epath.Path`).
PathLike = str | os.PathLike[str]


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
    return epath.Path(normalize(path))


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
    return as_path(path).exists()


def is_dir(path: PathLike) -> bool:
    return as_path(path).is_dir()


def makedirs(path: PathLike) -> None:
    """Creates a local folder (and parents). A no-op for a URL: buckets have no folders, and
    gcsfs would create a missing *bucket* here (a typo would make one instead of failing)."""
    if not is_url(path):
        os.makedirs(normalize(path), exist_ok=True)


def read_text(path: PathLike) -> str:
    return as_path(path).read_text(encoding="utf-8")


def write_bytes(path: PathLike, data: bytes) -> None:
    """Writes a whole file at once: a temporary sibling renamed into place locally (a kill leaves
    the old file or the new one, never half of it); one object write on a bucket (atomic there)."""
    target = normalize(path)
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
        with as_path(path).open("rb") as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst)
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
