"""The generated gRPC/protobuf modules in protos/ are exactly what `make protos` writes today.

Regenerates every protos/moesplit/v1/*.proto into a temporary directory with the same protoc
command as the Makefile and compares byte for byte: a stale or hand-edited *_pb2*.py fails.
"""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join("protos", "moesplit", "v1")
OUTPUTS = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def test_generated_files_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, PROTO_DIR, "*.proto")))
    assert protos, f"no .proto files under {PROTO_DIR}"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        cwd=ROOT, check=True, capture_output=True, timeout=60,
    )
    stale = []
    for proto in protos:
        base = proto[: -len(".proto")]
        for suffix in OUTPUTS:
            fresh = tmp_path / (base + suffix)
            committed = os.path.join(ROOT, base + suffix)
            assert fresh.exists(), f"protoc did not write {base + suffix}"
            if not os.path.exists(committed):
                stale.append(f"{base + suffix} (missing)")
            elif open(committed, "rb").read() != fresh.read_bytes():
                stale.append(base + suffix)
    assert not stale, f"generated files out of date: {', '.join(stale)}; run `make protos` (never hand-edit them)"


def test_experts_service_shape():
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

    svc = experts_pb2.DESCRIPTOR.services_by_name["ExpertService"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert methods == {"Forward": (True, True), "ForwardOne": (False, False), "Describe": (False, False),
                       "AttachShm": (False, False), "AttachTcp": (False, False)}
    assert experts_pb2.DESCRIPTOR.package == "moesplit.v1"
    assert hasattr(experts_pb2_grpc, "ExpertServiceStub")
