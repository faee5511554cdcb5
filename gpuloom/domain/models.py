"""Shared model weights (FaST-GShare's model sharing): the weights file format and the layout
of a model's tensors in one block of device memory. Pure: bytes in, descriptions out.

The file format is the safetensors layout: an 8-byte little-endian header length N, N bytes of
a JSON object, then the data. Each key of the object but "__metadata__" is a tensor:
    {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]}
with offsets relative to the start of the data; END - BEGIN must be the product of the shape
times the dtype's size, inside the data, and tensors must not overlap. "__metadata__" (an
object of strings) is allowed and ignored.

On the device a model is one allocation: its tensors in file order, each at an offset aligned
to DEVICE_ALIGNMENT bytes, so one IPC handle shares the whole model.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass

from gpuloom.domain.errors import InvalidArgument

MODEL_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
REPLICA_ID = MODEL_NAME
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 100_000
MAX_TENSOR_NAME_CHARS = 1024
MAX_DIMENSIONS = 16
DEVICE_ALIGNMENT = 256
METADATA_KEY = "__metadata__"

# dtype -> bytes per element (the safetensors names).
DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def check_model_name(field: str, value: str) -> str:
    if not isinstance(value, str) or not MODEL_NAME.fullmatch(value):
        raise InvalidArgument(field, "must be 1..128 characters of A-Z a-z 0-9 . _ : -")
    return value


def check_replica_id(field: str, value: str) -> str:
    if not isinstance(value, str) or not REPLICA_ID.fullmatch(value):
        raise InvalidArgument(field, "must be 1..128 characters of A-Z a-z 0-9 . _ : -")
    return value


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a weights file: where its bytes are in the file's data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data_begin: int
    data_end: int

    @property
    def nbytes(self) -> int:
        return self.data_end - self.data_begin


@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """One tensor of a loaded model: its place in the model's device allocation."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class WeightsFile:
    """A parsed header: the tensors and where the data section starts in the file."""

    tensors: tuple[TensorSpec, ...]
    data_start: int
    data_bytes: int


def header_length(prefix: bytes, field: str = "path") -> int:
    """The header length from the file's first 8 bytes."""
    if len(prefix) < HEADER_LENGTH_BYTES:
        raise InvalidArgument(field, "is not a weights file: shorter than its 8-byte header length")
    length = int.from_bytes(prefix[:HEADER_LENGTH_BYTES], "little")
    if length < 2 or length > MAX_HEADER_BYTES:
        raise InvalidArgument(
            field, f"is not a weights file: header length {length} not in 2..{MAX_HEADER_BYTES}"
        )
    return length


def parse_header(header: bytes, file_bytes: int, field: str = "path") -> WeightsFile:
    """Validate a header (the N bytes after the length) against the file's size."""
    data_start = HEADER_LENGTH_BYTES + len(header)
    if data_start > file_bytes:
        raise InvalidArgument(field, "is not a weights file: the header runs past the end")
    try:
        document = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise InvalidArgument(field, f"header is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(field, "header must be a JSON object")
    data_bytes = file_bytes - data_start
    tensors = []
    for name, entry in document.items():
        if name == METADATA_KEY:
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise InvalidArgument(field, f"{METADATA_KEY} must be an object of strings")
            continue
        tensors.append(_tensor(field, name, entry, data_bytes))
    if not tensors:
        raise InvalidArgument(field, "holds no tensors")
    if len(tensors) > MAX_TENSORS:
        raise InvalidArgument(field, f"holds {len(tensors)} tensors, at most {MAX_TENSORS}")
    ordered = sorted(tensors, key=lambda t: (t.data_begin, t.data_end))
    for before, after in itertools.pairwise(ordered):
        if after.data_begin < before.data_end:
            raise InvalidArgument(
                field, f"tensors {before.name!r} and {after.name!r} overlap in the data"
            )
    return WeightsFile(tuple(tensors), data_start, data_bytes)


def _tensor(field: str, name: str, entry: object, data_bytes: int) -> TensorSpec:
    where = f"{field}: tensor {name[:80]!r}"
    if not name or len(name) > MAX_TENSOR_NAME_CHARS:
        raise InvalidArgument(field, f"tensor names must be 1..{MAX_TENSOR_NAME_CHARS} characters")
    if not isinstance(entry, dict):
        raise InvalidArgument(where, "must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"{where}.dtype", f"{dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMENSIONS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise InvalidArgument(
            f"{where}.shape", f"must be a list of at most {MAX_DIMENSIONS} integers >= 0"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise InvalidArgument(
            f"{where}.data_offsets", f"must be [begin, end] with 0 <= begin <= end <= {data_bytes}"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise InvalidArgument(
            f"{where}.data_offsets",
            f"span {offsets[1] - offsets[0]} bytes, the shape and dtype need {expected}",
        )
    return TensorSpec(name, dtype, tuple(shape), offsets[0], offsets[1])


def align(value: int, alignment: int = DEVICE_ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def device_layout(tensors: tuple[TensorSpec, ...]) -> tuple[tuple[DeviceTensor, ...], int]:
    """Each tensor's offset in the model's one allocation (file order, aligned), and the
    allocation's size (at least one alignment unit: the driver refuses empty allocations)."""
    placed = []
    offset = 0
    for tensor in tensors:
        offset = align(offset)
        placed.append(DeviceTensor(tensor.name, tensor.dtype, tensor.shape, offset, tensor.nbytes))
        offset += tensor.nbytes
    return tuple(placed), max(align(offset), DEVICE_ALIGNMENT)


def encode_header(tensors: dict[str, tuple[str, tuple[int, ...], int]]) -> bytes:
    """The length-prefixed header of a weights file whose data is the tensors' bytes
    back to back in the order given (name -> dtype, shape, nbytes)."""
    document: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        document[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(document, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    return len(header).to_bytes(HEADER_LENGTH_BYTES, "little") + header
