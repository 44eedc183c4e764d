"""Model families against transformers: tiny random-weight models, the real models, RoPE scaling."""
