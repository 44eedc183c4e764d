"""Load test of ``refengine serve`` over HTTP: misbehaving clients and malformed requests
must not hurt the server or the well-behaved clients.

Usage (docs/benchmarks.md, "Load test")::

    python benchmarks/load_test.py                      # 5 minutes, default model
    python benchmarks/load_test.py --duration 60        # shorter
    python benchmarks/load_test.py --base-url http://127.0.0.1:8000   # a server already running

It starts ``refengine serve`` on a free loopback port (``--server-args`` passes flags; the
default model otherwise), then:

1. **Quiet run** (``--quiet-duration``, default a fifth of ``--duration``, 10-60 s): only
   the well-behaved clients (half of ``--clients``), the same request shape. Also the
   warm-up.
2. **Load run** (``--duration``): ``--clients`` (64) streaming clients, each sending one
   completion request after another: a quarter read slowly (``--slow-read-s`` between
   chunks), a quarter disconnect mid-stream (after ``--disconnect-after`` chunks), half are
   well-behaved; plus, every ``--burst-every-s``, a burst of malformed requests (bad JSON,
   wrong types, a huge stop list, negative ``max_tokens``, an over-long prompt, a chat
   request without messages). The server process's resident memory (its children's too,
   should it have any) is sampled every ``--sample-every-s``.
3. **End**: waits for the server to report no running or waiting requests, reads the KV
   usage from ``/metrics``.

Criteria (exit status 1 if any fails, 0 otherwise):

* no HTTP 5xx, to any request, malformed or not (an error event inside a stream counts as
  a 5xx when its code is >= 500);
* no hang: every request ends (or its client disconnects) within ``--request-timeout``;
* resident memory flat after warm-up: over the load run's samples after its first
  ``--warmup-fraction``, the largest is within ``--rss-tolerance`` (10%) of the first;
* KV cache usage back to 0 at the end (``refengine:kv_cache_usage_perc``);
* every well-behaved request succeeded, and every malformed one got a 4xx.

Also reported, not a criterion unless ``--max-tpot-ratio`` is given: the well-behaved
clients' p50/p99 TPOT (time per output token after the first, client clock) in the load run
beside the quiet run. The script uses only the HTTP API (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/metrics``, ``/health``), no server internals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from refengine.bench.serve import LaunchedServer

PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "Explain, step by step, how a bicycle gear works:",
    "List three facts about the moon.",
]


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients saw (counts; TPOT samples in seconds)."""

    sent: int = 0
    ok: int = 0
    status_5xx: int = 0
    hangs: int = 0
    failed_well_behaved: int = 0
    malformed_sent: int = 0
    malformed_4xx: int = 0
    malformed_other: list[str] = field(default_factory=list)
    disconnects: int = 0
    rejected_429: int = 0
    malformed_accepted: list[str] = field(default_factory=list)  # 200 where a 4xx was optional
    errors: list[str] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)  # well-behaved clients only

    def note(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)


def percentile_ms(xs: list[float], q: float) -> float | None:
    return None if not xs else float(np.percentile(np.asarray(xs) * 1000.0, q))


# --------------------------------------------------------------------------------------
# Server memory
# --------------------------------------------------------------------------------------


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants, bytes (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
        todo.extend(children.get(p, []))
    return total


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric ``name`` (any labels) in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name):len(name) + 1] in (" ", "{")):
            try:
                return float(line.rsplit(None, 1)[1])
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------


class Run:
    def __init__(self, args, base_url: str, model: str):
        self.args = args
        self.base = base_url
        self.model = model
        self.tally = Tally()

    def payload(self, i: int) -> dict:
        return {"model": self.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": self.args.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}

    async def stream_one(self, client, kind: str, i: int) -> None:
        """One streaming completion; ``kind``: "good", "slow" or "disconnect"."""
        t, a = self.tally, self.args
        t.sent += 1
        first = None
        chunks = 0
        async with client.stream("POST", self.base + "/v1/completions", json=self.payload(i)) as resp:
            if resp.status_code >= 500:
                t.status_5xx += 1
                t.note(f"{kind}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            if resp.status_code == 429:  # the server shedding load: reported, not a failure
                t.rejected_429 += 1
                await asyncio.sleep(0.5)
                return
            if resp.status_code != 200:
                if kind == "good":
                    t.failed_well_behaved += 1
                t.note(f"{kind}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    code = chunk["error"].get("code")
                    if isinstance(code, int) and code >= 500:
                        t.status_5xx += 1
                    if kind == "good":
                        t.failed_well_behaved += 1
                    t.note(f"{kind}: error event {chunk['error']}")
                    return
                if any(c.get("text") for c in chunk.get("choices", [])):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                if kind == "slow":
                    await asyncio.sleep(a.slow_read_s)
                elif kind == "disconnect" and chunks >= a.disconnect_after:
                    t.disconnects += 1
                    return  # leaving the context closes the connection mid-stream
        end = time.perf_counter()
        t.ok += 1
        if kind == "good":
            if first is None:
                t.failed_well_behaved += 1
                t.note("good: the stream carried no text")
            elif chunks >= 2:
                t.tpot.append((end - first) / (chunks - 1))

    async def client_loop(self, client, kind: str, idx: int, deadline: float) -> None:
        i = idx
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.stream_one(client, kind, i), self.args.request_timeout)
            except asyncio.TimeoutError:
                self.tally.hangs += 1
                self.tally.note(f"{kind}: no end within {self.args.request_timeout} s")
            except Exception as e:  # transport errors: the server closed on us, refused, ...
                if kind == "good":
                    self.tally.failed_well_behaved += 1
                self.tally.note(f"{kind}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
            i += len(PROMPTS) - 1

    def malformed(self) -> list[tuple[str, str, dict | None, bytes | None]]:
        """(name, path, JSON body or None, raw body or None). Every one must get a 4xx but
        the huge stop list, which a server may also serve (then reported)."""
        m, c = self.model, "/v1/completions"
        return [
            ("bad JSON", c, None, b'{"model": "x", "prompt": "hi", '),
            ("not an object", c, None, b"[1, 2, 3]"),
            ("max_tokens a string", c, {"model": m, "prompt": "hi", "max_tokens": "ten"}, None),
            ("prompt a number", c, {"model": m, "prompt": 5, "max_tokens": 4}, None),
            ("temperature a string", c, {"model": m, "prompt": "hi", "temperature": "hot"}, None),
            ("negative max_tokens", c, {"model": m, "prompt": "hi", "max_tokens": -5}, None),
            ("huge stop list", c, {"model": m, "prompt": "hi", "max_tokens": 4, "stop": ["x"] * 20000}, None),
            ("over-long prompt", c, {"model": m, "prompt": "word " * 200_000, "max_tokens": 4}, None),
            ("over-long prompt, streaming", c,
             {"model": m, "prompt": "word " * 200_000, "max_tokens": 4, "stream": True}, None),
            ("chat without messages", "/v1/chat/completions", {"model": m, "max_tokens": 4}, None),
            ("chat messages a string", "/v1/chat/completions", {"model": m, "messages": "hi"}, None),
        ]

    async def malformed_loop(self, client, deadline: float) -> None:
        t = self.tally
        while time.monotonic() < deadline:
            for name, path, body, raw in self.malformed():
                t.malformed_sent += 1
                try:
                    if raw is not None:
                        coro = client.post(self.base + path, content=raw, headers={"Content-Type": "application/json"})
                    else:
                        coro = client.post(self.base + path, json=body)
                    r = await asyncio.wait_for(coro, self.args.request_timeout)
                except asyncio.TimeoutError:
                    t.hangs += 1
                    t.note(f"malformed {name!r}: no answer within {self.args.request_timeout} s")
                    continue
                except Exception as e:
                    t.malformed_other.append(f"{name}: {type(e).__name__}: {e}")
                    continue
                status = r.status_code
                if status == 200 and r.text.lstrip().startswith("data:"):  # a stream: its error event's code
                    for line in r.text.splitlines():
                        if line.startswith("data: {") and '"error"' in line:
                            code = json.loads(line[6:])["error"].get("code")
                            status = code if isinstance(code, int) else status
                            break
                if status >= 500:
                    t.status_5xx += 1
                    t.note(f"malformed {name!r}: HTTP {status}: {r.text[:200]}")
                elif 400 <= status < 500:
                    t.malformed_4xx += 1
                elif name == "huge stop list":
                    t.malformed_4xx += 1  # allowed to be served
                    if len(t.malformed_accepted) < 3:
                        t.malformed_accepted.append(f"{name}: HTTP {status}")
                elif len(t.malformed_other) < 20:
                    t.malformed_other.append(f"{name}: HTTP {status}: {r.text[:120]}")
            await asyncio.sleep(self.args.burst_every_s)

    async def run(self, duration: float, clients: int, misbehave: bool, server_pid: int | None,
                  rss: list[tuple[float, int]]) -> None:
        import httpx

        limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
        timeout = httpx.Timeout(self.args.request_timeout)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            deadline = time.monotonic() + duration
            tasks = []
            for idx in range(clients):
                kind = "good"
                if misbehave:
                    kind = ("slow", "disconnect", "good", "good")[idx % 4]
                tasks.append(asyncio.create_task(self.client_loop(client, kind, idx, deadline)))
            if misbehave:
                tasks.append(asyncio.create_task(self.malformed_loop(client, deadline)))
            t0 = time.monotonic()
            while not all(task.done() for task in tasks):
                if server_pid is not None:
                    rss.append((time.monotonic() - t0, tree_rss_bytes(server_pid)))
                await asyncio.sleep(self.args.sample_every_s)
            await asyncio.gather(*tasks)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def get_json(base: str, path: str) -> dict:
    import httpx

    return httpx.get(base + path, timeout=30.0, trust_env=False).json()


def get_metrics(base: str) -> str:
    import httpx

    return httpx.get(base + "/metrics", timeout=30.0, trust_env=False).text


def wait_idle(base: str, timeout_s: float) -> tuple[float | None, float]:
    """Poll /metrics until no request runs or waits; returns (KV usage, seconds waited)."""
    t0 = time.monotonic()
    usage = None
    while time.monotonic() - t0 < timeout_s:
        text = get_metrics(base)
        running = metric_value(text, "refengine:num_requests_running") or 0.0
        waiting = metric_value(text, "refengine:num_requests_waiting") or 0.0
        usage = metric_value(text, "refengine:kv_cache_usage_perc")
        if running == 0 and waiting == 0 and usage == 0:
            break
        time.sleep(1.0)
    return usage, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="load run length, seconds (default 300)")
    ap.add_argument("--quiet-duration", type=float, default=None,
                    help="quiet run length, seconds (default duration/5, clamped to 10-60)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients in the load run")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every client request")
    ap.add_argument("--slow-read-s", type=float, default=0.2, help="slow readers' sleep between chunks")
    ap.add_argument("--disconnect-after", type=int, default=3, help="chunks a disconnecting client reads")
    ap.add_argument("--burst-every-s", type=float, default=5.0, help="pause between malformed bursts")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="a request not done by then is a hang")
    ap.add_argument("--sample-every-s", type=float, default=2.0, help="resident memory sampling period")
    ap.add_argument("--warmup-fraction", type=float, default=0.2, help="share of the load run before RSS is judged")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed growth of RSS after warm-up")
    ap.add_argument("--max-tpot-ratio", type=float, default=None,
                    help="fail if load-run p99 TPOT exceeds this multiple of the quiet run's (default: report only)")
    ap.add_argument("--server-args", default="", help="flags for `refengine serve` (default: the default model)")
    ap.add_argument("--base-url", default=None, help="use a running server instead (no memory sampling)")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the server to start")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.clients < 4:
        ap.error(f"--duration={args.duration} must be > 0 and --clients={args.clients} >= 4")
    quiet = args.quiet_duration if args.quiet_duration is not None else min(60.0, max(10.0, args.duration / 5))

    if args.base_url:
        return report(args, args.base_url.rstrip("/"), None, quiet)
    server = LaunchedServer(args.server_args, args.server_timeout)
    with server as url:
        return report(args, url, server.proc.pid, quiet)


def report(args, base: str, server_pid: int | None, quiet_s: float) -> int:
    model = get_json(base, "/v1/models")["data"][0]["id"]
    print(f"server {base}, model {model!r}", flush=True)

    quiet = Run(args, base, model)
    print(f"quiet run: {args.clients // 2} well-behaved clients for {quiet_s:.0f} s", flush=True)
    asyncio.run(quiet.run(quiet_s, args.clients // 2, False, None, []))

    load = Run(args, base, model)
    rss: list[tuple[float, int]] = []
    print(f"load run: {args.clients} clients (1/4 slow readers, 1/4 disconnecting) + malformed bursts "
          f"for {args.duration:.0f} s", flush=True)
    t0 = time.monotonic()
    asyncio.run(load.run(args.duration, args.clients, True, server_pid, rss))
    load_wall = time.monotonic() - t0
    usage, waited = wait_idle(base, 60.0)

    t = load.tally
    after = [b for s, b in rss if s >= args.warmup_fraction * args.duration]
    rss_first, rss_last, rss_max = (after[0], after[-1], max(after)) if after else (None, None, None)
    rss_growth = (rss_max - rss_first) / rss_first if after else None
    q99, l99 = percentile_ms(quiet.tally.tpot, 99), percentile_ms(t.tpot, 99)
    res = {
        "model": model, "clients": args.clients, "duration_s": args.duration, "load_wall_s": round(load_wall, 1),
        "max_tokens": args.max_tokens,
        "requests_sent": t.sent, "requests_ok": t.ok, "disconnects": t.disconnects,
        "status_5xx": t.status_5xx + quiet.tally.status_5xx, "hangs": t.hangs + quiet.tally.hangs,
        "failed_well_behaved": t.failed_well_behaved + quiet.tally.failed_well_behaved,
        "malformed_sent": t.malformed_sent, "malformed_4xx": t.malformed_4xx,
        "malformed_not_4xx": t.malformed_other[:10], "malformed_served_200": t.malformed_accepted,
        "rejected_429": t.rejected_429 + quiet.tally.rejected_429,
        "rss_mib_after_warmup": None if not after else {"first": round(rss_first / 2**20, 1),
                                                        "last": round(rss_last / 2**20, 1),
                                                        "max": round(rss_max / 2**20, 1),
                                                        "growth": round(rss_growth, 4)},
        "rss_samples": len(rss),
        "kv_cache_usage_end": usage, "idle_wait_s": round(waited, 1),
        "tpot_ms": {"quiet": {"n": len(quiet.tally.tpot), "p50": percentile_ms(quiet.tally.tpot, 50), "p99": q99},
                    "load": {"n": len(t.tpot), "p50": percentile_ms(t.tpot, 50), "p99": l99}},
        "errors": (quiet.tally.errors + t.errors)[:20],
    }
    checks = {
        "no 5xx": res["status_5xx"] == 0,
        "no hangs": res["hangs"] == 0,
        "well-behaved requests all succeeded": res["failed_well_behaved"] == 0 and len(t.tpot) > 0,
        "malformed requests all 4xx (a huge stop list may be served)":
            t.malformed_sent > 0 and t.malformed_4xx == t.malformed_sent,
        "KV usage back to 0": usage == 0,
    }
    if server_pid is not None:
        checks[f"RSS flat after warm-up (within {args.rss_tolerance:.0%})"] = (
            rss_growth is not None and rss_growth <= args.rss_tolerance)
    if args.max_tpot_ratio is not None:
        checks[f"p99 TPOT within {args.max_tpot_ratio}x quiet"] = (
            q99 is not None and l99 is not None and l99 <= args.max_tpot_ratio * q99)
    res["checks"] = checks
    print(json.dumps(res, indent=2), flush=True)
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
