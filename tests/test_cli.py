"""The command line (``relax-kvcache demo`` / ``build``): every error is one line on stderr with
exit code 2, checked before anything is compiled or written."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import tvm

from relax_kvcache import deploy
from relax_kvcache.cli import main

def run_cli(*argv: str):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, out, err, message):
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and message in err, (code, err)
    assert out == ""  # refused before compiling or running anything


def test_cli_demo_and_deploy_errors_are_one_line(tmp_path):
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a library")
    with pytest.raises(deploy.DeployError, match="could not load"):
        deploy.load(bogus)
    for args in (["--load", str(tmp_path / "missing.so")], ["--load", str(bogus)]):
        run = subprocess.run([sys.executable, "-m", "relax_kvcache.cli", "demo", *args], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "error:" in run.stderr, run.stderr


def test_cli_paths_that_cannot_be_written_or_are_empty(tmp_path):
    """Regression: ``~unknown_user`` paths and over-long names gave tracebacks; empty
    ``--export`` / ``--load`` values counted as absent (``--cache-only --export ""`` ran)."""
    long_name = str(tmp_path / ("x" * 300 + ".so"))
    for argv, message in [(("demo", "--cache-only", "--export", ""), "--export '' is empty"),
                          (("demo", "--load", ""), "--load '' is empty"),
                          (("demo", "--export", "~no_such_user_here/m.so"), "cannot be written"),
                          (("demo", "--export", long_name), "longer than 255 bytes"),
                          (("demo", "--load", "~no_such_user_here/m.so"), "cannot be opened"),
                          (("build", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32",
                            "--output", "~no_such_user_here/k.so"), "cannot be written")]:
        assert_one_line_error(*run_cli(*argv), message)


def test_cli_demo_load_of_a_kernel_library_is_one_line(kernel_library):
    assert_one_line_error(*run_cli("demo", "--load", str(kernel_library)), "holds no Relax model")


def test_cli_demo_model_over_8_bit_pages():
    """``--kv-dtype`` without ``--cache-only``: the demo model over e4m3 pages (scales calibrated),
    every logit row within the 8-bit bound of the float64 model but not as close as float32 pages."""
    from relax_kvcache.model_demo import FP8_TOLERANCE

    code, out, err = run_cli("demo", "--quiet", "--kv-dtype", "float8_e4m3fn")
    assert code == 0 and out.startswith("demo OK: Llama (2 layers) on llvm float32 over float8_e4m3fn pages"), out
    error = float(out.split("max logit error vs float64 numpy model ")[1].split()[0])
    assert 1e-3 < error <= FP8_TOLERANCE["float8_e4m3fn"], out  # quantized: far above float32 pages' ~1e-6
    assert f"(tolerance {FP8_TOLERANCE['float8_e4m3fn']:.0e})" in out


@pytest.mark.skipif(tvm.cuda(0).exist, reason="a CUDA GPU is present")
def test_cli_demo_cuda_load_without_cuda_is_one_line(kernel_library):
    code, out, err = run_cli("demo", "--target", "cuda", "--load", str(kernel_library))
    assert_one_line_error(code, out, err, "relax-kvcache demo: error:")


def test_cli_demo_export_destination_checked_before_compiling(tmp_path):
    assert_one_line_error(*run_cli("demo", "--export", str(tmp_path / "missing" / "m.so")), "does not exist")
    assert_one_line_error(*run_cli("demo", "--export", str(tmp_path)), "is a folder")
    assert_one_line_error(*run_cli("demo", "--export", str(tmp_path / "m.so") + os.sep), "ends with a path separator")
    # a path without .so (/dev/null was "written") and --load with --export
    assert_one_line_error(*run_cli("demo", "--export", os.devnull), "does not end in .so")
    assert_one_line_error(*run_cli("demo", "--load", str(tmp_path / "a.so"), "--export", str(tmp_path / "b.so")),
                          "expected one of them")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--load", "--export"])
def test_cli_demo_cache_only_refuses_load_and_export(tmp_path, option):
    assert_one_line_error(*run_cli("demo", "--cache-only", option, str(tmp_path / "m.so")),
                          f"cannot be combined with {option}")


@pytest.mark.parametrize("argv,message", [
    (["--target", "cuda", "--arch", "sm80"], "CUDA arch must look like 'sm_80'"),
    (["--export", "m.so", "--arch", "notacpu"], "'notacpu' is not a CPU LLVM knows"),
    (["--arch", "sm_90a"], "--arch 'sm_90a' is used where the demo compiles its model"),
    (["--cache-only", "--arch", "sm_90a"], "would be ignored"),
    (["--cache-only", "--target", "cuda"], "--target cuda would be ignored"),
])
def test_cli_demo_arch_is_checked_before_compiling(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(*run_cli("demo", *argv), message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_cli_demo_cache_only_over_8_bit_pages(kv_dtype):
    """``--kv-dtype``: the cache-only demo over 8-bit pages (scales calibrated from the first
    prefill), its stored K/V and outputs checked against numpy."""
    code, out, err = run_cli("demo", "--cache-only", "--quiet", "--dtype", "float16", "--kv-dtype", kv_dtype)
    assert code == 0 and err == "" and out.startswith("demo OK: 34 steps"), (code, out, err)
    assert f"{kv_dtype} pages within" in out


@pytest.mark.skipif(tvm.cuda(0).exist, reason="a CUDA GPU is present")
def test_cli_demo_cuda_without_a_gpu_is_refused_before_compiling():
    assert_one_line_error(*run_cli("demo", "--target", "cuda"), "there is none")


def test_cli_build_output_ending_in_a_separator(tmp_path):
    output = str(tmp_path / "k.so") + os.sep
    code, out, err = run_cli("build", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32",
                             "--output", output)
    assert_one_line_error(code, out, err, "ends with a path separator")
    assert list(tmp_path.iterdir()) == []


def test_cli_build_of_8_bit_pages(tmp_path):
    output = tmp_path / "k.so"
    code, out, err = run_cli("build", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "32",
                             "--kv-dtype", "float8_e5m2", "--output", str(output), "--quiet")
    assert code == 0, err
    assert "float16 over float8_e5m2 pages" in out and output.stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["--page-size", "1000000000"], "one page would hold 16000000000 elements"),
    (["--num-qo-heads", "2147483647"], "a step's fused q / k / v would hold"),
])
def test_cli_build_of_sizes_the_kernels_cannot_index(argv, message, tmp_path):
    base = {"--num-qo-heads": "2", "--num-kv-heads": "1", "--head-dim": "8"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    args = [x for kv in base.items() for x in kv]
    assert_one_line_error(*run_cli("build", "-o", str(tmp_path / "a.so"), "--no-cache", *args), message)
