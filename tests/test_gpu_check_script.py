"""`make gpu-check` (scripts/gpu_check.sh + scripts/gpu_check_report.py) on a CPU: the script itself
must not be what fails on a lent GPU machine. Its dry run (imports with the lent machine's absent
packages refused, argument parsing, the report's JSON shape), its "no CUDA" refusal, the wheels it
would install, and the report's verdicts on recorded results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check_report as R  # noqa: E402


def _run(args, tmp_path, **env):
    e = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
         "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), **env}
    t0 = time.monotonic()
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e, timeout=300)
    return p, time.monotonic() - t0


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_run_passes_and_prints_the_report(tmp_path):
    p, _ = _run(["--dry-run"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout[p.stdout.index("{"):])
    assert tuple(rep) == R.KEYS
    assert rep["dry_run"] is True and rep["ok"] is True and rep["problems"] == []
    assert f"{len(R.CHECK_MODULES)}/{len(R.CHECK_MODULES)} modules import" in p.stdout
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == rep


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": ""}], ids=["cpu", "no-visible-devices"])
def test_real_run_without_cuda_exits_1_saying_no_cuda_fast(tmp_path, env):
    p, took = _run([], tmp_path, **env)
    assert p.returncode == 1 and "no CUDA" in p.stderr, p.stderr
    assert took < 10, f"{took:.1f} s"


def test_unknown_argument_is_refused(tmp_path):
    p, _ = _run(["--dryrun"], tmp_path)
    assert p.returncode == 2 and "usage" in p.stderr


def test_preflight_names_a_module_needing_an_absent_package():
    """With fastapi & co. refused (as on the lent machine), a check module that needs them fails
    the preflight by name: here the HTTP API, which the gpu checks must never import."""
    code = ("import gpu_check_report as R, sys; R.CHECK_MODULES = ('gpu_service.api.http_api', 'gpu_service.runtime.engine');"
            "sys.exit(R.preflight())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "scripts")}, timeout=120)
    assert p.returncode == 1
    assert "gpu_service.api.http_api" in p.stderr and "refused" in p.stderr
    assert "gpu_service.runtime.engine" not in p.stderr and "1/2 modules import" in p.stdout


def test_only_missing_or_older_wheels_are_installed(tmp_path):
    for name in ("numpy-1.0-py3-none-any.whl", "moesplit_absent_pkg-1.0-py3-none-any.whl", "notes.txt",
                 "pytest-999.0.1-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert R.missing_wheels(str(tmp_path)) == [str(tmp_path / "moesplit_absent_pkg-1.0-py3-none-any.whl"),
                                               str(tmp_path / "pytest-999.0.1-py3-none-any.whl")]


def _junit(path, cases):
    body = "".join(f'<testcase classname="tests.test_gpu" name="{n}">{extra}</testcase>' for n, extra in cases)
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')


def test_report_verdicts(tmp_path):
    out = tmp_path
    (out / "machine.txt").write_text("GPU: NVIDIA H200, 580.65.06, 143771 MiB\nModel name:   Intel(R) Xeon(R) Platinum 8480+\n"
                                     "flags: avx512f amx_bf16 amx_tile amx_int8\n")
    (out / "torch.txt").write_text("torch 2.11.0 cuda 13.0 available True devices 1\n")
    (out / "build_status").write_text("ok\n")
    _junit(out / "junit.xml", [("test_a", ""), ("test_b", "")])
    (out / "records.jsonl").write_text(json.dumps({"name": "two_gpu_split", "ok": True, "device_count": 1}) + "\n")
    bench = {"cuda_graphs_vs_eager": [{"batch": b, "tokens_equal": True} for b in (1, 8, 32)], "linears": [],
             "real_shapes_layer": [{"preset": "deepseek-v3", "batch": b, "tokens_equal": True} for b in (1, 8)]}
    (out / "bench_gpu.json").write_text(json.dumps(bench))
    rep, problems = R.report(str(out), dry_run=False)
    assert problems == [] and rep["ok"]
    assert rep["machine"] == {"gpus": [{"name": "NVIDIA H200", "driver": "580.65.06", "memory": "143771 MiB"}],
                              "cpu": "Intel(R) Xeon(R) Platinum 8480+", "amx": ["amx_bf16", "amx_int8", "amx_tile"]}
    assert rep["tests"]["passed"] == 2 and rep["records"]["two_gpu_split"][0]["device_count"] == 1

    _junit(out / "junit.xml", [("test_a", "<skipped/>"), ("test_b", "<failure/>")])
    (out / "records.jsonl").write_text(json.dumps({"name": "long_prefill_peak_vs_plan", "ok": False}) + "\n")
    bench["cuda_graphs_vs_eager"][1]["tokens_equal"] = False
    bench["real_shapes_layer"][0]["tokens_equal"] = False
    (out / "bench_gpu.json").write_text(json.dumps(bench))
    rep, problems = R.report(str(out), dry_run=False)
    assert not rep["ok"] and rep["problems"] == problems
    text = "\n".join(problems)
    for want in ("skipped: tests.test_gpu::test_a", "failed: tests.test_gpu::test_b", "batch 8", "long_prefill_peak_vs_plan",
                 "deepseek-v3 layer at batch 1"):
        assert want in text

    (out / "junit.xml").unlink()
    (out / "bench_gpu.json").unlink()
    (out / "build_status").write_text("failed\n")
    (out / "preflight.txt").write_text("test_gpu: ModuleNotFoundError: No module named 'grpc'\n")
    (out / "build.txt").write_text("running build_ext\nerror: command 'gcc' failed: No such file or directory\n")
    _, problems = R.report(str(out), dry_run=False)
    assert any(p.startswith("building the C extensions: failed") and "'gcc' failed" in p for p in problems)
    assert "cannot import test_gpu: ModuleNotFoundError: No module named 'grpc'" in problems
    assert "no junit report: pytest did not run" in problems and "no CUDA-graphs-vs-eager benchmark rows" in problems
    assert "no real-shapes layer benchmark rows" in problems


def test_real_shapes_layer_plumbing_on_cpu():
    """bench_gpu's one-layer-at-real-shapes timing, shrunk and on the CPU (eager only): the rows the
    GPU run reports, from an in-memory model answered by zero experts."""
    from bench.bench_gpu import real_shapes_layer

    small = {"hidden_size": 256, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
             "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "moe_intermediate_size": 64,
             "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}
    rows = real_shapes_layer("deepseek-v3", batches=(1, 3), steps=3, device="cpu", overrides=small)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["hidden"] == 256 and r["ms_per_step_eager"] > 0 and "tokens_equal" not in r for r in rows)


def test_unpack_puts_a_wheel_where_it_imports(tmp_path):
    """Without pip on the lent machine, a carried wheel is unzipped onto PYTHONPATH."""
    import zipfile

    whl = tmp_path / "moesplit_probe_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("moesplit_probe_pkg/__init__.py", "VALUE = 42\n")
        z.writestr("moesplit_probe_pkg-1.0.dist-info/METADATA", "Name: moesplit-probe-pkg\nVersion: 1.0\n")
    site = tmp_path / "site"
    assert R.main(["unpack", str(site), str(whl)]) == 0
    p = subprocess.run([sys.executable, "-c", "import moesplit_probe_pkg as m; print(m.VALUE)"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert p.stdout.strip() == "42"


def test_every_gpu_marked_test_file_is_in_the_script():
    """A gpu test in a file the script does not run would never run anywhere."""
    import re

    tests = os.path.join(ROOT, "tests")
    marked = {f for f in os.listdir(tests) if f.endswith(".py") and f != "conftest.py"
              and re.search(r"pytest\.mark\.gpu\b", open(os.path.join(tests, f)).read())}
    script = open(SCRIPT).read()
    assert marked and all(f"tests/{f}" in script for f in marked), (marked, "not all in scripts/gpu_check.sh")
    assert {m for m in R.CHECK_MODULES if m.startswith("test_")} == {f[:-3] for f in marked}
