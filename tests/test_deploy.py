"""Deployment: ``relax-kvcache build``, ``deploy.load`` (also runtime-only) and the nvcc callback.

CI has no GPU: CUDA loading is checked up to the point where a GPU is needed (clear errors),
and the compile callback is checked by compiling a small CUDA source with nvcc when nvcc is
installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pathlib
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tvm
import tvm_ffi

import relax_kvcache as rk
from relax_kvcache import build, deploy
from relax_kvcache.cli import main

PYTHON_DIR = pathlib.Path(rk.__file__).resolve().parent.parent
#: A shape whose kernel set has every role (per-sequence and per-layer sliding windows).
BUILD_ARGS = ["--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32", "--dtype", "float32",
              "--sliding-window", "--layer-window", "64"]
#: A fatbin starts with this magic number (0xBA55ED50, little-endian).
FATBIN_MAGIC = bytes.fromhex("50ed55ba")
TINY_CUDA = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }\n'

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def run_cli(*argv: str):
    """``(exit code, stdout, stderr)`` of ``relax-kvcache ARGV``, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cpu_library(tmp_path_factory):
    """``(path, stdout)`` of ``relax-kvcache build --target llvm`` (compiled once, disk-cached)."""
    path = tmp_path_factory.mktemp("cli") / "kernels.so"
    code, out, err = run_cli("build", "--target", "llvm", *BUILD_ARGS, "--output", str(path))
    assert code == 0, err
    return path, out


# ----------------------------------------------------------------------------------------------
# relax-kvcache build
# ----------------------------------------------------------------------------------------------


def test_cli_build_reports_what_it_built(cpu_library):
    path, out = cpu_library
    assert path.is_file()
    assert f"built {path} (" in out
    assert "16 kernels for llvm" in out and "float32, 4/2 heads, head_dim 32, page 16" in out
    assert "kernels: " + ", ".join(rk.KERNEL_ROLES) in out


def test_cli_library_loads_with_every_kernel_role(cpu_library):
    mod = deploy.load(cpu_library[0])
    assert [role for role in rk.KERNEL_ROLES if not mod.implements_function(role, query_imports=True)] == []
    kernels = rk.KernelSet.from_module(mod)
    assert all(getattr(kernels, role) is not None for role in rk.KERNEL_ROLES)


def test_loaded_kernel_runs(cpu_library):
    copy_page = deploy.load(cpu_library[0], device=tvm.cpu())["copy_single_page"]
    pages = np.random.default_rng(0).standard_normal((3, 2, 2, 16, 32)).astype("float32")
    tensor = tvm.runtime.tensor(pages)
    copy_page(tensor, 0, 2, 5)
    expected = pages.copy()
    expected[2, :, :, :5] = pages[0, :, :, :5]
    np.testing.assert_array_equal(tensor.numpy(), expected)


RUNTIME_ONLY_SCRIPT = """
import sys
import numpy as np
import tvm
from relax_kvcache.deploy import load
assert tvm.base._RUNTIME_ONLY
mod = load(sys.argv[1])
pages = np.arange(3 * 2 * 2 * 16 * 32, dtype="float32").reshape(3, 2, 2, 16, 32)
tensor = tvm.runtime.tensor(pages)
mod["copy_single_page"](tensor, 1, 0, 16)
assert (tensor.numpy()[0] == pages[1]).all()
import relax_kvcache
# the kernels' TVMScript needs the compiler's Python packages, which runtime-only hosts lack
assert not [m for m in sys.modules if m.startswith("relax_kvcache.tir_kernels")], "imports tir_kernels"
print("runtime-only OK")
"""


def test_load_and_run_with_runtime_only_tvm(cpu_library):
    """As on a GPU host with only TVM's runtime: ``import relax_kvcache``, load, call a kernel."""
    # One thread: TVM's pool workers spin after a parallel kernel and slow the exit of a busy machine.
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", TVM_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_SCRIPT, str(cpu_library[0])],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runtime-only OK" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--target", "cuda", "--arch", "sm80"], "CUDA arch must look like 'sm_80', 'sm_89' or 'sm_90a', got 'sm80'"),
    (["--target", "vulkan"], "TVM built without SPIR-V code generation (USE_VULKAN)"),
    (["--target", "metal", "--arch", "m2"], "target kind 'metal' takes no arch (got 'm2')"),
    (["--num-qo-heads", "6", "--num-kv-heads", "4"], "num_qo_heads (6) must be a multiple of num_kv_heads (4)"),
    (["--layer-window", "0"], "layer_sliding_window_size must be a positive int, got 0"),
    (["--attention-chunk", "-8"], "attention_chunk_size must be a positive int, got -8"),
    (["--layer-window", "64", "--attention-chunk", "64"], "mixes MHA_SLIDING and MHA_CHUNKED_LOCAL"),
])
def test_cli_build_errors(tmp_path, argv, message):
    shape = ["--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32"]
    code, out, err = run_cli("build", *shape, *argv, "--output", str(tmp_path / "k.so"))
    assert code == 2 and message in err and out == ""
    assert not (tmp_path / "k.so").exists()


@pytest.mark.parametrize("output, message", [("missing/k.so", "does not exist"), ("k.tar", "must end in '.so'")])
def test_cli_build_output_errors(tmp_path, output, message):
    code, _, err = run_cli("build", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32",
                           "--output", str(tmp_path / output))
    assert code == 2 and message in err


def test_cli_build_config():
    from relax_kvcache.cli import _add_build_parser, build_config
    import argparse

    parser = argparse.ArgumentParser()
    _add_build_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["build", "--output", "k.so", "--num-qo-heads", "32", "--num-kv-heads", "8",
                              "--head-dim", "128", "--rope-mode", "inline", "--rope-theta", "500000",
                              "--layer-window", "4096", "--dtype", "bfloat16", "--page-size", "32"])
    config = build_config(args)
    assert config.attn_kinds == (rk.AttnKind.MHA_SLIDING, rk.AttnKind.MHA)
    assert config.layer_sliding_window_size == 4096 and not config.support_sliding_window
    assert (config.rope_mode, config.rope_theta, config.dtype, config.page_size) == \
        (rk.RopeMode.INLINE, 500000.0, "bfloat16", 32)
    args = parser.parse_args(["build", "--output", "k.so", "--num-qo-heads", "40", "--num-kv-heads", "8",
                              "--head-dim", "128", "--rope-mode", "none", "--attention-chunk", "8192"])
    config = build_config(args)
    assert config.attn_kinds == (rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA)
    assert config.attention_chunk_size == 8192 and config.layer_span == rk.LayerSpan(chunk=8192)


# ----------------------------------------------------------------------------------------------
# load: errors, CUDA libraries without a GPU
# ----------------------------------------------------------------------------------------------


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"kernel library '.*nope\.so' does not exist; expected a "
                                                 r"\.so file written by `relax-kvcache build"):
        deploy.load(tmp_path / "nope.so")


def test_load_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is a folder"):
        deploy.load(tmp_path)


def test_load_argument_types(cpu_library):
    with pytest.raises(TypeError, match="path must be a str or path-like, got int"):
        deploy.load(3)
    with pytest.raises(TypeError, match="device must be a tvm.runtime.Device or None, got str"):
        deploy.load(cpu_library[0], device="cuda")


def test_export_writes_a_checksum_that_load_checks(cpu_library, tmp_path):
    """``<lib>.sha256`` beside the library (``sha256sum`` format); a copy with any changed byte
    is refused naming the file, an intact copy without a checksum loads unchecked."""
    path = cpu_library[0]
    data = path.read_bytes()
    digest, name = deploy.checksum_path(path).read_text().split()
    assert digest == hashlib.sha256(data).hexdigest() and name == path.name
    assert deploy.verify_checksum(path)
    rng = random.Random(1)
    for i, at in enumerate([rng.randrange(len(data)) for _ in range(3)] + [len(data) - 1]):
        copy = tmp_path / f"copy{i}.so"
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        copy.write_bytes(bytes(bad))
        shutil.copyfile(deploy.checksum_path(path), deploy.checksum_path(copy))
        with pytest.raises(deploy.DeployError, match=rf"copy{i}\.so'.*the library is damaged"):
            deploy.load(copy)
    unchecked = tmp_path / "unchecked.so"
    unchecked.write_bytes(data)
    assert not deploy.verify_checksum(unchecked)
    assert deploy.load(unchecked).implements_function("attention_decode", query_imports=True)


def _replace_with(path, data):
    """Replace the file (a new inode: this process may have the old one mapped)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_damaged_cached_library_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_KVCACHE_CACHE_DIR", str(tmp_path))
    config = rk.KVCacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=16, page_size=4,
                              max_num_seqs=4, max_total_seq_len=64, prefill_chunk_size=16, dtype="float32")
    target = tvm.target.Target("llvm")
    cached = build.cache_path(build.kernel_set_spec(config), target)
    rk.export_kernels(config, target, tmp_path / "first.so")  # compiles into the cache; nothing maps it
    assert deploy.verify_checksum(cached)
    bad = bytearray(cached.read_bytes())
    bad[len(bad) // 2] ^= 0x10
    _replace_with(cached, bytes(bad))
    messages = []
    module = build.build_kernels(config, target, progress=messages.append)
    assert any(m.startswith("compiling kernels") for m in messages), messages
    assert deploy.verify_checksum(cached) and module is not None
    _replace_with(cached, bytes(bad))
    exported = tmp_path / "out.so"
    rk.export_kernels(config, target, exported)  # a damaged cache entry is not copied out either
    assert deploy.verify_checksum(exported)
    deploy.checksum_path(cached).unlink()  # a cache entry without its checksum is compiled again too
    messages.clear()
    build.build_kernels(config, target, progress=messages.append)
    assert any(m.startswith("compiling kernels") for m in messages) and deploy.verify_checksum(cached)


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory):
    """A small CUDA library exported here: it holds CUDA source (no GPU on this machine)."""
    from tvm.script import tirx as T

    @T.prim_func
    def add_one(a: T.Buffer((128,), "float32")):
        for i in T.thread_binding(128, thread="threadIdx.x"):
            a[i] = a[i] + T.float32(1)

    executable = tvm.compile(tvm.IRModule({"add_one": add_one}), target=rk.make_target("cuda", arch="sm_80"))
    path = tmp_path_factory.mktemp("cuda") / "add_one.so"
    executable.export_library(str(path))
    return path


def test_library_holds_cuda(cpu_library, cuda_library):
    assert deploy.library_holds_cuda(cuda_library)
    assert not deploy.library_holds_cuda(cpu_library[0])


@pytest.mark.skipif(tvm.cuda().exist, reason="this machine has a CUDA GPU")
def test_load_cuda_library_without_a_gpu(cuda_library):
    with pytest.raises(deploy.DeployError, match=r"could not load .*libtvm_runtime_cuda\.so|cuda:0 is not available"):
        deploy.load(cuda_library)


def test_missing_cuda_runtime_library(monkeypatch, tmp_path):
    monkeypatch.setattr(deploy, "cuda_runtime_registered", lambda: False)
    monkeypatch.setattr(deploy, "_cuda_runtime_folders", lambda: [tmp_path])
    with pytest.raises(deploy.DeployError, match=rf"libtvm_runtime_cuda\.so not found; looked in {tmp_path}"):
        deploy.load_cuda_runtime()


# ----------------------------------------------------------------------------------------------
# nvcc compile callback
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fatbin_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAX_KVCACHE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def restore_callback(monkeypatch):
    """Put TVM's compile callback (and our record of it) back after the test."""
    original = tvm_ffi.get_global_func(deploy.CUDA_COMPILE_CALLBACK, allow_missing=True)
    monkeypatch.setattr(deploy._CALLBACK, "installed", deploy._CALLBACK.installed)
    monkeypatch.setattr(deploy._CALLBACK, "arch", deploy._CALLBACK.arch)
    yield
    if original is not None:
        tvm_ffi.register_global_func(deploy.CUDA_COMPILE_CALLBACK, original, override=True)


def forbid_subprocess(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"subprocess.run called: {args}")

    monkeypatch.setattr(subprocess, "run", fail)


@needs_nvcc
def test_nvcc_compile_caches_the_fatbin(fatbin_cache, monkeypatch):
    fatbin = deploy.nvcc_compile(TINY_CUDA, arch="sm_80")
    assert fatbin.startswith(FATBIN_MAGIC)
    cached = deploy.fatbin_cache_path(TINY_CUDA, arch="sm_80")
    assert cached.parent.parent == fatbin_cache and cached.read_bytes() == fatbin
    forbid_subprocess(monkeypatch)
    assert deploy.nvcc_compile(TINY_CUDA, arch="sm_80") == fatbin
    assert deploy.fatbin_cache_path(TINY_CUDA, arch="sm_90a") != cached


@needs_nvcc
def test_registered_callback_compiles_with_nvcc(fatbin_cache, restore_callback, monkeypatch):
    assert deploy.install_cuda_compile_callback(arch="sm_80", force=True)
    callback = tvm_ffi.get_global_func(deploy.CUDA_COMPILE_CALLBACK)
    fatbin = bytes(callback(TINY_CUDA))
    assert fatbin.startswith(FATBIN_MAGIC)
    forbid_subprocess(monkeypatch)
    assert bytes(callback(TINY_CUDA)) == fatbin == deploy.nvcc_compile(TINY_CUDA, arch="sm_80")


@needs_nvcc
def test_nvcc_failure_shows_its_stderr(fatbin_cache):
    with pytest.raises(deploy.DeployError, match=r"(?s)nvcc failed \(exit \d+\) compiling CUDA source for "
                                                 r"sm_80: .*nvcc --fatbin -O3 -w -gencode=arch=compute_80,code=sm_80 .*first error: .*error"):
        deploy.nvcc_compile("this is not CUDA", arch="sm_80")
    assert not list(fatbin_cache.glob("cuda-fatbin/*.fatbin"))


def test_nvcc_missing_names_the_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(deploy, "_NVCC_FALLBACK_DIRS", ())
    with pytest.raises(deploy.DeployError, match=rf"nvcc not found: searched PATH={tmp_path}"):
        deploy.nvcc_compile(TINY_CUDA, arch="sm_80", use_cache=False)


def test_load_reraises_callback_errors(cpu_library, fatbin_cache, restore_callback, monkeypatch, tmp_path):
    """nvcc's errors inside TVM's module loader reach the caller as DeployError, not RuntimeError."""
    monkeypatch.setattr(deploy._CALLBACK, "error", None)
    assert deploy.install_cuda_compile_callback(arch="sm_80", force=True)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(deploy, "_NVCC_FALLBACK_DIRS", ())
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)

    def load_cuda_source(path):  # what TVM's loader does with a module holding CUDA source
        return tvm_ffi.get_global_func(deploy.CUDA_COMPILE_CALLBACK)(TINY_CUDA)

    monkeypatch.setattr(tvm.runtime, "load_module", load_cuda_source)
    with pytest.raises(deploy.DeployError, match="nvcc not found"):
        deploy.load(cpu_library[0])
    assert deploy._CALLBACK.error is None


def test_nvcc_compile_checks_arch():
    with pytest.raises(ValueError, match="CUDA arch must look like 'sm_80'.*got 'sm90'"):
        deploy.nvcc_compile(TINY_CUDA, arch="sm90")


def test_our_callback_replaces_tvms_when_runtime_only(restore_callback, monkeypatch):
    monkeypatch.setattr(deploy._CALLBACK, "installed", False)
    monkeypatch.setattr(tvm.base, "_RUNTIME_ONLY", True)
    assert deploy.install_cuda_compile_callback(arch="sm_90a")
    assert deploy._CALLBACK.installed and deploy._CALLBACK.arch == "sm_90a"


@needs_nvcc
def test_tvms_callback_kept_where_it_works(restore_callback, monkeypatch):
    monkeypatch.setattr(deploy._CALLBACK, "installed", False)
    monkeypatch.setattr(tvm.base, "_RUNTIME_ONLY", False)
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    assert not deploy.install_cuda_compile_callback()
    assert not deploy._CALLBACK.installed


def test_our_callback_replaces_tvms_nvrtc_without_cuda_bindings(restore_callback, monkeypatch):
    if deploy._module_exists("cuda.bindings.nvrtc"):
        pytest.skip("cuda-python is installed: TVM's NVRTC callback works")
    monkeypatch.setattr(deploy._CALLBACK, "installed", False)
    monkeypatch.setattr(tvm.base, "_RUNTIME_ONLY", False)
    monkeypatch.delenv("TVM_CUDA_COMPILE_MODE", raising=False)
    assert deploy.install_cuda_compile_callback()


# ---------------------------------------------------------------------------- damaged and replaced libraries


def _load_in_subprocess(path):
    """deploy.load in a child process (a regression would kill it, not pytest)."""
    code = "import sys; from relax_kvcache import deploy; deploy.load(sys.argv[1]); print('loaded')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_load_refuses_a_truncated_library_by_its_checksum(kernel_library, tmp_path):
    """dlopen of a truncated library can crash the process (SIGBUS); its checksum refuses it first."""
    data = kernel_library.read_bytes()
    assert len(data) > 100000
    bad = tmp_path / "bad.so"
    bad.write_bytes(data[:100000])
    shutil.copyfile(deploy.checksum_path(kernel_library), deploy.checksum_path(bad))
    run = _load_in_subprocess(bad)
    assert run.returncode == 1 and "DeployError: could not load" in run.stderr and str(bad) in run.stderr, run.stderr
    assert "the library is damaged" in run.stderr


def test_load_of_a_replaced_library_gets_the_new_one(kernel_library, tmp_path):
    """Dlopen returns the library first loaded under a path, so a rebuilt library
    at the same path was ignored."""
    path = tmp_path / "k.so"
    shutil.copyfile(kernel_library, path)
    assert deploy.load(path)["kernel_spec_num_kv_heads"]() == 2
    other = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=32, page_size=16,
                             dtype="float32")
    rk.export_kernels(other, tvm.target.Target("llvm"), path)
    assert deploy.load(path)["kernel_spec_num_kv_heads"]() == 1
    assert deploy.load(path)["kernel_spec_num_kv_heads"]() == 1  # again (still not the first file)
    shutil.copyfile(kernel_library, tmp_path / "new.so")
    os.replace(tmp_path / "new.so", path)  # back to (a copy of) the first one, as a new file
    shutil.copyfile(deploy.checksum_path(kernel_library), deploy.checksum_path(path))  # with its checksum
    assert deploy.load(path)["kernel_spec_num_kv_heads"]() == 2
