"""``refengine serve``: the OpenAI-compatible server on one engine.

    refengine serve --model weights/SmolLM2-135M-Instruct --port 8000 --max-model-len 2048

Engine flags are ``refengine generate``'s (vLLM's names, from :mod:`refengine.cli_options`).
FastAPI and uvicorn come from the ``serve`` extra and are imported only when the command runs.

uvicorn runs with bounds (see docs/serving.md, "Limits and a reverse proxy"): at most
``--limit-concurrency`` connections and tasks (503 above), idle keep-alive connections
closed after ``--timeout-keep-alive`` seconds, the h11 HTTP parser (so that
``--max-header-bytes`` bounds a request's head), and the app's ``--max-body-bytes``.

``--data-parallel-size N`` (N > 1) serves N engine replicas, each with its own KV cache,
behind one endpoint on Ray Serve, routed by prompt-prefix affinity
(:mod:`refengine.server.ray_serve`, docs/data_parallel.md): on the Ray cluster at
``$RAY_ADDRESS``, or a local one started here. Ray comes from the ``distributed`` extra and
is imported only then; Ray's HTTP proxy replaces uvicorn (``--limit-concurrency``,
``--timeout-keep-alive`` and ``--max-header-bytes`` do not apply).
"""

from __future__ import annotations

import logging

import click

from refengine.cli_options import build_engine, engine_options
from refengine.engine_args import default_served_model_name
from refengine.cli_options import fail as flag_fail


def fail(message: str):
    raise click.ClickException(message)


@click.command("serve")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind (0.0.0.0 exposes the server to the network)")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port to listen on")
@click.option("--served-model-name", default=None,
              help="the model name clients send (default: a Hub name as given to --model, else the model "
                   "directory's name)")
@click.option("--api-key", default=None, envvar="REFENGINE_API_KEY", show_default="none",
              help="require 'Authorization: Bearer KEY' on every route but /health (or $REFENGINE_API_KEY)")
@click.option("--disable-metrics-auth", is_flag=True, show_default="off",
              help="with --api-key, leave /metrics open (for a scraper that cannot send the key)")
@click.option("--max-waiting-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="answer 503 while this many sequences wait to be scheduled")
@click.option("--max-n", type=click.IntRange(min=1), default=16, show_default=True, help="largest n per request")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=4 * 1024 * 1024, show_default=True,
              help="largest request body in bytes (413 above)")
@click.option("--limit-concurrency", type=click.IntRange(min=1), default=1024, show_default=True,
              help="most concurrent connections and tasks; uvicorn answers 503 above")
@click.option("--timeout-keep-alive", type=click.IntRange(min=1), default=5, show_default=True,
              help="seconds an idle keep-alive connection stays open")
@click.option("--max-header-bytes", type=click.IntRange(min=1024), default=64 * 1024, show_default=True,
              help="largest request line + headers (h11's max_incomplete_event_size; 400 above)")
@click.option("--disable-log-requests", is_flag=True, show_default="off", help="no access line per request")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH", show_default="none",
              help="a PEFT LoRA adapter a request's model may name (vLLM's flag; repeat for more; turns on "
                   "--enable-lora); /v1/models lists them")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="engine replicas, each with its own KV cache, behind one endpoint on Ray Serve (needs the "
                   "'distributed' extra; uses $RAY_ADDRESS or starts a local Ray)")
def serve(host, port, served_model_name, api_key, disable_metrics_auth, max_waiting_requests, max_n,
          max_body_bytes, limit_concurrency, timeout_keep_alive, max_header_bytes, disable_log_requests,
          lora_modules, data_parallel_size, **kw):
    """Serve the model over HTTP with OpenAI's API (completions, chat, models, tokenize, metrics)."""
    if api_key is not None and not api_key.strip():  # before the weights load
        fail("--api-key (or $REFENGINE_API_KEY) is empty: give a key, or leave it unset to serve without one")
    root = click.get_current_context().find_root()
    if root.get_parameter_source("log_level") == click.core.ParameterSource.DEFAULT:
        logging.getLogger("refengine").setLevel(logging.INFO)  # access lines and engine stats by default
    loras = parse_lora_modules(lora_modules)
    if loras:
        if data_parallel_size > 1:
            fail("--lora-modules runs on one engine: not with --data-parallel-size > 1")
        kw["cli_enable_lora"] = True
    if data_parallel_size > 1:
        return serve_data_parallel(data_parallel_size, host, port, served_model_name, api_key, disable_metrics_auth,
                                   max_waiting_requests, max_n, max_body_bytes, disable_log_requests, kw)
    try:
        import uvicorn

        from refengine.server.api import ServerLimits, create_app
    except ImportError as e:
        fail(f"refengine serve needs the 'serve' extra (pip install 'refengine[serve]'): {e}")
    model_arg = kw.get("cli_model")
    try:
        engine = build_engine(kw)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        fail(str(e))
    name = served_model_name or default_served_model_name(model_arg, engine.model_dir)
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_n=max_n, max_waiting_requests=max_waiting_requests)
    try:
        app = create_app(engine, served_model_name=name, api_key=api_key, limits=limits,
                         log_requests=not disable_log_requests, metrics_auth=not disable_metrics_auth,
                         lora_modules=loras)
    except ValueError as e:  # an adapter that cannot be loaded
        fail(f"--lora-modules: {e}")
    click.echo(f"serving '{name}' (max_model_len {engine.config.max_model_len}) on http://{host}:{port}/v1",
               err=True)
    uvicorn.run(app, **uvicorn_options(host, port, limit_concurrency, timeout_keep_alive, max_header_bytes))


def parse_lora_modules(values) -> dict[str, str]:
    """``--lora-modules`` values ``NAME=PATH`` -> ``{name: path}``, in order.

    Raises:
        click.ClickException: a value without ``=``, an empty name or path, a name given twice.
    """
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            fail(f"--lora-modules {value!r} is invalid: give NAME=PATH (a PEFT adapter directory)")
        if name in out:
            fail(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def serve_data_parallel(size: int, host: str, port: int, served_model_name, api_key, disable_metrics_auth: bool,
                        max_waiting_requests: int, max_n: int, max_body_bytes: int, disable_log_requests: bool,
                        kw: dict) -> None:
    """``serve`` with ``--data-parallel-size`` > 1 (``--api-key`` and the log level already
    seen to by ``serve``): every engine flag checked, then the Ray Serve
    application deployed (:func:`refengine.server.ray_serve.data_parallel_app`) until Ctrl-C."""
    import dataclasses

    from refengine.engine_args import EngineArgs

    try:
        from refengine.server import ray_serve
    except ImportError as e:
        fail(f"--data-parallel-size needs Ray Serve (pip install 'refengine[distributed]'): {e}")
    try:
        args = EngineArgs.from_cli(kw)
        limits = dict(max_body_bytes=max_body_bytes, max_n=max_n, max_waiting_requests=max_waiting_requests)
        app = ray_serve.data_parallel_app(dataclasses.asdict(args), size, served_model_name=served_model_name,
                                          api_key=api_key, metrics_auth=not disable_metrics_auth, limits=limits,
                                          log_requests=not disable_log_requests)
    except (ValueError, FileNotFoundError) as e:  # as the one-engine path: exit status 2, flag names
        flag_fail(str(e))
    click.echo(f"serving {size} data-parallel replicas on Ray Serve at http://{host}:{port}/v1", err=True)
    ray_serve.run_data_parallel(app, host=host, port=port)


def uvicorn_options(host: str, port: int, limit_concurrency: int, timeout_keep_alive: int,
                    max_header_bytes: int) -> dict:
    """``uvicorn.run``'s keyword arguments: the address and the connection bounds (h11,
    whose ``h11_max_incomplete_event_size`` bounds the request head; httptools has no such knob)."""
    return dict(host=host, port=port, log_level="warning", access_log=False, http="h11",
                limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                h11_max_incomplete_event_size=max_header_bytes)
