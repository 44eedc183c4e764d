"""File formats: the GGUF reader, safetensors and config loading, GGUF conversion."""
