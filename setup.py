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

# gpu_service.model._native_decode: one DeepSeek-V3 decode layer in C for the CPU float32 runner
# (gpu_service/model/native_decode.h); portable C (an AVX2 clone on x86-64 GCC), built everywhere.
MDIR = "gpu_service/model"
ext_modules.append(Extension(
    "gpu_service.model._native_decode",
    sources=[f"{MDIR}/_native_decode.pyx", f"{MDIR}/native_decode.c", f"{MDIR}/native_remote.c"],
    include_dirs=[MDIR, "wire"],
    depends=[f"{MDIR}/native_decode.h", f"{MDIR}/native_remote.h", "wire/shm_wire.h"],
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"],
))

from Cython.Build import cythonize  # noqa: E402

ext_modules = cythonize(ext_modules, language_level=3, quiet=True)

setup(ext_modules=ext_modules)
