"""``refengine bench peers``: refengine against llama.cpp and CTranslate2, batch 1, one process each.

Decode at batch 1 is bound by the bytes read per token, so the question this benchmark
answers is what each engine makes of the same model at the same stored precision. Every
case runs in its own fresh subprocess (``sys.executable``), one after the other, never
two at once, on the same prompt token ids (cut from the bench corpus, tokenized by the
model's own tokenizer):

* ``refengine`` on the GGUF file as stored (``--model x.gguf``), on its float32
  dequantization (``dtype="float32"``), and on the HF directory with
  ``quantization="int8"`` (per-channel int8 of the same float32 weights), all with the
  engine's defaults, batch-invariant logits included; and the GGUF file once more with
  ``batch_invariant=False`` (BLAS products for the prompt, the paged decode kernel), the
  speed that invariance trades away;
* ``refengine-gguf-q8``: the GGUF file with ``activation_dtype="q8_0"`` (llama.cpp's own
  Q8_0 activations and integer dot products, docs/quantization.md);
* ``refengine-gguf-q8-f16kv``: that with ``kv_cache_dtype="float16"``, llama.cpp's cache
  type (its attention differs still: it rounds the queries to f16 too);
* ``refengine-gguf-q8-int8kv``: Q8_0 activations with ``kv_cache_dtype="int8"`` (a byte per
  cached value and a scale per token and head), against
* ``llama.cpp-q8kv``: llama.cpp with its own one-byte cache (``type_k = type_v = Q8_0``,
  which it allows with flash attention only);
* ``llama.cpp`` (``llama-cpp-python``) on the same GGUF file, its defaults (f16 cache);
* ``CTranslate2`` on the HF directory converted by its ``ct2-transformers-converter``
  (``int8`` and ``float32``), the conversion cached under ``weights/.cache``.

Each case reports: prefill time of the ``--prompt-len`` prompt (the time to the first
token), the decode rate of the ``--output-len`` greedy tokens that follow (EOS ignored),
the process's peak RSS (``getrusage``), and its first eight greedy tokens, so a reader sees
whether the engines agree. Figures are medians over ``--repeats`` rounds; a round runs
every case once, in order, so a slow drift of the machine reaches every case alike. Where
llama.cpp ran, each case's decode rate is also divided by llama.cpp's in the same round
(the table gives the median, lowest and highest of those ratios).
A peer that is not installed is skipped with a line saying how to get it:
``pip install ctranslate2`` (a wheel) and ``benchmarks/build_llama_cpp.sh`` (builds
``llama-cpp-python`` from its source distribution, about 15 minutes on two cores).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import click

from refengine.bench.options import output_path, performance_md_option
from refengine.bench.report import busy_warning, environment, format_table, write_json, write_performance
from refengine.cli_options import fail

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GGUF = ROOT / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HF_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"

#: case id -> (name in tables, module it needs, how to get it).
CASES = {
    "refengine-gguf": ("refengine, GGUF as stored", "refengine", ""),
    "refengine-gguf-fast": ("refengine, GGUF as stored, --no-batch-invariant", "refengine", ""),
    "refengine-gguf-q8": ("refengine, GGUF as stored, --activation-dtype q8_0", "refengine", ""),
    # llama.cpp's storage: Q8_0 activations and its default f16 KV cache
    "refengine-gguf-q8-f16kv": ("refengine, GGUF as stored, --activation-dtype q8_0 --kv-cache-dtype float16",
                                "refengine", ""),
    "refengine-gguf-q8-int8kv": ("refengine, GGUF as stored, --activation-dtype q8_0 --kv-cache-dtype int8",
                                 "refengine", ""),
    "refengine-f32": ("refengine, float32 (dequantized GGUF)", "refengine", ""),
    "refengine-int8": ("refengine, int8 (of the float32 directory)", "refengine", ""),
    "llama.cpp": ("llama.cpp, GGUF as stored", "llama_cpp", "run benchmarks/build_llama_cpp.sh"),
    "llama.cpp-q8kv": ("llama.cpp, GGUF as stored, flash attention, Q8_0 KV cache", "llama_cpp",
                       "run benchmarks/build_llama_cpp.sh"),
    "ct2-int8": ("CTranslate2, int8", "ctranslate2", "pip install ctranslate2"),
    "ct2-f32": ("CTranslate2, float32", "ctranslate2", "pip install ctranslate2"),
}
RESULT_MARK = "PEERS-RESULT "
CHILD = """import json, sys
from refengine.bench.peers import child_main
print({mark!r} + json.dumps(child_main(json.loads(sys.argv[1]))), flush=True)
"""


#: The case every other case's decode rate is divided by, round by round.
RATIO_BASE = "llama.cpp"


def decode_ratios(rounds: list[dict], base: list[dict]) -> list[float]:
    """Each round's decode rate (tok/s) over the base case's in the same round: on a machine
    whose speed drifts, a ratio of two runs a few seconds apart keeps what a ratio of two
    medians taken minutes apart loses."""
    return [r["decode_tok_s"] / b["decode_tok_s"] for r, b in zip(rounds, base)]


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _now() -> float:
    import time

    return time.perf_counter()


def _run_refengine(job: dict) -> dict:
    from refengine import LLM, SamplingParams

    # no prefix caching: the timed calls must compute the whole prompt (the warm-up's first
    # 64 tokens and the prefill call's blocks would otherwise be cache hits)
    kw = {"model": job["gguf"], "num_threads": job["threads"], "enable_prefix_caching": False,
          "max_model_len": len(job["prompt"]) + job["output_len"] + 8}
    if job["case"] == "refengine-gguf-fast":  # BLAS products and the paged decode kernel (docs/engine_options.md)
        kw["batch_invariant"] = False
    elif job["case"] == "refengine-gguf-q8":  # llama.cpp's Q8_0 activations (docs/quantization.md)
        kw["activation_dtype"] = "q8_0"
    elif job["case"] == "refengine-gguf-q8-f16kv":  # and its f16 KV cache
        kw.update(activation_dtype="q8_0", kv_cache_dtype="float16")
    elif job["case"] == "refengine-gguf-q8-int8kv":  # and a one-byte KV cache
        kw.update(activation_dtype="q8_0", kv_cache_dtype="int8")
    elif job["case"] == "refengine-f32":
        kw["dtype"] = "float32"
    elif job["case"] == "refengine-int8":  # int8 of the float32 weights (the HF directory)
        kw.update(model=job["hf_dir"], quantization="int8")
    llm = LLM(**kw)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([job["prompt"][:64]], warm, use_tqdm=False)
    t0 = _now()
    llm.generate([job["prompt"]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefill = _now() - t0
    req = llm.generate([job["prompt"]], SamplingParams(max_tokens=job["output_len"] + 1, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)[0]
    m, out = req.metrics, req.outputs[0]
    decode = m.finished_time - m.first_token_time  # the output_len tokens after the first, by the engine's clock
    return {"prefill_s": prefill, "decode_tok_s": job["output_len"] / max(decode, 1e-9),
            "first_tokens": list(out.token_ids[:8])}


def _run_llama_cpp(job: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama

    kv = {}
    if job["case"] == "llama.cpp-q8kv":  # its one-byte cache needs flash attention
        from llama_cpp import GGML_TYPE_Q8_0

        kv = {"flash_attn": True, "type_k": GGML_TYPE_Q8_0, "type_v": GGML_TYPE_Q8_0}
    llm = Llama(model_path=job["gguf"], n_ctx=len(job["prompt"]) + job["output_len"] + 8, n_batch=512,
                n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False, **kv)
    vocab = llm.n_vocab()

    def last_logits():  # the last evaluated row (Llama.scores stays empty without logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    llm.eval(job["prompt"][:64])  # warm-up
    llm.reset()
    t0 = _now()
    llm.eval(job["prompt"])
    token = int(np.argmax(last_logits()))
    prefill = _now() - t0
    tokens = [token]
    t0 = _now()
    for _ in range(job["output_len"]):
        llm.eval([token])
        token = int(np.argmax(last_logits()))
        tokens.append(token)
    decode = _now() - t0
    return {"prefill_s": prefill, "decode_tok_s": job["output_len"] / decode, "first_tokens": tokens[:8]}


def _run_ct2(job: dict) -> dict:
    import ctranslate2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(job["hf_dir"]) / "tokenizer.json"))
    tokens = [tok.id_to_token(i) for i in job["prompt"]]
    gen = ctranslate2.Generator(job["ct2_dir"], device="cpu", compute_type=job["compute_type"],
                                intra_threads=job["threads"], inter_threads=1)

    def run(n: int):
        return gen.generate_batch([tokens], max_length=n, min_length=n, sampling_topk=1,
                                  include_prompt_in_result=False)[0]

    run(2)  # warm-up
    t0 = _now()
    run(1)
    prefill = _now() - t0
    t0 = _now()
    out = run(job["output_len"] + 1)
    total = _now() - t0
    return {"prefill_s": prefill, "decode_tok_s": job["output_len"] / max(total - prefill, 1e-9),
            "first_tokens": list(out.sequences_ids[0][:8])}


def child_main(job: dict) -> dict:
    """One case in its own process: prefill time, decode tokens/s, the first greedy tokens
    and the peak RSS (MB) of the process, as a dict."""
    case = job["case"]
    if case.startswith("refengine"):
        result = _run_refengine(job)
    elif case.startswith("llama.cpp"):
        result = _run_llama_cpp(job)
    else:
        result = _run_ct2(job)
    return dict(result, peak_rss_mb=_peak_rss_mb())


def _ct2_convert(hf_dir: Path, quantization: str, echo) -> Path:
    """The CTranslate2 model of ``hf_dir`` (converted once, cached under ``weights/.cache``)."""
    out = ROOT / "weights" / ".cache" / f"ct2-{hf_dir.name}-{quantization}"
    if not (out / "model.bin").is_file():
        echo(f"converting {hf_dir} for CTranslate2 ({quantization}) into {out}")
        cmd = [str(Path(sys.executable).with_name("ct2-transformers-converter")), "--model", str(hf_dir),
               "--output_dir", str(out), "--quantization", quantization, "--force"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def _prompt_ids(gguf: Path, prompt_len: int) -> list[int]:
    from refengine.bench.workload import load_corpus
    from refengine.formats.gguf_file import open_gguf

    ids = open_gguf(gguf).tokenizer().encode(load_corpus())
    if len(ids) < prompt_len:
        raise ValueError(f"the bench corpus has {len(ids)} tokens, fewer than --prompt-len={prompt_len}")
    return ids[:prompt_len]


@click.command("peers")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=DEFAULT_GGUF,
              show_default="the default model's Q4_1 file", help="GGUF file (refengine and llama.cpp).")
@click.option("--hf-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=DEFAULT_HF_DIR,
              show_default="weights/SmolLM2-135M-Instruct",
              help="The same model as a HF directory (for CTranslate2's converter and its tokenizer).")
@click.option("--cases", default=",".join(CASES), show_default=True, help="Comma-separated cases to run.")
@click.option("--prompt-len", type=click.IntRange(min=2), default=512, show_default=True,
              help="Prompt tokens (cut from the bench corpus).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Greedy tokens decoded after the prompt (EOS ignored).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads every engine uses.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Rounds (medians reported).")
@click.option("--json", "json_path", default=None, callback=output_path, show_default="none",
              help="Write every round and the medians here.")
@performance_md_option
def peers_cmd(gguf, hf_dir, cases, prompt_len, output_len, threads, repeats, json_path, performance_md):
    """refengine against llama.cpp and CTranslate2 at batch 1, each in its own process, on the same prompt ids."""
    wanted = [c.strip() for c in cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        fail(f"unknown case(s) {unknown}; known: {list(CASES)}")
    runnable, skipped = [], []
    for case in wanted:
        name, module, how = CASES[case]
        if importlib.util.find_spec(module) is None:
            skipped.append(f"{name}: skipped, {module} is not installed ({how})")
        else:
            runnable.append(case)
    for line in skipped:
        click.echo(line)
    try:
        prompt = _prompt_ids(gguf, prompt_len)
    except ValueError as e:
        fail(str(e))
    jobs = {}
    for case in runnable:
        job = {"case": case, "gguf": str(gguf), "hf_dir": str(hf_dir), "prompt": prompt,
               "output_len": output_len, "threads": threads}
        if case.startswith("ct2"):
            quant = "int8" if case == "ct2-int8" else "float32"
            job.update(ct2_dir=str(_ct2_convert(hf_dir, quant, click.echo)), compute_type=quant)
        jobs[case] = job
    results: dict[str, list[dict]] = {case: [] for case in runnable}
    for r in range(repeats):
        for case in runnable:
            warn = busy_warning()
            if warn:
                click.echo(warn)
            proc = subprocess.run([sys.executable, "-c", CHILD.format(mark=RESULT_MARK), json.dumps(jobs[case])],
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)), None)
            if proc.returncode != 0 or line is None:
                fail(f"case {case} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(line[len(RESULT_MARK):])
            results[case].append(res)
            click.echo(f"round {r + 1}/{repeats} {case}: prefill {res['prefill_s']:.3f} s, "
                       f"decode {res['decode_tok_s']:.1f} tok/s, peak RSS {res['peak_rss_mb']:.0f} MB")
    rows, summary = [], {}
    base = results.get(RATIO_BASE)
    for case in runnable:
        med = {k: statistics.median(r[k] for r in results[case]) for k in ("prefill_s", "decode_tok_s", "peak_rss_mb")}
        med["first_tokens"] = results[case][0]["first_tokens"]
        row = [CASES[case][0], f"{med['prefill_s']:.3f}", f"{med['decode_tok_s']:.1f}"]
        if base:
            ratios = decode_ratios(results[case], base)
            med["decode_vs_llama_cpp"] = ratios
            row.append(f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        summary[case] = med
        rows.append(row + [f"{med['peak_rss_mb']:.0f}", " ".join(map(str, med["first_tokens"]))])
    headers = ["engine", f"prefill {prompt_len} (s)", "decode b1 (tok/s)"]
    headers += [f"decode vs {RATIO_BASE}, per round: median (min-max)"] if base else []
    headers += ["peak RSS (MB)", "first 8 greedy ids"]
    click.echo(format_table(headers, rows))
    if json_path:
        write_json(json_path, {"scenario": "peers", "prompt_len": prompt_len, "output_len": output_len,
                               "threads": threads, "results": results, "medians": summary,
                               "environment": environment()})
        click.echo(f"wrote {json_path}")
    body = [f"Batch 1: a {prompt_len}-token prompt (the bench corpus, the same ids for every engine), then "
            f"{output_len} greedy tokens, EOS ignored; {threads} threads; each case in its own process, "
            f"medians of {repeats} rounds. Model: `{gguf.name}`.", (headers, rows)]
    body += skipped
    section = "bench peers" if gguf.resolve() == DEFAULT_GGUF.resolve() else f"bench peers: {gguf.stem}"
    if set(wanted) != set(CASES):  # a subset (e.g. a head-to-head of two cases) keeps a section of its own
        section += f" ({', '.join(wanted)})"
    write_performance(performance_md, section, body, echo=click.echo)
