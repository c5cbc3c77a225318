"""`moesplit doctor` and `moesplit bench`: the probes they share with bench/bench_kernels.py, the
prediction's formula, no torch without a GPU, and a bench of a tiny checkpoint through the stack.

The probes' figures vary between runs on a shared machine (other processes take the cores), so the
tests check that the doctor runs the one probe implementation bench-kernels records and reports
its numbers unchanged; the figures of the two, run alternately, are compared by bench/bench_doctor.py
(bench/results/doctor.json)."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from gpu_service.plan.predict import ModelBytes, Side, distinct_experts, predict, predict_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_TORCH = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch must not be imported by moesplit doctor without a GPU")
        return None
sys.meta_path.insert(0, Block())
from moesplit.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules
sys.exit(rc)
"""


def _driver_lists_gpus() -> bool:
    from gpu_service.local.devices import driver_sees_gpus

    return driver_sees_gpus()


def _doctor(*args: str, block_torch: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", NO_TORCH] if block_torch else [sys.executable, "-m", "moesplit"]
    return subprocess.run([*cmd, "doctor", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def test_bench_kernels_measures_its_ceilings_with_the_doctors_probes():
    """One implementation: bench/bench_kernels.py imports cpu_expert_service.probes and calls none of
    the timing primitives (read_seconds / probe_peak) itself; the doctor runs that module's main."""
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(ROOT, "bench", "bench_kernels.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    from cpu_expert_service import probes

    assert bk.probes is probes
    with open(os.path.join(ROOT, "bench", "bench_kernels.py")) as f:
        tree = ast.parse(f.read())
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not called & {"read_seconds", "probe_peak", "read_probe"}, called
    assert "measure" in called
    from gpu_service.entrypoints import doctor

    with open(doctor.__file__) as f:
        assert '"-m", "cpu_expert_service.probes"' in f.read()


def test_bench_kernels_ceiling_probe_is_the_representations_best_exact_loop():
    """An AVX2 int8 record carries its representation's ceiling (the best of probes.REPRESENTATION_CEILINGS'
    loops per CPU-second, beside the instruction's peak); a format without one carries none."""
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(ROOT, "bench", "bench_kernels.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    per_cpu = {"peak_maddubs_int8_avx2_gops": 350.0, "int8_exact_wd_avx2": 175.0, "int8_exact_sign_avx2": 140.0}
    rec = {"isa": "avx2", "format": "int8", "act_bits": 8, "gflops_per_core": 105.0}
    cp = bk.ceiling_probe(rec, per_cpu, "peak_maddubs_int8_avx2_gops")
    assert cp["name"] == "int8_exact_wd_avx2" and cp["frac_of_peak"] == 0.5 and cp["record_frac_of_ceiling"] == 0.6
    assert bk.ceiling_probe(dict(rec, act_bits=16), {**per_cpu, "int8_exact_wd_avx2": None},
                            "peak_maddubs_int8_avx2_gops") is None  # a16 takes only the vpmaddwd loop
    assert bk.ceiling_probe(dict(rec, format="int4"), per_cpu, "peak_maddubs_int8_avx2_gops") is None


def test_doctor_json_reports_the_probes_numbers_without_torch(monkeypatch, capsys):
    """`moesplit doctor --json` with torch unimportable: the ISA a backend would pick, the probe's
    read bandwidth and peaks as measured, no GPU said (not a failure), exit 0."""
    if _driver_lists_gpus():
        pytest.skip("the NVIDIA driver lists a GPU here: the doctor asks torch about it")
    r = _doctor("--json", "--quick", block_torch=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    from cpu_expert_service.kernel_backend import select_isa

    assert rep["cpu"]["kernel_isa"] == select_isa()
    ce = rep["cpu"]["ceilings"]
    assert ce["read_gbps"] > 0.5 and ce["threads"] >= 1
    from cpu_expert_service.kernels import _moe

    for kind, (key, _) in __import__("cpu_expert_service.probes", fromlist=["PROBES"]).PROBES.items():
        has = _moe.cpu_has(_moe.PROBES[kind][0])
        assert (ce[key] is not None) == has and (not has or ce[key] > 1), (key, ce[key])
    assert rep["gpus"]["count"] == 0 and "no NVIDIA GPU" in rep["gpus"]["note"]
    assert all(set(f) == {"what", "fix"} for f in rep["findings"])

    # the printed figures are the probe process's, unchanged
    from gpu_service.entrypoints import doctor
    from moesplit.cli import main

    seen = []
    real = doctor.cpu_report
    monkeypatch.setattr(doctor, "cpu_report", lambda *a: seen.append(real(*a)) or json.loads(json.dumps(seen[-1])))
    capsys.readouterr()
    assert main(["doctor", "--json", "--quick", "--no-gpu-probe"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cpu"]["ceilings"] == seen[0]["ceilings"] and out["cpu"]["kernel_isa"] == seen[0]["kernel_isa"]


def test_doctor_isa_follows_the_kernels_override():
    """MOESPLIT_KERNEL_ISA picks the kernels' ISA: the doctor reports that one, and a bad value as a finding."""
    r = subprocess.run([sys.executable, "-m", "cpu_expert_service.probes", "--json", "--facts-only"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, MOESPLIT_KERNEL_ISA="generic"))
    rep = json.loads(r.stdout)
    assert rep["kernel_isa"] == "generic" and rep["kernel_isa_env"] == "generic"
    assert any("MOESPLIT_KERNEL_ISA" in f["what"] for f in rep["findings"]) == (rep["kernel_isas_available"][0] != "generic")
    r = subprocess.run([sys.executable, "-m", "cpu_expert_service.probes", "--json", "--facts-only"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, MOESPLIT_KERNEL_ISA="sse9"))
    rep = json.loads(r.stdout)
    assert rep["kernel_isa"] is None and any(f["fix"] == "unset MOESPLIT_KERNEL_ISA" for f in rep["findings"])


def test_doctor_predicts_kimi_on_a_24gib_gpu():
    """`moesplit doctor --model kimi-k2-thinking --gpu 24GiB` prints the formula, its terms and a
    prediction for 1 and 32 streams; the JSON's terms add up and use the measured bandwidth."""
    r = _doctor("--quick", "--model", "kimi-k2-thinking", "--gpu", "24GiB", "--no-gpu-probe", block_torch=True)
    assert r.returncode == 0, r.stderr
    for s in ("prediction (decode):", "t_step    = t_gpu + t_cpu + t_handoff", "cpu_read_bw=", "gpu_bw=1008 GB/s",
              "B=  1:", "B= 32:", "tokens/s"):
        assert s in r.stdout, (s, r.stdout)
    r = _doctor("--json", "--quick", "--model", "kimi-k2-thinking", "--gpu", "24GiB", "--no-gpu-probe",
                "--gpu-bandwidth", "900", "--handoff-us", "80")
    rep = json.loads(r.stdout)
    p = rep["prediction"]
    m, s = p["inputs"], p["sides"]
    assert s["cpu_read_gbps"] == rep["cpu"]["ceilings"]["read_gbps"]
    assert s["gpu_gbps"] == 900 and s["handoff_us"] == 80 and m["expert_format"] == "int4"
    assert m["experts_per_layer"] == 384 and m["top_k"] == 8 and m["moe_layers"] == 60
    for b, t in p["by_streams"].items():
        B = int(b)
        D = 384 * (1 - (1 - 8 / 384) ** B)
        assert t["cpu_bytes"] == pytest.approx(60 * D * (384 - m["gpu_experts"]) / 384 * m["expert_bytes"], rel=1e-6)
        step = t["t_gpu_ms"] + max(t["t_cpu_bandwidth_ms"], t["t_cpu_compute_ms"]) + t["t_handoff_ms"]
        assert t["t_step_ms"] == pytest.approx(step, rel=2e-3)
        assert t["tokens_per_s"] == pytest.approx(B / (t["t_step_ms"] / 1e3), rel=2e-3)
    assert p["by_streams"]["32"]["tokens_per_s"] > p["by_streams"]["1"]["tokens_per_s"]


def test_doctor_refuses_bad_input_before_measuring():
    """No GPU size to plan on, an unknown model: exit 2 naming the fix, before the probes run."""
    if _driver_lists_gpus():
        pytest.skip("a GPU is found here: the doctor plans on it")
    r = _doctor("--model", "kimi-k2-thinking", "--no-gpu-probe")
    assert r.returncode == 2 and "--gpu SIZE" in r.stderr and r.stdout == ""
    r = _doctor("--model", "no-such-model", "--gpu", "24GiB")
    assert r.returncode == 2 and "presets:" in r.stderr
    r = _doctor("--model", "kimi-k2-thinking", "--gpu", "24GiB", "--gpu-bandwidth", "0")
    assert r.returncode == 2 and "--gpu-bandwidth must be > 0" in r.stderr


def test_prediction_formula_by_hand():
    """E=8, k=2, one MoE layer of H=4, I=2: hand-computed terms."""
    assert distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert distinct_experts(8, 2, 10**4) == pytest.approx(8.0)
    m = ModelBytes(8, 2, 1, 4, 2, expert_bytes=1000, expert_format="bf16", gpu_experts=2, gpu_expert_bytes=400,
                   gpu_weight_bytes=5000, kv_bytes_per_token=10)
    s = Side(cpu_read_gbps=1.0, cpu_dot_peak_gops=None, gpu_gbps=2.0, handoff_us=10.0, link_gbps=1.0, sources={})
    r = predict_step(m, s, streams=1, context=100)
    cpu_bytes = 1 * 2.0 * 6 / 8 * 1000  # D(1) = k = 2 experts, 6 of 8 on the shards
    gpu_bytes = 5000 + 400 * 2.0 / 8 + 1 * 100 * 10
    t = cpu_bytes / 1e9 + gpu_bytes / 2e9 + 1 * (10e-6 + 2 * 1 * 4 * 2 / 1e9)
    assert r["cpu_bytes"] == int(cpu_bytes) and r["gpu_bytes"] == int(gpu_bytes)
    assert r["t_step_ms"] == pytest.approx(t * 1e3, rel=1e-3) and r["tokens_per_s"] == pytest.approx(1 / t, rel=2e-3)
    slow = predict_step(m, Side(1.0, 1e-6, 2.0, 10.0, 1.0, {}), streams=1, context=100)  # compute-bound shards
    assert slow["cpu_bound"] == "compute" and slow["t_step_ms"] > r["t_step_ms"]
    assert set(predict(m, s, (1, 4), 100)["by_streams"]) == {1, 4}


def test_bench_tiny_checkpoint_measured_vs_predicted(tmp_path, capsys):
    """`moesplit bench --model <tiny> --streams 1,32`: the stack comes up as `serve` does, both stream
    counts decode, and measured / predicted is the two figures' ratio."""
    from gpu_service.local.tiny import make_tiny
    from moesplit.cli import main

    d = str(tmp_path / "tiny")
    make_tiny(d, "bf16", seed=0)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", d, "--shards", "2", "--streams", "1,32", "--max-tokens", "8", "--quick",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured/predicted" in text and "prediction (decode):" in text
    res = json.loads(out.read_text())
    for b in ("1", "32"):
        r = res["results"][b]
        assert r["tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert r["measured_over_predicted"] == pytest.approx(r["tokens_per_s"] / r["predicted_tokens_per_s"], rel=2e-3)
        assert r["predicted_tokens_per_s"] == res["prediction"]["by_streams"][b]["tokens_per_s"]
        assert r["measured_step_ms"] == pytest.approx(int(b) / r["tokens_per_s"] * 1e3, rel=2e-3)
    assert res["prediction"]["inputs"]["expert_format"] == "bf16" and res["prediction"]["inputs"]["moe_layers"] >= 1
    assert res["results"]["32"]["tokens_per_s"] > res["results"]["1"]["tokens_per_s"]  # batching helps


def test_bench_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    from moesplit.cli import main

    assert main(["bench", "--model", str(tmp_path)]) == 2
    assert "make-tiny" in capsys.readouterr().err


def test_bench_refuses_deepseek_v4_naming_why(tmp_path, capsys):
    import shutil

    from moesplit.cli import main

    shutil.copy("/work/shared/model-configs/deepseek-v4-flash.json", tmp_path / "config.json")
    assert main(["bench", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "DeepSeek-V4 is not benchmarked yet" in err and "moesplit serve" in err


def test_pci_links_and_the_card_table(tmp_path):
    """PCIe links are read from sysfs for NVIDIA display controllers only; cards are found by name
    (the most specific key first) or by the memory they are sold with."""
    from gpu_service.local.devices import card_bandwidth, card_for_memory, pci_gpus

    def dev(addr, vendor, cls, width="16"):
        d = tmp_path / addr
        d.mkdir()
        for k, v in {"vendor": vendor, "class": cls, "current_link_speed": "16.0 GT/s PCIe",
                     "current_link_width": width, "max_link_speed": "32.0 GT/s PCIe", "max_link_width": "16"}.items():
            (d / k).write_text(v + "\n")

    dev("0000:17:00.0", "0x10de", "0x030200", width="8")
    dev("0000:18:00.0", "0x8086", "0x030000")  # another vendor's display controller
    dev("0000:19:00.0", "0x10de", "0x040300")  # an NVIDIA audio function
    links = pci_gpus(str(tmp_path))
    assert [x["pci"] for x in links] == ["0000:17:00.0"]
    assert links[0]["current_link_width"] == "8" and links[0]["max_link_speed"] == "32.0 GT/s PCIe"
    assert card_bandwidth("NVIDIA H100 PCIe") == (2000.0, "h100 pcie")
    assert card_bandwidth("NVIDIA H100 80GB HBM3") == (3350.0, "h100")
    assert card_bandwidth("NVIDIA GH200 480GB") == (4000.0, "gh200")
    assert card_bandwidth("NVIDIA GeForce RTX 4090") == (1008.0, "rtx 4090")
    assert card_bandwidth("Radeon 7900") is None
    assert card_for_memory(24 << 30)[1] == "rtx 4090" and card_for_memory(141 * 10**9)[1] == "h200"
    assert card_for_memory(3 << 30) is None


@pytest.mark.gpu
def test_doctor_describes_the_gpu_and_plans_on_it():
    """On a CUDA machine: name, memory, capability, copies timed; --model plans on the GPU found."""
    r = _doctor("--json", "--quick", "--model", "kimi-k2-thinking")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    g = rep["gpus"]["gpus"][0]
    assert rep["gpus"]["count"] >= 1 and g["memory_bytes"] > 1 << 30 and g["h2d_gbps"] > 1 and g["d2h_gbps"] > 1
    assert rep["prediction"]["sides"]["link_gbps"] == g["h2d_gbps"]
