"""The ``transformers`` baseline: the same token ids through ``generate``, in the same run.

``run_transformers`` feeds the requests to ``AutoModelForCausalLM.generate`` (greedy, left
padding) in batches of ``batch_size`` requests, the way a user would batch it by hand:
each batch runs to its longest output (``min_new_tokens = max_new_tokens`` so EOS cannot
end it early). Only the requested tokens count toward its throughput. Per-token times come
from a logits processor that stamps each generation step; all requests of a batch arrive
when the batch starts and finish when ``generate`` returns.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from typing import Sequence

from refengine.bench.driver import RequestResult, RunResult
from refengine.bench.workload import BenchRequest
from refengine.metrics import RequestMetrics

# transformers pads each batch to its longest prompt and output, so a user batches modestly.
HF_DEFAULT_BATCH = 32
MISSING_TRANSFORMERS = ("--compare-transformers needs torch and transformers, which are not installed: "
                        "pip install 'refengine[compare]'")


def transformers_available() -> bool:
    """Whether torch and transformers can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def run_transformers(model_dir: str, requests: Sequence[BenchRequest], *, batch_size: int,
                     progress: bool = True, label: str = "transformers", device: str = "cpu",
                     dtype: str = "float32") -> RunResult:
    """The same requests through ``transformers`` ``generate`` (greedy, left padding).

    Batches are consecutive slices of ``batch_size`` requests (no sorting), each run to its
    longest output. See the module docstring for how times are measured.

    Args:
        device: torch device (``"cpu"``, ``"cuda"``); on CUDA each step stamp synchronizes.
        dtype: torch dtype name for the weights (``"float32"``, ``"float16"``, ``"bfloat16"``).
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    pad_id = _pad_token_id(model)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    class StepClock(LogitsProcessor):
        """Stamps ``time.monotonic()`` at each generation step (after the forward, before the pick)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            sync()
            self.times.append(time.monotonic())
            return scores

    def generate(batch: Sequence[BenchRequest], clock: StepClock):
        # Left padding, as `tokenizer(texts, padding=True)` with padding_side="left" gives:
        # pad ids on the left, attention_mask 0 there, so every row ends at the same column.
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            input_ids[j, width - n:] = torch.tensor(list(r.prompt_token_ids), dtype=torch.long)
            attention_mask[j, width - n:] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        n_new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, temperature=None, top_p=None,
                                 top_k=None, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
        sync()
        return out[:, width:].cpu()

    generate([BenchRequest("warmup", list(requests[0].prompt_token_ids[:8]), 2)], StepClock())  # warm-up

    results: list[RequestResult] = []
    t_start = time.perf_counter()
    with tqdm(total=len(requests), desc=label, unit="req", disable=None if progress else True, leave=False) as bar:
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            clock = StepClock()
            t0 = time.monotonic()
            new_tokens = generate(batch, clock)
            t1 = time.monotonic()
            for j, req in enumerate(batch):
                m = RequestMetrics(arrival_time=t0, num_prompt_tokens=len(req.prompt_token_ids))
                m.on_scheduled(t0)
                for t in clock.times[:req.output_len]:
                    m.on_token(t)
                m.on_finished(t1)
                results.append(RequestResult.from_metrics(req, m, new_tokens[j, :req.output_len].tolist()))
            bar.update(len(batch))
    elapsed = time.perf_counter() - t_start
    del model
    gc.collect()
    return RunResult(label=label, max_concurrency=batch_size, elapsed_s=elapsed, requests=results)


def _pad_token_id(model) -> int:
    """The model's pad id, else its (first) EOS id, else 0: padded positions are masked anyway."""
    for cfg in (model.generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(cfg, name, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return 0


def compare(ours: RunResult, theirs: RunResult) -> dict:
    """Ratios refengine / transformers (> 1 means refengine is faster) and greedy agreement.

    ``greedy_exact_match`` counts requests whose output token ids are identical in both
    runs; float32 differences in batched/padded math can flip a near-tie, so it is a
    sanity figure, not a correctness test (the golden tests are that).
    """
    def ratio(a, b):
        return a / b if b else None

    def lat(run, name):
        return run.latencies()[name]["median_ms"]

    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(ours.requests, theirs.requests))
    return {
        "output_throughput_ratio": ratio(ours.output_throughput, theirs.output_throughput),
        "request_throughput_ratio": ratio(ours.request_throughput, theirs.request_throughput),
        "total_token_throughput_ratio": ratio(ours.total_token_throughput, theirs.total_token_throughput),
        "median_ttft_ratio_theirs_over_ours": ratio(lat(theirs, "ttft"), lat(ours, "ttft")),
        "median_tpot_ratio_theirs_over_ours": ratio(lat(theirs, "tpot"), lat(ours, "tpot")),
        "greedy_exact_match": same,
        "num_requests": len(ours.requests),
    }
