"""Paged attention: a layer the models use. KV write by slot mapping; SDPA over gathered blocks on CPU,
a Triton kernel reading block tables on CUDA."""
