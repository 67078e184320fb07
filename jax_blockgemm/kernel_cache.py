"""Compiled kernel objects, cached in process memory and on disk, so that a kernel compiles once per machine.

`get_object(variant)` looks in memory, then on disk, and only then calls the catalog's `compile_variant`. The disk
key covers everything that changes the object: the variant's key and arch, the CuTeDSL version and a hash of the
kernel sources. Entries are written atomically (temporary file, then rename) behind a header (magic, payload
length, SHA-256 of the payload); an entry that fails any check is deleted and rebuilt, never loaded.

Directory: $JAX_BLOCKGEMM_CACHE_DIR, else ~/.cache/jax_blockgemm. Size: at most $JAX_BLOCKGEMM_CACHE_MAX_BYTES
(default 512 MiB) of entries; past that the least recently used entries are deleted after each write (a disk hit
refreshes an entry's modification time, which is what "used" means here, across processes). A directory that
cannot be written (read-only, full, not creatable) is still read; the process then compiles into memory only and
says so in ONE warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import struct
import tempfile
import threading
import time
from typing import Any, Callable, Literal, Protocol

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "JAX_BLOCKGEMM_CACHE_DIR"
CACHE_MAX_BYTES_ENV = "JAX_BLOCKGEMM_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 512 * 2**20  # an object is ~60 KiB: thousands of entries
STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died
MAGIC = b"JBGOBJ01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)
Source = Literal["memory", "disk", "compiled"]


class Variant(Protocol):
    """What the cache needs of a catalog entry (`kernels.catalog.KernelVariant` has it)."""

    @property
    def key(self) -> str: ...

    @property
    def arch(self) -> str: ...


def default_cache_dir() -> pathlib.Path:
    """$JAX_BLOCKGEMM_CACHE_DIR, else ~/.cache/jax_blockgemm."""
    env = os.environ.get(CACHE_DIR_ENV)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jax_blockgemm"


def default_max_bytes() -> int:
    """$JAX_BLOCKGEMM_CACHE_MAX_BYTES (a positive integer), else DEFAULT_MAX_BYTES."""
    raw = os.environ.get(CACHE_MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CACHE_MAX_BYTES_ENV}={raw!r} must be a positive number of bytes, e.g. {DEFAULT_MAX_BYTES}")
    return value


def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version ('unknown' when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def encode_entry(payload: bytes) -> bytes:
    """Header + payload, as stored on disk."""
    return _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_entry(data: bytes) -> bytes | None:
    """The payload of a stored entry, or None when the magic, the length or the checksum is wrong."""
    if len(data) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


@dataclasses.dataclass
class ObjectCache:
    """Memory + disk cache of kernel objects for one (directory, compiler, DSL version, kernel sources).

    `compile_fn(variant) -> bytes` builds an object; `source_hash_fn() -> str` names the kernel sources. Both are
    looked up lazily so that constructing the default cache imports no CuTeDSL.
    """

    directory: pathlib.Path
    compile_fn: Callable[[Any], bytes]
    source_hash_fn: Callable[[], str]
    dsl_version_fn: Callable[[], str] = dsl_version
    max_bytes: int = DEFAULT_MAX_BYTES
    _memory: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False)
    _lock: threading.RLock = dataclasses.field(default_factory=threading.RLock, repr=False)
    _writable: bool = dataclasses.field(default=True, repr=False)  # False after the first failed write

    def entry_name(self, variant: Variant) -> str:
        """File name of `variant`'s entry: readable key + a digest of everything that changes the object."""
        ident = "\n".join([variant.key, variant.arch, self.dsl_version_fn(), self.source_hash_fn()])
        return f"{variant.key}-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.obj"

    def path(self, variant: Variant) -> pathlib.Path:
        return self.directory / self.entry_name(variant)

    @property
    def writable(self) -> bool:
        """False once a write has failed: objects compiled since then live in this process only."""
        return self._writable

    def get(self, variant: Variant) -> tuple[bytes, Source]:
        """The object of `variant` and where it came from ('memory', 'disk' or 'compiled')."""
        with self._lock:  # one compile per variant even when several threads lower at once
            name = self.entry_name(variant)
            if name in self._memory:
                return self._memory[name], "memory"
            payload = self._read(self.directory / name)
            source: Source = "disk"
            if payload is None:
                payload = bytes(self.compile_fn(variant))
                if not payload:
                    raise RuntimeError(f"compiling kernel variant {variant.key!r} produced an empty object")
                if self._writable:
                    self._store(self.directory / name, payload)
                source = "compiled"
            self._memory[name] = payload
            return payload, source

    def _store(self, path: pathlib.Path, payload: bytes) -> None:
        """Writes the entry and evicts; the first failure turns disk writes off for this process, with one warning."""
        try:
            write_atomic(path, encode_entry(payload))
        except OSError as e:  # read-only, full, or not creatable: the object still works from memory
            self._writable = False
            logger.warning("jax_blockgemm: cannot write the kernel cache %s (%s); compiling kernels in memory for the "
                           "rest of this process (set %s to a writable directory to keep them)", self.directory, e,
                           CACHE_DIR_ENV)
            return
        self.evict(keep=path)

    def evict(self, keep: pathlib.Path | None = None) -> list[pathlib.Path]:
        """Deletes the least recently used entries until the directory holds at most max_bytes, and temporary
        files a crashed writer left over an hour ago; returns what it deleted."""
        removed = []
        for tmp in self.directory.glob("*.obj.*.tmp"):
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
                    removed.append(tmp)
            except OSError:  # finished or removed by its writer meanwhile
                continue
        entries = []
        for path in self.directory.glob("*.obj"):
            try:
                st = path.stat()
            except OSError:  # deleted by another process meanwhile
                continue
            entries.append((st.st_mtime_ns, path.name, st.st_size, path))
        total = sum(size for _, _, size, _ in entries)
        for _, _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            removed.append(path)
        return removed

    @staticmethod
    def _read(path: pathlib.Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("jax_blockgemm: cannot read cached kernel %s (%s); recompiling", path, e)
            return None
        payload = decode_entry(data)
        if payload is None:
            logger.warning("jax_blockgemm: cached kernel %s is corrupt or truncated; deleting and recompiling", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # marks the entry used, for the least-recently-used eviction
        except OSError:  # a read-only cache: fine, nothing is evicted there either
            pass
        return payload


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write `data` to `path` atomically, for every file the cache directory holds (objects, verdicts, tuning
    tables): a temporary file beside it (`<name>.<random>.tmp`), fsync-ed, renamed over it, so that readers and a
    second writer see the old file or the whole new one. On failure the temporary file is removed and the error
    raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _catalog_compile(variant: Any) -> bytes:
    from jax_blockgemm.kernels import catalog

    return catalog.compile_variant(variant)


def _catalog_source_hash() -> str:
    from jax_blockgemm.kernels import catalog

    return catalog.kernel_source_hash()


_DEFAULT: ObjectCache | None = None
_DEFAULT_LOCK = threading.Lock()


def default_cache() -> ObjectCache:
    """The process-wide cache over the catalog (directory and size cap are read from the environment on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ObjectCache(default_cache_dir(), _catalog_compile, _catalog_source_hash,
                                   max_bytes=default_max_bytes())
        return _DEFAULT


def get_object(variant: Variant) -> bytes:
    """Object bytes of a catalog variant: process memory, else disk, else `catalog.compile_variant`."""
    return default_cache().get(variant)[0]
