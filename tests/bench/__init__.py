"""`refengine bench` and the benchmark scripts."""
