"""The OpenAPI document matches the server (paxcache/server/openapi.py): Schemathesis drives
every operation of the live schema (fake engine, real HTTP) and fails on a 5xx, an undeclared
status, a wrong content type or a body that contradicts its declared schema. Also: what the
document says (no 422, errors as OpenAI's, /metrics as text, streams as SSE), ``Allow`` on
405, the 400s of a missing or non-JSON body, and OpenAI's chat message rules.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import FakeEngine, serve_in_thread

from paxcache.server import ServerLimits, create_app

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def live():
    # Small limits keep generated requests cheap; the fake engine answers at once.
    app = create_app(FakeEngine(max_model_len=128), limits=ServerLimits(max_queue=64))
    with serve_in_thread(app) as base:
        yield base


def _fuzz(base: str, max_examples: int) -> None:
    """Every operation of the live schema, positive and negative cases; fails with every
    operation's first failing case."""
    live_schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    failures = []
    statuses: dict[str, Counter] = {}
    for result in live_schema.get_all_operations():
        operation = result.ok()
        examples = live_schema.get_strategies_from_examples(operation)  # the documented ones
        strategies = {
            "examples": st.one_of(examples) if examples else None,
            "positive": operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
            "negative": operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
        }
        for mode, strategy in strategies.items():
            if strategy is None:
                continue

            @given(case=strategy)
            @settings(
                max_examples=max_examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )
            def run(case) -> None:
                response = case.call_and_validate(checks=CHECKS, timeout=30)
                statuses.setdefault(case.operation.label, Counter())[response.status_code] += 1

            try:
                run()
            except Unsatisfiable:  # no parameter or body that can be made invalid
                assert mode == "negative", operation.label
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - failures are exception groups; collect
                failures.append(f"{operation.label} ({mode}): {e}")
    assert not failures, "\n\n".join(failures)
    # The body checks were not vacuous: every route answered a 200 (its documented examples).
    missing = [label for label, seen in statuses.items() if 200 not in seen]
    assert missing == ["GET /v1/models/{model_id}"], statuses


def test_every_answer_matches_the_openapi_schema(live):
    _fuzz(live, max_examples=5)


@pytest.mark.slow
def test_every_answer_matches_the_openapi_schema_wide(live):
    _fuzz(live, max_examples=200)


def test_document_lists_real_statuses_with_openai_errors_and_no_422(live):
    doc = httpx.get(f"{live}/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            answers = op["responses"]
            assert "422" not in answers, (method, path)
            assert {"400", "413", "500"} <= set(answers), (method, path)
            assert "401" not in answers  # no API keys on this server
            for status, answer in answers.items():
                assert "x-request-id" in answer["headers"]
                if status >= "400" and path != "/health":
                    assert answer["content"]["application/json"]["schema"] == error_ref
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"404", "429", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionResponse"
    }
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_keyed_server_documents_401_everywhere_but_health():
    from fastapi.testclient import TestClient

    app = create_app(FakeEngine(), api_key="k", warmup=False)
    doc = TestClient(app).get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) == (path != "/health"), path


def test_405_names_the_allowed_methods(live):
    r = httpx.get(f"{live}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("content", "headers", "expected"),
    [
        (None, {}, "missing request body"),
        (b"", {"content-type": "application/json"}, "missing request body"),
        (b'{"prompt": "x"}', {"content-type": "text/plain"}, "(got 'text/plain')"),
        (b'{"prompt": "x"}', {}, "(no Content-Type header)"),
        (b"[1, 2]", {"content-type": "application/json"}, "must be a JSON object"),
    ],
)
def test_missing_or_non_json_body_gets_a_400_that_says_so(live, content, headers, expected):
    r = httpx.post(f"{live}/v1/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]
    assert "None" not in r.json()["error"]["message"]


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_USER = {"role": "user", "content": "2+2?"}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([_USER, {"role": "tool", "content": "4"}], "needs 'tool_call_id'"),
        ([_USER, {"role": "tool", "content": "4", "tool_call_id": "c9"}], "no call has id 'c9'"),
        ([{"role": "assistant", "tool_calls": [{**_CALL, "id": ""}]}], "at least 1 character"),
        ([{**_USER, "tool_calls": [_CALL]}], "'tool_calls' belongs to 'assistant'"),
        ([{**_USER, "tool_call_id": "c1"}], "'tool_call_id' belongs to 'tool'"),
        ([{"role": "user"}], "a 'user' message needs 'content'"),
    ],
)
def test_chat_messages_are_checked_as_openai_checks_them(live, messages, expected):
    r = httpx.post(f"{live}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]


def test_a_tool_answer_to_an_earlier_call_is_accepted(live):
    messages = [
        _USER,
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    r = httpx.post(f"{live}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
