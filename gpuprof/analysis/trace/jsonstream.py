"""Decode a Chrome trace's `traceEvents` array in chunks, so memory stays bounded.

A 1 GB trace is never held whole: bytes are read (and gunzipped) block by block, each
block is cut at an event boundary and decoded by msgspec into typed structs, which the
caller turns into compact columns before the next block is read.

Cutting: a candidate boundary is a `},` between two events. A wrong candidate (inside a
string or a nested object) always leaves an unbalanced chunk, which fails to decode, so
decoding is the check and an earlier candidate is tried. Everything outside the array
(metadata such as `distributedInfo`) is decoded at the end from the bytes before and
after it.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec

from gpuprof.errors import TraceFormatError

BLOCK_BYTES = 4 * 2**20
# Documents up to this size are decoded in one piece: the structs of a larger one would cost more memory
# than streaming it saves time.
WHOLE_DOCUMENT_BYTES = 4 * 2**20
CANDIDATES_PER_BLOCK = 8
_SPACE_RE = re.compile(rb"\s*")
_ARRAY_START_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
_INDEX_RE = re.compile(r"\$\[(\d+)\]")


class _Blocks:
    """Reads a plain or gzip file block by block; I/O and gzip errors become TraceFormatError."""

    RAW_BYTES = 2**20

    def __init__(self, file: Path, stream: BinaryIO, gzipped: bool):
        self.file = file
        self.stream = stream
        self.inflate = zlib.decompressobj(wbits=31) if gzipped else None
        self.eof = False

    def read_into(self, buffer: bytearray, size: int) -> None:
        """Append up to `size` bytes to `buffer` (fewer only at the end of the file), a piece at a time:
        the block is never held twice."""
        length = len(buffer)
        try:
            for piece in self._pieces(size) if self.inflate is None else self._inflated(size):
                buffer += piece
        except zlib.error as error:
            raise TraceFormatError(f"{self.file}: truncated or corrupt gzip file ({error})") from None
        except OSError as error:
            raise TraceFormatError(f"{self.file}: cannot read ({error.strerror or error})") from None
        self.eof = len(buffer) - length < size

    def _pieces(self, size: int):
        while size > 0 and (piece := self.stream.read(min(size, self.RAW_BYTES))):
            size -= len(piece)
            yield piece

    def _inflated(self, size: int):
        while size > 0:
            if self.inflate.eof:  # a gzip file may hold several members back to back
                rest = self.inflate.unused_data
                self.inflate = zlib.decompressobj(wbits=31)
                raw = rest or self.stream.read(self.RAW_BYTES)
                if not raw:
                    return
            else:
                raw = self.inflate.unconsumed_tail or self.stream.read(self.RAW_BYTES)
                if not raw:
                    raise zlib.error("the file ends inside compressed data")
            piece = self.inflate.decompress(raw, size)
            size -= len(piece)
            yield piece


def open_blocks(file: Path) -> _Blocks:
    try:
        raw = open(file, "rb")
    except OSError as error:
        raise TraceFormatError(f"{file}: cannot read ({error.strerror or error})") from None
    gzipped = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    return _Blocks(file, raw, gzipped)


def _next_token(data: bytes, position: int = 0) -> int:
    """Index of the first non-whitespace byte at or after `position` (no copy)."""
    return _SPACE_RE.match(data, position).end()


def decode_trace(file: Path, event_type, document_type, on_events: Callable[[list, int], None]):
    """Stream the events of `file` to on_events(events, index_of_first) and return the
    metadata decoded as `document_type` (its traceEvents empty)."""
    blocks = open_blocks(file)
    try:
        return _decode(blocks, msgspec.json.Decoder(list[event_type]), document_type, on_events)
    finally:
        blocks.stream.close()


def _decode(blocks: _Blocks, events_decoder, document_type, on_events):
    file = blocks.file
    head = bytearray()
    blocks.read_into(head, WHOLE_DOCUMENT_BYTES)
    start = _next_token(head)
    first = head[start:start + 1]
    if blocks.eof and first in (b"[", b"{"):  # small enough to decode at once, which is fastest
        document = _whole_document(file, head, document_type, events_decoder)
        on_events(document.traceEvents, 0)
        document.traceEvents = []
        return document
    if first == b"[":
        prefix, position = None, start + 1
    elif first == b"{":
        match = _ARRAY_START_RE.search(head)
        while match is None and not blocks.eof:
            blocks.read_into(head, BLOCK_BYTES)
            match = _ARRAY_START_RE.search(head)
        if match is None:
            return _whole_document(file, head, document_type, events_decoder)
        prefix, position = head[: match.end() - 1], match.end()
    else:
        raise TraceFormatError(f"{file}: not a JSON trace (it does not start with '{{' or '[')")
    return _stream(blocks, head, position, prefix, events_decoder, document_type, on_events)


def _stream(blocks: _Blocks, buffer: bytearray, position: int, prefix, events_decoder, document_type, on_events):
    """Decode events from buffer[position:] on, one block at a time, reading more as needed.

    The buffer is a bytearray so each chunk is decoded in place: the byte before its
    first event becomes "[" and the comma after its last one "]" (restored after)."""
    offset = 0
    block = BLOCK_BYTES
    while True:
        if len(buffer) - position < block and not blocks.eof:
            del buffer[: position - 1]  # keep one byte before the next event, for the "["
            position = 1
            blocks.read_into(buffer, block - (len(buffer) - position))
        if blocks.eof and len(buffer) - position < block:
            break
        cut = _cut(blocks.file, buffer, position, position + block, events_decoder, offset)
        if cut is None:  # no boundary in this block (one huge event?): read a bigger one
            block *= 2
            continue
        events, position = cut
        on_events(events, offset)
        offset += len(events)
        block = BLOCK_BYTES
    return _finish(blocks.file, prefix, buffer, position, events_decoder, document_type, on_events, offset)


def _decode_span(file: Path, decoder, buffer: bytearray, start: int, close: int, offset: int):
    """Decode the events in buffer[start:close] as `[...]`, in place; None if that is not
    valid JSON. A type error is the trace's fault and is raised with its event index."""
    saved = buffer[start - 1], buffer[close]
    buffer[start - 1], buffer[close] = ord("["), ord("]")
    view = memoryview(buffer)
    span = view[start - 1: close + 1]
    try:
        return decoder.decode(span)
    except msgspec.ValidationError as error:  # a subclass of DecodeError: valid JSON, wrong shape
        where = _INDEX_RE.sub(lambda m: f"$.traceEvents[{offset + int(m.group(1))}]", str(error))
        raise TraceFormatError(f"{file}: not a torch.profiler trace ({where})") from None
    except msgspec.DecodeError:
        return None
    finally:
        span.release()
        view.release()
        buffer[start - 1], buffer[close] = saved


def _cut(file: Path, buffer: bytearray, start: int, limit: int, decoder, offset: int):
    """Decode the events in buffer[start:limit] up to the last true event boundary;
    returns them and where the next event starts, or None if no boundary decodes."""
    position = limit
    for _ in range(CANDIDATES_PER_BLOCK):
        position = buffer.rfind(b"},", start, position)
        if position <= start:
            return None
        events = _decode_span(file, decoder, buffer, start, position + 1, offset)
        if events is not None:
            return events, _next_token(buffer, position + 2)
    return None


def _finish(file, prefix, buffer: bytearray, position: int, decoder, document_type, on_events, offset):
    """The last events from `position` on, the array's closing bracket, and the metadata after it."""
    cut = _cut(file, buffer, position, len(buffer), decoder, offset)
    if cut is not None:  # all but the last event: then the bracket search below is cheap
        events, position = cut
        on_events(events, offset)
        offset += len(events)
    close = len(buffer)
    while (close := buffer.rfind(b"]", position, close)) >= 0:
        document = _metadata(file, prefix, bytes(buffer[close + 1:]), document_type)
        events = None if document is None else _decode_span(file, decoder, buffer, position, close, offset)
        if events is not None:
            on_events(events, offset)
            return document
    raise TraceFormatError(f"{file}: not valid JSON (the traceEvents array is truncated or malformed)")


def _metadata(file: Path, prefix, suffix: bytes, document_type):
    """The document around the events array, or None if `suffix` cannot follow it."""
    if prefix is None:  # a bare array: nothing may follow
        return None if _next_token(suffix) < len(suffix) else document_type()
    try:
        return msgspec.json.decode(prefix + b"[]" + suffix, type=document_type)
    except msgspec.ValidationError as error:
        raise TraceFormatError(f"{file}: not a torch.profiler trace ({error})") from None
    except msgspec.DecodeError:
        return None


def _whole_document(file: Path, data: bytes, document_type, events_decoder):
    """Decode a document held whole: a bare event array or an object with traceEvents."""
    try:
        start = _next_token(data)
        if data[start:start + 1] == b"[":
            return document_type(traceEvents=events_decoder.decode(data))
        document = msgspec.json.decode(data, type=document_type)
    except msgspec.ValidationError as error:  # a subclass of DecodeError: valid JSON, wrong shape
        raise TraceFormatError(f"{file}: not a torch.profiler trace ({error})") from None
    except msgspec.DecodeError as error:
        raise TraceFormatError(f"{file}: not valid JSON ({error})") from None
    if document.traceEvents is None:
        raise TraceFormatError(f"{file}: not a torch.profiler trace (no 'traceEvents' list)")
    return document
