"""Tensor parallelism on one machine: what a collective costs, and TP = 2 beside TP = 1.

Two measurements, one after the other:

1. The collective alone: ``mpiexec -n 2`` runs this file as two ranks (one core each) that
   all-reduce a float32 ``[rows, hidden]`` array (``rows`` 1: one decode row; 16; 512: a
   prefill chunk), with MPI (``mpi4py``, what refengine uses) and, where torch is installed,
   with gloo (``torch.distributed``, the alternative it was chosen over). Median of many.
2. The engine: the default model at ``tensor_parallel_size`` 1 and 2, one request of
   ``--prompt-len`` tokens then ``--decode-steps`` greedy tokens: TTFT (prefill), TPOT
   (decode), and the collectives a decode step makes (two per layer, one for the embedding,
   one all-gather of the logits) times their measured cost.

    python benchmarks/bench_tensor_parallel.py [--model DIR] [--prompt-len 512] [--decode-steps 64]
        [--performance-md docs/PERFORMANCE.md]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import click
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS = (1, 16, 512)


def _timed_collective(fn, repeats: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        samples.append((time.perf_counter() - t0) / repeats)
    return statistics.median(samples)


def run_collective_worker(hidden: int) -> None:
    """Run under ``mpiexec -n 2``: rank 0 prints ``{library: {rows: seconds}}`` as JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]])
    out = {"mpi": {}}
    for rows in ROWS:
        x = np.ones((rows, hidden), np.float32)
        out["mpi"][rows] = _timed_collective(lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                                             2000 if rows < 512 else 200)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(1)
        port = comm.bcast(29500 + os.getpid() % 1000 if rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=comm.Get_size())
        out["gloo"] = {}
        for rows in ROWS:
            t = torch.ones((rows, hidden), dtype=torch.float32)
            out["gloo"][rows] = _timed_collective(lambda: dist.all_reduce(t), 100 if rows < 512 else 50)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out))


def measure_collectives(hidden: int) -> dict:
    from refengine.core.executor import mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, os.path.abspath(__file__), "--collective-worker",
                           "--hidden", str(hidden)], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the collective benchmark failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_engine(model: str, tp: int, prompt: list[int], steps: int) -> dict:
    from refengine import LLM, SamplingParams

    llm = LLM(model=model, tensor_parallel_size=tp, max_num_batched_tokens=max(len(prompt), 512),
              enable_prefix_caching=False, log_stats=False)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:32]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        runs.append((m.first_token_time - m.first_scheduled_time, m.tpot))
    llm.llm_engine.shutdown()
    return {"ttft_s": statistics.median(r[0] for r in runs), "tpot_s": statistics.median(r[1] for r in runs)}


@click.command()
@click.option("--model", default=None, help="model (default: the default model)")
@click.option("--prompt-len", default=512, show_default=True)
@click.option("--decode-steps", default=64, show_default=True)
@click.option("--performance-md", default=None, help="write a section of this Markdown file (docs/PERFORMANCE.md)")
@click.option("--collective-worker", is_flag=True, hidden=True)
@click.option("--hidden", default=576, hidden=True)
def main(model, prompt_len, decode_steps, performance_md, collective_worker, hidden):
    if collective_worker:
        return run_collective_worker(hidden)
    from refengine.bench.report import write_performance
    from refengine.bench.workload import load_corpus
    from refengine.engine_args import EngineArgs, resolve_model_dir
    from refengine.tokenizer import Tokenizer

    model_dir = resolve_model_dir(model)
    mc = EngineArgs.from_kwargs(str(model_dir)).model_config()[1]
    coll = measure_collectives(mc.hidden_size)
    tok = Tokenizer.from_pretrained(model_dir)
    prompt = tok.encode(load_corpus(), add_special_tokens=False)[:prompt_len]
    engine = {tp: measure_engine(str(model_dir), tp, prompt, decode_steps) for tp in (1, 2)}
    per_step = 2 * mc.num_hidden_layers + 1  # all-reduces of one decode row, plus one all-gather of the logits
    rows = [[lib, *(f"{coll[lib][str(r)] * 1e6:.1f}" for r in ROWS)] for lib in coll]
    t1, t2 = engine[1], engine[2]
    body = [
        f"Collectives between two processes on this machine (one core each), float32 [rows, {mc.hidden_size}], "
        "median microseconds per all-reduce:",
        (["library", *(f"{r} rows" for r in ROWS)], rows),
        f"The engine, {model_dir.name}, prompt {len(prompt)} tokens then {decode_steps} greedy tokens, batch 1:",
        (["tensor_parallel_size", "TTFT (s)", "TPOT (ms)", "decode tok/s"],
         [[tp, f"{engine[tp]['ttft_s']:.3f}", f"{engine[tp]['tpot_s'] * 1e3:.1f}", f"{1 / engine[tp]['tpot_s']:.1f}"]
          for tp in (1, 2)]),
        f"A decode step at TP = 2 makes {per_step} all-reduces of one row plus one all-gather of the logits: "
        f"{per_step * coll['mpi']['1'] * 1e3:.2f} ms of MPI collectives per step at the measured cost"
        + (f" ({per_step * coll['gloo']['1'] * 1e3:.1f} ms with gloo)" if "gloo" in coll else ""),
        f"TP = 2 / TP = 1: prefill {t1['ttft_s'] / t2['ttft_s']:.2f}x, decode {t1['tpot_s'] / t2['tpot_s']:.2f}x "
        "the speed (each worker pinned to its own share of the cores; TP = 1 runs one process on all of them).",
    ]
    print("\n\n".join(b if isinstance(b, str) else json.dumps(b) for b in body))
    write_performance(performance_md, "Tensor parallelism on one machine (bench_tensor_parallel)", body, echo=print)


if __name__ == "__main__":
    main()
