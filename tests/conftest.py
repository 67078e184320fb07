"""Test-wide settings: eight host devices for the multi-device tests (before jax is first imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
