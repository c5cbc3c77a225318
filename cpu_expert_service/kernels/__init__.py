"""CPU MoE expert kernels: a Cython extension (_moe) over C files, one per ISA (generic, AVX2,
AVX-512 BF16/VNNI, AMX), with BF16 / INT8 / INT4-group-32 weights. See moe.h for the packed
layouts and cpu_expert_service.kernel_backend.KernelExperts for the Python API."""
