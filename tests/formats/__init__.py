"""File formats: the GGUF reader, GGUF models run as stored, GGUF conversion, broken model directories."""
