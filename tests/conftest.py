"""Test-wide settings: eight host devices for the multi-device tests (before jax is first imported), XLA's CPU
backend without LLVM optimization where no GPU is present (the tests compile hundreds of small programs and time none:
about 13% less wall time), and how many processes run the tests (pyproject.toml asks pytest-xdist for `-n auto`)."""

import os
import shutil

_HAS_GPU = bool(shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8"
                      + ("" if _HAS_GPU else " --xla_backend_optimization_level=0"))


def pytest_xdist_auto_num_workers(config) -> int:
    """A worker per core (at most 4) on a machine without an NVIDIA GPU; one where there is one, so that GPU tests
    never share the device (each JAX process takes most of its memory) and timings stay undisturbed."""
    if _HAS_GPU:
        return 1
    return max(1, min(4, os.cpu_count() or 1))
