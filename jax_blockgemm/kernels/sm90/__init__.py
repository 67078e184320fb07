"""Hopper (sm_90a) kernels: one module per operation."""
