"""How far the int8 KV cache moves SmolLM2's log-probabilities: the numbers in
docs/engine_options.md ("int8 KV cache", Accuracy).

Scores one fixed text with two engines that differ only in ``kv_cache_dtype`` (``auto``:
float32, and ``int8``), each with one prefill (``LLMEngine.prompt_logits``), and compares
the float32 log-softmax of every position's logits:

- ``|Δlogprob|`` over each position's 20 most likely tokens under float32 (what a request
  can ask for: ``max_logprobs`` is 20), max and mean;
- ``|Δlogprob|`` of each position's next token in the text (what ``echo`` + ``logprobs``
  and lm-eval's loglikelihood read), max and mean;
- ``|Δlogprob|`` over the whole vocabulary, max and mean (the far tail included);
- top-1 agreement: positions where both put the same token first.

Prints one JSON object. Deterministic (no sampling); a few seconds on a CPU::

    python benchmarks/kv_int8_logprobs.py [--model weights/SmolLM2-135M-Instruct] [--text FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# A fixed English paragraph: about 60 SmolLM2 tokens once the chat template is left out.
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small oil "
        "lamp and a notebook. He wrote down the colour of the sky, the height of the waves and the "
        "names of the ships that passed, because his grandfather had done the same for forty years.")
TOP_K = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``[S, V]`` float32 logits -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def measure(model: Path, text: str) -> dict:
    """The figures listed in the module docstring for ``text`` scored by ``model``."""
    from refengine.core.engine import LLMEngine

    engines = {dtype: LLMEngine(model, kv_cache_dtype=dtype, log_stats=False) for dtype in ("auto", "int8")}
    ids = engines["auto"].tokenizer.encode(text, add_special_tokens=True)
    ref, test = (log_softmax(e.prompt_logits(ids)) for e in engines.values())
    diff = np.abs(test - ref)
    rows = np.arange(len(ids))
    top = np.argsort(-ref, axis=-1, kind="stable")[:, :TOP_K]
    top_diff = np.take_along_axis(diff, top, axis=-1)
    next_diff = diff[rows[:-1], ids[1:]]  # the last row predicts past the text
    def at(position: int, token: int) -> dict:
        return {"position": position, "token_id": token, "float32_logprob": float(ref[position, token]),
                "int8_logprob": float(test[position, token])}

    worst = np.unravel_index(np.argmax(top_diff), top_diff.shape)
    worst_next = int(np.argmax(next_diff))
    return {
        "model": str(model), "num_tokens": len(ids),
        "top20_max_abs_delta": float(top_diff.max()), "top20_mean_abs_delta": float(top_diff.mean()),
        "top20_worst": at(int(worst[0]), int(top[worst])),
        "next_token_max_abs_delta": float(next_diff.max()), "next_token_mean_abs_delta": float(next_diff.mean()),
        "next_token_worst": at(worst_next, int(ids[worst_next + 1])),
        "vocab_max_abs_delta": float(diff.max()), "vocab_mean_abs_delta": float(diff.mean()),
        "top1_agreement": float((ref.argmax(-1) == test.argmax(-1)).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "weights" / "SmolLM2-135M-Instruct")
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 file to score instead of the fixed paragraph")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8") if args.text is not None else TEXT
    print(json.dumps(measure(args.model, text), indent=2))


if __name__ == "__main__":
    main()
