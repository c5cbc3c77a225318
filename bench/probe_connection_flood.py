"""The hostile-connection probe at full size against default ServerLimits: 1,100 sockets without a key, each
`GET /health` with Content-Length 100000, one body byte, then silence; meanwhile /live, /health and a
keyed completion must be served within 1 s. `--many`: the sockets come from 1,100 loopback
addresses (past the total cap) instead of one (past the per-address cap). The scaled form is a test
(tests/test_hostile_connections.py); this one takes ~30 s and 1,100 file descriptors.

    python bench/probe_connection_flood.py [--many]
"""
import resource, socket, sys, time, tempfile
import os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import httpx, torch
from checkpoint.reader import CheckpointReader
from cpu_expert_service.server import load_shard
from gpu_service.api.guard import ServerLimits
from gpu_service.api.tokenizer import Tokenizer
from gpu_service.entrypoints.serving import ServingStack
from gpu_service.local.tiny import make_tiny
from gpu_service.experts.handoff import LocalExperts
from gpu_service.runtime.runner import ModelRunner
from tests.test_hostile_connections import LivePoller
d = make_tiny(tempfile.mkdtemp() + "/tiny", "bf16", seed=0)
_, backend, _ = load_shard(d, None, None, "numpy")
runner = ModelRunner(CheckpointReader(d), LocalExperts(backend), device=torch.device("cpu"), dtype=torch.float32, kv_tokens=2048, page_size=16)
lim = ServerLimits()
print("defaults:", lim)
st = ServingStack(runner, Tokenizer(d), "tiny", port=0, grpc_port=0, api_key="K", limits=lim).start()
req = b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nx"
with LivePoller(st) as live:
    socks = []
    for i in range(1100):
        s = socket.socket(); s.bind((f"127.0.{1 + i // 250}.{2 + i % 250}", 0)) if "--many" in sys.argv else None
        s.settimeout(5); s.connect((st.host, st.port)); s.sendall(req); socks.append(s)
    time.sleep(1.0)
    res = {}
    for path, kw in (("/live", {}), ("/health", {}), ("/v1/completions", {"headers": {"authorization": "Bearer K"}, "json": {"model": "tiny", "prompt": [5, 6], "max_tokens": 2}})):
        t0 = time.monotonic()
        r = httpx.request("POST" if kw else "GET", st.http_url + path, timeout=2.0, **kw)
        res[path] = (r.status_code, round(time.monotonic() - t0, 3))
    print("while 1,100 sockets are held:", res)
print(f"/live worst {live.worst * 1000:.0f} ms over {live.n} polls, failures {len(live.failures)}")
for s in socks: s.close()
st.stop()
