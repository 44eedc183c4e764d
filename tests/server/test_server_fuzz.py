"""Schema-driven fuzzing of the server with schemathesis, against its own ``/openapi.json``.

Every operation gets generated requests (valid and invalid bodies); each must get an
answer that is not a 5xx, and one whose body matches what the schema documents for its
status (``response_schema_conformance``). The short form here (a few dozen examples per
operation, ``max_tokens`` kept small, the tiny random model with a character tokenizer)
runs in the suite; the long form is the same test with more examples::

    REFENGINE_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest -q tests/server/test_server_fuzz.py

or schemathesis' own runner against a running ``refengine serve`` (docs/serving.md).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from refengine.core.engine import LLMEngine  # noqa: E402
from refengine.server.api import ServerLimits, create_app  # noqa: E402
from tests.helpers import KEY, ServerThread  # noqa: E402

EXAMPLES = int(os.environ.get("REFENGINE_FUZZ_EXAMPLES", "25"))
MAX_TOKENS = 4  # generated requests' lengths are clamped to this: the fuzz is about the API, not the model
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_tok_dir):
    engine = LLMEngine(tiny_llama_tok_dir, max_model_len=64, num_kv_blocks=64, log_stats=False)
    app = create_app(engine, served_model_name="tiny", api_key=KEY, limits=ServerLimits(max_n=2),
                     log_requests=False)
    with ServerThread(app) as url:
        yield url, app


def clamp(case) -> None:
    """Keep generations short: clamp the length fields a generated body sets (any other
    value, wrong types included, is sent as generated)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS  # chat's default runs to max_model_len
    value = body.get("min_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS


OPERATIONS = ["GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions",
              "POST /tokenize", "POST /detokenize"]


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_5xx_and_responses_match_the_schema(fuzz_server, label):
    # hypothesis driven by hand over each operation's strategy (schemathesis' pytest plugin,
    # schema.parametrize, does not load under this pytest)
    url, app = fuzz_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    operations = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}
    assert set(OPERATIONS) <= set(operations)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operations[label].as_strategy())
    def check(case):
        clamp(case)
        case.call_and_validate(base_url=url, headers=AUTH, timeout=60,
                               checks=[not_a_server_error, response_schema_conformance, status_code_conformance])
        assert app.state.engine_loop.is_running

    check()
