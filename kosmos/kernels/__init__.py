"""Triton kernels: the persistent GEMM core (gemm.py) and the fused kernels built on it.

Import the modules themselves (e.g. ``from kosmos.kernels.gemm import gemm``); nothing is imported here.
"""
