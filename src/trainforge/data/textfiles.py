"""Data files as bytes: which names are data, gzip-compressed text formats, and whether a file is UTF-8 text.

``train.jsonl.gz`` is JSON Lines compressed with gzip (Anthropic's hh-rlhf ships only such files): it is
read as it is decompressed, with the same rows and ``file:line`` locations as the plain file. Only the
text formats come compressed; Parquet compresses inside itself.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
SNIFF_BYTES = 8192
# a sample with more than this share of bytes that are not UTF-8 text (invalid or control bytes) is binary;
# a text file in another encoding falls under it and gets the per-line "not valid UTF-8" messages instead
BINARY_SHARE = 0.3
_TEXT_CONTROLS = frozenset("\t\n\r\f\v\x1b")
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def text_file_problem(path: Path) -> str | None:
    """Why ``path`` is not UTF-8 text (a NUL byte, a UTF-16/32 byte-order mark, or mostly undecodable or
    control bytes in its first bytes, decompressed for ``.gz``), or None. The reader raises it whatever the
    bad-row policy: a binary file's "rows" are not bad rows to skip, the file is the wrong one."""
    with open_data(path) as f:
        sample = f.read(SNIFF_BYTES)
        more = bool(f.read(1))
    for bom, name in _OTHER_BOMS:
        if sample.startswith(bom):
            return f"{path} is {name} text (it starts with a {name} byte-order mark); re-encode it as UTF-8"
    nul = sample.find(b"\0")
    if nul >= 0:
        return f"{path} is not a text file (byte {nul} is NUL); give a JSONL, JSON, CSV or text file in UTF-8"
    n_bad, first, i = 0, None, 0  # bytes that are not text; the first one (offset, what it is)
    while i < len(sample):
        try:
            text, err = sample[i:].decode("utf-8"), None
        except UnicodeDecodeError as e:
            text, err = sample[i : i + e.start].decode("utf-8"), e
        for k, c in enumerate(text):
            if (c < " " and c not in _TEXT_CONTROLS) or c == "\x7f":
                n_bad += 1
                if first is None:
                    first = (i + len(text[:k].encode("utf-8")), f"control character 0x{ord(c):02x}")
        if err is None or (more and err.reason == "unexpected end of data"):  # a character cut by the sample's end
            break
        n_bad += err.end - err.start
        if first is None:
            first = (i + err.start, f"0x{sample[i + err.start]:02x}, not valid UTF-8")
        i += err.end
    if first is not None and n_bad > BINARY_SHARE * len(sample):
        byte, what = first
        return (
            f"{path} is not a text file (byte {byte} is {what}; {n_bad} of its first {len(sample)} bytes are not text); "
            "give a JSONL, JSON, CSV or text file in UTF-8"
        )
    return None


def strip_bom(raw: bytes) -> bytes:
    """``raw`` without a leading UTF-8 byte-order mark."""
    return raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw


GZIP = ".gz"  # a text format compressed with gzip (Anthropic's hh-rlhf ships train.jsonl.gz), read as it streams
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # not gzip, cut short, or corrupt (BadGzipFile is an OSError)


def data_suffix(path: Path) -> str:
    """The format a data file's name gives: ``.jsonl`` for ``train.jsonl`` and for ``train.jsonl.gz``."""
    if path.suffix == GZIP and len(path.suffixes) >= 2:
        return path.suffixes[-2]
    return path.suffix


def is_data_file(path: Path) -> bool:
    """A file name trainforge reads: a supported suffix, or a text format's suffix then ``.gz``."""
    inner = data_suffix(path)
    return inner in (TEXT_SUFFIXES if path.suffix == GZIP else SUPPORTED_SUFFIXES)


def open_data(path: Path, mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """Open a data file for reading, decompressing it as it is read when it is gzip-compressed."""
    if path.suffix == GZIP:
        return gzip.open(path, mode if "b" in mode else mode.replace("t", "") + "t", **kwargs)
    return open(path, mode, **kwargs)


# ---------------------------------------------------------------- bounded reads (a gzip file may decompress to anything)

MAX_LINE_BYTES = 1 << 28  # 256 MiB: a JSONL row longer than this is no training example (a damaged or hostile file)
WHOLE_FILE_SHARE = 8  # a file parsed whole (JSON array, text) takes several times its size as Python objects
_CHUNK = 1 << 24


_LINE_ENDS = (b"\n", "\n", "\r")  # binary files end lines with \n; text files opened with newline="" also with \r


def bounded_lines(f: IO[Any]) -> Iterator[Any]:
    """The lines of a file (bytes or text); a line over ``MAX_LINE_BYTES`` is skipped without being held, and
    gives None (a one-line ``.jsonl.gz`` that decompresses to many gigabytes would otherwise fill the memory)."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES and raw[-1:] not in _LINE_ENDS:
            while (rest := f.readline(_CHUNK)) and rest[-1:] not in _LINE_ENDS:
                pass
            yield None
        else:
            yield raw


def whole_file_limit() -> int | None:
    """The most bytes a file parsed whole may hold: the system's available memory over ``WHOLE_FILE_SHARE``
    (None where it is not known)."""
    import torch

    from ..hardware.device import available_memory_bytes

    available = available_memory_bytes(torch.device("cpu"))
    return None if available is None else available // WHOLE_FILE_SHARE


def read_whole(path: Path) -> tuple[bytes | None, int | None]:
    """(the file's bytes, decompressed, or None when they exceed ``whole_file_limit``; the limit). A plain file is
    measured before it is read; a compressed one as it decompresses, and left as soon as it passes the limit."""
    limit = whole_file_limit()
    if limit is not None and path.suffix != GZIP and path.stat().st_size > limit:
        return None, limit
    chunks, n = [], 0
    with open_data(path) as f:
        while chunk := f.read(_CHUNK):
            n += len(chunk)
            if limit is not None and n > limit:
                return None, limit
            chunks.append(chunk)
    return b"".join(chunks), limit
