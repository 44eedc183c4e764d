"""lm-evaluation-harness end to end: its ``local-completions`` model against ``refengine
serve`` beside its own ``hf`` model (transformers, float32), on one small multiple-choice task.

lm-eval scores a multiple-choice question by the log-likelihood of each answer after the
question: its API models send ``context + continuation`` as token ids with ``echo: true,
logprobs: 1, max_tokens: 1`` and sum the prompt tokens' ``token_logprobs`` over the
continuation, which is what refengine's ``prompt_logprobs`` give. This script

1. writes a task (``refengine_mc_check``: a YAML over a local JSONL of 20 general-knowledge
   questions, four answers each; no hub access) into a temporary folder;
2. starts ``refengine serve`` on 127.0.0.1 (a free port) with ``--model`` (default
   ``weights/SmolLM2-135M-Instruct``) and runs ``lm_eval.simple_evaluate`` with
   ``local-completions`` (lm-eval's own tokenizer: the model's, from the same folder);
3. runs the same task with lm-eval's ``hf`` model on transformers (float32, CPU);
4. compares the log-likelihood of every (question, answer) pair (they must agree within
   ``--tolerance``, 1e-4 nats), whether each answer is greedy, and the accuracies.

Prints a Markdown table; ``--write docs/evaluation.md`` also writes it as that file's
section "lm-evaluation-harness against the server" with the date, commit and CPU::

    pip install 'lm-eval[api]'       # lm-eval and its API models' packages
    python benchmarks/lm_eval_check.py --write docs/evaluation.md

Exit status 0 when everything agrees, 1 when a log-likelihood or an accuracy differs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from refengine.bench.report import markdown_table, write_performance  # noqa: E402

DEFAULT_MODEL = ROOT / "weights" / "SmolLM2-135M-Instruct"
TASK = "refengine_mc_check"
SECTION = "lm-evaluation-harness against the server"

# (question, answers, index of the right one): easy facts, so a 135M model gets some right
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "black"], 2),
    ("Which planet is closest to the Sun?", ["Venus", "Mars", "Earth", "Mercury"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wax paper"], 1),
    ("Which animal is known as the king of the jungle?", ["the mouse", "the cow", "the lion", "the frog"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("How many days are in a week?", ["seven", "five", "ten", "twelve"], 0),
    ("What is the largest ocean on Earth?", ["the Atlantic", "the Pacific", "the Indian", "the Arctic"], 1),
    ("Which gas do plants take in from the air?", ["helium", "neon", "carbon dioxide", "argon"], 2),
    ("What is the opposite of hot?", ["warm", "bright", "loud", "cold"], 3),
    ("Which language is spoken in Spain?", ["Spanish", "Japanese", "Russian", "Hindi"], 0),
    ("How many hours are in a day?", ["twelve", "twenty-four", "sixty", "ten"], 1),
    ("What do cows drink?", ["oil", "juice", "water", "coffee"], 2),
    ("Which season comes after winter?", ["autumn", "summer", "winter", "spring"], 3),
    ("What is the chemical symbol for water?", ["H2O", "CO2", "NaCl", "O3"], 0),
    ("Which is the tallest animal?", ["the pig", "the giraffe", "the cat", "the dog"], 1),
    ("What shape has three sides?", ["a square", "a circle", "a triangle", "a hexagon"], 2),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Bangkok", "Tokyo"], 3),
]


def write_task(folder: Path) -> None:
    """The JSONL and the task YAML lm-eval's TaskManager reads from ``folder``."""
    data = folder / "mc.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for q, answers, right in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": answers, "answer": right}) + "\n")
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
        "  - metric: acc_norm\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n",
        encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    """``refengine serve`` on 127.0.0.1:``port``; returns once ``/health`` answers 200.

    Raises:
        RuntimeError: the server exited or did not answer within 10 minutes (its log named).
    """
    cmd = [sys.executable, "-m", "refengine.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "refengine", "--disable-log-requests", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"refengine serve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"refengine serve did not answer /health in 10 minutes; see {log}")


def run_lm_eval(model: str, model_args: dict, task_dir: Path, batch_size: int) -> tuple[dict, list[dict]]:
    """``(results of TASK, its samples sorted by doc_id)`` from ``lm_eval.simple_evaluate``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(task_dir)), num_fewshot=0,
                                  batch_size=batch_size, log_samples=True, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    return out["results"][TASK], sorted(out["samples"][TASK], key=lambda s: s["doc_id"])


def loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    """``(log-likelihood, is_greedy)`` of each answer of one sample (before filters)."""
    return [(float(r[0][0]), bool(r[0][1])) for r in sample["resps"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model folder (served and for hf)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest log-likelihood difference, nats")
    parser.add_argument("--batch-size", type=int, default=4, help="requests per call (a list prompt for the server)")
    parser.add_argument("--write", default=None, metavar="MD", help="write the table as a section of this file")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `refengine serve` flag")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: fail rather than reach a hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with tempfile.TemporaryDirectory(prefix="lm_eval_check_") as tmp:
        tmp = Path(tmp)
        write_task(tmp)
        port = free_port()
        log = tmp / "serve.log"
        t0 = time.monotonic()
        server = start_server(args.model, port, log, args.serve_arg)
        try:
            api_args = {"model": "refengine", "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(args.model), "tokenized_requests": True,
                        "num_concurrent": 1, "max_retries": 1, "timeout": 300}
            api_res, api_samples = run_lm_eval("local-completions", api_args, tmp, args.batch_size)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        t_api = time.monotonic() - t0
        t0 = time.monotonic()
        hf_res, hf_samples = run_lm_eval("hf", {"pretrained": str(args.model), "dtype": "float32", "device": "cpu"},
                                         tmp, args.batch_size)
        t_hf = time.monotonic() - t0

    assert [s["doc_id"] for s in api_samples] == [s["doc_id"] for s in hf_samples]
    worst, greedy_diff, pairs = 0.0, 0, 0
    for a, h in zip(api_samples, hf_samples):
        for (lla, ga), (llh, gh) in zip(loglikelihoods(a), loglikelihoods(h), strict=True):
            worst = max(worst, abs(lla - llh))
            greedy_diff += ga != gh
            pairs += 1
    same_acc = all(abs(api_res[m] - hf_res[m]) < 1e-12 for m in ("acc,none", "acc_norm,none"))
    ok = worst <= args.tolerance and same_acc
    per_doc_same = sum(
        max(range(4), key=lambda i: loglikelihoods(a)[i][0]) == max(range(4), key=lambda i: loglikelihoods(h)[i][0])
        for a, h in zip(api_samples, hf_samples))
    headers = ["lm-eval model", "acc", "acc_norm", "seconds"]
    rows = [["`local-completions` → `refengine serve`", f"{api_res['acc,none']:.3f}", f"{api_res['acc_norm,none']:.3f}",
             f"{t_api:.0f}"],
            ["`hf` (transformers, float32)", f"{hf_res['acc,none']:.3f}", f"{hf_res['acc_norm,none']:.3f}",
             f"{t_hf:.0f}"]]
    summary = (f"{len(QUESTIONS)} questions × 4 answers = {pairs} log-likelihoods (`{TASK}`, a local JSONL, "
               f"0-shot, batch size {args.batch_size}); model `{args.model.name}`. Largest |difference| "
               f"of a log-likelihood: {worst:.2e} nats (tolerance {args.tolerance:g}); answers whose is_greedy "
               f"differs: {greedy_diff}; questions where both pick the same answer: {per_doc_same}/{len(QUESTIONS)}; "
               f"accuracies {'equal' if same_acc else 'DIFFERENT'}. Seconds include starting the server "
               f"(or loading the model). {'PASS' if ok else 'FAIL'}.")
    print(markdown_table(headers, rows))
    print()
    print(summary)
    write_performance(args.write, SECTION, [
        "`benchmarks/lm_eval_check.py`: lm-evaluation-harness's `local-completions` model (echo + prompt "
        "logprobs over `/v1/completions`) against `refengine serve`, beside its `hf` model on the same weights.",
        (headers, rows), summary], echo=lambda s: print(s, file=sys.stderr))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
