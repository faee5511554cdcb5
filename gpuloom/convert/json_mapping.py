"""The one JSON form of the project's messages: protobuf's JSON mapping, as grpcurl prints it,
with the options every `gpuloom ... --json` uses: field names as in the .proto
(`submitted_at`, not `submittedAt`), every field written even at its default (a script need
not know proto3's defaults), enums by name, 64-bit integers as strings,
`google.protobuf.Timestamp` in RFC 3339. `json_format.Parse` reads it back."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message


def message_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
