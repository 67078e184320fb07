"""CPU: our sm_100a mainloops against NVIDIA's own CuTeDSL kernels for the same operations (the cuDNN frontend
wheel), both compiled here for sm_100a with our pinned CuTeDSL. For every gemm_amax variant our catalog shares with
NVIDIA's `dense_blockscaled_gemm_persistent_amax`, and for our proj_rope against NVIDIA's bf16-input
`gemm_proj_rope_mxfp8`: the producer (TMA) warp and the MMA warp issue the same mainloop instructions in the same
order, every mbarrier starts with the same arrival count, the producer arms the same transaction bytes, and every
tcgen05.mma gets the same instruction descriptor, matrix-descriptor fields, tensor-memory addresses and accumulate
flag. What differs on purpose is listed below, each with its reason (docs/design/gemm_amax.md and proj_rope.md,
"Against NVIDIA's kernels"), and the checks tolerate exactly that.

No GPU runs either kernel: this is evidence that our mainloops match code NVIDIA runs on B200s, not a run of ours.
The default tier compares a few representative variants; `-m catalog` compares every shared one.
"""

import re
import unittest

import pytest
from absl.testing import absltest, parameterized

import compiled_kernels
import nvidia_kernels as nk
from jax_blockgemm.kernels import catalog

HAVE_WHEEL = nk.package_root() is not None
SKIP_REASON = f"{nk.WHEEL} (with its CuTeDSL GEMM kernels) is not installed; it is in the test extra"

# ------------------------------------------------------------------------------------------------ gemm_amax
# Where ours differs from NVIDIA's gemm_amax on purpose: each difference and why. The checks apply these and no other.
GEMM_AMAX_DIFFERENCES = {
    "epilogue": "not compared: the epilogue is where the two operations part (our amax is an integer max over the "
                "bits of the in-bounds fp32 values, after NVFP4's alpha; NVIDIA's is an fp32 max that propagates "
                "NaN, with an optional element-wise function), and ours hands a 128x256 accumulator buffer back "
                "early (next entry)",
    "accumulator buffers at N = 256": "ours keeps two 256-column accumulator buffers that share the columns the "
                                      "scales leave free (the second starts 208 columns in; the accumulator "
                                      "pipeline's phase picks the buffer) and puts the scales after them, so that "
                                      "the epilogue of a tile overlaps the next tile's MMAs; NVIDIA's gemm_amax has "
                                      "one buffer at N = 256 (scales at column 256) and does not overlap them. The "
                                      "MMA operands compare with scale columns taken relative to where each kernel "
                                      "puts its scales",
    "early barrier probe": "NVIDIA's producer and MMA warps also probe the next k-tile's barrier ahead of time "
                           "(a non-blocking try_wait after the current loads or MMAs) and skip the blocking wait "
                           "when it already passed; ours does the same test in the blocking wait at the top of each "
                           "k-tile. A latency refinement, not a change of order or of what is waited for",
}
# The early probe's opcode: dropped from both sides' sequences ("early barrier probe").
PROBE_OPCODE = "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64"
# "accumulator buffers at N = 256": how each side addresses the accumulator of its MMAs at N = 256
SHARED_BUFFER_ADDRESS = re.compile(r"\[mad\.lo\.s32\(phi, (\d+), ld\.shared\.b32\)\]")
SINGLE_BUFFER_ADDRESS = "[ld.shared.b32]"

_GEMM_AMAX = catalog.variants_for("sm_100a", "gemm_amax")
# Default tier: MXFP8 E4M3 -> f32 at the (128, 128) tile on one CTA; -> bf16 at (128, 256) on a 2x2 multicast
# cluster; NVFP4 (E4M3 scales, block 16) on a 2x2 cluster.
# (128x128 on one CTA is compiled by the test that the comparison tells configurations apart)
_GEMM_AMAX_DEFAULT = ("gemm_amax.sm_100a.e4m3.bf16.sf32.t128x256.c2x2",
                      "gemm_amax.sm_100a.e2m1.f32.sf16e4m3.t128x128.c2x2")

# ------------------------------------------------------------------------------------------------ proj_rope
PROJ_ROPE_DIFFERENCES = {
    "epilogue": "not compared: NVIDIA's 12 epilogue warps stage the accumulator as bf16 in shared memory and round "
                "scales their own way; ours (4 warps) quantizes straight from fp32 in tensor memory (SPEC §5). "
                "NVIDIA's kernel is no oracle for our results, only for the mainloop",
    "warp numbering": "NVIDIA's TMA warp is warp 13 and its MMA warp 12 (after 12 epilogue warps); ours are 5 and 4",
    "operand stages": "ours has 5 stages of 40 KB (as many as shared memory holds), NVIDIA's 4 (its bf16 staging "
                      "buffer takes the room of the fifth); NVIDIA's kernel is compiled with our count",
    "k-loop unrolling": "NVIDIA leaves its producer and MMA k-tile loops to the compiler, which unrolls them (by 4 "
                        "and 2, with remainder copies); ours pins unroll=1. NVIDIA's kernel is compiled with its "
                        "loops rolled, so that one loop body compares with one",
    "TMA form": "NVIDIA loads through the multicast TMA form (shared::cluster destination, a multicast mask of its "
                "one-CTA cluster); ours, with no cluster, through the plain shared::cta form: the same copy",
    "first accumulate flag": "NVIDIA computes the first MMA's accumulate flag of each k-tile as k_tile != 0; ours "
                             "carries a flag cleared at the tile's first MMA (as NVIDIA's gemm_amax does): false for "
                             "the first k-tile, true after, in both",
}
NVIDIA_PROJ_ROPE_WARPS = {"producer": 13, "mma": 12}  # "warp numbering"
# "TMA form": NVIDIA's opcode -> ours
PROJ_ROPE_TMA_FORMS = {
    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
    ".L2::cache_hint": "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"}
# "first accumulate flag": how each side computes the first MMA's flag of a k-tile
PROJ_ROPE_FIRST_ACCUMULATE = {"ours": "phi", "nvidia": "setp.ne.b32(phi, 0)"}

_PROJ_ROPE = catalog.variants_for("sm_100a", "proj_rope")
_PROJ_ROPE_DEFAULT = ("proj_rope.sm_100a.bf16.e4m3.sf32.t128x192.c1x1",)

_PAIRS: dict = {}


def _stages(kernel) -> dict:
    return {"ab": int(kernel.ab_stages), "acc": int(kernel.acc_stages)}


def _gemm_amax_pair(v: catalog.KernelVariant):
    """(our facts, NVIDIA's facts, our stages, NVIDIA's stages) for gemm_amax variant `v`, once per process."""
    if v.key not in _PAIRS:
        ours = compiled_kernels.compiled(v)
        nvidia = nk.compile_nvidia_gemm_amax(v.ab_dtype, v.c_dtype, v.tile_mn, v.cluster_mn, sf_vec_size=v.sf_vec_size,
                                             sf_dtype=v.sf_dtype, a_major=v.a_major, b_major=v.b_major)
        _PAIRS[v.key] = (nk.mainloop_facts(ours.ptx, ours.kernel.producer_warp, ours.kernel.mma_warp),
                         nk.mainloop_facts(nvidia.ptx, 5, 4), _stages(ours.kernel), nvidia.stages)
    return _PAIRS[v.key]


def _proj_rope_pair(v: catalog.KernelVariant):
    """As `_gemm_amax_pair`, for proj_rope variant `v` (NVIDIA's kernel with its k-loops rolled)."""
    if v.key not in _PAIRS:
        ours = compiled_kernels.compiled(v)
        stages = _stages(ours.kernel)
        nvidia = nk.compile_nvidia_proj_rope(v.b_major, stages, k_loops_rolled=True)
        _PAIRS[v.key] = (nk.mainloop_facts(ours.ptx, ours.kernel.producer_warp, ours.kernel.mma_warp),
                         nk.mainloop_facts(nvidia.ptx, NVIDIA_PROJ_ROPE_WARPS["producer"],
                                           NVIDIA_PROJ_ROPE_WARPS["mma"]),
                         stages, nvidia.native_stages)
    return _PAIRS[v.key]


def _selected(variants, keys):
    return [v for v in variants if v.key in keys]


def _diff(ours, theirs) -> str:
    """The first position where two sequences differ, with context, for a failure message."""
    ours, theirs = list(ours), list(theirs)
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"lengths {len(ours)} (ours) vs {len(theirs)} (NVIDIA); first difference at {at}:\n"
            f"  ours:   {ours[max(0, at - 2):at + 3]}\n  NVIDIA: {theirs[max(0, at - 2):at + 3]}")


class _Checks(parameterized.TestCase):
    """The comparisons of one variant with NVIDIA's kernel at the same configuration (no tests of its own)."""

    def assert_gemm_amax_matches(self, v: catalog.KernelVariant) -> None:
        ours, theirs, stages, nvidia_stages = _gemm_amax_pair(v)
        self.assertEqual(stages, nvidia_stages, f"stage counts of {v.key}: ours vs NVIDIA's; name why they differ")
        for role in ("producer", "mma"):  # the same mainloop opcodes in the same order, but for the probe
            self.assertIn(PROBE_OPCODE, getattr(theirs, role),
                          "NVIDIA's early barrier probe is gone: drop that entry of GEMM_AMAX_DIFFERENCES")
            mine = [op for op in getattr(ours, role) if op != PROBE_OPCODE]
            nvidia = [op for op in getattr(theirs, role) if op != PROBE_OPCODE]
            self.assertEqual(mine, nvidia, f"{role} warp of {v.key}: {_diff(mine, nvidia)}")
        # Not vacuous: one k-tile's four TMA loads (A, B, SFA, SFB; those shared along a cluster side multicast)
        # and its four MMAs.
        tma = [op for op in ours.producer if op.startswith("cp.async.bulk.tensor")]
        self.assertLen(tma, 4)
        self.assertEqual(any("multicast::cluster" in op for op in tma), v.cluster_mn != (1, 1))
        self.assertLen([op for op in ours.mma if op.startswith("tcgen05.mma")], 4)

        self.assertEqual(ours.mbarrier_init, theirs.mbarrier_init, f"mbarrier.init of {v.key}")
        self.assertLen(ours.mbarrier_init, 2 * (stages["ab"] + stages["acc"]))  # full + empty per stage
        self.assertEqual(ours.expect_tx, theirs.expect_tx, f"transaction bytes of {v.key}")

        # Scale columns: right after the accumulator at N = 128 in both; after our two shared buffers at N = 256.
        bases = [nk.tensor_memory_column(facts.mma_operands[0]["sfa"]) for facts in (ours, theirs)]
        skip = set()
        if v.tile_mn[1] == 256:  # "accumulator buffers at N = 256"
            self.assertEqual(bases[1], 256)
            for i, (mine, nvidia) in enumerate(zip(ours.mma_operands, theirs.mma_operands)):
                self.assertEqual(nvidia["d"], SINGLE_BUFFER_ADDRESS)
                shared = SHARED_BUFFER_ADDRESS.fullmatch(mine["d"])
                self.assertIsNotNone(shared, mine["d"])
                self.assertEqual(int(shared.group(1)) + 256, bases[0], "our second buffer ends where scales begin")
                skip.add((i, "d"))
        else:
            self.assertEqual(bases, [2 * v.tile_mn[1]] * 2)
        self._assert_same_mma_operands(v.key, ours, theirs, skip=skip, tmem_bases=bases)

    def assert_proj_rope_matches(self, v: catalog.KernelVariant) -> None:
        ours, theirs, stages, native = _proj_rope_pair(v)
        for role in ("producer", "mma"):
            nvidia = [PROJ_ROPE_TMA_FORMS.get(op, op) for op in getattr(theirs, role)]
            self.assertEqual(list(getattr(ours, role)), nvidia,
                             f"{role} warp of {v.key}: {_diff(getattr(ours, role), nvidia)}")
        self.assertTrue(set(PROJ_ROPE_TMA_FORMS) <= set(theirs.producer), "NVIDIA's TMA form changed")
        # Not vacuous: one k-tile is a TMA load of x and one of w (three 64-feature boxes when w is read
        # feature-major), and four k16 MMAs.
        self.assertLen([op for op in ours.producer if op.startswith("cp.async.bulk.tensor")],
                       2 if v.b_major == "k" else 4)
        self.assertLen([op for op in ours.mma if op.startswith("tcgen05.mma")], 4)

        self.assertEqual(ours.mbarrier_init, theirs.mbarrier_init, f"mbarrier.init of {v.key}")
        self.assertLen(ours.mbarrier_init, 2 * (stages["ab"] + stages["acc"]))
        self.assertEqual(ours.expect_tx, theirs.expect_tx, f"transaction bytes of {v.key}")
        first = ours.mma_operands[0]["accumulate"], theirs.mma_operands[0]["accumulate"]  # "first accumulate flag"
        self.assertEqual(first, (PROJ_ROPE_FIRST_ACCUMULATE["ours"], PROJ_ROPE_FIRST_ACCUMULATE["nvidia"]))
        self._assert_same_mma_operands(v.key, ours, theirs, skip={(0, "accumulate")})

        self.assertEqual((stages["ab"], native["ab"]), (5, 4), PROJ_ROPE_DIFFERENCES["operand stages"])
        self.assertEqual(stages["acc"], native["acc"])

    def _assert_same_mma_operands(self, key: str, ours, theirs, skip=frozenset(), tmem_bases=(0, 0)) -> None:
        """Every operand of every MMA equal, but those in `skip` ((MMA index, operand)); tensor-memory columns of
        the scales (and the scale-factor bits of idesc derived from them) relative to `tmem_bases` (ours, theirs)."""
        self.assertLen(ours.mma_operands, 4)
        self.assertEqual(len(ours.mma_operands), len(theirs.mma_operands))
        for i, (mine, nvidia) in enumerate(zip(ours.mma_operands, theirs.mma_operands)):
            for field in sorted(set(mine) | set(nvidia)):
                if (i, field) not in skip:
                    self.assertEqual(nk.rebase_tensor_memory(mine.get(field, ""), tmem_bases[0]),
                                     nk.rebase_tensor_memory(nvidia.get(field, ""), tmem_bases[1]),
                                     f"MMA {i} of {key}, operand {field}")


@unittest.skipUnless(HAVE_WHEEL, SKIP_REASON)
class AgainstNvidiaTest(_Checks):
    """Representative variants (the default tier)."""

    @parameterized.named_parameters(compiled_kernels.named(_selected(_GEMM_AMAX, _GEMM_AMAX_DEFAULT)))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_matches(v)

    @parameterized.named_parameters(compiled_kernels.named(_selected(_PROJ_ROPE, _PROJ_ROPE_DEFAULT)))
    def test_proj_rope(self, v):
        self.assert_proj_rope_matches(v)

    def test_comparison_tells_configurations_apart(self):
        """The compared facts carry the configuration: NVIDIA's kernel at another tile, cluster and stage count than
        our (128, 128) one-CTA variant has other MMA instruction descriptors, barrier counts (multicast consumers)
        and transaction bytes; the descriptors differ in exactly the N field (bits 17-22: N >> 3)."""
        v = catalog.select_variant(arch="sm_100a", ab_dtype="float8_e4m3fn", c_dtype="float32", sf_vec_size=32,
                                   tile_mn=(128, 128), cluster_mn=(1, 1))
        ours, _, _, _ = _gemm_amax_pair(v)
        other = nk.compile_nvidia_gemm_amax("float8_e4m3fn", "float32", (128, 256), (2, 2))
        theirs = nk.mainloop_facts(other.ptx, 5, 4)
        self.assertNotEqual(ours.mbarrier_init, theirs.mbarrier_init)
        self.assertNotEqual(ours.expect_tx, theirs.expect_tx)
        constants = [[int(x) for x in re.findall(r"selp\.b32\((\d+), (\d+),", facts.mma_operands[0]["idesc"])[0]]
                     for facts in (ours, theirs)]
        self.assertEqual([a ^ b for a, b in zip(*constants)], [((128 >> 3) ^ (256 >> 3)) << 17] * 2)


@pytest.mark.catalog
@unittest.skipUnless(HAVE_WHEEL, SKIP_REASON)
class AgainstNvidiaCatalogTest(_Checks):
    """Every gemm_amax variant of our sm_100a catalog (all are inside NVIDIA's kernel's surface: MXFP8, MXFP4 and
    NVFP4, both tiles, every cluster shape, MN-major MXFP8 operands) and both proj_rope w layouts."""

    @parameterized.named_parameters(compiled_kernels.named(_GEMM_AMAX))
    def test_gemm_amax(self, v):
        self.assert_gemm_amax_matches(v)

    @parameterized.named_parameters(compiled_kernels.named(_PROJ_ROPE))
    def test_proj_rope(self, v):
        self.assert_proj_rope_matches(v)


if __name__ == "__main__":
    absltest.main()
