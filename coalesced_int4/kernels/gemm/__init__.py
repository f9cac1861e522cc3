"""The Triton kernels of the two GEMM families, each beside its launcher: W4A8 (M = 1-4), W4A16
(M = 8-64) and the split-K reduction they share."""
