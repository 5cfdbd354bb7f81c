"""Request parsing and reply serialization of the daemon's handlers (auditor/daemon/server.py).

Requests are parsed by our own deserializer: bytes that are not a valid message arrive as a
`MalformedRequest` and are refused with INVALID_ARGUMENT instead of gRPC's INTERNAL; a batch whose
checksum does not match its bytes as received arrives as a `CorruptBatch` (ABORTED). Replies
serialized in a worker process pass through as bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import Message

from numaudit.auditor.daemon.validate import CorruptedInTransit, ValidationError
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.checksum import received_records_checksum


class MalformedRequest:
    """What our deserializer returns for bytes that do not parse as the expected message."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


class CorruptBatch:
    """What our deserializer returns for a RecordBatch whose `records_crc32` does not match the
    bytes received: corrupted in transit (ABORTED, the agent resends)."""

    __slots__ = ()


def _lenient_parser(cls: Any) -> Callable[[bytes], Any]:
    type_name = cls.DESCRIPTOR.full_name
    is_batch = cls is pb.RecordBatch

    def parse(data: bytes) -> Any:
        try:
            message = cls.FromString(data)
        except Exception:  # DecodeError, recursion limits: the peer's fault, reported in the
                           # handler
            return MalformedRequest(type_name)
        if is_batch and message.HasField("records_crc32"):
            # Checked on the bytes as received (wire/checksum.py), not on a re-encoding: any
            # valid encoding passes. Cleared once checked, so validation does not redo it.
            try:
                if received_records_checksum(data) != message.records_crc32:
                    return CorruptBatch()
            except ValueError:
                return MalformedRequest(type_name)
            message.ClearField("records_crc32")
        # Fields this build does not know are ignored: dropped here, never stored or hashed.
        message.DiscardUnknownFields()
        return message

    return parse


def _parsed(message: Any) -> Any:
    if isinstance(message, MalformedRequest):
        raise ValidationError("request", f"not a valid {message.type_name}")
    if isinstance(message, CorruptBatch):
        raise CorruptedInTransit("records_crc32", "does not match the records as received "
                                                  "(corrupted in transit); resend the batch")
    return message


async def _parsed_stream(messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for message in messages:
        yield _parsed(message)


def _serializer(cls: type[Message]) -> Callable[[Any], bytes]:
    """A response serializer that passes bytes through: a handler whose reply was serialized
    in a worker process (Compare's reply, Watch's events) returns those bytes, so the daemon
    never holds a large reply as a message or serializes it on its event loop."""
    serialize = cls.SerializeToString

    def to_bytes(reply: Any) -> bytes:
        return reply if type(reply) is bytes else serialize(reply)

    return to_bytes
