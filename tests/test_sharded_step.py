"""The sharded training step of jax_blockgemm/examples/sharded_step.py on 8 host devices, a (fsdp=2, tp=4) mesh.

Its compiled program gathers only what FSDP asks for (each weight over the fsdp axis, never an activation, nothing
over tp), every proj_rope runs on its device's heads, and its losses follow the unsharded step's. Also the
gemm_amax rule these rest on: K sharded in whole scale atoms runs per shard and sums the partial products.
"""

import contextlib
import io
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax, when run directly

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_blockgemm as jbg
from jax_blockgemm import formats
from jax_blockgemm.examples import sharded_step as ss

FSDP_SIZE, TP_SIZE = 2, 4
CONFIG = ss.SMALL  # 768 tokens: no weight has a dimension of 768 or 768/128, so a gathered activation stands out
STEPS = 3

_INSTRUCTION = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*?\s(all-gather|all-gather-start)\(")


def _group_size(line: str) -> int:
    """Devices in one replica group of a collective, whichever of XLA's three spellings the line uses."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2))]))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(m.group(2))
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    raise AssertionError(f"unparsed replica groups: {line[:200]}")


def our_gathers(hlo: str) -> list[tuple[tuple[int, ...], int, str]]:
    """(gathered shape, replica group size, line) of each all-gather the partitioning rules of our primitives
    placed (their instructions carry op_name .../custom_partitioning)."""
    found = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.search(line)
        if m and "custom_partitioning" in line:
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            found.append((shape, _group_size(line), line.strip()))
    return found


def _needs_eight_devices() -> None:
    if len(jax.devices()) < FSDP_SIZE * TP_SIZE:
        raise absltest.SkipTest("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


class ShardedStepHloTest(absltest.TestCase):
    """The compiled program of the sharded MXFP8 step (compiled once, not run)."""

    @classmethod
    def setUpClass(cls):
        _needs_eight_devices()
        built = ss.build_train_step(CONFIG, mx=True, fsdp=FSDP_SIZE, tp=TP_SIZE)
        x0, t0 = (built.put(v) for v in ss.make_batch(CONFIG, 0))
        cls.hlo = built.step.lower(built.state, x0, t0).compile().as_text()

    def test_only_fsdp_weight_gathers(self):
        """Every gather of an operand of ours runs over the fsdp axis (2 devices) and holds a weight: no
        dimension is the token count (768) or its scale atoms (6); tensor-parallel activations are never gathered
        (wgrad and row-parallel GEMMs sum partial products instead)."""
        gathers = our_gathers(self.hlo)
        self.assertNotEmpty(gathers, "FSDP must gather the weights: the check sees no gather at all")
        tokens = CONFIG.batch * CONFIG.seq
        for shape, group, line in gathers:
            self.assertEqual(group, FSDP_SIZE, f"a gather over other devices than the fsdp axis: {line[:240]}")
            self.assertNotIn(tokens, shape, f"an activation is gathered: {line[:240]}")
            self.assertNotIn(tokens // 128, shape, f"an activation's scales are gathered: {line[:240]}")
        # proj_rope's weight arrives with its K gathered (FSDP) and only this device's heads
        local_heads = CONFIG.heads // TP_SIZE
        self.assertIn((1, CONFIG.d_model, local_heads * 192), [s for s, _, _ in gathers])

    def test_proj_rope_runs_on_local_heads(self):
        """The per-head (G, T, H, 192) arrays of proj_rope in the partitioned program have this device's tokens
        and heads, and no array holds all heads."""
        shapes = set(re.findall(r"\w+\[1,(\d+),(\d+),192\]", self.hlo))
        self.assertNotEmpty(shapes, "no per-head proj_rope array found")
        local = (str(CONFIG.batch * CONFIG.seq // FSDP_SIZE), str(CONFIG.heads // TP_SIZE))
        self.assertEqual(shapes, {local})

@pytest.mark.end_to_end
class ShardedStepLossTest(absltest.TestCase):
    """The sharded step trained for a few steps beside the one-device step (two compiles and runs)."""

    @classmethod
    def setUpClass(cls):
        _needs_eight_devices()
        batches = [ss.make_batch(CONFIG, i) for i in range(STEPS)]
        cls.losses = {}
        for name, (fsdp, tp) in (("sharded", (FSDP_SIZE, TP_SIZE)), ("single", (1, 1))):
            built = ss.build_train_step(CONFIG, mx=True, fsdp=fsdp, tp=tp)
            x0, t0 = built.put(batches[0][0]), built.put(batches[0][1])
            compiled = built.step.lower(built.state, x0, t0).compile()  # one compile per configuration
            state, losses = built.state, []
            for x, target in batches:
                state, loss = compiled(state, built.put(x), built.put(target))
                losses.append(float(loss))
            cls.losses[name] = np.array(losses)

    def test_bad_mesh_arguments_are_usage_errors(self):
        """--fsdp 0 and a mesh larger than the devices end in usage errors (exit status 2), not tracebacks."""
        for argv, message in ((["--small", "--fsdp", "0"], "argument --fsdp: expected an integer >= 1"),
                              (["--small", "--fsdp", "3", "--tp", "3"], "a 3x3 mesh needs 9 devices")):
            with self.subTest(argv=argv), contextlib.redirect_stderr(io.StringIO()) as err, \
                    self.assertRaises(SystemExit) as raised:
                ss.main(argv)
            self.assertEqual(raised.exception.code, 2)
            self.assertIn(message, err.getvalue())

    def test_losses_follow_the_unsharded_step(self):
        """Same seed, same batches, same MXFP8 recipe on one device and on the 2x4 mesh. The operands quantize
        identically per block; what differs is the float32 summation order where K is split (wgrad over tokens,
        row-parallel layers over features), about 1e-7 relative, which can move an FP8 code by one step in a
        later layer's input. Step 0 (same parameters) agrees to float32 sums; later steps to 1e-3 relative."""
        sharded, single = self.losses["sharded"], self.losses["single"]
        self.assertTrue(np.all(np.isfinite(sharded)))
        np.testing.assert_allclose(sharded[0], single[0], rtol=1e-5)
        np.testing.assert_allclose(sharded, single, rtol=1e-3)
        self.assertLess(sharded[-1], sharded[0])  # the step trains


class ContractionShardedGemmTest(absltest.TestCase):
    """gemm_amax with K sharded in whole scale atoms: per-shard partial products, summed; no operand gathered."""

    def test_k_split_sums_partials(self):
        if len(jax.devices()) < 8:
            raise absltest.SkipTest("needs 8 devices")
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))
        rng = np.random.default_rng(0)
        m, n, k = 256, 128, 512  # K: one 128-element atom column per tp shard
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)

        def fn(x, w):
            a, sfa = formats.quantize_mxfp8(x)
            b, sfb = formats.quantize_mxfp8(w)
            return jbg.gemm_amax(a, b, sfa, sfb, c_dtype=jnp.bfloat16)

        want_c, want_amax = jax.jit(fn)(x, w)
        k_sharded = NamedSharding(mesh, P("fsdp", "tp"))
        jitted = jax.jit(fn)
        args = (jax.device_put(x, k_sharded), jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
        hlo = jitted.lower(*args).compile().as_text()
        self.assertEmpty(our_gathers(hlo))
        self.assertIn("all-reduce", hlo)
        c, amax = jitted(*args)
        np.testing.assert_allclose(np.asarray(c, np.float32), np.asarray(want_c, np.float32), rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(np.asarray(amax), np.asarray(want_amax), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(amax), np.max(np.abs(np.asarray(c, np.float32))), rtol=1e-2)


if __name__ == "__main__":
    absltest.main()
