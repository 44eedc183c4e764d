"""What each stored precision costs in accuracy: perplexity and KL divergence on the bench
corpus, every format of the default model against its float32 weights.

Rows (``refengine eval perplexity`` with ``--baseline``, llama.cpp's method: windows of
``--ctx`` tokens, the second half of each scored):

* the GGUF file as stored (Q4_1 layers, Q8_0 embedding) against the same file
  dequantized to float32: the kernels' cost (the float32 weights *are* the dequantized
  blocks, so this should be rounding only);
* the same file with ``activation_dtype="q8_0"`` (llama.cpp's Q8_0 activations) against it;
* the same file with Q8_0 activations and ``kv_cache_dtype="float16"``: llama.cpp's CPU
  numerics (its f16 KV cache);
* ``quantization="int8"`` (per-channel int8 of the float32 weights);
* ``kv_cache_dtype="float16"`` (IEEE half KV cache), float32 weights;
* ``kv_cache_dtype="int8"`` (per-token, per-head int8 KV cache), float32 weights;
* both int8 together.

Prints a Markdown table (for the README) and, with ``--performance-md``, writes it as a
section of ``docs/PERFORMANCE.md`` with the machine and the command::

    python benchmarks/perplexity_table.py --performance-md docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from refengine import LLM  # noqa: E402
from refengine.bench.report import markdown_table, write_performance  # noqa: E402
from refengine.eval.perplexity import compare, load_text, tokenize  # noqa: E402

HF_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
GGUF = ROOT / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"

#: row name -> (engine options, baseline options)
ROWS = {
    "GGUF Q4_1 as stored (vs the same blocks dequantized)": ({"model": GGUF}, {"model": GGUF, "dtype": "float32"}),
    "GGUF Q4_1, Q8_0 activations (vs the same blocks dequantized)": (
        {"model": GGUF, "activation_dtype": "q8_0"}, {"model": GGUF, "dtype": "float32"}),
    "GGUF Q4_1, Q8_0 activations, float16 KV cache (llama.cpp's numerics)": (
        {"model": GGUF, "activation_dtype": "q8_0", "kv_cache_dtype": "float16"}, {"model": GGUF, "dtype": "float32"}),
    "int8 weights": ({"model": HF_DIR, "quantization": "int8"}, {"model": HF_DIR}),
    "float16 KV cache": ({"model": HF_DIR, "kv_cache_dtype": "float16"}, {"model": HF_DIR}),
    "int8 KV cache": ({"model": HF_DIR, "kv_cache_dtype": "int8"}, {"model": HF_DIR}),
    "int8 weights + int8 KV cache": ({"model": HF_DIR, "quantization": "int8", "kv_cache_dtype": "int8"},
                                     {"model": HF_DIR}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--performance-md", default=None)
    args = parser.parse_args()
    text = load_text()
    headers = ["format", "PPL", "float32 PPL", "ΔPPL", "mean KLD", "p99 KLD", "KLD by quarter of the window",
               "top-1 agreement"]
    rows, ntok = [], 0
    for name, (opts, base_opts) in ROWS.items():
        common = {"num_kv_blocks": 2 * args.ctx // 16 + 2, "block_size": 16, "log_stats": False}
        llm, base = LLM(**opts, **common), LLM(**base_opts, **common)
        ids = tokenize(llm.llm_engine, text)
        r = compare(llm, base, ids, ctx=args.ctx)
        ntok = r.model.num_tokens
        rows.append([name, f"{r.model.ppl:.4f}", f"{r.baseline.ppl:.4f}", f"{r.delta_ppl_pct:+.2f}%",
                     f"{r.kld_mean:.5f}", f"{r.kld_p99:.4f}", " / ".join(f"{q:.4f}" for q in r.kld_by_quarter),
                     f"{100 * r.top1_agreement:.1f}%"])
        print(f"{name}: done ({r.model.seconds + r.baseline.seconds:.0f} s)", file=sys.stderr)
        del llm, base
    table = markdown_table(headers, rows)
    print(table)
    write_performance(args.performance_md, "perplexity and KL divergence by format", [
        f"SmolLM2-135M-Instruct on the bench corpus (`refengine/bench/data`), windows of {args.ctx} tokens, "
        f"the second half of each scored ({ntok} tokens; llama.cpp's `perplexity` method, "
        f"`refengine eval perplexity --baseline`). KLD is KL(float32 || format) in nats per position.",
        (headers, rows)], echo=lambda s: print(s, file=sys.stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
