"""MKL's reproducible mode, set before anything in the process calls MKL (imported first by the package).

Without it MKL may take a different summation order depending on which OpenMP thread computes a slice
and on memory alignment: the same attention slab came out different in its last bits on the worker's
second thread, so a token's attention depended on how many rows shared its SDPA call. MKL_CBWR=AUTO
keeps the code path MKL picks for this CPU and makes it reproducible (and was no slower: figures in
docs/BENCHMARKS.md, section 14.4, "MKL's reproducible mode"). MKL reads the variable once, on its first
call; a value the user set is kept, and child processes (the worker) inherit it.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO")
