"""Which SPMD partitioner a sharding test runs under (shared by the sharding tests of every primitive)."""

import contextlib
from typing import Iterator

import jax


@contextlib.contextmanager
def partitioner(name: str) -> Iterator[None]:
    """Runs the block under Shardy ("shardy", JAX's default) or the GSPMD partitioner ("gspmd")."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", name == "shardy")
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)
