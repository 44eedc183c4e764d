"""The OpenAI-compatible server: the API, its limits and faults, schema fuzzing."""
