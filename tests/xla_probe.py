"""Runs a probe script that registers the real FFI handlers with XLA:CPU in a fresh process (so that XLA itself runs
their instantiate stage), and reads back the "NAME value" lines it prints."""

from __future__ import annotations

import os
import subprocess
import sys


def run(source: str) -> tuple[str, dict[str, str]]:
    """(everything the probe printed, {first word: rest of the line} of its stdout), on the CPU platform only."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=120)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}
    return proc.stdout + proc.stderr, lines
