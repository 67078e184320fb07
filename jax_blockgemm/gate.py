"""The first-use gate: a kernel of an architecture where ours never ran is used only after it passed a self-check.

Lowering asks `ensure_verified(variant)`. A verdict is kept per (kernel key, object hash, GPU model), in memory and
on disk beside the kernel cache, so each object is checked once per GPU model. Without one, the gate writes an
"attempted" record, runs the check (`python -m jax_blockgemm.selfcheck --child KEY`) in a child process pinned to
that GPU (no memory preallocation, its own process group, a timeout: `JAX_BLOCKGEMM_SELFCHECK_TIMEOUT`, 120 s by
default, after which the whole group is killed; on Linux the child also ends with its parent), and stores what came of
it. A wrong result, a hang, a crash or an
illegal address all end in the child and become a stored FAIL naming what happened; the user's process never
launched the kernel, so it stays usable: None falls back to the reference and "cutedsl" raises. An attempted record
with no verdict (the checking process itself was killed) also reads as FAIL: nothing retries it silently;
`python -m jax_blockgemm.selfcheck --force` checks again. A check interrupted in the user's process (KeyboardInterrupt,
a notebook's stop button) ends its child and leaves no record, so the next call checks again. The record names its
machine: where the cache is shared between machines, another machine's record counts as a check still running until
it is older than the timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Optional, Sequence

from jax_blockgemm import arch, kernel_cache

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "JAX_BLOCKGEMM_SELFCHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
# Test-only kernels (deliberately broken ones under tests/) are made known to the child by importing this module.
EXTRA_VARIANTS_ENV = "JAX_BLOCKGEMM_EXTRA_VARIANTS_MODULE"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one self-check: which kernel object, on which GPU model, passed or not and why."""

    key: str
    device: str
    object_sha: str
    ok: bool
    detail: str
    source: str = "ran"  # "ran" (this call), "memory" or "disk" (an earlier check of the same object)


PARENT_ENV = "JAX_BLOCKGEMM_SELFCHECK_PARENT"  # the child's parent process id (set by run_in_child)
_PID_MAX = 2**31 - 1  # larger is no process id (os.kill raises OverflowError past a C int)
_PROC = pathlib.Path("/proc")  # Linux's process table: tells an exited, unreaped process (a zombie) from a live one
_MEMORY: dict[tuple[str, str, str], Verdict] = {}
_WARNED: set[tuple[str, str, str]] = set()
_LOCK = threading.RLock()


def timeout_s() -> float:
    """The child's time limit: $JAX_BLOCKGEMM_SELFCHECK_TIMEOUT seconds, else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # an endless limit would let a hung kernel hang the user's process
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    return value


def verdict_path(key: str, device: str, object_sha: str) -> pathlib.Path:
    """Where the verdict of `key` (object `object_sha`) on GPU model `device` is stored."""
    slug = re.sub(r"[^0-9A-Za-z]+", "-", device).strip("-") or "gpu"
    return kernel_cache.default_cache_dir() / "selfcheck" / f"{key}-{object_sha[:16]}-{slug}.json"


def _attempt_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_suffix(".attempt")


def _write_json(path: pathlib.Path, fields: dict) -> bool:
    """Write atomically (`kernel_cache.write_atomic`); whether it was written. An unwritable cache only means the
    check runs again in the next process."""
    try:
        kernel_cache.write_atomic(path, json.dumps({**fields, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}).encode())
    except OSError as e:
        logger.warning("jax_blockgemm: cannot write %s (%s)", path, e)
        return False
    return True


def _remove(path: pathlib.Path) -> None:
    """Delete `path` if it is there; a store that cannot be changed (not a directory, read-only) only warns."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("jax_blockgemm: cannot delete %s (%s)", path, e)


def _exists(path: pathlib.Path) -> bool:
    """Whether `path` exists; False where its directory cannot be searched."""
    try:
        return path.exists()
    except OSError:
        return False


def load(path: pathlib.Path, ident: Optional[tuple[str, str, str]] = None) -> Optional[Verdict]:
    """The verdict stored at `path`, or None when absent, unreadable or not a verdict of `ident` (key, GPU model,
    object SHA-256; when given): `ok` must be a JSON boolean, the identity fields and `detail` strings."""
    try:
        fields = json.loads(path.read_text())
        verdict = Verdict(**{f.name: fields[f.name] for f in dataclasses.fields(Verdict) if f.name != "source"},
                          source="disk")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    names = (verdict.key, verdict.device, verdict.object_sha, verdict.detail)
    if type(verdict.ok) is not bool or not all(isinstance(x, str) for x in names):
        return None
    if ident is not None and (verdict.key, verdict.device, verdict.object_sha) != tuple(ident):
        return None
    return verdict


def store(path: pathlib.Path, verdict: Verdict) -> bool:
    """Keep `verdict` on disk at `path`; whether it was stored."""
    return _write_json(path, {f.name: getattr(verdict, f.name) for f in dataclasses.fields(Verdict)
                              if f.name != "source"})


def local_device(target: str) -> Any | None:
    """The first visible CUDA device whose compute capability runs our `target` objects, or None."""
    return next(iter(local_models(target)), None)


def model_name(device: Any) -> str:
    """A device's GPU model (jax.Device.device_kind, e.g. "NVIDIA H200"): what a verdict is kept per."""
    return str(getattr(device, "device_kind", device))


def local_models(target: str) -> list[Any]:
    """One visible CUDA device of each GPU model whose compute capability runs our `target` objects (a host may mix
    models of one target, an H100 beside an H200: each needs its own verdict)."""
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return []
    models: dict[str, Any] = {}
    for d in devices:
        if arch.target_of(str(getattr(d, "compute_capability", ""))) == target:
            models.setdefault(model_name(d), d)
    return list(models.values())


def physical_gpu(device: Any) -> str:
    """The CUDA_VISIBLE_DEVICES entry that names `device` for a child process (the parent's own mapping applied)."""
    index = int(getattr(device, "local_hardware_id", None) or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def die_with_parent() -> None:
    """In the check's child: end with the process that started it (Linux: the parent-death signal), so that a user
    process killed mid-check (a notebook restart) does not leave the check holding the GPU until its timeout."""
    parent = os.environ.get(PARENT_ENV, "")
    if not sys.platform.startswith("linux") or not parent.isdigit():
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent was gone before the signal was armed
        os._exit(1)


def child_command(key: str, result: pathlib.Path) -> list[str]:
    """The command line that checks kernel `key` and writes its outcome to `result` (JSON)."""
    return [sys.executable, "-m", "jax_blockgemm.selfcheck", "--child", key, "--result", str(result)]


def package_root() -> str:
    """The directory holding this copy of the jax_blockgemm package: the child's working directory and first
    PYTHONPATH entry, so that it imports this copy, not one in the caller's working directory."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_child(command: Sequence[str], *, gpu: str, timeout: float) -> tuple[bool, str]:
    """Run a check `command` (its last argument pair is `--result PATH`) in its own process group on GPU `gpu`.

    Returns (ok, detail): a pass only where the child exited with status 0 and its result says ok (true). A child
    that outlives `timeout` is killed with its whole group, as is the group of one whose wait is interrupted here
    (KeyboardInterrupt, then raised again); one that exits without writing its result (a crash, an illegal
    address, a signal) or with a non-zero status fails with its exit status and its last words.
    """
    result = pathlib.Path(command[-1])
    root = package_root()
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_PLATFORMS="cuda",
               PYTHONPATH=path, **{PARENT_ENV: str(os.getpid())})
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=root, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # anything the child left running; all of it when our wait was interrupted
        if timed_out:
            return False, (f"timed out after {timeout:g} s (a hang, e.g. a barrier never arrived); the check's "
                           f"process group was killed")
        took = time.monotonic() - start
        status = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                  else f"exited with status {proc.returncode}")
        try:
            outcome = json.loads(result.read_text())
            ok, detail = outcome["ok"], str(outcome["detail"])
        except (OSError, ValueError, KeyError, TypeError):
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
            return False, f"the check's process {status} after {took:.1f} s without a result: {' | '.join(tail)}"
        if proc.returncode != 0:
            return False, f"the check's process {status} after {took:.1f} s (its result: ok={ok!r}, {detail})"
        if type(ok) is not bool:
            return False, f"the check's result has ok={ok!r}, neither true nor false ({detail})"
        return ok, detail


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _is_pid(x: Any) -> bool:
    """Whether `x` can name one process: a positive int of C size (os.kill(0 or -1, ...) would signal a group)."""
    return type(x) is int and 0 < x <= _PID_MAX


def _pid_alive(pid: Any) -> bool:
    """Whether process `pid` runs: it exists and is no zombie (exited, not yet reaped: it finishes no check)."""
    if not _is_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether /proc (Linux) shows `pid` as exited (state Z or X); False where /proc cannot tell."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    state = stat.rpartition(")")[2].split()[:1]  # after the command name, which may hold spaces and parentheses
    return state in (["Z"], ["X"])


def _earlier_attempt(path: pathlib.Path, limit: float) -> Optional[str]:
    """Why an earlier, unfinished attempt at this check fails it; None when there is none (or it is still running
    in a live process and finished within `limit` seconds: then its verdict is at `path`)."""
    attempt = _attempt_path(path)
    deadline = time.monotonic() + limit
    while True:
        try:
            record = json.loads(attempt.read_text())
        except (OSError, ValueError):
            return None
        record = record if isinstance(record, dict) else {}
        pid = record.get("pid")
        pid = pid if _is_pid(pid) else "?"  # a garbled record: no process runs it (and none is alive)
        host = record.get("host")
        elsewhere = isinstance(host, str) and host != socket.gethostname()  # a cache shared between machines
        if _exists(path):
            return None
        if elsewhere:  # its process cannot be asked: running while younger than the limit
            started = record.get("started")
            running = type(started) in (int, float) and 0 <= time.time() - started < limit
        else:
            running = pid != os.getpid() and _pid_alive(pid)
        if not running or time.monotonic() > deadline:
            where = f" on {host}" if elsewhere else ""
            return (f"an earlier check (process {pid}{where}, started {record.get('when', '?')}) never finished: "
                    "the kernel may have hung or crashed that process")
        time.sleep(0.5)


def identity(variant: Any, device: Any) -> tuple[str, str, str]:
    """(kernel key, GPU model, SHA-256 of the kernel object): what a verdict is kept under."""
    return variant.key, model_name(device), hashlib.sha256(kernel_cache.get_object(variant)).hexdigest()


def check(variant: Any, *, device: Any = None, force: bool = False,
          run: Optional[Callable[[Any, Any], tuple[bool, str]]] = None) -> Verdict:
    """The self-check verdict of `variant` on `device` (default: the first local GPU of its arch).

    From memory or disk where this object was checked on this GPU model before (unless `force`); else an
    attempted record, then `run(variant, device)` -> (ok, detail) (default: the child process), then the stored
    verdict. Raises RuntimeError when no local GPU runs `variant.arch`.
    """
    device = local_device(variant.arch) if device is None else device
    if device is None:
        raise RuntimeError(f"no local GPU runs {variant.arch} kernels; cannot self-check {variant.key}")
    ident = identity(variant, device)
    with _LOCK:
        if not force and ident in _MEMORY:
            return dataclasses.replace(_MEMORY[ident], source="memory")
        path = verdict_path(*ident)
        verdict = None
        if not force:
            verdict = load(path, ident)
            if verdict is None and (why := _earlier_attempt(path, timeout_s() + 30)) is not None:
                verdict = Verdict(*ident, ok=False, detail=why)
                if store(path, verdict):  # the stored FAIL stands for the attempt now; else the record keeps
                    _remove(_attempt_path(path))  # failing the check in later processes
            elif verdict is None:
                verdict = load(path, ident)  # a concurrent process may have just finished the same check
        if verdict is None:
            _write_json(_attempt_path(path), {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                              "key": variant.key})
            try:
                ok, detail = (run or _run_child)(variant, device)
            except Exception as e:  # noqa: BLE001 -- a check that cannot even start fails; the caller goes on
                ok, detail = False, f"the check could not run: {type(e).__name__}: {e}"
            except BaseException:  # interrupted here (KeyboardInterrupt): the child was ended with our wait, and
                _remove(_attempt_path(path))  # the kernel did nothing wrong, so no record: the next call checks
                raise
            verdict = Verdict(*ident, ok=ok, detail=detail or "ok")
            store(path, verdict)
            _remove(_attempt_path(path))
        _MEMORY[ident] = verdict
        return verdict


def _run_child(variant: Any, device: Any) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="jbg-selfcheck-") as tmp:
        return run_in_child(child_command(variant.key, pathlib.Path(tmp) / "result.json"),
                            gpu=physical_gpu(device), timeout=timeout_s())


def ensure_verified(variant: Any, **kwargs: Any) -> Verdict:
    """`check(variant)`, warning once per process (naming the kernel) when it failed."""
    verdict = check(variant, **kwargs)
    ident = (verdict.key, verdict.device, verdict.object_sha)
    if not verdict.ok and ident not in _WARNED:
        _WARNED.add(ident)
        message = (f"jax_blockgemm: kernel {verdict.key} failed its first-use self-check on {verdict.device} "
                   f"({verdict.detail}); it will not be used: implementation=None takes the next choice (another of "
                   f"our kernels where one serves the call, else the XLA reference; verdict stored in "
                   f"{verdict_path(*ident)}; rerun with `python -m jax_blockgemm.selfcheck --force`)")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return verdict
