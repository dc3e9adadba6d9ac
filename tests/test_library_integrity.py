"""Corrupt kernel libraries: refused before they are mapped, never a crash.

Libraries we write carry a seal (the SHA-256 of their bytes, appended); a corrupt copy of one is
refused whatever byte changed. A library without a seal is checked for structure: every table
the dynamic loader walks must lie within the file and its segments (a corrupt relocation
crashed the loader with SIGSEGV). The tests corrupt real libraries with a small ELF parser of
their own and load them in child processes, where a crash cannot take pytest down.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import build, deploy

TINY = rk.KVCacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=16, page_size=4, max_num_seqs=4,
                        max_total_seq_len=64, prefill_chunk_size=16, dtype="float32")


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    """A kernel library as export_kernels writes it (sealed)."""
    return rk.export_kernels(TINY, tvm.target.Target("llvm"), tmp_path_factory.mktemp("sealed") / "kernels.so")


@pytest.fixture(scope="module")
def unsealed(sealed, tmp_path_factory):
    """The same library without its seal, as other tools write libraries."""
    path = tmp_path_factory.mktemp("unsealed") / "kernels.so"
    path.write_bytes(sealed.read_bytes()[:-len(deploy.SEAL_MARK) - 32])
    return path


def _load_all_in_child(paths):
    """deploy.load each path in one child process; returns (return code, per-path outcome lines)."""
    code = ("import sys\nfrom relax_kvcache import deploy\n"
            "for p in sys.argv[1:]:\n"
            "    print('start', p, flush=True)\n"
            "    try:\n        deploy.load(p)\n        print('loaded', flush=True)\n"
            "    except deploy.DeployError as e:\n        print('refused', str(e).replace(chr(10), ' '), flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, env=env,
                         timeout=300)
    return run.returncode, run.stdout.splitlines(), run.stderr


# -- a minimal ELF reader of the tests' own (64-bit little-endian) -----------------------------

def _sections(data):
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, _, _, addr, offset, size, _, _, _, entsize in headers:
        end = data.index(b"\0", names_at + name)
        out[data[names_at + name:end].decode()] = (addr, offset, size, entsize)
    return out


def _dynamic_entry_offset(data, tag):
    _, offset, size, _ = _sections(data)[".dynamic"]
    for at in range(offset, offset + size, 16):
        if struct.unpack_from("<q", data, at)[0] == tag:
            return at
    raise AssertionError(f"no dynamic entry {tag}")


def _patched(data, offset, fmt, value):
    data = bytearray(data)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _first_relocation(data):
    return _sections(data)[".rela.dyn"][1]


def _corruptions(data):
    """(name, corrupt bytes, expected message) of one corrupt loader table each."""
    dynsym = _sections(data)[".dynsym"][1]
    gnu_hash = _sections(data)[".gnu.hash"][1]
    return [
        ("relocation target", _patched(data, _first_relocation(data), "<Q", 0x7F0000000000),
         "relocation 0 .* outside the loadable segments"),
        ("relocation symbol", _patched(data, _first_relocation(data) + 12, "<I", 0xFFFF), "names symbol 65535"),
        ("relative addend", _patched(data, _first_relocation(data) + 16, "<q", 1 << 40), "points at 0x10000000000"),
        ("symbol name", _patched(data, dynsym + 24, "<I", 0x7FFFFFF), "symbol 1 names string 134217727"),
        ("string table size", _patched(data, _dynamic_entry_offset(data, 10) + 8, "<Q", 1 << 40),
         "the dynamic string table"),
        ("init function", _patched(data, _dynamic_entry_offset(data, 12) + 8, "<Q", 1 << 44), "init function"),
        ("hash bucket", _patched(data, gnu_hash + 16 + 8 * struct.unpack_from("<I", data, gnu_hash + 8)[0], "<I",
                                 0xFFFFFF), "GNU hash bucket 0"),
        ("no terminating dynamic entry", _no_dt_null(data), "no terminating entry"),
    ]


def _no_dt_null(data):
    _, offset, size, _ = _sections(data)[".dynamic"]
    data = bytearray(data)
    for at in range(offset, offset + size, 16):
        if struct.unpack_from("<q", data, at)[0] == 0:
            struct.pack_into("<qQ", data, at, 0x6FFFFFF9, 0)  # DT_RELACOUNT 0 in place of every DT_NULL
    return bytes(data)


# -- the seal ------------------------------------------------------------------------------------

def test_export_seals_the_library(sealed):
    data = sealed.read_bytes()
    body, mark, digest = data[:-len(deploy.SEAL_MARK) - 32], data[-len(deploy.SEAL_MARK) - 32:-32], data[-32:]
    assert mark == deploy.SEAL_MARK and digest == hashlib.sha256(body).digest()
    assert deploy.verify_seal(sealed)
    deploy.seal_library(sealed)  # sealing again changes nothing
    assert sealed.read_bytes() == data
    deploy.load(sealed)


def test_a_changed_byte_of_a_sealed_copy_is_refused(sealed, tmp_path):
    """Any byte: code, data or the seal itself; the copy (another name) keeps the seal."""
    rng = random.Random(1)
    data = sealed.read_bytes()
    for i, at in enumerate([rng.randrange(len(data) - 53) for _ in range(3)] + [len(data) - 1]):
        copy = tmp_path / f"copy{i}.so"
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        copy.write_bytes(bytes(bad))
        with pytest.raises(deploy.DeployError, match=r"copy[0-9]\.so'.*the library is corrupt"):
            deploy.load(copy)


def _replace_with(path, data):
    """Replace the file (a new inode: this process may have the old one mapped)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_corrupt_cached_library_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_KVCACHE_CACHE_DIR", str(tmp_path))
    target = tvm.target.Target("llvm")
    cached = build.cache_path(build.kernel_set_spec(TINY), target)
    rk.export_kernels(TINY, target, tmp_path / "first.so")  # compiles into the cache; nothing maps it
    bad = bytearray(cached.read_bytes())
    bad[len(bad) // 2] ^= 0x10
    _replace_with(cached, bytes(bad))
    messages = []
    module = build.build_kernels(TINY, target, progress=messages.append)
    assert any(m.startswith("compiling kernels") for m in messages), messages
    assert deploy.verify_seal(cached) and module is not None
    _replace_with(cached, bytes(bad))
    exported = tmp_path / "out.so"
    rk.export_kernels(TINY, target, exported)  # a corrupt cache entry is not copied out either
    assert deploy.verify_seal(exported)


# -- libraries without a seal -------------------------------------------------------------------

def test_crafted_loader_corruptions_are_refused(unsealed, tmp_path):
    data = unsealed.read_bytes()
    deploy.check_elf(unsealed)
    paths = []
    for i, (name, corrupt, message) in enumerate(_corruptions(data)):
        path = tmp_path / f"bad{i}.so"
        path.write_bytes(corrupt)
        with pytest.raises(deploy.DeployError, match=message):
            deploy.check_elf(path)
        paths.append(path)
    returncode, lines, stderr = _load_all_in_child(paths)
    assert returncode == 0, stderr[-2000:]
    assert sum(line.startswith("refused") for line in lines) == len(paths), lines


def test_random_flips_in_loader_tables_never_crash(unsealed, tmp_path):
    """Regression: 4 of 60 random flips in the first pages crashed the dynamic loader."""
    rng = random.Random(20261124)
    data = unsealed.read_bytes()
    _, dynamic_at, dynamic_size, _ = _sections(data)[".dynamic"]
    paths = []
    for i in range(40):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(64, 4096) if rng.random() < 0.8 else rng.randrange(dynamic_at, dynamic_at + dynamic_size)
            bad[at] = rng.randrange(256)
        path = tmp_path / f"flip{i}.so"
        path.write_bytes(bytes(bad))
        paths.append(path)
    returncode, lines, stderr = _load_all_in_child(paths)
    last = next((line for line in reversed(lines) if line.startswith("start")), "")
    assert returncode == 0, f"child died ({returncode}) at {last}: {stderr[-2000:]}"
    outcomes = [line.split()[0] for line in lines if not line.startswith("start")]
    assert len(outcomes) == len(paths) and "refused" in outcomes


def test_system_libraries_pass_the_structure_check():
    """No false alarms: TVM's own libraries and the C library are well formed."""
    import glob

    found = glob.glob(os.path.join(os.path.dirname(tvm.__file__), "**", "*.so"), recursive=True)
    found += glob.glob("/lib/*-linux-gnu/libc.so.6") + glob.glob("/lib/*-linux-gnu/libm.so.6")
    assert len(found) >= 3, found
    for path in found:
        deploy.check_elf(path)


def test_a_huge_version_need_count_does_not_hang(unsealed, tmp_path):
    """The loader follows the version-need chain's links, not its count; so does the check."""
    import time

    data = unsealed.read_bytes()
    path = tmp_path / "verneednum.so"
    path.write_bytes(_patched(data, _dynamic_entry_offset(data, 0x6FFFFFFF) + 8, "<Q", (1 << 32) - 1))
    start = time.perf_counter()
    deploy.check_elf(path)
    assert time.perf_counter() - start < 5


# -- eleventh red-team round ----------------------------------------------------------------------

def _dynsym_names(data):
    _, dynsym, size, _ = _sections(data)[".dynsym"]
    _, dynstr, _, _ = _sections(data)[".dynstr"]
    return [data[dynstr + struct.unpack_from("<I", data, dynsym + 24 * i)[0]:].split(b"\0")[0]
            for i in range(size // 24)]


def test_corruptions_the_loader_survives_until_a_call_are_refused(unsealed, sealed, tmp_path):
    """The trial load bound symbols lazily and took only a signal as a failure: the loader's own
    assertion (exit 127) killed the real load, and a symbol that cannot be bound crashed at the
    first kernel call. A seal skipped the trial altogether (anyone can seal a file)."""
    data = unsealed.read_bytes()
    _, dynsym, _, _ = _sections(data)[".dynsym"]
    _, dynstr, dynstr_size, _ = _sections(data)[".dynstr"]
    _, versym, _, _ = _sections(data)[".gnu.version"]
    memset = _dynsym_names(data).index(b"memset")
    version_name = data[dynstr:dynstr + dynstr_size].index(b"GLIBC_2.")
    cases = {
        "relative relocation retyped": (_patched(data, _first_relocation(data) + 2 * 24 + 8, "<Q", 1),
                                        "crashed on it .exit 127"),
        "symbol renamed to a version": (_patched(data, dynsym + 24 * memset, "<I", version_name),
                                        "refuses it: .*undefined symbol"),
        "version index out of range": (_patched(data, versym + 2 * memset, "<H", 0x7FFF), "could not load"),
    }
    paths = []
    for i, (name, (corrupt, message)) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.so"
        path.write_bytes(corrupt)
        with pytest.raises(deploy.DeployError, match=message):
            deploy.check_loads(path)
        paths.append(path)
    sealed_bad = tmp_path / "sealed_bad.so"  # the init array pointed into data, then sealed
    sealed_bad.write_bytes(_patched(data, _first_relocation(data) + 16, "<q", 0x1E000))
    deploy.seal_library(sealed_bad)
    assert deploy.verify_seal(sealed_bad)
    paths.append(sealed_bad)
    returncode, lines, stderr = _load_all_in_child(paths)
    assert returncode == 0, stderr[-2000:]
    assert sum(line.startswith("refused") for line in lines) == len(paths), lines


def test_load_maps_the_bytes_it_checked(sealed, tmp_path, monkeypatch):
    """The checks opened the file by its path and the loader opened it again: a file replaced
    in between was mapped unchecked (a crash in the race). Now the checked copy is loaded."""
    path = tmp_path / "k.so"
    path.write_bytes(sealed.read_bytes())
    real_check = deploy.check_loads

    def check_then_replace(library, *, shown=None):
        real_check(library, shown=shown)
        path.write_bytes(b"\x7fELF" + b"\0" * 100)  # the original changes after the checks
    monkeypatch.setattr(deploy, "check_loads", check_then_replace)
    module = deploy.load(path)
    assert module.implements_function("attention_decode", query_imports=True)


def test_public_library_helpers_refuse_what_is_not_a_file(tmp_path):
    """check_elf / verify_seal / seal_library blocked forever on a FIFO and raised bare
    IsADirectoryError for folders."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = ("import sys\nfrom relax_kvcache import deploy\n"
            "for f in (deploy.check_elf, deploy.verify_seal, deploy.seal_library):\n"
            "    for p in sys.argv[1:]:\n"
            "        try:\n            f(p)\n        except FileNotFoundError:\n            print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code, str(fifo), str(tmp_path), ""], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["ok"] * 9, run.stdout + run.stderr


def test_a_long_version_chain_is_checked_in_linear_time(unsealed, tmp_path):
    """A forward-chained version-need region (16-byte entries, each with a long version list)
    took 25 s on a 300 KB file: the walk was quadratic."""
    import time

    data = bytearray(unsealed.read_bytes())
    _, text_at, text_size, _ = _sections(bytes(data))[".text"]
    text_addr = _sections(bytes(data))[".text"][0]
    entries = text_size // 16
    for i in range(entries):  # every entry: 0xFFFF versions, the first at the next entry, then the next entry
        struct.pack_into("<HHIII", data, text_at + 16 * i, 1, 0xFFFF, 0, 16, 16)
    path = tmp_path / "chain.so"
    path.write_bytes(_patched(bytes(data), _dynamic_entry_offset(bytes(data), 0x6FFFFFFE) + 8, "<Q", text_addr))
    start = time.perf_counter()
    with pytest.raises(deploy.DeployError):
        deploy.check_elf(path)
    assert time.perf_counter() - start < 10
