"""The ``/v1/embeddings`` schema (``proxy.protocol.embeddings``): every input shape, the response
body, and each bad field refused with its ``param``."""

from __future__ import annotations

import base64

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


def test_response_float_and_base64():
    vectors = np.array([[0.5, -0.25], [1.0, 0.1]], dtype=np.float32)
    body = embedding_response(vectors, "m", 7, "float")
    assert body == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                             {"object": "embedding", "index": 1, "embedding": [1.0, float(np.float32(0.1))]}]}
    packed = embedding_response(vectors, "m", 7, "base64")["data"][1]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), vectors[1])
