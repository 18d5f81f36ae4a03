"""Read an offline W&B run file (``run-<id>.wandb``) back. A 7-byte header (``:W&B``, magic, version)
then a LevelDB-style log: 32 KiB blocks of chunks ``crc32c(4) | length(2 LE) | type(1) | data``
(FULL=1, FIRST=2, MIDDLE=3, LAST=4; a block tail under 7 bytes is padding), each reassembled
payload a ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def read_wandb_payloads(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    out: list[bytes] = []
    pos, parts = _HEADER, []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left  # zero padding up to the block end
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if not 1 <= kind <= 4:
            raise ValueError(f"{path}: bad chunk type {kind} at byte {pos}")
        parts = [chunk] if kind in (1, 2) else [*parts, chunk]
        if kind in (1, 4):
            out.append(b"".join(parts))
    return out


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The ``wandb.log`` rows of a run file, as dicts of decoded JSON values."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for payload in read_wandb_payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            )
    return rows
