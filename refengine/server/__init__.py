"""An OpenAI-compatible HTTP server over :class:`refengine.core.engine.LLMEngine`.

- ``protocol.py``: the request and response bodies (OpenAI's field names, vLLM's extras).
- ``engine_loop.py``: :class:`AsyncEngine`, the one owner of the engine; handlers talk to
  it through a queue.
- ``api.py``: the FastAPI app (``create_app``): endpoints, errors, limits, access log.
- ``cli.py``: ``refengine serve``.

The load generator over HTTP, ``refengine bench serve``, is :mod:`refengine.bench.serve`.

FastAPI and uvicorn are the optional ``serve`` extra (``pip install 'refengine[serve]'``);
nothing here imports them until a server is built.
"""
