"""The INT4 GEMM torch ops, one per bucket, and the rules they enforce (validation, config
spaces, launch-parameter candidates, grids)."""
