"""The swap_ab ragged path on a CPU machine (MXFP8 E4M3, MXFP4 and NVFP4 weights converted in registers, bf16
tokens): the token column orders against the wgmma register layout CuTe builds and against a model of the threads'
FP4 conversion, the handler's checks of its buffers, which calls dispatch sends to it, and its custom call lowered
for CUDA. The kernel's results are checked on the H200 by tests/test_gpu_ragged.py and
tests/test_gpu_weight_stream.py."""

import itertools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from jax_blockgemm import _native, arch, dispatch, formats, gate, swap_ab_layout
from jax_blockgemm.kernels import catalog, common, structure

from compiled_kernels import compiled

import test_decode_bits as decode_bits
import test_ffi_ragged as ffi_cases
import test_ragged_kernel as lowering_cases

ext = _native.extension()
U8, F32, BF16, F16, E4M3, E5M2 = "uint8", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"
FP4, E8M0 = "float4_e2m1fn", "float8_e8m0fnu"


def _rs_fragment_layout():
    """(thread, value) -> column-major (64 x 16) index of the bf16 register-sourced wgmma A fragment that the
    kernel's tiled MMA uses, and the fragment's register layout, as CuTe builds them for sm_90a."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cutlass_dsl import CuTeDSL

    out = {}

    @cute.jit
    def probe():
        kmajor = cute.nvgpu.OperandMajorMode.K
        mma = sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, kmajor, kmajor, cutlass.Float32,
                                                (2, 1, 1), tiler_mn=(64, 128),
                                                a_source=cute.nvgpu.warpgroup.OperandSource.RMEM)
        tv = mma.tv_layout_A
        out["index"] = [[tv((t, v)) for v in range(8)] for t in range(128)]
        out["registers"] = str(mma.make_fragment_A(mma.get_slice(0).partition_shape_A((128, 64))).layout)

    envar = CuTeDSL._get_dsl().envar
    saved = envar._arch
    envar.arch = "sm_90a"
    try:
        probe()
    finally:
        envar._arch = saved
    return out


class TokenOrderTest(absltest.TestCase):

    def test_order_is_the_fragment_order(self):
        """The kernel gives thread (g, c) of warp w codes 32c .. 32c + 31 of rows 16w + g and + 8 and puts code
        32c + 4s + 2h + j of row + 8r into value (j, r, h) of k-step s (word 4s + 2h + r, `_convert_words`); CuTe's
        fragment says which k that value multiplies. The tokens' column there must be that code's column."""
        frag = _rs_fragment_layout()
        self.assertEqual(frag["registers"], "((2,2,2),1,4):((1,2,4),0,8)")  # value (j, r, h), then k-step s
        order = swap_ab_layout.swap_ab_column_order()
        self.assertEqual(sorted(order.tolist()), list(range(128)))
        for t in range(128):
            w, g, c = t // 32, t % 32 // 4, t % 4
            for j, r, h in itertools.product(range(2), range(2), range(2)):
                k16, m = divmod(frag["index"][t][j + 2 * r + 4 * h], 64)  # column-major (64, 16)
                self.assertEqual(m, 16 * w + g + 8 * r, (t, j, r, h))
                for s in range(8):
                    self.assertEqual(order[16 * s + k16], 32 * c + 4 * s + 2 * h + j, (t, j, r, h, s))

    def test_e4m3_swizzled_rows_model_keeps_the_dot_product(self):
        """A model of 64 weight rows' 128-code k-tile through a decode tile's threads: the rows as TMA lands them
        128-byte swizzled (piece p of row r at 16·(p ^ r % 8)), each lane's two loads at the kernel's own addresses
        (`_code_addresses`), word s of a row's codes to k-step s by `e4m3_pair_bits`, fed to the fragment slots at
        column 16s + 8h + 2c + j; against the tokens in `swap_ab_column_order` every row's sum is its dot product with
        the tokens in their own order. Each quarter-warp's 16-byte loads meet every bank once."""
        import ml_dtypes
        from jax_blockgemm.kernels.sm90.ragged_swap_ab import HopperRaggedSwapAB

        kernel = HopperRaggedSwapAB(token_rows=16, weight_warpgroups=1, k_split=3)
        self.assertEqual((kernel.k_tile, kernel.row_bytes, kernel.swizzled_codes), (128, 128, True))
        rng = np.random.default_rng(3)
        codes = rng.integers(0, 256, size=(64, 128), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes here (1.0)
        values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        stage = np.zeros(64 * 128, np.uint8)
        for r in range(64):
            for p in range(8):
                stage[r * 128 + 16 * (p ^ r % 8):r * 128 + 16 * (p ^ r % 8) + 16] = codes[r, 16 * p:16 * p + 16]
        tokens = rng.standard_normal(128)
        permuted = tokens[swap_ab_layout.swap_ab_column_order()]
        bf16 = lambda bits: np.array([bits & 0xFFFF], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)[0]
        sums = np.zeros(64)
        for warp, lane in itertools.product(range(4), range(32)):
            quad, pair = lane // 4, lane % 4
            row0 = warp * 16 + quad
            for r, at in enumerate(kernel._code_addresses(0, row0, quad, pair)):
                words = np.concatenate([stage[a:a + 16] for a in at]).view(np.uint32)
                for s, h in itertools.product(range(8), range(2)):
                    bits = int(common.e4m3_pair_bits(words[s:s + 1], bool(h), decode_bits._prmt)[0]) & 0xFFFFFFFF
                    for j in range(2):
                        code = bf16(bits >> (16 * j)) * 2.0**common.E4M3_PLACEMENT
                        sums[row0 + 8 * r] += code * permuted[16 * s + 8 * h + 2 * pair + j]
        np.testing.assert_allclose(sums, values @ tokens, rtol=1e-12, atol=1e-9)
        for warp, phase, i in itertools.product(range(4), range(4), range(2)):  # lanes 8·phase .. + 7, load i
            banks = set()
            for lane in range(8 * phase, 8 * phase + 8):
                row0 = warp * 16 + lane // 4
                at = kernel._code_addresses(0, row0, lane // 4, lane % 4)[0][i]
                banks.update(range(at // 4 % 32, at // 4 % 32 + 4))
            self.assertEqual(len(banks), 32, (warp, phase, i))

    def test_fp4_order_is_the_fragment_order(self):
        """FP4: thread (g, c) loads codes 32c .. 32c + 31 of rows 16w + g and + 8 (four words of eight codes each)
        and puts pair 2(s % 2) + h of word s // 2 (`common.e2m1_pair_bits`: codes p and p + 4 of the word) into value
        (j, r, h) of k-step s (`_convert_fp4_words`); the tokens' column there must be that code's."""
        frag = _rs_fragment_layout()
        order = swap_ab_layout.swap_ab_column_order(fp4=True)
        self.assertEqual(sorted(order.tolist()), list(range(128)))
        for t in range(128):
            c = t % 4
            for j, r, h in itertools.product(range(2), range(2), range(2)):
                k16 = frag["index"][t][j + 2 * r + 4 * h] // 64
                for s in range(8):
                    code = 32 * c + 8 * (s // 2) + 2 * (s % 2) + h + 4 * j
                    self.assertEqual(order[16 * s + k16], code, (t, j, r, h, s))

    def test_fp4_conversion_model_keeps_the_dot_product(self):
        """A model of one weight row's k-tile through the kernel: packed bytes (SPEC §1: code 2i in the low nibble
        of byte i), each lane's words, the pairs `e2m1_pair_bits` forms decoded and scaled, fed to the fragment
        slots at column 16s + 8h + 2c + j; against tokens in the FP4 order the sum is the row's dot product with the
        tokens in their own order."""
        import ml_dtypes
        from jax_blockgemm import formats

        def bf16(bits):
            return np.array([bits & 0xFFFF], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)[0]

        rng = np.random.default_rng(1)
        nibbles = rng.integers(0, 16, size=128)
        packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
        values = np.asarray(formats.unpack_fp4(jnp.asarray(packed)).astype(jnp.float32), np.float64)
        tokens = rng.standard_normal(128)
        permuted = tokens[swap_ab_layout.swap_ab_column_order(fp4=True)]
        total = 0.0
        for c in range(4):
            words = packed[16 * c:16 * (c + 1)].view(np.int32)  # the lane's 16-byte shared load
            for s, h in itertools.product(range(8), range(2)):
                bits = int(common.e2m1_pair_bits(words[s // 2:s // 2 + 1], 2 * (s % 2) + h)[0]) & 0xFFFFFFFF
                for j in range(2):
                    code = bf16(bits >> (16 * j)) * 2.0**common.E2M1_PLACEMENT
                    total += code * permuted[16 * s + 8 * h + 2 * c + j]
        self.assertAlmostEqual(total, float(values @ tokens), places=10)

    def test_dequantize_kernel_writes_the_same_order(self):
        """The dequantize kernel's swap_ab order (kernels/dequantize.py): the run of 8 codes at column 8·run of a
        128-column tile stores its bf16 pair q (codes 2q, 2q + 1) at `swap_ab_pair_column(run, q)`; every output column
        must then hold the code `swap_ab_column_order` names, each column written once."""
        from jax_blockgemm.kernels import dequantize

        order = swap_ab_layout.swap_ab_column_order()
        written = {}
        for run in range(dequantize.SWAP_AB_TILE // dequantize.RUN):
            for q in range(dequantize.RUN // 2):
                for j in range(2):
                    written[dequantize.swap_ab_pair_column(run, q) + j] = dequantize.RUN * run + 2 * q + j
        self.assertEqual(sorted(written), list(range(128)))
        self.assertEqual([written[c] for c in range(128)], order.tolist())

    def test_tokens_padded_and_permuted(self):
        """swap_ab_tokens: K rounded up to 256 with zeros, every 128 columns in `swap_ab_column_order`, and a dot
        product with weights permuted the same way unchanged."""
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 5, 272)).astype(np.float32)
        got = np.asarray(swap_ab_layout.swap_ab_tokens(jnp.asarray(x)))
        self.assertEqual(got.shape, (2, 5, 512))
        padded = np.pad(x, ((0, 0), (0, 0), (0, 240)))
        order = (np.arange(4)[:, None] * 128 + swap_ab_layout.swap_ab_column_order()[None]).reshape(-1)
        np.testing.assert_array_equal(got, padded[..., order])
        w = rng.standard_normal(272)
        np.testing.assert_allclose(got @ np.pad(w, (0, 240))[order], x @ w, rtol=1e-12)
        fp4 = np.asarray(swap_ab_layout.swap_ab_tokens(jnp.asarray(x), fp4=True))
        order4 = (np.arange(4)[:, None] * 128 + swap_ab_layout.swap_ab_column_order(fp4=True)[None]).reshape(-1)
        np.testing.assert_array_equal(fp4, padded[..., order4])
        self.assertFalse(np.array_equal(order4, order))


class KernelOrderedTokensTest(parameterized.TestCase):
    """The decode tiles order each k-tile's token columns in shared memory (`HopperRaggedSwapAB.order_tokens`): a
    model of one stage, 128-byte swizzled as TMA and the wgmma address it (chunk j of row r at 16·(j ^ r % 8)), through
    `common.token_chunk_words` and `token_chunk_place`, must leave every row as `swap_ab_tokens` orders it."""

    @staticmethod
    def _byte_perm(a, b, selector):  # prmt.b32 on the bytes of (b:a)
        pool = int(a & 0xFFFFFFFF).to_bytes(4, "little") + int(b & 0xFFFFFFFF).to_bytes(4, "little")
        return int.from_bytes(bytes(pool[(selector >> (4 * i)) & 0x7] for i in range(4)), "little")

    @parameterized.parameters(False, True)
    def test_a_stage_ends_in_the_fragment_order(self, fp4):
        rows, k_tile = 16, swap_ab_layout.SWAP_AB_K_TILE
        chunks = k_tile // 8
        rng = np.random.default_rng(7)
        x = rng.integers(0, 2**16, size=(rows, k_tile), dtype=np.uint16)  # a k-tile of bf16 tokens, as bits
        stage = np.zeros(rows * k_tile * 2, np.uint8)
        # chunk j of row r: in swizzle atom j // 8 (every row's 128-byte line of one atom, then the next atom's)
        at = lambda r, j: j // 8 * rows * 128 + r * 128 + 16 * (j % 8 ^ r % 8)
        for r in range(rows):  # as TMA lands it: the row's chunks in their own column order, swizzled
            for j in range(chunks):
                stage[at(r, j):at(r, j) + 16] = x[r, 8 * j:8 * j + 8].view(np.uint8)
        for r in range(rows):  # a lane a chunk: every chunk of a row read before any is written
            words = {v: [int(w) for w in stage[at(r, v):at(r, v) + 16].view(np.uint32)] for v in range(chunks)}
            for v in range(chunks):
                for q, word in enumerate(common.token_chunk_words(words[v], fp4, self._byte_perm)):
                    chunk, offset = common.token_chunk_place(v, q)
                    stage[at(r, chunk) + offset:at(r, chunk) + offset + 4] = np.array([word], np.uint32).view(np.uint8)
        got = np.stack([np.concatenate([stage[at(r, j):at(r, j) + 16].view(np.uint16) for j in range(chunks)])
                        for r in range(rows)])  # as the wgmma reads the stage
        np.testing.assert_array_equal(got, x[:, swap_ab_layout.swap_ab_column_order(fp4=fp4)])

    def test_which_tiles_order_their_tokens(self):
        """The 16-token decode tile orders the tokens itself and takes them padded only; the wider tiles (the 32- and
        64-token decode tiles, the MoE tile) take them permuted (`kernel_tokens`)."""
        x = jnp.arange(2 * 320, dtype=jnp.float32).reshape(2, 320)
        for (tokens, _, _), fp4 in itertools.product(catalog.SWAP_AB_DECODE_TILES + ((128, 128, 1),), (False, True)):
            want = jnp.pad(x, ((0, 0), (0, 192))) if tokens == 16 else swap_ab_layout.swap_ab_tokens(x, fp4=fp4)
            self.assertEqual(swap_ab_layout.kernel_orders_tokens(tokens), tokens == 16)
            np.testing.assert_array_equal(swap_ab_layout.kernel_tokens(x, fp4=fp4, tile_tokens=tokens), want)


class ScaleAddressingTest(parameterized.TestCase):
    """A model of the kernel's scale reads: for every weight row of a tile (rows past N too) and every lane's codes
    (each block of them: NVFP4's 128-code k-tiles give a lane two) in every k-tile of the groups the mainloop walks
    (the next group's loaded ahead, past K included), the byte at `_scale_row_at` + `_scale_offset` (of the lane's
    `_scale_walk`) in the scales, compact or in SPEC §3's atoms (`atom`: sf_atom 1), must be that row's scale of the
    block holding those codes, or for rows past N and codes past K (TMA's zeros) a byte of the weight's last real row
    and block: no read leaves the weight's scales."""

    @parameterized.product(fmt=((E4M3, 32, E8M0), (FP4, 32, E8M0), (FP4, 16, E4M3)), tile=((128, 128), (64, 64),
                                                                                           (16, 64)),
                           atom=(False, True))
    def test_each_lane_reads_its_block(self, fmt, tile, atom):
        from jax_blockgemm.kernels.sm90 import ragged_swap_ab

        w_dtype, block, sf = fmt
        kernel = ragged_swap_ab.HopperRaggedSwapAB(token_rows=tile[0], weight_warpgroups=tile[1] // 64,
                                                   w_dtype=w_dtype, sf_vec_size=block, sf_dtype=sf)
        g, n, k = 2, 200, 544  # N off both tiles; K past a whole promotion group (the last blocks clamped)
        kb = -(-k // block)
        compact = np.random.default_rng(block + tile[1]).integers(0, 256, (g, n, kb)).astype(np.uint8)
        flat = np.asarray(formats.to_scale_atom(jnp.asarray(compact)) if atom else compact).reshape(-1)
        groups = -(-k // ragged_swap_ab.K_PAD)
        rows = tile[1]

        class Base:  # the kernel takes the tensor's address; the model reads offsets from 0
            class iterator:
                toint = staticmethod(lambda: 0)

        for w_batch in range(g):
            for tile_n in range(-(-n // rows)):
                for row in range(rows):
                    at = int(kernel._scale_row_at(Base, int(atom), w_batch, tile_n * rows + row, n, kb))
                    for q in range(groups + 1):  # the last group's loads of the next one: the clamped block
                        for i, pair, b in itertools.product(range(kernel.promote_tiles), range(4),
                                                            range(kernel.lane_blocks)):
                            walk = kernel._scale_walk(pair, kb, int(atom))
                            got = flat[at + int(kernel._scale_offset(walk, q, i, b))]
                            kt = kernel.promote_tiles * q + i
                            first_code = kernel.k_tile * kt + kernel.k_tile // 4 * pair + block * b
                            want = compact[w_batch, min(tile_n * rows + row, n - 1), min(first_code // block, kb - 1)]
                            self.assertEqual(int(got), int(want), (w_batch, tile_n, row, q, i, pair, b))


def _k_split_pipeline(kernel, k_tiles: int) -> str:
    """Runs a model of the kernel's stage pipeline over k_tiles k-tiles: the producer fills k-tile kt into stage
    kt % stages once that stage's previous k-tile was released; part p's consumer follows the mainloop's order (wait
    for a k-tile, multiply it, release the one before, wait for the next: its next group's first k-tile before it
    releases its group's last), its states starting and skipping as `part_walk` says. Returns "done" or "deadlock";
    raises AssertionError where a part would read or release a stage that holds another k-tile than the one it
    multiplies next."""
    per, stages, split = kernel.promote_tiles, kernel.stages, kernel.k_split
    filled, released = [], set()  # k-tiles filled, in order; k-tiles released

    def consumer(part):
        first, skip = kernel.part_walk(part)
        read = release = first  # absolute positions: the stage is position % stages
        groups = range(part, k_tiles // per, split)
        if groups:
            yield ("wait", read, per * part)
        for q in groups:
            for i in range(per):
                read += 1
                if i > 0:
                    yield ("release", release, per * q + i - 1)
                    release += 1
                if i + 1 < per:
                    yield ("wait", read, per * q + i + 1)
                else:
                    read += skip
                    if q + split < k_tiles // per:
                        yield ("wait", read, per * (q + split))
            yield ("release", release, per * q + per - 1)
            release += 1 + skip

    parts = [consumer(p) for p in range(split)]
    pending = [next(c, None) for c in parts]
    while len(filled) < k_tiles or any(pending):
        moved = False
        kt = len(filled)
        if kt < k_tiles and (kt < stages or kt - stages in released):
            filled.append(kt)
            moved = True
        for p, step in enumerate(pending):
            if step is None:
                continue
            op, position, tile = step
            assert position == tile, (op, p, position, tile)  # the stage and phase of the k-tile it handles
            if op == "wait" and tile not in filled:
                continue
            if op == "release":
                released.add(tile)
            pending[p] = next(parts[p], None)
            moved = True
        if not moved:
            return "deadlock"
    return "done"


class KSplitPipelineModelTest(parameterized.TestCase):
    """The k_split decode tiles' stage pipeline (kernels/sm90/ragged_swap_ab.py, `mainloop`): each part reads only
    the k-tiles of its promotion groups, each stage always by the same part, and no part waits forever."""

    @parameterized.product(split=(1, 2, 3), groups=(1, 2, 3, 5, 8, 13), w_dtype=(E4M3, FP4))
    def test_every_part_reads_its_groups_and_finishes(self, split, groups, w_dtype):
        from jax_blockgemm.kernels.sm90 import ragged_swap_ab

        kernel = ragged_swap_ab.HopperRaggedSwapAB(token_rows=16, weight_warpgroups=1, k_split=split, w_dtype=w_dtype)
        self.assertEqual(_k_split_pipeline(kernel, groups * kernel.promote_tiles), "done")

    def test_the_model_catches_a_wrong_walk_and_too_few_stages(self):
        """The model fails where the kernel would: a part whose states do not skip the other parts' groups reads
        their stages, and stages for fewer than one promotion group per part leave a part waiting for a k-tile
        behind the one it has not released."""
        from jax_blockgemm.kernels.sm90 import ragged_swap_ab

        kernel = ragged_swap_ab.HopperRaggedSwapAB(token_rows=16, weight_warpgroups=1, k_split=2)
        per = kernel.promote_tiles
        with mock.patch.object(kernel, "part_walk", lambda part: (per * part, 0)):
            with self.assertRaises(AssertionError):
                _k_split_pipeline(kernel, 4 * per)
        kernel.stages = per
        self.assertEqual(_k_split_pipeline(kernel, 4 * per), "deadlock")


class CompileTest(parameterized.TestCase):
    """Both swap_ab objects compile for sm_90a to what the design rests on (kernels/sm90/ragged_swap_ab.py)."""

    @parameterized.parameters(F32, BF16)
    def test_structure(self, c_dtype):
        """The MoE tile: 128-code k-tiles (FP8 rows of 128 bytes, swizzled) in as many stages as fit (4 of 48 KB)."""
        v = catalog.select_variant(op="ragged", arch="sm_90a", ab_dtype=E4M3, c_dtype=c_dtype, sf_vec_size=32,
                                   tile_mn=(128, 128), cluster_mn=(1, 1), schedule=catalog.SWAP_AB)
        c = compiled(v)
        self.assertEqual((c.kernel.tile_mnk, c.kernel.row_bytes, c.kernel.swizzled_codes, c.kernel.stages),
                         ((128, 128, 128), 128, True, 4))
        # the weights from registers (four 32-bit A registers), the tokens from shared memory, 128 tokens wide (32,
        # 64 or 96 for items of at most that many tokens); the codes by bit moves, not the converter; TMA loads;
        # registers moved to the MMA warpgroups; amax's open tally (arrivals counted, amax opened by a release store
        # and waited for by an acquire load, each CTA's max folded in by a reduction) and no atomic max that returns
        # a value
        wanted = {"register-sourced wgmma": r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, "
                                             r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+",
                  "prmt": r"prmt\.b32", "TMA": r"cp\.async\.bulk\.tensor",
                  "setmaxnreg": r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232",
                  "max folded in": r"red\.relaxed\.gpu\.global\.max\.s32",
                  "arrivals counted": r"atom\.relaxed\.gpu\.global\.add\.u32",
                  "amax opened": r"st\.release\.gpu\.global\.b32",
                  "open awaited": r"ld\.acquire\.gpu\.global\.b32"}
        for name, pattern in wanted.items():
            self.assertTrue(re.search(pattern, c.ptx), name)
        self.assertEqual(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", c.ptx)),
                         {"32", "64", "96", "128"})  # each item's narrowest width that holds its tokens
        for name, pattern in {"FP8 converter": r"cvt\.rn\.f16x2\.e4m3x2", "local memory": r"\.local",
                              "atomic max": r"atom\.global\.max",
                              "tokens ordered in the kernel": r"fence\.proxy\.async"}.items():
            self.assertFalse(re.search(pattern, c.ptx), name)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))

    @parameterized.product(fmt=((32, E8M0), (16, E4M3)), c_dtype=(F32, BF16),
                           tile=((128, 128, 1), *catalog.SWAP_AB_DECODE_TILES))
    def test_fp4_structure(self, fmt, c_dtype, tile):
        """MXFP4 and NVFP4 objects: one 16-byte shared load of a thread's 32 codes of a row (k-tiles of 128 codes,
        64-byte rows, plain), the register-sourced wgmma as wide as the tile's tokens, the E2M1 bit moves (no FP8
        converter) with 2^126 for the two-multiply path, no local memory; the MoE tile in 5 stages of 40 KB."""
        block, sf = fmt
        v = catalog.select_variant(op="ragged", arch="sm_90a", ab_dtype=FP4, c_dtype=c_dtype, sf_vec_size=block,
                                   sf_dtype=sf, tile_mn=tile[:2], k_split=tile[2], cluster_mn=(1, 1),
                                   schedule=catalog.SWAP_AB)
        c = compiled(v)
        self.assertEqual((c.kernel.k_tile, c.kernel.row_bytes, c.kernel.swizzled_codes), (128, 64, False))
        if tile[0] == 128:
            self.assertEqual(c.kernel.stages, 5)
            self.assertEqual(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", c.ptx)),
                             {"32", "64", "96", "128"})
        self.assertTrue(re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile[0]}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                                  r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", c.ptx))
        self.assertTrue(re.search(r"ld\.shared\.v4\.b32", c.ptx))
        self.assertIn(str(common.BF16X2_TWO_POW_126), c.ptx)  # 2^126 in both bf16 halves
        for name, pattern in {"FP8 converter": r"cvt\.rn\.f16x2\.e4m3x2", "local memory": r"\.local"}.items():
            self.assertFalse(re.search(pattern, c.ptx), name)
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))

    @parameterized.product(c_dtype=(F32, BF16), tile=catalog.SWAP_AB_DECODE_TILES)
    def test_decode_tile_structure(self, c_dtype, tile):
        """The decode tiles (catalog.SWAP_AB_DECODE_TILES): one MMA warpgroup per 64 weight rows and K part, as many
        tokens wide as the tile and no narrower one (a decode tile's calls fill it), 128-code k-tiles, the same
        register-sourced wgmma, the MMA warpgroups raised to 232 registers (152 with three K parts: 512 threads share
        the SM's 64 K; 144 on the 16-token tile, whose producer warpgroup keeps 80 for the warps that order the
        tokens' columns there), and no local memory."""
        tokens, rows, split = tile
        v = catalog.select_variant(op="ragged", arch="sm_90a", ab_dtype=E4M3, c_dtype=c_dtype, sf_vec_size=32,
                                   tile_mn=(tokens, rows), k_split=split, cluster_mn=(1, 1), schedule=catalog.SWAP_AB)
        c = compiled(v)
        self.assertEqual(c.kernel.tile_mnk, (tokens, rows, 128))  # 128-code k-tiles: 128-byte rows, swizzled
        self.assertEqual((c.kernel.row_bytes, c.kernel.swizzled_codes), (128, True))
        self.assertEqual(c.kernel.threads_per_cta, 128 * (1 + rows // 64 * split))
        self.assertTrue(re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tokens}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                                  r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", c.ptx))
        self.assertEqual(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", c.ptx)), {str(tokens)})
        regs = {16: 144, 32: 152, 64: 232}[tokens]
        self.assertEqual(c.kernel.consumer_regs, regs)
        self.assertTrue(re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{regs}\b", c.ptx))
        self.assertFalse(re.search(r"\.local", c.ptx))
        # the 16-token tile's producer warps order the tokens' columns: their stores made visible to the wgmma
        self.assertEqual(c.kernel.orders_tokens, tokens == 16)
        self.assertEqual(len(re.findall(r"fence\.proxy\.async\.shared::cta", c.ptx)), int(tokens == 16))
        resources = structure.cubin_resources(c.fn.__cubin__)
        self.assertEqual((resources.frame_bytes, resources.stack_bytes), (0, 0))
        self.assertEqual(resources.registers, c.kernel.launch_regs)  # what setmaxnreg shares out (next test)

    def test_setmaxnreg_shares_out_only_what_the_launch_gave(self):
        """For every tile the constructor accepts, the producer's registers and the MMA warpgroups' raised ones fit in
        what the CTA was launched with (a warpgroup asking for more than is free would wait forever)."""
        from jax_blockgemm.kernels.sm90.ragged_swap_ab import HopperRaggedSwapAB

        accepted = 0
        for tokens, warpgroups, split in itertools.product((16, 32, 64, 128), (1, 2), (1, 2, 3)):
            try:
                kernel = HopperRaggedSwapAB(token_rows=tokens, weight_warpgroups=warpgroups, k_split=split)
            except ValueError:
                continue
            accepted += 1
            with self.subTest(tokens=tokens, warpgroups=warpgroups, split=split):
                mma_threads = kernel.threads_per_cta - kernel.threads_per_wg
                self.assertLessEqual(kernel.threads_per_wg * kernel.producer_regs + mma_threads * kernel.consumer_regs,
                                     kernel.threads_per_cta * kernel.launch_regs)
                self.assertLessEqual(kernel.threads_per_cta * kernel.launch_regs, 64 * 1024)
        self.assertGreaterEqual(accepted, len(catalog.SWAP_AB_DECODE_TILES) + 1)

    @parameterized.parameters((16, E4M3, 32, E8M0), (32, FP4, 16, E4M3))
    def test_three_k_parts_fit_their_registers(self, tokens, w_dtype, block, sf):
        """k_split = 3 (the 16- and 32-token decode tiles; here also with NVFP4 codes): 512 threads launched at 128
        registers, the MMA warpgroups raised to 152 (144 beside the 16-token tile's token writers), two promotion
        groups of stages per part (12 stages of 128-code k-tiles), still without local memory or stack."""
        from jax_blockgemm.kernels.sm90.ragged_swap_ab import HopperRaggedSwapAB

        kernel = HopperRaggedSwapAB(c_dtype=BF16, token_rows=tokens, weight_warpgroups=1, k_split=3, w_dtype=w_dtype,
                                    sf_vec_size=block, sf_dtype=sf)
        v = catalog.KernelVariant(op="ragged", ab_dtype=w_dtype, c_dtype=BF16, sf_vec_size=block, sf_dtype=sf,
                                  tile_mn=(tokens, 64), schedule=catalog.SWAP_AB, k_split=3)
        fn = catalog.compile_function(v, keep_ptx=True, kernel=kernel)
        self.assertEqual((kernel.threads_per_cta, kernel.consumer_regs, kernel.stages),
                         (512, 144 if tokens == 16 else 152, 12))
        self.assertTrue(re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{kernel.consumer_regs}\b", fn.__ptx__))
        self.assertFalse(re.search(r"\.local", fn.__ptx__))
        resources = structure.cubin_resources(fn.__cubin__)
        self.assertEqual((resources.registers, resources.frame_bytes, resources.stack_bytes), (128, 0, 0))

    def test_the_constructor_refuses_what_does_not_fit(self):
        from jax_blockgemm.kernels.sm90.ragged_swap_ab import HopperRaggedSwapAB

        with self.assertRaisesRegex(ValueError, "12 stages of 24576 bytes exceed 204800 bytes"):
            HopperRaggedSwapAB(token_rows=64, weight_warpgroups=1, k_split=3)  # three parts of 64 tokens
        with self.assertRaisesRegex(ValueError, "must leave each MMA warpgroup 144 registers"):
            HopperRaggedSwapAB(token_rows=16, weight_warpgroups=2, k_split=2)  # four MMA warpgroups


class HandlerTest(parameterized.TestCase):
    """ffi/ragged.cc's swap_ab attributes and buffer checks, through the module's test hooks."""

    @staticmethod
    def _buffers(l=1, t=300, n=72, k=160, g=5, max_items=8):
        out = ffi_cases._buffers(l, t, n, k, g, max_items)
        out = ffi_cases._replace(out, 0, dtype=BF16, dims=[l, t, -(-k // 256) * 256])
        out = ffi_cases._replace(out, 3, dims=[l * g, n, -(-k // 32)])  # sfb compact
        out = ffi_cases._replace(out, 7, dims=[l * g])  # alpha: one per weight
        return ffi_cases._replace(out, 2, dims=[0], address=0)

    def test_attributes(self):
        got = ext.parse_ragged_attributes(E4M3, BF16, "float8_e8m0fnu", 32, "k", BF16)
        self.assertTrue(got[-1])  # a_bf16
        self.assertFalse(ext.parse_ragged_attributes(E4M3, BF16, "float8_e8m0fnu", 32, "k")[-1])
        for args in ((E5M2, F32, "float8_e8m0fnu", 32, "k", BF16), (E4M3, F16, "float8_e8m0fnu", 32, "k", BF16),
                     (E4M3, F32, "float8_e8m0fnu", 32, "k", F32)):
            with self.assertRaisesRegex(ValueError, r"a_dtype .* is not supported"):
                ext.parse_ragged_attributes(*args)

    @parameterized.parameters((E8M0, 32), (E4M3, 16))
    def test_fp4_attributes(self, sf, block):
        """MXFP4 and NVFP4 weights take bf16 tokens too (a_bf16), with a float32 or bfloat16 C only."""
        self.assertTrue(ext.parse_ragged_attributes(FP4, F32, sf, block, "k", BF16)[-1])
        self.assertTrue(ext.parse_ragged_attributes(FP4, BF16, sf, block, "k", BF16)[-1])
        with self.assertRaisesRegex(ValueError, r"a_dtype .* is not supported"):
            ext.parse_ragged_attributes(FP4, F16, sf, block, "k", BF16)

    @parameterized.parameters((E8M0, 32), (E4M3, 16))
    def test_fp4_buffers(self, sf, block):
        """Packed FP4 codes (L, G, N, K/2) against tokens of K rounded up to 256 (K = 2 x b's rows, a multiple of
        32), the scales of K's blocks of `block` compact or in atoms (sf_atom 1)."""
        def fp4(k):
            out = ffi_cases._buffers(1, 300, 72, k, 5, 8, ab=U8, sf=U8 if sf == E8M0 else sf, v=block)
            out = ffi_cases._replace(out, 0, dtype=BF16, dims=[1, 300, -(-k // 256) * 256])
            out = ffi_cases._replace(out, 3, dims=[5, 72, -(-k // block)])
            return ffi_cases._replace(ffi_cases._replace(out, 2, dtype=U8, dims=[0], address=0), 7, dims=[5])

        check = lambda buffers: ext.check_ragged_buffers(buffers, FP4, F32, sf_dtype=sf, sf_vec_size=block,
                                                         a_dtype=BF16)
        message, dims = check(fp4(320))
        self.assertEqual(message, "")
        self.assertEqual(dims, (300, 72, 320, 1, 5, 8, 0))
        atoms = ffi_cases._replace(fp4(320), 3, dims=[5, 1, -(-320 // block // 4), 32, 4, 4])
        self.assertEqual(check(atoms), ("", (300, 72, 320, 1, 5, 8, 1)))
        cases = [(fp4(336), r"a multiple of 32 \(16-byte rows of packed FP4 codes\)"),
                 (ffi_cases._replace(fp4(320), 0, dims=[1, 300, 320]), r"expected K = 512: b's K rounded up to 256"),
                 (ffi_cases._replace(fp4(320), 1, dtype=E4M3), r"b is .*compiled for"),
                 (ffi_cases._replace(fp4(320), 3, dims=[5, 1, 1, 32, 4, 4]), r"sfb .* \(L\*G, N, ceil\(K/"),
                 (ffi_cases._replace(fp4(320), 3, dims=[4, 1, -(-320 // block // 4), 32, 4, 4]),
                  r"sfb .*or \(5, 1, \d+, 32, 4, 4\) \(L\*G, ceil\(N/128\)"),
                 (ffi_cases._replace(fp4(320), 3, dims=[5, 72, 320 // block + 1]),
                  rf"sfb .*expected \(5, 72, {320 // block}\)"),
                 (ffi_cases._replace(fp4(320), 2, dtype=E4M3), r"sfa .* uint8 of zero elements")]
        for buffers, pattern in cases:
            with self.subTest(pattern=pattern):
                self.assertRegex(check(buffers)[0], pattern)

    def test_buffers(self):
        message, dims = ext.check_ragged_buffers(self._buffers(), E4M3, F32, a_dtype=BF16)
        self.assertEqual(message, "")
        self.assertEqual(dims, (300, 72, 160, 1, 5, 8, 0))
        atoms = ffi_cases._replace(self._buffers(), 3, dims=[5, 1, 2, 32, 4, 4])  # K's 5 blocks in 2 atoms
        self.assertEqual(ext.check_ragged_buffers(atoms, E4M3, F32, a_dtype=BF16), ("", (300, 72, 160, 1, 5, 8, 1)))
        cases = [
            (ffi_cases._replace(self._buffers(), 0, dims=[1, 300, 160]), r"expected K = 256: b's K rounded up to 256"),
            (ffi_cases._replace(self._buffers(), 0, dtype=E4M3), r"bfloat16 tokens"),
            (ffi_cases._replace(self._buffers(), 2, dims=[1, 3, 2, 32, 4, 4], address=4096),
             r"sfa .* uint8 of zero elements"),
            (ffi_cases._replace(self._buffers(), 1, dims=[1, 5, 72, 168]), r"a multiple of 16"),
            (ffi_cases._replace(self._buffers(), 1, dims=[1, 5, 72]), r"b is .*expected \(L, G, N, K\) = \(1, G >= 1"),
            (ffi_cases._replace(self._buffers(), 1, dtype=E5M2), r"b is .*compiled for float8_e4m3fn codes"),
            (ffi_cases._replace(self._buffers(), 0, dims=[300, 256]), r"expected rank 3 \(L, T, K rounded up to 256\)"),
            (ffi_cases._replace(self._buffers(), 3, dims=[5, 1, 1, 32, 4, 4]),
             r"sfb .*expected \(5, 72, 5\) .*compact, or \(5, 1, 2, 32, 4, 4\)"),
            (ffi_cases._replace(self._buffers(), 3, dims=[5, 2, 2, 32, 4, 4]), r"sfb .*128x4 scale atom"),
            (ffi_cases._replace(self._buffers(), 3, dims=[5, 71, 5]), r"sfb .*compact"),
            (ffi_cases._replace(self._buffers(), 5, dims=[1, 300, 71]), r"c is .*expected \(1, 300, 72\)"),
            (ffi_cases._replace(self._buffers(), 7, dims=[1]),
             r"alpha is .*expected float32 \(5,\) \(L\*G,\): one per weight")]
        for buffers, pattern in cases:
            with self.subTest(pattern=pattern):
                self.assertRegex(ext.check_ragged_buffers(buffers, E4M3, F32, a_dtype=BF16)[0], pattern)


def _verdict(ok: bool):
    """A stand-in for the first-use self-check's verdict (the gate runs it in a child process on a GPU)."""
    return lambda v, device=None: gate.Verdict(key=v.key, device="NVIDIA H200", object_sha="0" * 64, ok=ok,
                                               detail="" if ok else "hung: killed after 120 s")


def _choice(ab=jnp.float8_e4m3fn, c=jnp.bfloat16, capabilities=("9.0",), t=512, g=4, n=256, k=512, checked=True):
    """dispatch.ragged_kernels for a "cutedsl" call, on the given local GPUs, the self-check passing (`checked`) or
    failing."""
    sa = jax.core.ShapedArray
    avals = [sa((1, t, k), ab), sa((1, g, n, k), ab), sa((1, t, k // 32), jnp.uint8), sa((1, g, n, k // 32), jnp.uint8),
             sa((1, g), jnp.int32), sa((1, g), jnp.int32)]
    with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=capabilities), \
            mock.patch.object(gate, "ensure_verified", side_effect=_verdict(checked)) as check:
        choice = dispatch.ragged_kernels(avals, c_dtype=np.dtype(c), sf_vec_size=32, k=k, implementation="cutedsl")
    return choice, [call.args[0].key for call in check.call_args_list]


class DispatchTest(absltest.TestCase):

    def test_which_calls_take_it(self):
        """MXFP8 E4M3 (arch.TABLE's ragged_swap_ab_formats) with f32 or bf16 C on an H200 (verified there: no
        self-check); while the schedule is listed as unverified, only once its first-use self-check passed; the
        block-scaled kernels otherwise."""
        swap_bf16 = "ragged.sm_90a.e4m3.bf16.sf32.t128x128.c1x1.swap_ab"
        with arch.overridden("9.0", unverified_schedules=()):
            choice, checked = _choice()
            self.assertEqual([v.key for v in choice.variants], [swap_bf16])
            self.assertEqual(checked, [])
            choice, _ = _choice(c=jnp.float32)
            self.assertEqual([v.key for v in choice.variants],
                             ["ragged.sm_90a.e4m3.f32.sf32.t128x128.c1x1.swap_ab"])
            with arch.overridden("9.0", ragged_swap_ab_formats=()):  # a format the table does not give it
                self.assertEqual({v.schedule for v in _choice()[0].variants}, {""})
        with arch.overridden("9.0", unverified_schedules=(catalog.SWAP_AB,)):
            choice, checked = _choice()
            self.assertEqual(([v.key for v in choice.variants], checked), ([swap_bf16], [swap_bf16]))
            # the self-check failed (a wrong result, a hang): the block-scaled kernel, which ran correct on the H200
            choice, checked = _choice(checked=False)
            self.assertEqual({v.schedule for v in choice.variants}, {""})
            self.assertEqual(checked, [swap_bf16])
        # other formats and C dtypes, and no GPU (a program lowered for any target): the block-scaled kernels
        # (MXFP4 and NVFP4: test_fp4_lowered_call)
        for kwargs in (dict(ab=jnp.float8_e5m2), dict(c=jnp.float16), dict(capabilities=None)):
            choice, checked = _choice(**kwargs)
            self.assertEqual({v.schedule for v in choice.variants}, {""}, kwargs)
            self.assertEqual(checked, [], kwargs)

    def test_few_tokens_take_the_smallest_decode_tile_that_holds_them(self):
        """MoE decode (all T tokens within 64, over many experts): every group fits a decode tile, so the swap_ab
        kernel runs on the smallest that holds T; from 65 tokens on, the MoE tile."""
        with arch.overridden("9.0", unverified_schedules=()):
            for t, tile in ((1, "t16x64.c1x1.swap_ab.k3"), (16, "t16x64.c1x1.swap_ab.k3"),
                            (17, "t32x64.c1x1.swap_ab.k3"), (32, "t32x64.c1x1.swap_ab.k3"),
                            (33, "t64x64.c1x1.swap_ab.k2"), (64, "t64x64.c1x1.swap_ab.k2"),
                            (65, "t128x128.c1x1.swap_ab")):
                choice, _ = _choice(t=t, g=256)
                self.assertEqual([v.key for v in choice.variants], [f"ragged.sm_90a.e4m3.bf16.sf32.{tile}"], t)

    def test_constants_agree(self):
        """The swap_ab names and sizes each layer keeps (the kernels import cutlass, the lowering must not): the
        schedule, the tokens' k-tile (also the dequantize kernel's permuted tile), K padding."""
        from jax_blockgemm import ffi_lowering
        from jax_blockgemm.kernels import dequantize
        from jax_blockgemm.kernels.sm90 import ragged_swap_ab

        self.assertEqual(ffi_lowering.SWAP_AB, catalog.SWAP_AB)
        self.assertEqual({swap_ab_layout.SWAP_AB_K_PAD}, {ragged_swap_ab.K_PAD})
        self.assertEqual(swap_ab_layout.SWAP_AB_K_TILE, dequantize.SWAP_AB_TILE)

    def test_catalog(self):
        swapped = [v for v in catalog.CATALOG if v.schedule == catalog.SWAP_AB]
        tiles = sorted(((128, 128, 1), *catalog.SWAP_AB_DECODE_TILES))
        formats = sorted([(E4M3, 32, E8M0), (FP4, 32, E8M0), (FP4, 16, E4M3)])
        self.assertEqual(sorted((v.op, v.arch, v.ab_dtype, v.sf_vec_size, v.sf_dtype, v.c_dtype,
                                 (*v.tile_mn, v.k_split)) for v in swapped if v.op == "ragged"),
                         [("ragged", "sm_90a", *fmt, c, tile)
                          for fmt in formats for c in (BF16, F32) for tile in tiles])
        self.assertEqual([(v.arch, v.ab_dtype, v.c_dtype) for v in swapped if v.op == "dequantize"],
                         [("sm_90a", E4M3, BF16)])

    def test_lowered_call(self):
        """The custom call takes bf16 tokens of K rounded up to 256 (a fusion of the dequantization and the gather
        before it), empty token scales, and a_dtype bfloat16."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(gate, "ensure_verified", side_effect=_verdict(True)):
            text = lowering_cases._lowered(t=300, g=5, n=72, k=160)
        call = next(line for line in text.splitlines() if "@jbg_ragged_gemm_amax" in line)
        self.assertIn('a_dtype = "bfloat16"', call)
        self.assertIn('ab_dtype = "float8_e4m3fn"', call)
        self.assertIn("amax_batches = 1", call)  # ragged_gemm_amax returns amax: L = 1 batch (the tally's)
        self.assertRegex(call, r"\(tensor<1x300x256xbf16>, tensor<1x5x72x160xf8E4M3FN>, tensor<1x0xui8>, "
                               r"tensor<5x72x5xui8>")  # the weights' scales compact: (L*G, N, K/32)
        self.assertRegex(call, r"swap_ab")
        self.assertNotIn("jbg_dequantize_mxfp8", text)  # K = 160 needs padding: XLA's gather pads it

    def test_fp4_lowered_call(self):
        """MXFP4 and NVFP4 on an H200 where arch.TABLE's ragged_swap_ab_formats names them: the swap_ab object, bf16
        tokens of K rounded up to 256 (XLA unpacks, dequantizes and gathers them in the FP4 order; no dequantize
        kernel, which takes MXFP8), the packed codes (L, G, N, K/2), the weights' compact scales (E4M3 for NVFP4) and
        an empty sfa; a float16 C keeps the block-scaled kernel, as do both formats where the table leaves them out."""
        for fmt, sf, kb in (("mxfp4", "ui8", 16), ("nvfp4", "f8E4M3FN", 32)):
            with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                    mock.patch.object(gate, "ensure_verified", side_effect=_verdict(True)):
                with arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3",)):
                    left_out = lowering_cases._lowered(fmt, t=300, g=5, n=72, k=512)
                with arch.overridden("9.0", ragged_swap_ab_formats=("mxfp8_e4m3", "mxfp4", "nvfp4")):
                    text = lowering_cases._lowered(fmt, t=300, g=5, n=72, k=512)
                    f16 = lowering_cases._lowered(fmt, t=300, g=5, n=72, k=512, c_dtype=jnp.float16)
            left_out_call = next(line for line in left_out.splitlines() if "@jbg_ragged_gemm_amax" in line)
            self.assertNotIn("swap_ab", left_out_call)
            call = next(line for line in text.splitlines() if "@jbg_ragged_gemm_amax" in line)
            self.assertIn('a_dtype = "bfloat16"', call)
            self.assertIn('ab_dtype = "float4_e2m1fn"', call)
            self.assertIn("swap_ab", call)
            self.assertRegex(call, rf"\(tensor<1x300x512xbf16>, tensor<1x5x72x256xui8>, tensor<1x0xui8>, "
                                   rf"tensor<5x72x{kb}x{sf}>")
            self.assertNotIn("jbg_dequantize_mxfp8", text)
            f16_call = next(line for line in f16.splitlines() if "@jbg_ragged_gemm_amax" in line)
            self.assertNotIn("swap_ab", f16_call)

    def test_lowered_call_with_the_dequantize_kernel(self):
        """K a multiple of 256: the tokens become bf16 in the kernel's column order by one dequantize launch (its
        swap_ab object) that feeds the ragged call directly, with no gather of tokens; where that kernel's self-check
        failed, XLA's dequantization and gather instead."""
        with mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                mock.patch.object(gate, "ensure_verified", side_effect=_verdict(True)):
            text = lowering_cases._lowered(t=300, g=5, n=72, k=512)
            # both swap_ab objects unverified, the ragged kernel's self-check passing and the dequantize one's not
            only_ragged = lambda v, device=None: _verdict(v.op == "ragged")(v)
            with arch.overridden("9.0", unverified_schedules=(catalog.SWAP_AB,)), \
                    mock.patch.object(gate, "ensure_verified", side_effect=only_ragged):
                fallback = lowering_cases._lowered(t=300, g=5, n=72, k=512)
        (dequant,) = [line for line in text.splitlines() if "@jbg_dequantize_mxfp8" in line]
        self.assertTrue('function_prefixes = "jbg_dequantize_sm_90a_e4m3_bf16_sf32_t1x16_c1x1_swap_ab"' in dequant,
                        "the call carries the swap_ab dequantize object only")
        signature = "(tensor<1x300x512xf8E4M3FN>, tensor<1x300x16xui8>) -> tensor<1x300x512xbf16>"
        self.assertTrue(dequant.endswith(signature), dequant[-200:])
        call = next(line for line in text.splitlines() if "@jbg_ragged_gemm_amax" in line)
        self.assertTrue("(tensor<1x300x512xbf16>, tensor<1x5x72x512xf8E4M3FN>, tensor<1x0xui8>" in call, call[-300:])
        token_gathers = lambda program: [line for line in program.splitlines() if "gather" in line and "bf16" in line]
        self.assertEqual(token_gathers(text), [])  # (the item tables' small int32 gathers stay)
        self.assertNotIn("jbg_dequantize_mxfp8", fallback)
        self.assertEqual(len(token_gathers(fallback)), 1)

    def test_few_tokens_take_dequantized_tokens_in_their_tiles_order(self):
        """Decode-sized ragged calls (a decode step over many experts): at most 16 tokens in all run the 16-token
        tile, which orders the tokens itself, so the dequantize kernel's plain object writes them in their own order;
        17 to 64 run the 32- or 64-token tile, whose k-tiles span 128 columns as the MoE tile's do, so its swap_ab
        object writes them in that order. Either way nothing gathers them."""
        for t, dequantize_object, tile in ((8, "", "t16x64"), (40, "_swap_ab", "t64x64")):
            with self.subTest(t=t), mock.patch.object(dispatch, "local_cuda_capabilities", return_value=("9.0",)), \
                    mock.patch.object(gate, "ensure_verified", side_effect=_verdict(True)):
                text = lowering_cases._lowered(t=t, g=4, n=72, k=512)
                (dequant,) = [line for line in text.splitlines() if "@jbg_dequantize_mxfp8" in line]
                prefix = f"jbg_dequantize_sm_90a_e4m3_bf16_sf32_t1x16_c1x1{dequantize_object}"
                self.assertIn(f'function_prefixes = "{prefix}"', dequant)
                call = next(line for line in text.splitlines() if "@jbg_ragged_gemm_amax" in line)
                self.assertIn(tile, call)
                self.assertTrue(f"(tensor<1x{t}x512xbf16>, tensor<1x4x72x512xf8E4M3FN>, tensor<1x0xui8>" in call,
                                call[-300:])
                self.assertEqual([line for line in text.splitlines() if "gather" in line and "bf16" in line], [])


if __name__ == "__main__":
    absltest.main()
