"""The core loop: engine, scheduler, KV cache and prefix cache, invariance, metrics, memory."""
