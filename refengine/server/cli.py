"""``refengine serve``: the OpenAI-compatible server on one engine.

    refengine serve --model weights/SmolLM2-135M-Instruct --port 8000 --max-model-len 2048

Engine flags are ``refengine generate``'s (vLLM's names, from :mod:`refengine.cli_options`).
FastAPI and uvicorn come from the ``serve`` extra and are imported only when the command runs.
"""

from __future__ import annotations

import logging

import click

from refengine.cli_options import build_engine, engine_options


def fail(message: str):
    raise click.ClickException(message)


@click.command("serve")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind (0.0.0.0 exposes the server to the network)")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port to listen on")
@click.option("--served-model-name", default=None,
              help="the model name clients send (default: the model directory's name)")
@click.option("--api-key", default=None, envvar="REFENGINE_API_KEY", show_default="none",
              help="require 'Authorization: Bearer KEY' on /v1/* (or $REFENGINE_API_KEY)")
@click.option("--max-waiting-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="answer 503 while this many sequences wait to be scheduled")
@click.option("--max-n", type=click.IntRange(min=1), default=16, show_default=True, help="largest n per request")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=4 * 1024 * 1024, show_default=True,
              help="largest request body in bytes (413 above)")
@click.option("--disable-log-requests", is_flag=True, show_default="off", help="no access line per request")
def serve(host, port, served_model_name, api_key, max_waiting_requests, max_n, max_body_bytes,
          disable_log_requests, **kw):
    """Serve the model over HTTP with OpenAI's API (completions, chat, models, tokenize, metrics)."""
    try:
        import uvicorn

        from refengine.server.api import ServerLimits, create_app
    except ImportError as e:
        fail(f"refengine serve needs the 'serve' extra (pip install 'refengine[serve]'): {e}")
    root = click.get_current_context().find_root()
    if root.get_parameter_source("log_level") == click.core.ParameterSource.DEFAULT:
        logging.getLogger("refengine").setLevel(logging.INFO)  # access lines and engine stats by default
    try:
        engine = build_engine(kw)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        fail(str(e))
    name = served_model_name or engine.model_dir.name
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_n=max_n, max_waiting_requests=max_waiting_requests)
    app = create_app(engine, served_model_name=name, api_key=api_key, limits=limits,
                     log_requests=not disable_log_requests)
    click.echo(f"serving '{name}' (max_model_len {engine.config.max_model_len}) on http://{host}:{port}/v1",
               err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
