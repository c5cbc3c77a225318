"""The shape of the tree, checked from the source (ast, no third-party tool).

- no import cycle anywhere in the project (imports inside functions count too);
- no module over 600 lines in the services, the wire package, checkpoint or the entry point
  (generated `*_pb2*` files aside);
- `gpu_service` imports nothing of `cpu_expert_service`; `wire` and `checkpoint` import neither
  service; `moesplit` (the entry point) imports no service at load;
- `gpu_service` keeps at most 12 modules at its top level;
- `moesplit expert-server` / `convert` run with `gpu_service` and torch unimportable.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moesplit", "wire", "checkpoint", "gpu_service", "cpu_expert_service", "protos")
SIZE_CHECKED = ("moesplit", "wire", "checkpoint", "gpu_service", "cpu_expert_service")
MAX_LINES = 600


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(d, f)
    return out


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (the most specific module each import names)."""
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        edges = set()
        for n in ast.walk(tree):
            targets = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:  # relative import
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[:len(parts) - (n.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in n.names] or [base]
            for t in targets:
                r = _resolve(t, modules)
                if r is not None and r != mod:
                    edges.add(r)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


MODULES = _modules()
GRAPH = import_graph(MODULES)


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == [], "import cycles (break them: move the shared part to a module both import)"


def test_module_sizes():
    big = {}
    for mod, path in MODULES.items():
        if _top(mod) in SIZE_CHECKED and "_pb2" not in mod:
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                big[mod] = n
    assert big == {}, f"modules over {MAX_LINES} lines (split them by concept)"


@pytest.mark.parametrize("src,forbidden", [
    ("gpu_service", ("cpu_expert_service",)),
    ("cpu_expert_service", ("gpu_service",)),
    ("wire", ("gpu_service", "cpu_expert_service")),
    ("checkpoint", ("gpu_service", "cpu_expert_service", "wire")),
    ("moesplit", ("gpu_service", "cpu_expert_service")),
    ("protos", ("gpu_service", "cpu_expert_service", "wire", "checkpoint")),
])
def test_layering(src, forbidden):
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _top(m) == src for t in ts if _top(t) in forbidden)
    assert bad == []


def test_gpu_service_top_level_stays_small():
    top = sorted(m for m, p in MODULES.items() if m.count(".") == 1 and m.startswith("gpu_service.")
                 and not p.endswith("__init__.py"))
    assert len(top) <= 12, top


def test_every_package_says_what_lives_there():
    for mod, path in MODULES.items():
        if path.endswith("__init__.py") and _top(mod) in SIZE_CHECKED:
            with open(path) as f:
                doc = ast.get_docstring(ast.parse(f.read()))
            assert doc and len(doc) > 60, f"{path}: the package docstring should say what lives there"


BLOCKER = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("gpu_service", "torch"):
            raise ImportError(f"{name} must not be imported by the expert side")
        return None
sys.meta_path.insert(0, Block())
from moesplit.cli import main
rc = main(sys.argv[1:])
assert not [m for m in sys.modules if m.split(".")[0] in ("gpu_service", "torch")]
sys.exit(rc)
"""


@pytest.mark.parametrize("command", ["expert-server", "convert"])
def test_expert_commands_need_no_gpu_service(command):
    r = subprocess.run([sys.executable, "-c", BLOCKER, command, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: moesplit " + command in r.stdout


# ---- the decode wing: one model, one decode path, transport code outside model/ ----------------
def _imports_of(path: str) -> set[str]:
    """Every module name an import statement in `path` names (stdlib and third-party included)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            out.add(n.module)
    return out


TRANSPORT_MODULES = ("socket", "select", "selectors", "mmap", "ctypes", "grpc", "ml_dtypes", "multiprocessing")


def test_model_imports_no_transport_and_nothing_of_experts():
    """gpu_service/model/ calls the routed experts only through model.experts_api.ExpertsFn: it
    imports nothing of gpu_service.experts, gpu_service.runtime or the wire, and no transport module."""
    bad = {}
    for mod, path in MODULES.items():
        if mod.startswith(("gpu_service.model", "gpu_service.attention")):
            hits = sorted(m for m in _imports_of(path)
                          if m.split(".")[0] in TRANSPORT_MODULES + ("wire", "protos")
                          or m.startswith(("gpu_service.experts", "gpu_service.runtime", "gpu_service.api")))
            if hits:
                bad[mod] = hits
    assert bad == {}


def test_model_does_not_probe_the_experts_object():
    """No getattr / hasattr / isinstance on the experts argument in model/: one interface, no probes."""
    bad = []
    for mod, path in MODULES.items():
        if not mod.startswith("gpu_service.model"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr",
                                                                                          "isinstance")
                    and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "experts"):
                bad.append(f"{path}:{n.lineno}")
    assert bad == []


LAYER_METHODS = ("steps", "project", "core")  # what a decode implementation of a layer defines


def test_one_decode_implementation_per_architecture():
    """The rule checked: the layer pieces a decode step runs (`steps`, `project`, `core`) are defined
    once per architecture, in gpu_service/model/ (one class each), and no C, C++ or Cython source
    lives under gpu_service/ (no second implementation of the model in another language)."""
    seen: dict[str, list[str]] = {}
    for mod, path in MODULES.items():
        if not mod.startswith("gpu_service"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in LAYER_METHODS:
                    seen.setdefault(fn.name, []).append(f"{mod}.{cls.name}")
    assert all(len(v) == 1 for v in seen.values()), seen
    assert all(v[0].startswith("gpu_service.model.") for v in seen.values()), seen
    native = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "gpu_service")) for f in fs
              if f.endswith((".c", ".h", ".cc", ".cpp", ".pyx")) and "/experts/" not in d + "/"]
    assert native == [], "C sources outside gpu_service/experts/ (the transport's client may be C, the model not)"
