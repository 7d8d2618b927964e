"""The OpenAPI document matches the server (paxcache/server/openapi.py,
paxcache/server/schema_rules.py): Schemathesis drives every operation of the live schema (fake
engine, real HTTP) with its default checks, all of them: no 5xx, only documented statuses,
content types, headers and bodies, schema-valid bodies accepted and schema-invalid ones
refused. Also: what the document says (no 422, errors as OpenAI's, /metrics as text, streams
as SSE), ``Allow`` on 405, the 400s of a missing or non-JSON body, and OpenAI's chat message
rules.
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
from schemathesis.specs.openapi.checks import positive_data_acceptance
from server_harness import FakeEngine, serve_in_thread

from paxcache.server import ServerLimits, create_app

RUNTIME_RULES = (
    # No JSON schema can refer from one array element to another: a named tool_choice must be
    # one of the tools.
    "which is not in tools",
    # A user-supplied JSON schema (response_format / tool parameters) the grammar library
    # cannot compile: only compiling it tells.
    "response_format.json_schema",
    ".function.parameters:",
    # Token counts are known only after tokenizing: a text or chat prompt past the context
    # window (a maxLength safe for every text would refuse most texts that fit, and the
    # server does not refuse them), and the fake engine's own refusal of prompt + max_tokens
    # past max_model_len (the real engine stops at the length instead).
    "the model's maximum context length",
    "exceeds max_model_len",
    # prompts x n <= max_choices: an arithmetic rule between two fields; stated exactly it
    # takes 15 anyOf branches, past what Schemathesis 4.32 generates from (UnsupportedSchema
    # past ~10 with the other rules); documented in words on `n`.
    "(limit max_choices)",
)


@schemathesis.check
def positive_data_accepted_unless_a_runtime_rule(ctx, response, case):
    """Schemathesis's ``positive_data_acceptance``, except a 400 that names one of
    RUNTIME_RULES (a rule no schema can state)."""
    if response.status_code == 400:
        message = response.json()["error"]["message"]
        if any(rule in message for rule in RUNTIME_RULES):
            return None
    return positive_data_acceptance(ctx, response, case)


@pytest.fixture(scope="module")
def live():
    # Small limits keep generated requests cheap; the fake engine answers at once.
    app = create_app(FakeEngine(max_model_len=128), limits=ServerLimits(max_queue=64))
    with serve_in_thread(app) as base:
        yield base


def _fuzz(base: str, max_examples: int) -> None:
    """Every operation of the live schema, its examples, positive and negative cases, under
    Schemathesis's default checks; fails with every operation's first failing case."""
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
                response = case.call_and_validate(
                    excluded_checks=[positive_data_acceptance],
                    additional_checks=[positive_data_accepted_unless_a_runtime_rule],
                    timeout=30,
                )
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


@pytest.mark.parametrize(
    "before",
    [[{"role": "assistant", "content": None, "tool_calls": [_CALL]}], []],
    ids=["answers-an-earlier-call", "answers-no-earlier-call"],
)
def test_a_tool_answer_is_accepted_whether_or_not_an_earlier_call_has_its_id(live, before):
    # vLLM's rule (the template renders it); OpenAI's own API refuses the second, but no JSON
    # schema can relate two messages, and the OpenAPI document must not call a refused body
    # valid (Schemathesis's positive_data_acceptance).
    messages = [_USER, *before, {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    r = httpx.post(f"{live}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
