"""Sampling: the sampler, SamplingParams, logit bias, logprobs, structured outputs, beam search."""
