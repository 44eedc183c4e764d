"""Batch-1 speed, refengine vs transformers, in one run: a prefill and N decode steps.

Both engines get the same prompt (the first ``--prompt-len`` tokens of the benchmark text
in ``refengine/bench/data``), run float32 on the CPU (or ``--device``), greedy:

- prefill time: the prompt through the model up to the first token, seconds.
  refengine: TTFT of one request (``max_num_batched_tokens >= prompt_len``, so the prompt
  is one step). transformers: one ``model(input_ids, use_cache=True)`` forward plus argmax.
- decode: ``--decode-steps`` more tokens, one forward each; tokens/s =
  steps / (time of last token - time of first token).

transformers runs a plain loop over ``model(...)`` with its KV cache,
which is what ``generate`` does at batch 1 minus its bookkeeping. Each measurement is
repeated ``--repeats`` times after one warm-up; the median is reported.

``--busy-core``: refengine once more with a second process keeping one core busy (a
Python busy loop this benchmark starts, and stops when done), after a warm-up request
so the engine has seen the load (``refengine.cpu.threads.adapt_threads``); both figures and
their ratio are reported.

    python benchmarks/bench_single.py [--model DIR] [--prompt-len 512] [--decode-steps 128] [--busy-core] [--json FILE]
        [--performance-md docs/PERFORMANCE.md]
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

import click

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from refengine.bench.options import output_path, performance_md_option  # noqa: E402
from refengine.bench.report import busy_warning, environment, write_json, write_performance  # noqa: E402
from refengine.bench.workload import load_corpus  # noqa: E402
from refengine.engine_args import resolve_model_dir  # noqa: E402


def bench_refengine(model_dir: str, prompt_ids: list[int], decode_steps: int, repeats: int, device: str,
                    attention_backend: str | None = None, busy_core: bool = False) -> dict:
    """Prefill seconds and decode tokens/s of refengine at batch 1 (medians over repeats);
    with ``busy_core``, also under ``"busy_core"`` with another process spinning on one core."""
    from refengine import LLM, SamplingParams

    n = len(prompt_ids)
    max_len = -(-(n + decode_steps + 1) // 16) * 16
    llm = LLM(model=model_dir, device=device, attention_backend=attention_backend, block_size=16, max_num_seqs=1,
              max_num_batched_tokens=max(n, 16),
              enable_chunked_prefill=True, max_model_len=max_len, log_stats=False,
              enable_prefix_caching=False)  # every repeat prefills the whole prompt
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt_ids[:16]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)  # warm-up

    def measure() -> dict:
        prefill, decode, tokens = [], [], None
        for _ in range(repeats):
            out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
            m = out.metrics
            prefill.append(m.ttft)
            decode.append(decode_steps / (m.token_times[-1] - m.token_times[0]))
            tokens = list(out.outputs[0].token_ids)
        return {"prefill_s": statistics.median(prefill), "decode_tok_per_s": statistics.median(decode),
                "prefill_s_all": prefill, "decode_tok_per_s_all": decode, "token_ids": tokens}

    quiet = measure()
    if busy_core:
        import subprocess

        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.5)  # the engine's thread count looks back one second (refengine/cpu/threads.py)
            llm.generate([prompt_ids[:64]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
            quiet["busy_core"] = measure()
        finally:
            spinner.kill()
            spinner.wait()
    return quiet


def bench_transformers(model_dir: str, prompt_ids: list[int], decode_steps: int, repeats: int, device: str) -> dict:
    """The same figures for transformers (float32, eager loop over the model with its KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()
    # transformers 5 names the KV-cache argument and output `cache`; 4.x `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(ids: list[int], steps: int):
        x = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=x, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = [int(tok)]  # int() syncs a GPU, so the time is real
            t_first = time.perf_counter()
            cache = getattr(out, cache_arg)
            for _ in range(steps):
                out = model(input_ids=tok, use_cache=True, **{cache_arg: cache})
                cache = getattr(out, cache_arg)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(tok))
            t_last = time.perf_counter()
        return t_first - t0, (steps / (t_last - t_first)) if steps else None, tokens

    run(prompt_ids[:16], 1)  # warm-up
    prefill, decode, tokens = [], [], None
    for _ in range(repeats):
        p, d, tokens = run(prompt_ids, decode_steps)
        prefill.append(p)
        decode.append(d)
    return {"prefill_s": statistics.median(prefill), "decode_tok_per_s": statistics.median(decode),
            "prefill_s_all": prefill, "decode_tok_per_s_all": decode, "token_ids": tokens,
            "torch_num_threads": torch.get_num_threads()}


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@click.command()
@click.option("--model", default=lambda: str(resolve_model_dir(None)),
              show_default="$REFENGINE_MODEL or weights/SmolLM2-135M-Instruct")
@click.option("--prompt-len", type=int, default=512, show_default=True, help="Prefill length in tokens.")
@click.option("--decode-steps", type=int, default=128, show_default=True, help="Decode steps after the first token.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Timed repeats (median reported).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--attention-backend", default=None, help="numpy, numba, cuda (default: follows the device)")
@click.option("--skip-transformers", is_flag=True, help="Only time refengine.")
@click.option("--busy-core", is_flag=True, help="Also time refengine with another process keeping one core busy.")
@click.option("--json", "json_path", default=None, callback=output_path, help="Write the figures here.")
@performance_md_option
def main(model, prompt_len, decode_steps, repeats, device, attention_backend, skip_transformers, busy_core,
         json_path, performance_md):
    """Batch-1 prefill time and decode tokens/s, refengine vs transformers."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    ids = tok.encode(load_corpus(), add_special_tokens=False).ids
    if len(ids) < prompt_len:
        ids = (ids * (prompt_len // len(ids) + 1))
    prompt_ids = ids[:prompt_len]

    if busy_warning():
        click.echo(busy_warning())
    click.echo(f"model {model}, prompt {prompt_len} tokens, {decode_steps} decode steps, batch 1, {device}"
               f"{', attention ' + attention_backend if attention_backend else ''}")
    ours = bench_refengine(model, prompt_ids, decode_steps, repeats, device, attention_backend, busy_core)
    click.echo(f"refengine:    prefill {ours['prefill_s'] * 1000:9.1f} ms   decode {ours['decode_tok_per_s']:8.2f} tok/s")
    if busy_core:
        busy = ours["busy_core"]
        click.echo(f"refengine, one core busy: prefill {busy['prefill_s'] * 1000:9.1f} ms   decode "
                   f"{busy['decode_tok_per_s']:8.2f} tok/s ({busy['decode_tok_per_s'] / ours['decode_tok_per_s']:.0%} "
                   "of the quiet decode)")
    report = {"model": model, "prompt_len": prompt_len, "decode_steps": decode_steps, "device": device,
              "attention_backend": attention_backend, "repeats": repeats, "refengine": ours}
    if not skip_transformers:
        theirs = bench_transformers(model, prompt_ids, decode_steps, repeats, device)
        click.echo(f"transformers: prefill {theirs['prefill_s'] * 1000:9.1f} ms   "
                   f"decode {theirs['decode_tok_per_s']:8.2f} tok/s   (torch threads {theirs['torch_num_threads']})")
        ratio_prefill = theirs["prefill_s"] / ours["prefill_s"]
        ratio_decode = ours["decode_tok_per_s"] / theirs["decode_tok_per_s"]
        same = matching_prefix(ours["token_ids"], theirs["token_ids"])
        click.echo(f"refengine vs transformers: prefill x{ratio_prefill:.2f} as fast, decode x{ratio_decode:.2f} "
                   f"as fast (>1: refengine faster); greedy tokens agree for the first {same}/{decode_steps + 1}")
        report.update(transformers=theirs, prefill_speed_ratio=ratio_prefill, decode_speed_ratio=ratio_decode,
                      greedy_matching_prefix=same)
    report["environment"] = environment()
    if json_path:
        write_json(json_path, report)
        click.echo(f"wrote {json_path}")
    write_performance(performance_md, "benchmarks/bench_single.py", [
        f"Batch 1, {os.path.basename(model.rstrip('/'))}, {device}: a {prompt_len}-token prompt, then {decode_steps} "
        f"greedy decode steps, prefix caching off; median of {repeats}.", performance_table(report)], echo=click.echo)


def performance_table(report: dict) -> tuple[list[str], list[list]]:
    """The report's figures as ``(headers, rows)``: prefill ms and decode tokens/s per side,
    then the ratios (> 1: refengine faster)."""
    ours = report["refengine"]
    rows = [["refengine", 1e3 * ours["prefill_s"], ours["decode_tok_per_s"]]]
    if "busy_core" in ours:
        busy = ours["busy_core"]
        rows.append([f"refengine, one core busy ({busy['decode_tok_per_s'] / ours['decode_tok_per_s']:.0%} of quiet)",
                     1e3 * busy["prefill_s"], busy["decode_tok_per_s"]])
    if "transformers" in report:
        theirs = report["transformers"]
        rows.append(["transformers", 1e3 * theirs["prefill_s"], theirs["decode_tok_per_s"]])
        rows.append(["refengine / transformers (speed)", f"x{report['prefill_speed_ratio']:.2f}",
                     f"x{report['decode_speed_ratio']:.2f}"])
    return ["", f"prefill {report['prompt_len']} tokens, ms", "decode tok/s"], rows


if __name__ == "__main__":
    main()
