"""A checkpoint file torn as a failing disk or an interrupted ``rsync --inplace`` tears it: a tensor's bytes changed,
its zip archive's directory (names, sizes, CRC-32s) as written, so ``torch.load`` reads it without an error."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path


def tear(source: Path, target: Path) -> str:
    """Write to ``target`` a copy of checkpoint ``source`` whose largest tensor record is zeroed; that record's name in
    the archive (``archive/data/3``). ``target`` may be ``source``."""
    whole = source.read_bytes()
    with zipfile.ZipFile(source) as archive:
        record = max(archive.infolist(), key=lambda r: r.file_size if "/data/" in r.filename else -1)
    name_length, extra_length = struct.unpack("<HH", whole[record.header_offset + 26 : record.header_offset + 30])
    start = record.header_offset + 30 + name_length + extra_length
    target.write_bytes(whole[:start] + bytes(record.file_size) + whole[start + record.file_size :])
    return record.filename
