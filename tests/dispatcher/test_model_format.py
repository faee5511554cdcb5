"""The weights file format and the device layout of a model (gpuloom/domain/models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.clients.models import save_weights
from gpuloom.domain.errors import InvalidArgument
from gpuloom.domain.models import (
    DEVICE_ALIGNMENT,
    device_layout,
    header_length,
    parse_header,
)

DTYPES = [np.float32, np.float16, np.float64, np.int64, np.int32, np.int16, np.int8, np.uint8]


def read(path: Path):
    data = path.read_bytes()
    length = header_length(data[:8])
    return data, parse_header(data[8 : 8 + length], len(data))


arrays = st.dictionaries(
    st.text("abcdefghij._", min_size=1, max_size=12),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), min_size=0, max_size=3)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(arrays)
def test_saved_weights_parse_back_and_lay_out_aligned_without_overlap(
    tmp_path_factory: pytest.TempPathFactory, specs: dict
) -> None:
    path = tmp_path_factory.mktemp("w") / "m.safetensors"
    values = {
        name: np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
        for name, (dtype, shape) in specs.items()
    }
    save_weights(path, values)
    data, parsed = read(path)
    assert [t.name for t in parsed.tensors] == list(values)
    for tensor in parsed.tensors:
        begin = parsed.data_start + tensor.data_begin
        assert data[begin : begin + tensor.nbytes] == values[tensor.name].tobytes()
        assert tensor.shape == values[tensor.name].shape
    placed, total = device_layout(parsed.tensors)
    assert total % DEVICE_ALIGNMENT == 0 and total >= DEVICE_ALIGNMENT
    end = 0
    for tensor in placed:
        assert tensor.offset % DEVICE_ALIGNMENT == 0 and tensor.offset >= end
        end = tensor.offset + tensor.nbytes
    assert end <= total


def header(document: object, data_bytes: int = 64) -> tuple[bytes, int]:
    raw = json.dumps(document).encode()
    return raw, 8 + len(raw) + data_bytes


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ([1, 2], "JSON object"),
        ({}, "no tensors"),
        ({"__metadata__": {"a": "b"}}, "no tensors"),
        ({"__metadata__": {"a": 1}, "t": F32}, "__metadata__"),
        ({"t": {**F32, "dtype": "F8"}}, "dtype"),
        ({"t": {**F32, "shape": [2, -2]}}, "shape"),
        ({"t": {**F32, "shape": "2x2"}}, "shape"),
        ({"t": {**F32, "data_offsets": [0, 12]}}, "need 16"),
        ({"t": {**F32, "data_offsets": [60, 76]}}, "data_offsets"),
        ({"t": {**F32, "data_offsets": [8, 4]}}, "data_offsets"),
        ({"t": F32, "u": {**F32, "data_offsets": [8, 24]}}, "overlap"),
        ({"t": [1]}, "must be an object"),
    ],
)
def test_bad_headers_are_refused_naming_what_is_wrong(document: object, words: str) -> None:
    raw, size = header(document)
    with pytest.raises(InvalidArgument) as caught:
        parse_header(raw, size)
    assert words in str(caught.value) and str(caught.value).startswith("path")


def test_a_header_longer_than_the_file_or_not_json_is_refused() -> None:
    raw, _ = header({"t": F32})
    with pytest.raises(InvalidArgument, match="past the end"):
        parse_header(raw, len(raw))
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse_header(b"\xff\xfe", 100)
    with pytest.raises(InvalidArgument, match="8-byte"):
        header_length(b"\x01")
    with pytest.raises(InvalidArgument, match="header length"):
        header_length((1 << 40).to_bytes(8, "little"))


def test_metadata_is_ignored_and_an_empty_tensor_takes_no_bytes() -> None:
    document = {
        "__metadata__": {"format": "pt"},
        "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "t": F32,
    }
    raw, size = header(document)
    parsed = parse_header(raw, size)
    assert [t.name for t in parsed.tensors] == ["empty", "t"]
    placed, total = device_layout(parsed.tensors)
    assert [(t.offset, t.nbytes) for t in placed] == [(0, 0), (0, 16)]
    assert total == DEVICE_ALIGNMENT
