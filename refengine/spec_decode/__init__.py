"""Speculative decoding: cheap proposals, verified exactly by the target model.

A proposer guesses the next ``k`` tokens of a decoding sequence; the target scores all of
them in one forward pass (an ordinary ``1 + k``-token chunk under the attention contract)
and the rejection sampler keeps a prefix of them plus one token of its own, so the output
is distributed exactly as without speculation (token for token the same when greedy, and
for any seeded request with deterministic proposals such as the n-gram lookup).

- ``config.py``: ``SpeculativeConfig``, the validated ``speculative_config`` engine option.
- ``ngram.py``: proposals copied from the sequence itself (prompt lookup).
- ``draft_model.py``: proposals from a smaller model; its KV cache shares the target's block tables.
- ``rejection.py``: the acceptance rules (Leviathan et al. 2023 §2.3, Chen et al. 2023 Alg. 2), on
  uniforms keyed by output position.
- ``decoder.py``: ``SpecDecoder``, what the scheduler and the engine call each step.
"""

from refengine.spec_decode.config import SpeculativeConfig
from refengine.spec_decode.decoder import SpecDecodeStats, SpecDecoder
from refengine.spec_decode.draft_model import DraftModelProposer, Proposal
from refengine.spec_decode.ngram import propose_ngram
from refengine.spec_decode.rejection import rejection_sample, verify_tokens

__all__ = ["SpeculativeConfig", "SpecDecoder", "SpecDecodeStats", "DraftModelProposer", "Proposal",
           "propose_ngram", "rejection_sample", "verify_tokens"]
