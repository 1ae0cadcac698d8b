"""Reading static archives and the object headers inside them, for the mobile tests: `ar` members
(GNU and BSD/Darwin naming), ELF and Mach-O headers."""

from __future__ import annotations

import struct
from dataclasses import dataclass

AR_MAGIC = b"!<arch>\n"
AR_HEADER = struct.Struct("16s12s6s6s8s10s2s")
SYMBOL_TABLES = ("/", "/SYM64/", "__.SYMDEF", "__.SYMDEF SORTED", "__.SYMDEF_64", "__.SYMDEF_64 SORTED")

EM_AARCH64 = 183
MH_MAGIC_64 = 0xFEEDFACF
CPU_TYPE_ARM64 = 0x0100000C
LC_BUILD_VERSION = 0x32
PLATFORM_MACOS, PLATFORM_IOS = 1, 2


def archive_members(data: bytes) -> dict[str, bytes]:
    """The object members of an `ar` archive, by name (the symbol index and name table left out)."""
    assert data.startswith(AR_MAGIC), "not an ar archive"
    members, long_names, offset = {}, b"", len(AR_MAGIC)
    while offset < len(data):
        name, *_, size, fmag = AR_HEADER.unpack_from(data, offset)
        assert fmag == b"`\n", f"bad member header at byte {offset}"
        offset += AR_HEADER.size
        size = int(size)
        body = data[offset : offset + size]
        name = name.decode().rstrip()
        if name.startswith("#1/"):  # BSD: the name follows the header, counted in the size
            length = int(name[3:])
            name, body = body[:length].rstrip(b"\0").decode(), body[length:]
        elif name == "//":
            long_names = body
        elif name.startswith("/") and name[1:].isdigit():  # GNU: an offset into the name table
            start = int(name[1:])
            name = long_names[start : long_names.index(b"/\n", start)].decode()
        elif name.endswith("/") and name != "/":
            name = name[:-1]
        if name not in SYMBOL_TABLES and name != "//":
            members[name] = body
        offset += size + size % 2
    return members


@dataclass(frozen=True)
class ObjectHeader:
    format: str  # "elf" or "macho"
    machine: int  # ELF e_machine or Mach-O cputype
    platform: int | None = None  # Mach-O LC_BUILD_VERSION platform


def object_header(obj: bytes) -> ObjectHeader:
    if obj[:4] == b"\x7fELF":
        assert obj[4] == 2 and obj[5] == 1, "expected a 64-bit little-endian ELF object"
        return ObjectHeader("elf", struct.unpack_from("<H", obj, 18)[0])
    magic, cputype, _, _, ncmds = struct.unpack_from("<IIIII", obj, 0)
    assert magic == MH_MAGIC_64, f"neither ELF nor 64-bit Mach-O (magic {magic:#x})"
    platform, offset = None, 32
    for _ in range(ncmds):
        cmd, cmdsize = struct.unpack_from("<II", obj, offset)
        if cmd == LC_BUILD_VERSION:
            platform = struct.unpack_from("<I", obj, offset + 8)[0]
        offset += cmdsize
    return ObjectHeader("macho", cputype, platform)
