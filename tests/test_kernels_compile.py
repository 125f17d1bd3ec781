"""Our CUDA sources compile where no GPU is: the kernels (custom_kernels/src/*.cu) with nvcc for Ampere and
Hopper, as build.sh compiles them, without spilling registers to local memory, and the operators' CUDA-side
host code (the part the host-reference build leaves out) with g++. nvcc and the headers come from the dev
extra's pip packages (nvidia-cuda-nvcc, -cccl, -runtime); skipped where they are not installed."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "custom_kernels" / "src"
ARCHS = ("80", "90")  # Ampere and Hopper: the two build.sh's kernels are tuned for


def _pip_cuda() -> tuple[Path, list[Path]]:
    """nvcc and the include folders of pip's CUDA packages, or a skip."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec else []
    nvcc = [Path(p) for r in roots for p in sorted(glob.glob(os.path.join(r, "*", "bin", "nvcc")))]
    includes = [Path(p) for r in roots for p in sorted(glob.glob(os.path.join(r, "*", "include")))]
    if not nvcc or not any((d / "cuda_runtime_api.h").is_file() for d in includes):
        pytest.skip("needs pip's nvidia-cuda-nvcc, nvidia-cuda-cccl and nvidia-cuda-runtime (the dev extra, Linux x86-64)")
    return nvcc[0], includes


@pytest.mark.parametrize("source", sorted(p.name for p in SRC.glob("*.cu")))
def test_kernel_compiles_for_ampere_and_hopper_without_spilling(source, tmp_path):
    nvcc, includes = _pip_cuda()
    gencode = [f for arch in ARCHS for f in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    done = subprocess.run([str(nvcc), "-std=c++17", "-O3", "-Xcompiler", "-fPIC", *[f"-I{d}" for d in includes],
                           "-c", str(SRC / source), "-o", str(tmp_path / "kernel.o"), *gencode, "-Xptxas", "-v"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # ptxas: "Compiling entry function 'NAME' for 'sm_NN'", then "... N bytes spill stores, M bytes spill loads"
    entries = re.findall(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", done.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert entries and len(spills) == len(entries), done.stderr[-3000:]
    assert {arch for _, arch in entries} == set(ARCHS)
    spilled = [(name, arch, s) for (name, arch), s in zip(entries, spills) if s != ("0", "0")]
    assert not spilled, f"registers spilled to local memory (slow): {spilled}"


@pytest.mark.parametrize("source", ["packed_attention.cc", "remove_padding.cc"])
def test_operator_cuda_host_code_compiles(source):
    """The CUDA half of an operator, which the host-reference build (the rest of the suite) never compiles.
    matmul_epilogues.cc needs cuBLAS's headers too, which only the GPU image's build installs."""
    _, includes = _pip_cuda()
    compiler = shutil.which("g++") or pytest.skip("needs g++")
    done = subprocess.run([compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                           "-DBERTSERVE_PACKED_ATTENTION", "-DBERTSERVE_REMOVE_PADDING",
                           *[f"-I{d}" for d in includes], str(SRC / source)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
