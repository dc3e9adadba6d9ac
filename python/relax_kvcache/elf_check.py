"""Structural checks of a 64-bit ELF shared library before the dynamic loader maps it.

The loader trusts the file: a truncated library makes it read past the mapping (SIGBUS), and a
corrupt relocation, symbol, string or hash table entry makes it write or read at a wild
address (SIGSEGV) while it relocates the library or looks a symbol up in it. :func:`check_elf`
bounds every table the loader walks (program headers, the dynamic section, relocations, the
dynamic symbol and string tables, the GNU hash table and symbol versions) against the file and
its segments. It is a check of structure, not of contents: a library whose code was changed is
caught only by its seal (:func:`relax_kvcache.deploy.verify_seal`).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import struct
from typing import BinaryIO, Dict, List, Optional, Tuple, Union

_ELF_MAGIC = b"\x7fELF"
_EHDR, _PHDR, _SHDR, _DYN, _RELA, _SYM = 64, 56, 64, 16, 24, 24  # bytes of 64-bit entries
_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_DYNSYM = 11
_R_RELATIVE = 8  # R_X86_64_RELATIVE / R_AARCH64_RELATIVE is 1027: its addend is checked on x86-64 only
_MAX_RELOC_TYPE = 1100  # beyond every x86-64 / AArch64 relocation type
_MAX_ENTRIES = 1 << 24  # no table of a library is longer; bounds the loops over a corrupt file

# dynamic tags
DT_NULL, DT_NEEDED, DT_PLTRELSZ, DT_PLTGOT, DT_STRTAB, DT_SYMTAB, DT_RELA, DT_RELASZ, DT_RELAENT = 0, 1, 2, 3, 5, 6, 7, 8, 9
DT_STRSZ, DT_SYMENT, DT_INIT, DT_FINI, DT_SONAME, DT_RPATH, DT_PLTREL, DT_JMPREL = 10, 11, 12, 13, 14, 15, 20, 23
DT_INIT_ARRAY, DT_FINI_ARRAY, DT_INIT_ARRAYSZ, DT_FINI_ARRAYSZ, DT_RUNPATH = 25, 26, 27, 28, 29
DT_GNU_HASH, DT_VERSYM, DT_VERNEED, DT_VERNEEDNUM = 0x6FFFFEF5, 0x6FFFFFF0, 0x6FFFFFFE, 0x6FFFFFFF


class ElfError(ValueError):
    """The file is not a complete, well-formed 64-bit ELF shared library (the reason says why)."""


@dataclasses.dataclass(frozen=True)
class _Segment:
    """A PT_LOAD segment: memory ``[vaddr, vaddr + memsz)``, file ``[offset, offset + filesz)``."""

    vaddr: int
    memsz: int
    offset: int
    filesz: int


class _Image:
    """An open ELF file: its size, byte order and loadable segments; reads by file offset or by
    virtual address (only where a segment maps that address to file bytes)."""

    def __init__(self, f: BinaryIO, size: int, order: str, segments: List[_Segment]):
        self.f, self.size, self.order, self.segments = f, size, order, segments
        self.end = max((s.vaddr + s.memsz for s in segments), default=0)

    def read(self, offset: int, length: int) -> bytes:
        self.f.seek(offset)
        data = self.f.read(length)
        if len(data) != length:
            raise ElfError(f"{length} bytes at file offset {offset} run past the end of the file ({self.size} bytes)")
        return data

    def file_offset(self, addr: int, length: int, what: str) -> int:
        """File offset of ``length`` bytes at virtual address ``addr``, all within one segment's file bytes."""
        for s in self.segments:
            if s.vaddr <= addr and addr + length <= s.vaddr + s.filesz:
                return s.offset + addr - s.vaddr
        raise ElfError(f"{what} (address {addr:#x}, {length} bytes) lies outside the file bytes of every loadable segment")

    def mapped(self, addr: int, length: int) -> bool:
        return any(s.vaddr <= addr and addr + length <= s.vaddr + s.memsz for s in self.segments)

    def table(self, addr: int, length: int, what: str) -> bytes:
        return self.read(self.file_offset(addr, length, what), length)


def check_elf(path: Union[str, "os.PathLike[str]"]) -> None:
    """Raise :class:`ElfError` unless ``path`` is a well-formed 64-bit ELF shared library: the
    header, every program header and segment within the file, and the dynamic section with the
    tables the loader walks (see the module docstring)."""
    try:
        _check(path)
    except ElfError:
        raise
    except (struct.error, OverflowError, ValueError) as err:  # offsets beyond any file: a corrupt table
        raise ElfError(f"a table points outside the file ({err})") from None


def _check(path: Union[str, "os.PathLike[str]"]) -> None:
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read, a device never end
        raise ElfError("not a regular file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = f.read(_EHDR)
        if header[:4] != _ELF_MAGIC:
            raise ElfError(f"not an ELF file (starts with {header[:4]!r}, expected {_ELF_MAGIC!r})")
        if len(header) < _EHDR:
            raise ElfError(f"the file is {size} bytes, shorter than an ELF header ({_EHDR} bytes)")
        if header[4] != 2:
            raise ElfError(f"ELF class {header[4]} (expected 2, 64-bit)")
        if header[5] not in (1, 2):
            raise ElfError(f"ELF data encoding {header[5]} (expected 1 or 2)")
        order = "<" if header[5] == 1 else ">"
        image = _Image(f, size, order, [])
        image.segments, dynamic = _program_headers(image, header)
        image.end = max((s.vaddr + s.memsz for s in image.segments), default=0)
        shdr_dynsym = _section_header_dynsym(image, header)
        if dynamic is not None:
            _check_dynamic(image, dynamic, header[18:20], shdr_dynsym)


def _program_headers(image: _Image, header: bytes) -> Tuple[List[_Segment], Optional[_Segment]]:
    order = image.order
    phoff, shoff = struct.unpack_from(order + "QQ", header, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", header, 0x36)
    if shoff and shoff + shnum * shentsize > image.size:
        raise ElfError(f"the section header table (offset {shoff}, {shnum} x {shentsize} bytes) ends past the end "
                       f"of the file ({image.size} bytes): the file is truncated")
    if phnum and (phentsize < _PHDR or phoff + phnum * phentsize > image.size):
        raise ElfError(f"the program header table (offset {phoff}, {phnum} x {phentsize} bytes) does not fit in "
                       f"the file ({image.size} bytes): the file is truncated or corrupt")
    segments, dynamic = [], None
    for i in range(phnum):
        p_type, _, offset, vaddr, _, filesz, memsz, _ = struct.unpack(order + "IIQQQQQQ",
                                                                      image.read(phoff + i * phentsize, _PHDR))
        if offset + filesz > image.size:
            raise ElfError(f"segment {i} (file offset {offset}, {filesz} bytes) ends past the end of the file "
                           f"({image.size} bytes): the file is truncated")
        if p_type == _PT_LOAD:
            if filesz > memsz or vaddr + memsz >= 1 << 47:
                raise ElfError(f"loadable segment {i} maps {filesz} file bytes into {memsz} bytes at {vaddr:#x}")
            segments.append(_Segment(vaddr, memsz, offset, filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = _Segment(vaddr, memsz, offset, filesz)
    if dynamic is not None and not segments:
        raise ElfError("a dynamic section but no loadable segment")
    return segments, dynamic


def _section_header_dynsym(image: _Image, header: bytes) -> Optional[Tuple[int, int, int]]:
    """(address, size, entry size) of the .dynsym section header, if the file has section headers."""
    shoff, = struct.unpack_from(image.order + "Q", header, 0x28)
    shentsize, shnum = struct.unpack_from(image.order + "HH", header, 0x3A)
    if not shoff or shentsize < _SHDR:
        return None
    for i in range(min(shnum, _MAX_ENTRIES)):
        _, sh_type, _, addr, _, sh_size, _, _, _, entsize = struct.unpack(
            image.order + "IIQQQQIIQQ", image.read(shoff + i * shentsize, _SHDR))
        if sh_type == _SHT_DYNSYM:
            return addr, sh_size, entsize
    return None


def _check_dynamic(image: _Image, dynamic: _Segment, machine: bytes,
                   shdr_dynsym: Optional[Tuple[int, int, int]]) -> None:
    tags = _dynamic_entries(image, dynamic)
    one = {tag: values[0] for tag, values in tags.items()}
    for tag, want in ((DT_RELAENT, _RELA), (DT_SYMENT, _SYM), (DT_PLTREL, DT_RELA)):
        if tag in one and one[tag] != want:
            raise ElfError(f"dynamic entry {tag} is {one[tag]} (expected {want})")
    strsz = one.get(DT_STRSZ, 0)
    if DT_STRTAB in one:
        image.file_offset(one[DT_STRTAB], strsz, "the dynamic string table")
    for tag in (DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH):
        for value in tags.get(tag, []):
            if value >= strsz:
                raise ElfError(f"dynamic entry {tag} names string {value}, past the string table ({strsz} bytes)")
    if DT_PLTGOT in one and not image.mapped(one[DT_PLTGOT], 24):  # lazy binding writes its first 3 slots
        raise ElfError(f"the PLT's global offset table ({one[DT_PLTGOT]:#x}) is not in a loadable segment")
    for tag in (DT_INIT, DT_FINI):
        if tag in one and not image.mapped(one[tag], 1):
            raise ElfError(f"the {'init' if tag == DT_INIT else 'fini'} function ({one[tag]:#x}) is not in a loadable segment")
    for addr_tag, size_tag, what in ((DT_INIT_ARRAY, DT_INIT_ARRAYSZ, "init"), (DT_FINI_ARRAY, DT_FINI_ARRAYSZ, "fini")):
        if addr_tag in one and not image.mapped(one[addr_tag], one.get(size_tag, 0)):
            raise ElfError(f"the {what} array ({one[addr_tag]:#x}, {one.get(size_tag, 0)} bytes) is not in a loadable segment")
    nsyms = _dynsym_count(image, one, shdr_dynsym)
    if DT_SYMTAB in one and nsyms is not None:
        _check_symbols(image, image.table(one[DT_SYMTAB], nsyms * _SYM, "the dynamic symbol table"), strsz)
    relative = _R_RELATIVE if machine == struct.pack(image.order + "H", 62) else None  # EM_X86_64
    for addr_tag, size_tag, what in ((DT_RELA, DT_RELASZ, "relocations"), (DT_JMPREL, DT_PLTRELSZ, "PLT relocations")):
        if addr_tag in one:
            _check_relocations(image, image.table(one[addr_tag], one.get(size_tag, 0), f"the {what}"), nsyms, relative)
    if DT_GNU_HASH in one and nsyms is not None:
        _check_gnu_hash(image, one[DT_GNU_HASH], nsyms)
    if DT_VERSYM in one and nsyms is not None:
        image.table(one[DT_VERSYM], 2 * nsyms, "the symbol version table")
    if DT_VERNEED in one:
        _check_verneed(image, one[DT_VERNEED], one.get(DT_VERNEEDNUM, 0), strsz)


def _dynamic_entries(image: _Image, dynamic: _Segment) -> Dict[int, List[int]]:
    data = image.read(dynamic.offset, dynamic.filesz - dynamic.filesz % _DYN)
    tags: Dict[int, List[int]] = {}
    for tag, value in struct.iter_unpack(image.order + "qQ", data):
        if tag == DT_NULL:
            return tags
        tags.setdefault(tag, []).append(value)
    raise ElfError(f"the dynamic section ({dynamic.filesz} bytes at offset {dynamic.offset}) has no terminating entry")


def _dynsym_count(image: _Image, one: Dict[int, int], shdr_dynsym: Optional[Tuple[int, int, int]]) -> Optional[int]:
    """Number of dynamic symbols, from the .dynsym section header (None without one)."""
    if shdr_dynsym is None:
        return None
    addr, size, entsize = shdr_dynsym
    if entsize != _SYM or size % _SYM or size // _SYM > _MAX_ENTRIES:
        raise ElfError(f"the .dynsym section holds {size} bytes of {entsize}-byte entries (expected {_SYM}-byte entries)")
    if DT_SYMTAB in one and one[DT_SYMTAB] != addr:
        raise ElfError(f"the dynamic symbol table is at {one[DT_SYMTAB]:#x}, its section at {addr:#x}")
    return size // _SYM


def _check_symbols(image: _Image, table: bytes, strsz: int) -> None:
    for i, (name, _, _, shndx, value, _) in enumerate(struct.iter_unpack(image.order + "IBBHQQ", table)):
        if name >= max(strsz, 1):
            raise ElfError(f"dynamic symbol {i} names string {name}, past the string table ({strsz} bytes)")
        if shndx != 0 and shndx < 0xFF00 and value > image.end:
            raise ElfError(f"dynamic symbol {i} is defined at {value:#x}, past the loadable segments (end {image.end:#x})")


def _check_relocations(image: _Image, table: bytes, nsyms: Optional[int], relative: Optional[int]) -> None:
    if len(table) % _RELA:
        raise ElfError(f"a relocation table of {len(table)} bytes (expected a multiple of {_RELA})")
    for i, (offset, info, addend) in enumerate(struct.iter_unpack(image.order + "QQq", table)):
        kind, sym = info & 0xFFFFFFFF, info >> 32
        if kind > _MAX_RELOC_TYPE or not image.mapped(offset, 8):
            raise ElfError(f"relocation {i} (type {kind}) writes at {offset:#x}, outside the loadable segments")
        if nsyms is not None and sym >= nsyms:
            raise ElfError(f"relocation {i} names symbol {sym} of {nsyms}")
        if kind == relative and not 0 <= addend <= image.end:
            raise ElfError(f"relative relocation {i} points at {addend:#x}, outside the loadable segments")


def _check_gnu_hash(image: _Image, addr: int, nsyms: int) -> None:
    nbuckets, symoffset, bloom_size, _ = struct.unpack(image.order + "IIII", image.table(addr, 16, "the GNU hash table"))
    if symoffset > nsyms or nbuckets > _MAX_ENTRIES or bloom_size > _MAX_ENTRIES:
        raise ElfError(f"the GNU hash table has {nbuckets} buckets from symbol {symoffset} of {nsyms}")
    start = addr + 16 + 8 * bloom_size
    buckets = struct.unpack(image.order + f"{nbuckets}I", image.table(start, 4 * nbuckets, "the GNU hash buckets"))
    image.table(start + 4 * nbuckets, 4 * (nsyms - symoffset), "the GNU hash chains")
    for i, first in enumerate(buckets):
        if first and not symoffset <= first < nsyms:
            raise ElfError(f"GNU hash bucket {i} starts at symbol {first} (expected {symoffset} to {nsyms - 1})")


def _check_verneed(image: _Image, addr: int, count: int, strsz: int) -> None:
    """The version-need chain, as glibc's loader walks it: entries until a zero link (``count``,
    DT_VERNEEDNUM, is not what ends it), each with its versions. Every entry is 16 bytes of the
    file and links only go forward, so the walk is linear in the file's size."""
    del count  # the loader follows the links
    budget = image.size // 16
    while True:
        budget -= 1
        if budget < 0:
            raise ElfError("the version-need chain is longer than the file can hold")
        _, version_count, file, aux, nxt = struct.unpack(image.order + "HHIII",
                                                         image.table(addr, 16, "the version needs"))
        if file >= strsz:
            raise ElfError(f"a version need names file string {file}, past the string table ({strsz} bytes)")
        at = addr + aux
        for _ in range(version_count):
            budget -= 1
            if budget < 0:
                raise ElfError("the version-need chain is longer than the file can hold")
            _, _, _, name, aux_next = struct.unpack(image.order + "IHHII", image.table(at, 16, "the version needs"))
            if name >= strsz:
                raise ElfError(f"a version names string {name}, past the string table ({strsz} bytes)")
            if not aux_next:
                break
            at += aux_next
        if not nxt:
            break
        addr += nxt
