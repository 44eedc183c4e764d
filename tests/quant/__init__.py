"""Quantized weights: int8, AWQ/GPTQ int4, GGUF block types and Q8_0 activations."""
