"""Blackwell (sm_100a) kernels: one module per operation (compiled and checked here; no Blackwell GPU has run them).

The support surface lives here, free of CuTeDSL imports, so that the catalog can list the variants without
importing the kernel modules (a DSL release that breaks a Blackwell helper must not take the Hopper kernels down).
"""

# The seed's gemm_amax surface: TILE_M 128 (256, the two-CTA MMA, is disabled in the seed too), TILE_N 128 or
# 256; cluster sides 1, 2 or 4 (scale-factor multicast reaches at most 4 CTAs).
SUPPORTED_TILES_MN = ((128, 128), (128, 256))
SUPPORTED_CLUSTERS_MN = tuple((cm, cn) for cm in (1, 2, 4) for cn in (1, 2, 4))

# Device facts the kernels are compiled against. The persistent grid is sized for a B200 (148 SMs) at compile time,
# since the ABI carries no device facts. On a GPU with fewer SMs the extra CTAs simply wait for a free SM: tiles are
# independent, so results do not change.
SM_COUNT = 148
SMEM_CAPACITY = 232448  # bytes of shared memory per CTA on sm_100 (227 KiB)
TMEM_COLUMNS = 512  # tensor-memory columns per SM (128 lanes x 512 x 32 bit)
