"""The ROCm build's check of its HIP runtime against torch's (csrc/setup_ext.py), on a CPU
machine: a ROCm tree is a directory with include/hip/hip_version.h (or bin/hipconfig), and
torch's HIP version is the string torch.version.hip holds on a ROCm wheel. Another major
is refused before anything compiles (a second libamdhip64.so.N beside torch's), another
minor only noted, as the CUDA build treats nvcc's major."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from csrc import setup_ext


def _rocm(tmp_path, major, minor, how="header"):
    root = tmp_path / f"rocm-{major}.{minor}-{how}"
    if how == "header":
        (root / "include" / "hip").mkdir(parents=True)
        (root / "include" / "hip" / "hip_version.h").write_text(
            f"#define HIP_VERSION_MAJOR {major}\n#define HIP_VERSION_MINOR {minor}\n"
            f"#define HIP_VERSION_PATCH 41134\n")
    else:  # a tree without the header: hipconfig answers
        (root / "bin").mkdir(parents=True)
        exe = root / "bin" / "hipconfig"
        exe.write_text(f"#!/bin/sh\necho {major}.{minor}.41134-65d174c3e\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(root)


@pytest.mark.parametrize("how", ["header", "hipconfig"])
def test_same_major_links_and_says_so(tmp_path, how):
    rocm = _rocm(tmp_path, 6, 2, how)
    assert setup_ext.rocm_hip_version(rocm) == (6, 2)
    libdirs, why = setup_ext.hip_link_plan(rocm, torch_hip="6.2.41133-dd7f95766")
    assert libdirs == [os.path.join(rocm, "lib")]
    assert "HIP 6.2" in why and "torch's is" not in why
    _, other_minor = setup_ext.hip_link_plan(rocm, torch_hip="6.1.40091-a8dbc0c19")
    assert "torch's is 6.1: same SONAME" in other_minor


def test_another_major_is_refused_naming_both(tmp_path):
    rocm = _rocm(tmp_path, 5, 7)
    with pytest.raises(RuntimeError, match=r"HIP 5\.7 but torch was built with HIP "
                                           r"6\.2\.41133.*rocm module of torch's ROCm 6\.x"):
        setup_ext.hip_link_plan(rocm, torch_hip="6.2.41133-dd7f95766")


def test_unknown_versions_do_not_block_the_build(tmp_path):
    if shutil.which("hipconfig") is None:  # (else the PATH's hipconfig answers)
        assert setup_ext.rocm_hip_version(str(tmp_path / "nothing")) is None
    assert setup_ext.parse_hip_version("") is None
    assert setup_ext.parse_hip_version("6.2.41133-dd7f95766") == (6, 2)
    _, why = setup_ext.hip_link_plan(_rocm(tmp_path, 6, 2), torch_hip="unknown")
    assert "HIP 6.2" in why
