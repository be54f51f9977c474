"""Quantized weights: the codes (GGUF's and stepahead's), the packed linears and head that run them,
and the loader step that swaps them into a built model."""
