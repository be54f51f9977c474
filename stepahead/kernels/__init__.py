"""stepahead's own CPU kernels, compiled on first use (see cpu_build.py)."""
