"""Tensor parallelism (MPI workers) and data parallelism (Ray Serve replicas)."""
