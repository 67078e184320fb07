"""A stand-in for the decode kernel class (kernels/weight_stream.py's WeightStreamGemm) with its documented
can_implement, so that dispatch and lowering tests of the weight_stream op run whether or not the real class exists;
and `real_class()`, for the tests that need the real one."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

from jax_blockgemm.kernels import catalog


class StandInWeightStream:
    """Takes what the interface says the kernel takes: m <= tile[1], K a multiple of 16 (FP8) or 32 (FP4), n, l >= 1."""

    def __init__(self, v: catalog.KernelVariant) -> None:
        self.variant = v

    def can_implement(self, m: int, n: int, k: int, l: int) -> tuple[bool, str]:
        step = 32 if self.variant.ab_dtype == "float4_e2m1fn" else 16
        if m > self.variant.tile_mn[1]:
            return False, f"m={m} is more than the tile's {self.variant.tile_mn[1]} rows"
        if k % step:
            return False, f"k must be a multiple of {step}"
        if min(m, n, k, l) < 1:
            return False, "every size must be >= 1"
        return True, ""


@contextlib.contextmanager
def stand_in_kernels() -> Iterator[None]:
    """Within this block, the catalog builds StandInWeightStream for every weight_stream variant."""
    factories = {("weight_stream", arch): StandInWeightStream for arch in ("sm_90a", "sm_100a")}
    with mock.patch.dict(catalog._FACTORIES, factories):
        yield


def real_class() -> Any:
    """kernels.weight_stream.WeightStreamGemm, or None while that module or class does not exist."""
    try:
        from jax_blockgemm.kernels import weight_stream
    except ImportError:
        return None
    return getattr(weight_stream, "WeightStreamGemm", None)


MISSING = "jax_blockgemm.kernels.weight_stream.WeightStreamGemm does not exist yet"
