"""jax_blockgemm: fused block-scaled GEMM kernels as JAX primitives."""
