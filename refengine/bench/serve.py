"""``refengine bench serve``: load an OpenAI-compatible server over HTTP (vLLM's ``bench serve`` shape).

How requests are driven (open loop): request ``i`` is sent at its arrival time whatever
the server is doing. Arrival gaps are drawn from a gamma distribution with shape
``--burstiness`` and mean ``1 / --request-rate`` seconds (burstiness 1 is a Poisson
process; below 1 burstier, above 1 more regular); ``--request-rate inf`` sends all at
once. ``--max-concurrency`` caps the requests in flight (later arrivals wait for a slot;
their wait counts in their latency). A list of rates (``1,2,4,inf``) runs one benchmark
per rate on the same prompts, so TTFT and TPOT can be plotted against load.

Prompts are windows of ``--input-len`` tokens cut at seeded offsets from the shipped
corpus (``refengine/bench/data/*.txt``, :func:`refengine.bench.workload.sample_requests`, as
the in-process scenarios cut theirs), tokenized by the server's ``/tokenize``; completions
get the token ids themselves (exact lengths), chat gets their text as one user message
(the template adds its tokens; token counts come from the server's usage). Every request
streams with ``ignore_eos`` and ``max_tokens = --output-len`` at temperature 0.

Per request, from the client's clock: TTFT (send to first chunk carrying text), ITL (gaps
between such chunks), TPOT ((E2EL - TTFT) / (output tokens - 1), first token excluded) and
E2EL (send to end of stream). Times are reported in milliseconds
(:func:`refengine.bench.driver.latency_figures`), throughputs per second of the whole run.
Goodput counts the requests meeting every ``--goodput`` limit.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import click
import numpy as np

from refengine.bench.driver import latency_figures
from refengine.bench.options import output_path, performance_md_option
from refengine.bench.plot import MISSING_MATPLOTLIB, matplotlib_available, plot_rate_sweep
from refengine.bench.report import environment, format_table, write_json, write_performance
from refengine.bench.workload import load_corpus, sample_requests


# The article's three scenarios; sizes chosen to finish in minutes on a CPU.
PRESETS = {
    "chat": {"input_len": 128, "output_len": 128, "num_prompts": 32},  # short in, short out
    "generation": {"input_len": 32, "output_len": 512, "num_prompts": 16},  # short in, long out
    "long-document": {"input_len": 2048, "output_len": 32, "num_prompts": 8},  # long in, short out
}
DEFAULTS = PRESETS["chat"]
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


# --------------------------------------------------------------------------------------
# Workload and arrivals
# --------------------------------------------------------------------------------------


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, mean=1/rate); zeros for inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num).tolist()


def parse_rates(text: str) -> list[float]:
    """``"1,2.5,inf"`` -> ``[1.0, 2.5, inf]``.

    Raises:
        click.BadParameter: a value that is not a positive number or ``inf``.
    """
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a number or inf") from None
        if not rate > 0:
            raise click.BadParameter(f"request rate {part!r} must be > 0 (or inf)")
        rates.append(rate)
    return rates


def parse_goodput(items: tuple[str, ...]) -> dict[str, float]:
    """``("ttft:500", "tpot:50")`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slo = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            if key not in GOODPUT_KEYS:
                raise ValueError
            slo[key] = float(value)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}") from None
    return slo


# --------------------------------------------------------------------------------------
# One request over HTTP
# --------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds, from the client's clock)."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


async def send_request(client, url: str, payload: dict, headers: dict) -> RequestRecord:
    """Stream one request; every failure (status, error event, transport) ends up in the record."""
    rec = RequestRecord()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", str(chunk["error"]))
                    return rec
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
        rec.e2el = time.perf_counter() - start
        rec.success = rec.ttft is not None
        if not rec.success:
            rec.error = "the stream carried no text"
    except Exception as e:  # transport errors, timeouts, bad JSON: the request failed
        rec.error = f"{type(e).__name__}: {e}"
    return rec


# --------------------------------------------------------------------------------------
# One run at one rate
# --------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    base_url: str
    endpoint: str
    model: str
    headers: dict
    output_len: int
    burstiness: float
    max_concurrency: int | None
    seed: int
    timeout_s: float


def make_payload(cfg: RunConfig, prompt) -> dict:
    payload = {"model": cfg.model, "max_tokens": cfg.output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint.endswith("/chat/completions"):
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


async def run_at_rate(cfg: RunConfig, prompts: list, rate: float) -> tuple[list[RequestRecord], float, int]:
    """Send every prompt at its arrival time; return (records, duration in s, peak in flight)."""
    import httpx

    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    in_flight = peak = 0
    limits = httpx.Limits(max_connections=cfg.max_concurrency or len(prompts), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits, trust_env=False) as client:

        async def one(prompt) -> RequestRecord:
            nonlocal in_flight, peak
            if slots:
                await slots.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(client, cfg.base_url + cfg.endpoint, make_payload(cfg, prompt), cfg.headers)
            finally:
                in_flight -= 1
                if slots:
                    slots.release()

        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), rate, cfg.burstiness, cfg.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start, peak


def summarize(records: list[RequestRecord], duration: float, peak: int, rate: float, cfg: RunConfig,
              percentiles: list[float], slo_ms: dict[str, float]) -> dict:
    """The run's figures as a JSON-ready dict (``request_rate`` "inf" when unbounded)."""
    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = None
    if slo_ms:
        def meets(r):
            values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
            return all(values[k] is None or values[k] * 1e3 <= limit for k, limit in slo_ms.items())
        good = sum(1 for r in ok if meets(r)) / duration
    return {
        "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency, "duration_s": duration,
        "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration, "peak_concurrency": peak,
        "goodput_slo_ms": slo_ms or None, "request_goodput": good,
        "ttft_ms": latency_figures([r.ttft for r in ok], percentiles),
        "tpot_ms": latency_figures([r.tpot for r in ok], percentiles),
        "itl_ms": latency_figures([x for r in ok for x in r.itl], percentiles),
        "e2el_ms": latency_figures([r.e2el for r in ok], percentiles),
        "errors": sorted({r.error for r in records if not r.success})[:5],
    }


def format_block(run: dict, percentiles: list[float]) -> str:
    """vLLM's result block: counts, throughputs, then TTFT / TPOT / ITL / E2EL in ms."""
    def row(label, value, fmt="{:.2f}"):
        text = "n/a" if value is None else (fmt.format(value) if isinstance(value, float) else str(value))
        return f"{label:<40}{text:<10}"

    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             row("Successful requests:", run["completed"]), row("Failed requests:", run["failed"]),
             row("Request rate configured (RPS):", run["request_rate"]),
             row("Burstiness:", run["burstiness"]),
             row("Maximum request concurrency:", run["max_concurrency"]),
             row("Benchmark duration (s):", run["duration_s"]),
             row("Total input tokens:", run["total_input_tokens"]),
             row("Total generated tokens:", run["total_output_tokens"]),
             row("Request throughput (req/s):", run["request_throughput"]),
             row("Output token throughput (tok/s):", run["output_throughput"]),
             row("Total token throughput (tok/s):", run["total_token_throughput"]),
             row("Peak concurrent requests:", run["peak_concurrency"])]
    if run["goodput_slo_ms"]:
        lines.append(row("Request goodput (req/s):", run["request_goodput"]))
    sections = [("ttft_ms", "TTFT", "Time to First Token"),
                ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl_ms", "ITL", "Inter-token Latency"), ("e2el_ms", "E2EL", "End-to-end Latency")]
    for key, short, title in sections:
        stats = run[key]
        lines.append("{:-^50}".format(title))
        lines.append(row(f"Mean {short} (ms):", stats["mean"]))
        lines.append(row(f"Median {short} (ms):", stats["median"]))
        for q in percentiles:
            if q != 50:  # the median, just above
                lines.append(row(f"P{q:g} {short} (ms):", stats[f"p{q:g}"]))
    if run["errors"]:
        lines.append("{:-^50}".format("Errors (first kinds)"))
        lines += [f"  {e}" for e in run["errors"]]
    lines.append("=" * 50)
    return "\n".join(lines)


def sweep_table(runs: list[dict], percentiles: list[float]) -> tuple[list[str], list[list]]:
    """``(headers, rows)``: one row per rate, throughput and TTFT / TPOT percentiles (ms)."""
    qs = [f"p{q:g}" for q in percentiles]
    head = ["rate", "req/s", "out tok/s"] + [f"TTFT {q}" for q in qs] + [f"TPOT {q}" for q in qs]
    rows = [[str(r["request_rate"]), r["request_throughput"], r["output_throughput"]]
            + [r["ttft_ms"][q] for q in qs] + [r["tpot_ms"][q] for q in qs] for r in runs]
    return head, rows


# --------------------------------------------------------------------------------------
# A server of our own, when asked
# --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``refengine serve`` in a subprocess on a free loopback port; a context manager.

    Raises:
        click.ClickException: the server exited or was not healthy within ``timeout_s``.
    """

    def __init__(self, server_args: str, timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "refengine.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     *shlex.split(server_args)]
        self.timeout_s = timeout_s
        self.log = tempfile.NamedTemporaryFile("w+", prefix="refengine-serve-", suffix=".log", delete=False)

    def __enter__(self) -> str:
        import httpx

        click.echo(f"starting: {shlex.join(self.args[1:])} (log: {self.log.name})", err=True)
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise click.ClickException(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise click.ClickException(f"the server was not healthy within {self.timeout_s:.0f} s; see {self.log.name}")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def _server_json(method: str, url: str, headers: dict, body: dict | None = None) -> dict:
    import httpx

    r = httpx.request(method, url, json=body, headers=headers, timeout=120.0, trust_env=False)
    if r.status_code != 200:
        raise click.ClickException(f"{method} {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def run_benchmark(base_url: str, opts: dict) -> dict:
    """Prepare the prompts, warm up, run every rate; return the report (printing as it goes)."""
    headers = {"Authorization": f"Bearer {opts['api_key']}"} if opts["api_key"] else {}
    model = opts["model"] or _server_json("GET", base_url + "/v1/models", headers)["data"][0]["id"]
    corpus_ids = _server_json("POST", base_url + "/tokenize", headers,
                              {"model": model, "prompt": load_corpus(), "add_special_tokens": False})["tokens"]
    length = (opts["input_len"], opts["input_len"])
    prompts = [r.prompt_token_ids for r in sample_requests(corpus_ids, opts["num_prompts"], length, length,
                                                           opts["seed"])]
    if opts["endpoint"].endswith("/chat/completions"):
        prompts = [_server_json("POST", base_url + "/detokenize", headers, {"model": model, "tokens": p})["prompt"]
                   for p in prompts]
    cfg = RunConfig(base_url=base_url, endpoint=opts["endpoint"], model=model, headers=headers,
                    output_len=opts["output_len"], burstiness=opts["burstiness"],
                    max_concurrency=opts["max_concurrency"], seed=opts["seed"], timeout_s=opts["timeout"])
    if opts["num_warmups"]:  # not counted; also fails fast on a misconfigured server
        warm_cfg = RunConfig(**{**asdict(cfg), "output_len": 2})
        warm = asyncio.run(run_at_rate(warm_cfg, prompts[:opts["num_warmups"]], math.inf))[0]
        if not all(r.success for r in warm):
            raise click.ClickException(f"a warm-up request failed: {next(r.error for r in warm if not r.success)}")
    runs = []
    for rate in opts["rates"]:
        records, duration, peak = asyncio.run(run_at_rate(cfg, prompts, rate))
        run = summarize(records, duration, peak, rate, cfg, opts["percentiles"], opts["slo_ms"])
        click.echo(format_block(run, opts["percentiles"]))
        runs.append(run)
    if len(runs) > 1:
        click.echo(format_table(*sweep_table(runs, opts["percentiles"])))
    return {"base_url": base_url, "endpoint": cfg.endpoint, "model": model, "num_prompts": opts["num_prompts"],
            "input_len": opts["input_len"], "output_len": opts["output_len"], "seed": opts["seed"],
            "preset": opts["preset"], "runs": runs, "environment": environment()}


@click.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="the server to load (ignored with --launch-server)")
@click.option("--endpoint", type=click.Choice(["/v1/completions", "/v1/chat/completions"]),
              default="/v1/completions", show_default=True, help="the OpenAI endpoint to load")
@click.option("--model", default=None, help="model name to send (default: the server's first)")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", show_default="none",
              help="bearer key (or $OPENAI_API_KEY)")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None, show_default="none",
              help="chat (short in, short out), generation (short in, long out), "
                   "long-document (long in, short out); explicit flags override it")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help=f"default {DEFAULTS['num_prompts']}")
@click.option("--input-len", type=click.IntRange(min=1), default=None,
              help=f"prompt tokens, default {DEFAULTS['input_len']}")
@click.option("--output-len", type=click.IntRange(min=1), default=None,
              help=f"generated tokens, default {DEFAULTS['output_len']}")
@click.option("--request-rate", default="inf", show_default=True,
              help="requests/s (Poisson), inf = all at once; a comma list sweeps (1,2,4,inf)")
@click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, show_default="no limit",
              help="most requests in flight")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the prompts and arrival times")
@click.option("--percentiles", default="50,90,99", show_default=True, help="comma-separated, 0-100")
@click.option("--goodput", multiple=True, metavar="KEY:MS", show_default="none",
              help="service-level limit, repeatable: ttft:500 tpot:50 e2el:10000")
@click.option("--num-warmups", type=click.IntRange(min=0), default=1, show_default=True,
              help="requests sent (2 tokens each) before measuring")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="seconds per request")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=output_path,
              show_default="none", help="write the report here")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, callback=output_path,
              show_default="none", help="PNG of TTFT / TPOT percentiles against the request rate (needs matplotlib)")
@click.option("--launch-server", is_flag=True, show_default="off", help="start `refengine serve` on a free loopback port for the run")
@click.option("--server-args", default="", show_default="none", help="flags for the launched server, one string ('--model DIR ...')")
@click.option("--launch-timeout", type=float, default=600.0, show_default=True,
              help="seconds to wait for the launched server to be healthy")
@performance_md_option
def serve_bench(base_url, endpoint, model, api_key, preset, num_prompts, input_len, output_len, request_rate,
                burstiness, max_concurrency, seed, percentiles, goodput, num_warmups, timeout, json_path, plot_path,
                launch_server, server_args, launch_timeout, performance_md):
    """Load an OpenAI-compatible server over HTTP; print vLLM's serving benchmark block."""
    if importlib.util.find_spec("httpx") is None:
        raise click.ClickException("bench serve needs httpx (pip install 'refengine[serve]')")
    if plot_path and not matplotlib_available():
        raise click.ClickException(MISSING_MATPLOTLIB)
    sizes = PRESETS[preset] if preset else DEFAULTS
    try:
        qs = [float(q) for q in percentiles.split(",")]
        if not all(0 <= q <= 100 for q in qs):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{percentiles!r} is not a comma list of numbers in [0, 100]",
                                 param_hint="--percentiles") from None
    opts = {"endpoint": endpoint, "model": model, "api_key": api_key, "preset": preset,
            "num_prompts": num_prompts or sizes["num_prompts"], "input_len": input_len or sizes["input_len"],
            "output_len": output_len or sizes["output_len"], "rates": parse_rates(request_rate),
            "burstiness": burstiness, "max_concurrency": max_concurrency, "seed": seed, "percentiles": qs,
            "slo_ms": parse_goodput(goodput), "num_warmups": num_warmups, "timeout": timeout}
    if launch_server:
        with LaunchedServer(server_args, launch_timeout) as url:
            report = run_benchmark(url, opts)
    else:
        report = run_benchmark(base_url.rstrip("/"), opts)
    if json_path:
        write_json(json_path, report)
    if plot_path:
        plot_rate_sweep(plot_path, report["runs"], qs)
        click.echo(f"plot: {os.path.abspath(plot_path)}", err=True)
    where = "a server it launched" if launch_server else "a running server"
    write_performance(performance_md, "bench serve", [
        f"{report['num_prompts']} requests to {report['endpoint']} of {where}, {report['input_len']} tokens in, "
        f"{report['output_len']} out (greedy, EOS ignored, seed {seed}), burstiness {burstiness}, max concurrency "
        f"{max_concurrency or 'no limit'}; the client's clock. Times in ms.",
        sweep_table(report["runs"], qs)], echo=click.echo)
