"""The custom calls in a lowered program, for the lowering tests: found by target name in the StableHLO module, with
the typed-FFI attributes jax encodes in each call's backend config."""

from typing import Any, Iterator, Sequence

import numpy as np


def walk(op: Any) -> Iterator[Any]:
    """Every operation nested in `op`, depth first."""
    for region in op.regions:
        for block in region:
            for child in block:
                yield child
                yield from walk(child)


def ir_str(attr: Any) -> str:
    """An MLIR string attribute's value, without its quotes."""
    return str(attr).strip('"')


def calls(lowered: Any, target: str) -> list:
    """The `target` custom calls of `lowered`, in program order."""
    return [op for op in walk(lowered.compiler_ir("stablehlo").operation)
            if op.name == "stablehlo.custom_call" and ir_str(op.attributes["call_target_name"]) == target]


def custom_call(lowered: Any, target: str, names: Sequence[str]) -> tuple[dict, list[str], list[str]]:
    """(attributes `names`, operand types, result types) of the one `target` custom call in `lowered`; the objects and
    their offsets as arrays, every other attribute as its text."""
    found = calls(lowered, target)
    assert len(found) == 1, lowered.as_text()
    op = found[0]
    config = op.attributes["mhlo.backend_config"]  # jax's encoding of typed-FFI attributes
    attrs = {name: (np.array(config[name]) if name in ("objects", "offsets") else ir_str(config[name]))
             for name in names}
    return attrs, [str(x.type) for x in op.operands], [str(r.type) for r in op.results]
