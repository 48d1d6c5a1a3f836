"""Engram table files: one per Engram layer, laid out for O_DIRECT page reads.

    page 0             header: MAGIC, u32 JSON length, JSON TableHeader, zero padding
    pages 1 .. P       data pages: rows_per_page rows of `row_bytes`, zero padding, 16-byte trailer
    after the data     (scale_layout "separate" only) the scale section, page aligned

A row never straddles a page, so one 4 KiB read returns a whole row, and with the "inline" layout its
scales too (values then scales, contiguous). Every data page ends with a trailer
(page number u32, table id u64, crc32 u32 of everything before the crc); a read is used only if the
length, page number, table id and checksum all match, so a short, stale, misplaced or corrupt page
is never served. The table id is random per file: pages copied from another file do not verify.

The header binds the file to what it was converted from: `source_digest` is source.py's digest of the
checkpoint tensors (values and scales), recorded at conversion and compared with the checkpoint's on
every open, so a table of another checkpoint, or of these weights before they were rewritten, is never
served. Version 2 added it; a file of another version is refused like a foreign one (StaleTableError).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

PAGE = 4096
MAGIC = b"DS4ENGRM"
VERSION = 2  # 2: source_digest
TRAILER = struct.Struct("<IQI")  # page number, table id, crc32
VALUE_DTYPES = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}
SCALE_DTYPES = {"e8m0": 1, "float32": 4}  # e8m0: uint8 exponent, value 2 ** (e - 127)


class TableFormatError(ValueError):
    """A table file that is not what it claims (header, size, page checksum); names the file."""


class StaleTableError(TableFormatError):
    """A sound table file that does not belong here: another format version, or converted from other
    tensors than the checkpoint's (source digest). Reconverting replaces it; names the file."""


@dataclass(frozen=True)
class TableHeader:
    table_id: int  # random u64; every data page carries it
    layer_id: int
    rows: int
    row_dim: int
    value_dtype: str
    scale_dtype: str
    scale_block: int  # channels per scale
    scale_layout: str  # "inline" (in each row) or "separate" (a section after the data pages)
    primes: list[int] = field(default_factory=list)  # per column, column order
    offsets: list[int] = field(default_factory=list)
    checksum: str = "crc32-per-page"
    version: int = VERSION
    scale_section_crc: int = 0
    source_digest: str = ""  # source.py's digest of the tensors it was converted from ("": none recorded)

    @property
    def value_bytes(self) -> int:
        return self.row_dim * VALUE_DTYPES[self.value_dtype]

    @property
    def scale_bytes(self) -> int:
        return self.row_dim // self.scale_block * SCALE_DTYPES[self.scale_dtype]

    @property
    def row_bytes(self) -> int:
        return self.value_bytes + (self.scale_bytes if self.scale_layout == "inline" else 0)

    @property
    def rows_per_page(self) -> int:
        return (PAGE - TRAILER.size) // self.row_bytes

    @property
    def data_pages(self) -> int:
        return -(-self.rows // self.rows_per_page)

    @property
    def scale_section_offset(self) -> int:
        return PAGE * (1 + self.data_pages)

    @property
    def scale_section_bytes(self) -> int:
        return self.rows * self.scale_bytes if self.scale_layout == "separate" else 0

    @property
    def file_bytes(self) -> int:
        return self.scale_section_offset + -(-self.scale_section_bytes // PAGE) * PAGE

    def page_of(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page number, byte offset inside the page) of rows."""
        return 1 + row // self.rows_per_page, (row % self.rows_per_page) * self.row_bytes

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True).encode()
        page = MAGIC + struct.pack("<I", len(body)) + body
        if len(page) > PAGE:
            raise TableFormatError(f"header of {len(page)} bytes does not fit in one page")
        return page.ljust(PAGE, b"\0")

    @classmethod
    def decode(cls, page: bytes, where: str) -> "TableHeader":
        if page[: len(MAGIC)] != MAGIC:
            raise TableFormatError(f"{where}: not an Engram table file (bad magic)")
        (length,) = struct.unpack_from("<I", page, len(MAGIC))
        try:
            fields = json.loads(page[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
        except ValueError as exc:
            raise TableFormatError(f"{where}: unreadable header: {exc}") from exc
        if fields.get("version") != VERSION:
            raise StaleTableError(f"{where}: table format version {fields.get('version')}, this server reads {VERSION}")
        header = cls(**fields)
        if header.value_dtype not in VALUE_DTYPES or header.scale_dtype not in SCALE_DTYPES:
            raise TableFormatError(f"{where}: unknown dtypes {header.value_dtype} / {header.scale_dtype}")
        return header


def seal_page(payload: bytes | bytearray, page_no: int, table_id: int) -> bytes:
    """A data page: payload padded, then the trailer with its checksum."""
    body = bytes(payload).ljust(PAGE - TRAILER.size, b"\0") + struct.pack("<IQ", page_no, table_id)
    return body + struct.pack("<I", zlib.crc32(body))


def check_page(page: memoryview | bytes, page_no: int, table_id: int) -> str | None:
    """Why the page must not be used, or None if it verifies."""
    if len(page) != PAGE:
        return f"short read ({len(page)} of {PAGE} bytes)"
    stored_page, stored_id, crc = TRAILER.unpack_from(page, PAGE - TRAILER.size)
    if stored_id != table_id:
        return f"page belongs to table {stored_id:#x}, expected {table_id:#x}"
    if stored_page != page_no:
        return f"page number {stored_page}, expected {page_no}"
    if zlib.crc32(page[: PAGE - 4]) != crc:
        return "checksum mismatch"
    return None
