"""Blackwell (sm_100a) kernels: one module per operation (compiled and checked here; no Blackwell GPU has run them)."""
