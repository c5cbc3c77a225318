"""Build hooks that pyproject.toml cannot express: the Cython extensions.

cpu_expert_service.kernels._moe is one extension built from the Cython binding and one C file per
ISA. No -march flag: every ISA file selects its own target with `#pragma GCC target`, so the .so
loads on any x86-64 and the dispatcher (moe_cpu_has, decided once per backend) picks what runs.
Built by `pip install -e .` (make setup) and `setup.py build_ext --inplace` (make build)."""
import platform

from setuptools import Extension, setup

KDIR = "cpu_expert_service/kernels"
ISA_FILES = ["moe_core.c", "moe_avx2.c", "moe_avx512.c", "moe_amx.c", "moe_shm.c"]

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext = Extension(
        "cpu_expert_service.kernels._moe",
        sources=[f"{KDIR}/_moe.pyx"] + [f"{KDIR}/{f}" for f in ISA_FILES],
        include_dirs=[KDIR, "wire"],
        depends=[f"{KDIR}/moe.h", f"{KDIR}/moe_shm.h", "wire/shm_wire.h", f"{KDIR}/amx_emu.h", f"{KDIR}/simde_x86.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fno-math-errno", "-Wno-unused-function"],
        extra_link_args=["-pthread"],
    )
    ext_modules = [ext]

from Cython.Build import cythonize  # noqa: E402

ext_modules = cythonize(ext_modules, language_level=3, quiet=True)

setup(ext_modules=ext_modules)
