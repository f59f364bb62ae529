"""examples/serve.py without the model: what it accepts, what it refuses and how.

The routes run on aiohttp's test server without the lifespan (no weights, no
KVTier): every body here is refused before a request would reach the model. The
served model's own behaviour is in ``integrations/test_serve_model.py``.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from serve import (
    MAX_BODY_BYTES,
    MODEL_NAME,
    APIError,
    Detokenizer,
    Sampling,
    make_app,
    parse_chat_request,
    pick_token,
)

USER = {"role": "user", "content": "Hello"}


def parsed(**fields: Any):
    return parse_chat_request({"messages": [USER], **fields}, max_tokens_limit=100)


def refusal(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_chat_request(fields, max_tokens_limit=100)
    return caught.value


# ------------------------------------------------------------------ the fields


def test_a_bare_request_is_greedy_and_may_run_to_the_servers_limit():
    chat = parsed()
    assert chat.sampling == Sampling(temperature=0.0, top_p=1.0, seed=None)
    assert chat.max_tokens is None and chat.stream is False and chat.include_usage is False


def test_max_tokens_null_is_the_servers_limit():
    assert parsed(max_tokens=None).max_tokens is None
    assert parsed(max_tokens=None, max_completion_tokens=None).max_tokens is None


def test_max_completion_tokens_is_taken_before_max_tokens():
    assert parsed(max_completion_tokens=7).max_tokens == 7
    assert parsed(max_completion_tokens=7, max_tokens=9).max_tokens == 7
    assert parsed(max_completion_tokens=None, max_tokens=9).max_tokens == 9


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": "8"}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"seed": 1.0}, "seed"),
        ({"seed": False}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"n": 2}, "n"),
        ({"stop": ["\n"]}, "stop"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_each_field_out_of_range_or_of_the_wrong_type_is_a_400_naming_it(fields, param):
    error = refusal(messages=[USER], **fields)
    assert error.status == 400 and error.param == param
    assert param.split(".")[0] in error.message


def test_ranges_are_inclusive_where_the_api_says_so():
    assert parsed(temperature=0).sampling.temperature == 0.0
    assert parsed(temperature=2).sampling.temperature == 2.0
    assert parsed(top_p=1).sampling.top_p == 1.0
    assert parsed(top_p=1e-9).sampling.top_p == 1e-9
    assert parsed(max_tokens=100).max_tokens == 100
    assert parsed(seed=-(2**63), temperature=1).sampling.seed == -(2**63)


def test_neutral_values_of_unsupported_parameters_are_accepted():
    chat = parsed(n=1, stop=None, tools=[], logprobs=False, frequency_penalty=0)
    assert chat.max_tokens is None
    assert parsed(response_format={"type": "text"}).stream is False


def test_stream_options_include_usage_needs_stream():
    assert parsed(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert parsed(stream=True, stream_options=None).include_usage is False


def test_content_parts_are_joined_as_lines():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    chat = parse_chat_request({"messages": [{"role": "user", "content": parts}]})
    assert chat.messages == [{"role": "user", "content": "first\nsecond"}]


def test_a_part_other_than_text_is_a_400_naming_its_type():
    parts = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    error = refusal(messages=[{"role": "user", "content": parts}])
    assert error.status == 400 and "'image_url'" in error.message
    assert error.param == "messages[0].content[1].type"


def test_developer_is_the_system_role_and_unknown_roles_are_refused():
    chat = parse_chat_request({"messages": [{"role": "developer", "content": "Be brief"}, USER]})
    assert chat.messages[0] == {"role": "system", "content": "Be brief"}
    error = refusal(messages=[{"role": "tool", "content": "42"}])
    assert error.param == "messages[0].role" and "'tool'" in error.message


def test_a_lone_surrogate_is_a_400_not_a_tokenizer_crash():
    body = json.loads('{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    error = refusal(**body)
    assert error.status == 400 and error.param == "messages[0].content"
    assert "surrogate" in error.message
    parts = json.loads('[{"type": "text", "text": "\\udfff"}]')
    assert refusal(messages=[{"role": "user", "content": parts}]).param == (
        "messages[0].content[0].text"
    )


def test_another_model_is_a_404_and_this_one_or_none_is_served():
    assert parsed(model=MODEL_NAME).max_tokens is None
    error = refusal(messages=[USER], model="gpt-4o")
    assert error.status == 404 and error.code == "model_not_found"


# ------------------------------------------------------------------- decoding


def test_temperature_zero_picks_the_most_likely_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert pick_token(logits, Sampling(), generator) == 1


def test_a_small_top_p_keeps_only_the_most_likely_token():
    logits = torch.tensor([0.0, 1.0, 0.5, 0.9])
    generator = torch.Generator().manual_seed(0)
    picks = {
        pick_token(logits, Sampling(temperature=2.0, top_p=0.01), generator) for _ in range(50)
    }
    assert picks == {1}


def test_top_p_keeps_the_smallest_set_reaching_it():
    # Probabilities 0.5, 0.3, 0.2: top_p 0.7 needs the first two, never the third.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    generator = torch.Generator().manual_seed(0)
    picks = {
        pick_token(logits, Sampling(temperature=1.0, top_p=0.7), generator) for _ in range(200)
    }
    assert picks == {0, 1}


def test_sampling_with_a_seed_repeats_itself():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))

    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [pick_token(logits, Sampling(temperature=1.0), generator) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


class ByteTokenizer:
    """A byte-level tokenizer: one token per UTF-8 byte, as BPE splits rare characters."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenized_pieces_never_split_a_character_and_add_up_to_the_text():
    text = "Grüße, 東京 🚲!"
    detokenizer = Detokenizer(ByteTokenizer())
    pieces = [detokenizer.add(byte) for byte in text.encode()]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[text.encode().index("🚲".encode()) + 3] == "🚲"


def test_an_answer_cut_inside_a_character_ends_as_the_whole_decode_does():
    detokenizer = Detokenizer(ByteTokenizer())
    cut = "ok 🚲".encode()[:-1]
    pieces = [detokenizer.add(byte) for byte in cut] + [detokenizer.flush()]
    assert "".join(pieces) == ByteTokenizer().decode(list(cut))


# ------------------------------------------------------------ bodies over HTTP


#: (content type, body) -> (status, code) of the JSON answer.
BAD_BODIES = [
    ("application/json", b'{"messages": [\xff]}', 400, "invalid_encoding"),
    ("application/json; charset=no-such-charset", b"{}", 415, "unsupported_charset"),
    ("application/json; charset=rot13", b"{}", 415, "unsupported_charset"),
    (
        "application/json",
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "invalid_encoding",
    ),
    ("application/json", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("application/json", b'{"messages": ', 400, "invalid_json"),
    ("application/json", b'{"max_tokens": 1' + b"0" * 5000 + b"}", 400, "invalid_json"),
    ("application/json", b"[]", 400, "invalid_value"),
    ("application/json", b" " * (MAX_BODY_BYTES + 1), 413, "request_too_large"),
    ("text/plain", b"{}", 415, "unsupported_media_type"),
    ("application/x-www-form-urlencoded", b"messages=hi", 415, "unsupported_media_type"),
]


def assert_openai_error(answer: dict[str, Any], code: str) -> None:
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert error["message"]


@pytest.mark.anyio
@pytest.mark.parametrize(("content_type", "body", "status", "code"), BAD_BODIES)
async def test_every_bad_body_is_a_json_4xx_and_logs_no_traceback(
    content_type, body, status, code, caplog
):
    caplog.set_level(logging.DEBUG)
    async with TestClient(TestServer(make_app())) as client:
        # A stream: aiohttp's client warns about large bytes bodies.
        response = await client.post(
            "/v1/chat/completions", data=io.BytesIO(body), headers={"Content-Type": content_type}
        )
        assert response.status == status
        assert response.content_type == "application/json"
        assert_openai_error(await response.json(), code)
    assert not [record for record in caplog.records if record.exc_info]


@pytest.mark.anyio
async def test_an_unknown_route_and_a_wrong_method_are_json_too():
    async with TestClient(TestServer(make_app())) as client:
        missing = await client.post("/v1/completions", json={})
        assert missing.status == 404
        assert_openai_error(await missing.json(), "not_found")
        wrong = await client.get("/v1/chat/completions")
        assert wrong.status == 405 and wrong.headers["Allow"] == "POST"
        answer = await wrong.json()
        assert_openai_error(answer, "method_not_allowed")
        assert "POST" in answer["error"]["message"]


@pytest.mark.anyio
async def test_a_valid_body_with_a_bad_field_names_the_field_over_http():
    async with TestClient(TestServer(make_app(max_tokens=50))) as client:
        response = await client.post(
            "/v1/chat/completions", json={"messages": [USER], "max_tokens": 51}
        )
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["param"] == "max_tokens" and "[1, 50]" in error["message"]
