"""Reading back what W&B wrote in offline mode (test helper; needs `wandb` installed).

Offline, W&B writes a run as protobuf `Record`s in a LevelDB-style log,
`<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`: a 7-byte file header (":W&B", magic,
version), then 32 KiB blocks of records, each with a 7-byte header (crc32, length, type:
full, or first/middle/last pieces of one record). wandb 0.31 ships no Python reader of it.
"""

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7  # file: ":W&B", magic, version; record: crc32, length, type
_FULL, _LAST = 1, 4


def read_records(path: Path, *, timeout_s: float = 30.0) -> list:
    """The `Record`s of a finished run's `.wandb` file, in order.

    `run.finish()` can return before W&B's service process has written the file to its end
    (the `exit` record): wait for that record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = _parse_records(path.read_bytes())
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.1)


def _parse_records(data: bytes) -> list:
    if len(data) < _HEADER:
        return []
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if pos + length > len(data):  # the writer is still at it
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records) -> list[dict]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {".".join(i.nested_key) or i.key: i.value_json for i in record.history.item}
            )
    return rows


def logged_config(records) -> dict:
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else ()
        updates = record.config.update if kind == "config" else updates
        for item in updates:
            config[item.key] = json.loads(item.value_json)
    return config


def run_files(run_dir: Path) -> list[Path]:
    """The `.wandb` logs of every W&B run started in `run_dir`, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
