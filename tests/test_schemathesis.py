"""Schema fuzz of the REST API (issue 14, item 6): schemathesis generates requests from the OpenAPI
document, valid and invalid, for every operation, and checks each answer: no 5xx, only documented
status codes, the documented body schema and content type, invalid requests refused, a correct
`Allow` on 405. The app runs in-process without workers (nothing is built or decoded), so routes
that need a worker answer their documented 409/503. Examples are bounded to keep the module well
under a minute on 2 cores; `CTXCACHE_FUZZ_EXAMPLES` raises the bound for a longer local run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import schemathesis
from schemathesis import checks
from hypothesis import HealthCheck, given, settings

from service.app import create_app
from service.settings import Settings
from test_api import _settings

EXAMPLES = int(os.environ.get("CTXCACHE_FUZZ_EXAMPLES", "30"))
# every operation of the document (an app that is not started builds it: no model, no Redis)
OPERATIONS = [(method.upper(), path) for path, item in create_app(Settings(data_dir=Path("unused"))).openapi()["paths"].items()
              for method in item]


@pytest.fixture
def api_schema(tmp_path, redis_prefix, lm):
    app = create_app(_settings(tmp_path, redis_prefix, run_workers=False), lm=lm)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    schemathesis.python.asgi.shutdown_lifespans()  # schemathesis keeps the app's lifespan running until then


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_api_answers_as_documented(api_schema, method, path):
    """`schemathesis.pytest.from_fixture` would do this per operation, but needs pytest internals
    (`Function._nodeid`) that this pytest lacks; the same checks run through the Python API."""
    operation = api_schema[path][method]
    # Not checked: `positive_data_acceptance` (a schema-valid request answered 2xx). What a request is
    # checked against besides the schema cannot be stated in it: the served model's vocabulary
    # (token_ids), the method names and their params, a context's length, the budgets; each such
    # refusal is a documented 4xx with a stable code. /readyz answers its documented 503 here (no
    # workers run), so a 5xx is expected there and only there.
    excluded = [checks.positive_data_acceptance] + ([checks.not_a_server_error] if path == "/readyz" else [])

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    def fuzz(case):
        case.call_and_validate(excluded_checks=excluded)

    fuzz()
