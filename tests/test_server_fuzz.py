"""Schema fuzzing: schemathesis drives every endpoint of /openapi.json with generated requests.

No reply may be a 5xx, every reply must match the document (status, content type, body schema),
and bodies that break the schema must be refused; that is what keeps /openapi.json true.
"""

import importlib.metadata

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance)

from jaxserve.server.openapi import openapi_document
from server_fixtures import serving, tiny_engine  # noqa: F401 - fixture

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, max_n=2) as server:
        yield server


# Loaded from the same builder the server uses (schemathesis' lazy fixture loader does not run on
# pytest 9); the first test checks that the server serves exactly this document.
DOCUMENT = openapi_document("jaxserve", importlib.metadata.version("jaxserve"), with_api_key=False)
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_every_route_is_documented(server):
    served = {(r.method.lower(), r.resource.canonical) for r in server.app.router.routes() if r.method != "HEAD"}
    served_document = requests.get(f"{server.url}/openapi.json", timeout=10).json()
    assert served_document == DOCUMENT
    assert served == {(method, path) for path, item in DOCUMENT["paths"].items() for method in item}


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz(case, server):
    _bound_chat_length(case.body)
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)


def _bound_chat_length(body) -> None:
    """A chat without a length runs to the end of the context; give it one (still a valid body)."""
    if isinstance(body, dict) and "messages" in body and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 16


def test_still_serving_after_fuzzing(server):
    reply = requests.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
