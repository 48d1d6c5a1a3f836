"""The HTTP edge against a hostile client, over a real server (`python -m server`, tiny V4.1): a body
without a JSON Content-Type gets a 400 that says so; flags, token ids and `logprobs` are strict (no
quiet coercion of `"yes"`, `true` or `false`); /openapi.json states the statuses actually sent (no
422; 400/401/404/413/429/503 with the OpenAI error body); and a bounded schemathesis run against that
document finds no server error and no response outside it (issue 21, item 9)."""

from __future__ import annotations

import socket
import time
from collections import Counter, defaultdict

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from tests.serving import free_port, running_server

MAX_BODY = 65536
ERROR_STATUSES = ("400", "401", "404", "413", "429", "503")
GENERATION = ("/v1/completions", "/v1/chat/completions")
FUZZ_EXAMPLES = 20  # per operation: the whole run stays well under 3 minutes on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(checkpoints):
    with running_server(checkpoints["v41"], "tiny", "--max-model-len", "128",
                        "--set", f"server.max_body_bytes={MAX_BODY}") as base:
        yield base


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert "loc" not in error["message"] and "pydantic" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --- (a) the Content-Type -------------------------------------------------------------------------

@pytest.mark.parametrize("path", [*GENERATION, "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_without_a_json_content_type_gets_a_400_naming_the_header(server, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server + path, content=b'{"prompt": "x", "messages": [], "tokens": [1]}', headers=headers)
    error = assert_openai_error(response, 400, "Content-Type")
    assert "Content-Type: application/json" in error["message"]
    assert (content_type or "no Content-Type") in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_are_read(server, content_type):
    response = httpx.post(server + "/tokenize", content=b'{"prompt": "hello"}', headers={"content-type": content_type})
    assert response.status_code == 200, response.text


def test_a_bad_field_with_a_json_content_type_still_names_the_field(server):
    response = httpx.post(server + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    error = assert_openai_error(response, 400, "max_tokens")
    assert "Content-Type" not in error["message"]


# --- (b) strict fields ----------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "logprobs": False}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "echo": "true"}, "echo"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "no"}, "ignore_eos"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, False]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": True},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
])
def test_wrong_types_are_refused_not_coerced(server, path, body, param):
    assert_openai_error(httpx.post(server + path, json=body), 400, param)


def test_the_strict_fields_take_their_own_types(server):
    response = httpx.post(server + "/v1/completions",
                          json={"prompt": [1, 2], "max_tokens": 1, "logprobs": 0, "echo": False, "stream": False})
    assert response.status_code == 200, response.text
    assert httpx.post(server + "/detokenize", json={"tokens": [1, 2]}).status_code == 200


# --- (c) the OpenAPI document ---------------------------------------------------------------------

def test_openapi_states_the_statuses_sent_with_the_error_body(server):
    document = httpx.get(server + "/openapi.json").json()
    assert "HTTPValidationError" not in document["components"]["schemas"]
    error = document["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["$ref"].endswith("/ErrorInfo")
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
            assert {"400", "413"} <= set(operation["responses"]), path
    for path in GENERATION:
        responses = document["paths"][path]["post"]["responses"]
        assert set(ERROR_STATUSES) <= set(responses), path
        for status in ERROR_STATUSES:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "401" not in document["paths"]["/health"]["get"]["responses"]  # open paths need no key
    assert "503" in document["paths"]["/health"]["get"]["responses"]


def test_a_validation_error_is_a_400_never_the_422_fastapi_documents(server):
    response = httpx.post(server + "/v1/completions", json={"prompt": 5.5})
    assert_openai_error(response, 400, "prompt")


# --- below the ASGI app: what h11 cannot parse (server/http_edge.py OpenAIErrorH11Protocol) --------

@pytest.fixture(scope="module")
def edge():
    """uvicorn with the edge protocol, in this process, over a small ASGI app behind the body limit."""
    import threading

    import uvicorn

    from server.http_edge import BodyLimit, OpenAIErrorH11Protocol, RequestIds

    async def echo(scope, receive, send):
        message = await receive()
        body = orjson.dumps({"read": len(message.get("body", b""))})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                               (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(RequestIds(BodyLimit(echo, max_bytes=MAX_BODY)), host="127.0.0.1", port=port,
                                           http=OpenAIErrorH11Protocol, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


H11_REFUSED = [
    (b"GET /\r\n\r\n", "not valid HTTP/1.1"),  # an HTTP/0.9 line
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     "chunk"),  # a chunk size that is not hex
    ((b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"
      b"2\r\n{}\r\n0\r\n\r\n"), "both Content-Length and Transfer-Encoding"),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: nine\r\n\r\n{}", "not valid HTTP/1.1"),
]


@pytest.mark.parametrize("request_bytes, says", H11_REFUSED)
def test_the_served_api_answers_what_h11_refuses_with_an_openai_error_body(server, request_bytes, says):
    status, headers, body = raw_exchange(int(server.rsplit(":", 1)[1]), request_bytes)
    assert status == 400 and headers["content-type"] == "application/json"
    assert says in orjson.loads(body)["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize("request_bytes, says", H11_REFUSED)
def test_what_h11_refuses_gets_an_openai_error_body(edge, request_bytes, says):
    status, headers, body = raw_exchange(edge, request_bytes)
    assert status == 400 and headers["content-type"] == "application/json" and headers["x-request-id"]
    error = orjson.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and says in error["message"], error


def test_a_well_framed_chunked_body_still_reaches_the_app(edge):
    request = b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    status, _, body = raw_exchange(edge, request)
    assert status == 200 and orjson.loads(body) == {"read": 2}


# --- the bounded schema fuzz ----------------------------------------------------------------------

def fuzz(operation, sent: Counter[int]) -> None:
    """FUZZ_EXAMPLES generated requests to one operation, each checked for a 5xx and for a status or
    body the document does not state; raises schemathesis's failure on the first that fails."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case) -> None:
        response = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)
        sent[response.status_code] += 1

    run()


def test_fuzzed_requests_get_no_server_error_and_a_documented_response(server):
    """The bounded schema fuzz (schemathesis's pytest loader does not run on this pytest, so each
    operation's strategy runs under hypothesis here). Failures are collected over every operation."""
    schemathesis = pytest.importorskip("schemathesis")  # the `test` extra has it
    schema = schemathesis.openapi.from_url(server + "/openapi.json")
    failures: list[str] = []
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"
        try:
            fuzz(operation, statuses[label])
        except Exception as failure:  # noqa: BLE001  (schemathesis raises its own failure groups)
            failures.append(f"{label}: {failure}")
    assert not failures, "\n\n".join(failures)
    assert len(statuses) == len(operations), statuses  # every operation was called (one with no inputs: once)
    assert all(sum(sent.values()) >= 5 for label, sent in statuses.items() if label.startswith("POST")), statuses
