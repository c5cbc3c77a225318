"""Build hooks that pyproject.toml cannot express: the Cython kernel extension.

The kernel extension is added by cpu_expert_service/kernels (see its build.py)."""
from setuptools import setup

setup()
