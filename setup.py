"""Build hooks that pyproject.toml cannot express: the Cython extensions.

cpu_expert_service.kernels._moe is one extension built from the Cython binding, the ISA-independent
C (moe_core.c: features, pool, fused op; moe_pack.c: packing; moe_generic.c: portable kernels) and one
C file per ISA. No -march flag: every ISA file selects its own target with `#pragma GCC target`, so the .so
loads on any x86-64 and the dispatcher (moe_cpu_has, decided once per backend) picks what runs.
gpu_service.experts._shm_client is the GPU side's shared-memory client (shm_client.c) and
gpu_service.experts._tcp_client its TCP data path client (tcp_client.c), plain C for any Linux machine.
Both ends of the TCP data path move their bytes through wire/tcp_io.c (plaintext or mutual TLS),
linked against OpenSSL (libssl-dev to build: scripts/setup_build.sh installs it).
Built by `pip install -e .` (make setup) and `setup.py build_ext --inplace` (make build)."""
import platform

import numpy
from setuptools import Extension, setup

KDIR = "cpu_expert_service/kernels"
ISA_FILES = ["moe_core.c", "moe_pack.c", "moe_generic.c", "moe_avx2.c", "moe_avx2_ub.c", "moe_avx512.c", "moe_amx.c",
             "moe_shm.c", "moe_tcp.c"]
TLS = dict(libraries=["ssl", "crypto"])  # wire/tcp_io.c: the TCP data path's mutual TLS (OpenSSL 3, libssl-dev)

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext = Extension(
        "cpu_expert_service.kernels._moe",
        sources=[f"{KDIR}/_moe.pyx"] + [f"{KDIR}/{f}" for f in ISA_FILES] + ["wire/tcp_io.c"],
        include_dirs=[KDIR, "wire"],
        depends=[f"{KDIR}/moe.h", f"{KDIR}/moe_shm.h", "wire/shm_wire.h", "wire/tcp_io.h", "wire/tcp_link.pxi",
                 f"{KDIR}/amx_emu.h", f"{KDIR}/simde_x86.h"],
        extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fno-math-errno", "-Wno-unused-function"],
        extra_link_args=["-pthread"],
        **TLS,
    )
    ext_modules = [ext]
EDIR = "gpu_service/experts"
ext_modules.append(Extension(
    "gpu_service.experts._shm_client",
    sources=[f"{EDIR}/_shm_client.pyx", f"{EDIR}/shm_client.c"],
    include_dirs=[EDIR, "wire", numpy.get_include()],
    depends=[f"{EDIR}/shm_client.h", "wire/shm_wire.h"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wno-unused-function"],
))

ext_modules.append(Extension(  # the TCP data path's client (plaintext or TLS), sharing shm_client.c's casts
    "gpu_service.experts._tcp_client",
    sources=[f"{EDIR}/_tcp_client.pyx", f"{EDIR}/tcp_client.c", f"{EDIR}/shm_client.c", "wire/tcp_io.c"],
    include_dirs=[EDIR, "wire", numpy.get_include()],
    depends=[f"{EDIR}/tcp_client.h", f"{EDIR}/shm_client.h", "wire/shm_wire.h", "wire/tcp_io.h",
             "wire/tcp_link.pxi", f"{EDIR}/call_check.pxi"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wno-unused-function"],
    extra_link_args=["-pthread"],
    **TLS,
))

from Cython.Build import cythonize  # noqa: E402

ext_modules = cythonize(ext_modules, language_level=3, quiet=True, include_path=["wire", EDIR])

setup(ext_modules=ext_modules)
