"""The ``/v1/embeddings`` schema (``proxy.protocol.embeddings``): every input shape, the response
body, and each bad field refused with its ``param``."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from proxy.errors import InvalidRequestError
from proxy.protocol import embedding_response, parse_embedding_request


def test_input_shapes():
    one = parse_embedding_request({"model": "m", "input": "hi"})
    assert (one.texts, one.token_ids, one.encoding_format, one.dimensions) == (("hi",), None, "float", None)
    assert parse_embedding_request({"model": "m", "input": ["a", "b"]}).texts == ("a", "b")
    assert parse_embedding_request({"model": "m", "input": [1, 2, 3]}).token_ids == ((1, 2, 3),)
    many = parse_embedding_request({"model": "m", "input": [[1], [2, 3]], "encoding_format": "base64",
                                    "dimensions": 8, "user": "u", "truncate_prompt_tokens": -1})
    got = (many.token_ids, many.encoding_format, many.dimensions, many.truncate_prompt_tokens,
           many.num_inputs)
    assert got == (((1,), (2, 3)), "base64", 8, -1, 2)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": {"a": 1}}, "input"),
    ({"model": "m", "input": ["a", ""]}, "input[1]"),
    ({"model": "m", "input": ["a", [1, 2]]}, "input[1]"),
    ({"model": "m", "input": [[1, 2], "a"]}, "input[1]"),
    ({"model": "m", "input": [1, "a"]}, "input"),
    ({"model": "m", "input": [[1], []]}, "input[1]"),
    ({"model": "m", "input": [[1, -1]]}, "input[0]"),
    ({"model": "m", "input": [True]}, "input[0]"),
    ({"model": "m", "input": [None]}, "input[0]"),
    ({"model": "m", "input": ["a"] * 2049}, "input"),
    ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "a", "encoding_format": 1}, "encoding_format"),
    ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": -3}, "dimensions"),
    ({"model": "m", "input": "a", "dimensions": "8"}, "dimensions"),
    ({"model": "m", "input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"model": "m", "input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"model": "m", "input": "a", "user": 5}, "user"),
])
def test_bad_fields_name_their_param(body, param):
    with pytest.raises(InvalidRequestError) as err:
        parse_embedding_request(body)
    assert err.value.param == param and err.value.status == 400


def test_a_bad_token_id_says_what_it_got():
    with pytest.raises(InvalidRequestError) as err:
        parse_embedding_request({"model": "m", "input": [[1, -1]]})
    assert err.value.message == ("'input[0][1]' must be a token id (a non-negative integer), "
                                 "not the negative integer -1.")
    with pytest.raises(InvalidRequestError) as err:
        parse_embedding_request({"model": "m", "input": [[1, "a"]]})
    assert err.value.message.endswith("(a non-negative integer), not a string.")


def test_response_float_and_base64():
    vectors = np.array([[0.5, -0.25], [1.0, 0.1]], dtype=np.float32)
    raw = embedding_response(vectors, "m", 7, "float")
    # compact JSON; each float the shortest decimal that reads back as the same float32
    assert raw == (b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,-0.25]},'
                   b'{"object":"embedding","index":1,"embedding":[1.0,0.1]}],"model":"m",'
                   b'"usage":{"prompt_tokens":7,"total_tokens":7}}')
    body = json.loads(raw)
    assert np.array_equal(np.array([d["embedding"] for d in body["data"]], dtype=np.float32), vectors)
    packed = json.loads(embedding_response(vectors, "m", 7, "base64"))["data"][1]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), vectors[1])


def test_response_float_values_round_trip_and_non_finite_is_null():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 257)).astype(np.float32) * np.float32(1e-3)
    vectors[1] = vectors[1] ** 3  # tiny magnitudes: exponent notation
    floats = json.loads(embedding_response(vectors, "m", 1, "float"))["data"]
    assert np.array_equal(np.array([d["embedding"] for d in floats], dtype=np.float32), vectors)
    packed = json.loads(embedding_response(vectors, "m", 1, "base64"))["data"]
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                                    for d in packed]), vectors)
    bad = np.array([[np.nan, np.inf, 1.0]], dtype=np.float32)
    assert json.loads(embedding_response(bad, "m", 1, "float"))["data"][0]["embedding"] == [None, None, 1.0]
