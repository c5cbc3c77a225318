"""The shape of the tree, checked from the source (ast, no third-party tool).

- no import cycle anywhere in the project (imports inside functions count too);
- no module over 600 lines in the services, the wire package, checkpoint or the entry point
  (generated `*_pb2*` files aside), and no hand-written C / Cython source (.c, .h, .pyx, .pxd, .pxi) of
  the packages over 600 lines either (Cython's generated C aside);
- `gpu_service` imports nothing of `cpu_expert_service`; `wire` and `checkpoint` import neither
  service; `moesplit` (the entry point) imports no service at load;
- `gpu_service` keeps at most 12 modules at its top level;
- `moesplit expert-server` / `convert` run with `gpu_service` and torch unimportable;
- no function in `gpu_service` over 120 lines;
- no source file of the packages points at the tracker (`issue 20`): comments say what the code does;
- dotted names (`gpu_service.local.tiny.make_tiny`) and paths (`gpu_service/api/http_api.py`) of the
  project in docstrings and comments name modules (and their top-level names) that exist.
"""
from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moesplit", "wire", "checkpoint", "gpu_service", "cpu_expert_service", "protos")
SIZE_CHECKED = ("moesplit", "wire", "checkpoint", "gpu_service", "cpu_expert_service")
MAX_LINES = 600
MAX_FUNCTION_LINES = 120


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


# ---- functions, tracker references, stale names ----------------------------------------------------
def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function (methods and nested ones too) over `limit` lines."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = n.end_lineno - n.lineno + 1
            if length > limit:
                out.append((n.name, n.lineno, length))
    return out


def test_long_function_finder_finds_a_planted_one():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [("f", 1, MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"class C:\n    def g(self):\n    {body.replace(chr(10), chr(10) + '    ')}") != []
    assert long_functions(f"def f():\n{body[:-len(body.splitlines()[-1]) - 1]}") == []


def test_functions_are_short():
    big = []
    for mod, path in sorted(MODULES.items()):
        if _top(mod) == "gpu_service":
            with open(path) as f:
                big += [f"{os.path.relpath(path, ROOT)}:{line} {name} ({n} lines)"
                        for name, line, n in long_functions(f.read())]
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(big)


SOURCE_SUFFIXES = (".py", ".c", ".h", ".pyx", ".pxd", ".pxi")
C_SUFFIXES = (".c", ".h", ".pyx", ".pxd", ".pxi")
TRACKER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def _sources() -> list[str]:
    """Every hand-written source file of the packages (Cython's generated C aside)."""
    out = []
    for pkg in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in sorted(files):
                path = os.path.join(d, f)
                if f.endswith(SOURCE_SUFFIXES) and "_pb2" not in f:
                    with open(path, errors="replace") as fh:
                        if not fh.read(200).startswith("/* Generated by Cython"):
                            out.append(path)
    return sorted(out)


def test_c_source_sizes():
    """The hand-written C and Cython sources keep to the modules' line limit too."""
    big = {}
    for path in _sources():
        if path.endswith(C_SUFFIXES):
            with open(path, errors="replace") as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                big[os.path.relpath(path, ROOT)] = n
    assert any(p.endswith("moe_core.c") for p in _sources())  # the walk sees the C sources at all
    assert big == {}, f"C / Cython sources over {MAX_LINES} lines (split them into cohesive files)"


def test_tracker_pattern():
    assert TRACKER.search("dequantised once per call (issue 21's scratch)")
    assert TRACKER.search("/* the doorbell loop in C (Issue #20). */")
    assert not TRACKER.search("an issue with 20 layers") and not TRACKER.search("tissue 3")


def test_no_tracker_references_in_the_code():
    hits = []
    for path in _sources():
        with open(path, errors="replace") as f:
            hits += [f"{os.path.relpath(path, ROOT)}:{i}: {m.group(0)}"
                     for i, line in enumerate(f, 1) for m in TRACKER.finditer(line)]
    assert not hits, "say what the code does, not which tracker issue it came from:\n" + "\n".join(hits)


NAMED = ("gpu_service", "cpu_expert_service", "wire", "checkpoint", "protos")  # `moesplit.*` is also the
# proto package and the loggers' namespace: not only modules
DOTTED = re.compile(r"\b(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(NAMED))
PATHED = re.compile(r"\b(?:%s)(?:/\w+)*/\w+\.(?:py|pyx|pxd|c|h)\b" % "|".join(PACKAGES))


def _top_level_names(path: str) -> set[str]:
    """Names a module defines or imports at its top level (inside if / try too)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for stmt in tree.body:
        for n in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def stale_name(name: str, modules: dict[str, str]) -> bool:
    """True when dotted `name` is no module, nor a module plus one of its top-level names (what
    follows that, e.g. a method, is not checked)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in modules:
            return i < len(parts) and parts[i] not in _top_level_names(modules[mod])
    return True


def _prose(path: str):
    """(line, text) of a module's docstrings and comments."""
    with open(path) as f:
        source = f.read()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(n, clean=False)
            if doc:
                yield n.body[0].lineno, doc
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def test_stale_name_finder():
    assert stale_name("gpu_service.tiny", MODULES)  # a module that moved to gpu_service.local.tiny
    assert stale_name("gpu_service.runner.LocalExperts", MODULES)
    assert stale_name("gpu_service.local.tiny.no_such_function", MODULES)
    assert not stale_name("gpu_service.local.tiny.make_tiny", MODULES)
    assert not stale_name("gpu_service.runtime.sampling", MODULES)
    assert not stale_name("gpu_service.experts.client.ExpertsClient.connect", MODULES)


def test_names_in_docstrings_and_comments_exist():
    stale = []
    for mod, path in sorted(MODULES.items()):
        if "_pb2" in mod:
            continue
        for line, text in _prose(path):
            def where(m: re.Match) -> str:
                return f"{os.path.relpath(path, ROOT)}:{line + text.count(chr(10), 0, m.start())}: {m.group(0)}"
            stale += [where(m) for m in DOTTED.finditer(text) if stale_name(m.group(0), MODULES)]
            stale += [where(m) for m in PATHED.finditer(text) if not os.path.exists(os.path.join(ROOT, m.group(0)))]
    assert not stale, ("docstrings / comments name modules that do not exist (name what is there now):\n"
                       + "\n".join(stale))
