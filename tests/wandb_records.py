"""Reading a W&B offline run file (RUN/wandb/offline-run-*/run-ID.wandb) without wandb's service.

The file is a ':W&B' header (4 bytes, a 2-byte magic, a 1-byte version) followed by LevelDB-log
framing: 32 KiB blocks of chunks, each with a 7-byte header (CRC-32C, length, type: 1 full, 2 first,
3 middle, 4 last); a block's tail shorter than a header is padding. Each whole payload is one
`Record` protocol buffer of wandb's published schema (wandb.proto.wandb_internal_pb2)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_runs(folder: Path) -> list[Path]:
    """The .wandb files of the offline runs under `folder`, oldest first."""
    return sorted(folder.glob("offline-run-*/run-*.wandb"))


def payloads(file: Path) -> list[bytes]:
    data = file.read_bytes()
    ident, _magic, _version = HEADER.unpack_from(data)
    assert ident == b":W&B", f"{file}: not a W&B run file"
    found, partial, position = [], b"", HEADER.size
    while position + CHUNK.size <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK.size:  # padding at a block's end
            position += left
            continue
        _crc, length, kind = CHUNK.unpack_from(data, position)
        if length == 0 and kind == 0:  # the rest of the block is empty
            position += left
            continue
        chunk = data[position + CHUNK.size:position + CHUNK.size + length]
        position += CHUNK.size + length
        if kind == FULL:
            found.append(chunk)
        elif kind == FIRST:
            partial = chunk
        elif kind == MIDDLE:
            partial += chunk
        elif kind == LAST:
            found.append(partial + chunk)
            partial = b""
    return found


def history_rows(file: Path) -> list[dict[str, object]]:
    """Each `log` call's row: metric name -> value."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for payload in payloads(file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item})
    return rows
