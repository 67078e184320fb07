"""Test-wide settings: eight host devices for the multi-device tests (before jax is first imported), and how many
processes run the tests (pyproject.toml asks pytest-xdist for `-n auto`)."""

import os
import shutil

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pytest_xdist_auto_num_workers(config) -> int:
    """A worker per core (at most 4) on a machine without an NVIDIA GPU; one where there is one, so that GPU tests
    never share the device (each JAX process takes most of its memory) and timings stay undisturbed."""
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0"):
        return 1
    return max(1, min(4, os.cpu_count() or 1))
