"""Speculative decoding: the proposers, the acceptance rule, the scheduler's side, the engine."""
