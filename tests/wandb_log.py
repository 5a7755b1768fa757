"""Read back what the real wandb package wrote for an offline run.

wandb 0.31 keeps an offline run's data only in its transaction log (`run-<id>.wandb`; no
files/wandb-summary.json until it is synced). That log is the LevelDB log format (32 KiB blocks,
records with a 7-byte header: crc32, length, type) after a 7-byte ':W&B' header, each record a
protobuf `Record` from wandb.proto. This reads the history rows back, for tests only.
"""
import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written: stop before it
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def finished_log(run_dir, timeout: float = 30.0) -> Path:
    """The run's transaction log once it holds the run's exit record. run.finish() can return before
    wandb-core has written the log (seen: 7 bytes, its header alone, right after finish, complete a
    moment later), so a test that reads it at once would see an empty run."""
    log = next(Path(run_dir).glob("run-*.wandb"))
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(log)):
        assert time.monotonic() < deadline, f"{log}: no exit record after {timeout:.0f} s"
        time.sleep(0.1)
    return log


def history(run_dir) -> list:
    """The logged rows of an offline run dir (offline-run-*), as dicts of JSON values."""
    log = finished_log(run_dir)
    rows = []
    for r in records(log):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def summary(run_dir) -> dict:
    """Last value of every key, as W&B's run summary shows it."""
    out = {}
    for row in history(run_dir):
        out.update(row)
    return out


def run_record(run_dir) -> dict:
    """The run's identity as W&B stored it: id, display name, group."""
    log = finished_log(run_dir)
    for r in records(log):
        if r.WhichOneof("record_type") == "run":
            return {"id": r.run.run_id, "name": r.run.display_name, "group": r.run.run_group}
    raise AssertionError(f"no run record in {log}")
