"""CuTeDSL kernels for gemm_amax: the catalog of compiled variants (`catalog`), their shared device helpers
(`common`), and one module per kernel (`hopper_gemm_amax`). Importing `catalog` needs nvidia-cutlass-dsl."""
