"""Blackwell (sm_100a) kernels: one module per operation (compiled and checked here; no Blackwell GPU has run them).

The support surface lives here, free of CuTeDSL imports, so that the catalog can list the variants without
importing the kernel modules (a DSL release that breaks a Blackwell helper must not take the Hopper kernels down).
"""

# The seed's gemm_amax surface: TILE_M 128 (256, the two-CTA MMA, is disabled in the seed too), TILE_N 128 or
# 256; cluster sides 1, 2 or 4 (scale-factor multicast reaches at most 4 CTAs).
SUPPORTED_TILES_MN = ((128, 128), (128, 256))
SUPPORTED_CLUSTERS_MN = tuple((cm, cn) for cm in (1, 2, 4) for cn in (1, 2, 4))

# Elements of A and B along K per k-tile (4 MMAs): the kernel checks its MMA against it; the self-check sizes K by it.
TILE_K = {"float8_e4m3fn": 128, "float8_e5m2": 128, "float4_e2m1fn": 256}
MAX_AB_STAGES = 8  # the most shared-memory operand stages a kernel takes, however many fit
C_STAGES = 2  # gemm_amax's shared-memory C sub-tiles (one being stored by TMA while the next is written)

# Device facts the kernels are compiled against. The persistent grid is not one of them: the handler reads the
# GPU's SM count (and, for clusters, how many fit at once) when it loads a kernel and passes it in.
SMEM_CAPACITY = 232448  # bytes of shared memory per CTA on sm_100 (227 KiB)
TMEM_COLUMNS = 512  # tensor-memory columns per SM (128 lanes x 512 x 32 bit)
