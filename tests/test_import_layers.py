"""The import graph follows the layers (issue #13, item 6; #31, item 6).

Read from the source (no import runs): the neutral layer imports no
framework at module level; backends import neither the integration layer
nor the checkpoint; the checkpoint does not reach the strategies or the
integration layer; only the integration layer names `keras.src`; and no
two modules import each other, directly or around a longer cycle.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_distribute"
FRAMEWORKS = ("jax", "tensorflow", "torch")
STRATEGY_MODULES = tuple(
    f"keras_distribute.strategies.{name}" for name in (
        "strategy", "extended", "mirrored", "multi_worker", "tpu", "default"))


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`, and `if __name__ == "__main__":` (run as a
    script, the module is `__main__`, not itself: no cycle)."""
    return isinstance(node, ast.If) and (
        "TYPE_CHECKING" in ast.unparse(node.test)
        or ast.unparse(node.test) in ("__name__ == '__main__'",
                                      '__name__ == "__main__"'))


def _imports(tree: ast.Module, modules: set):
    """`(module imported, at module level?)` pairs of one file; `from pkg
    import sub` counts as importing `pkg.sub`."""
    found = []

    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                        ast.ClassDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, top_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                subs = [f"{child.module}.{a.name}" for a in child.names
                        if f"{child.module}.{a.name}" in modules]
                found.extend((name, top_level)
                             for name in subs or [child.module])
            visit(child, top_level and not nested)

    visit(tree, True)
    return found


@pytest.fixture(scope="module")
def graph():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(ast.parse(path.read_text()), modules)
            for name, path in files.items()}, files


def _layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ("backend", "checkpoint",
                                       "integration"):
        return parts[1]
    return "neutral"


def test_no_import_cycles(graph):
    imports, files = graph
    edges = {m: {n for n, _ in found if n in files and n != m}
             for m, found in imports.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def connect(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            connect(module)
    assert cycles == []


def test_each_layer_imports_only_the_layers_below(graph):
    imports, _ = graph
    wrong = []
    for module, found in imports.items():
        layer = _layer(module)
        for name, top_level in found:
            target = name.split(".")
            if layer == "backend" and name.startswith((
                    "keras_distribute.integration",
                    "keras_distribute.checkpoint")):
                wrong.append((module, name))
            if layer == "checkpoint" and (name.startswith(
                    "keras_distribute.integration") or name in
                    STRATEGY_MODULES):
                wrong.append((module, name))
            if layer in ("neutral", "checkpoint") and top_level and (
                    target[0] in FRAMEWORKS):
                wrong.append((module, name))
            if name.startswith("keras.src") and layer != "integration":
                wrong.append((module, name))
    assert wrong == []


def test_the_reader_counts_lazy_imports():
    # The graph reader itself: a lazy import inside a function counts.
    tree = ast.parse(
        "def f():\n    from keras_distribute.common import context\n")
    assert _imports(tree, {"keras_distribute.common.context"}) == [
        ("keras_distribute.common.context", False)]


# The packages, lowest first (#31: the tree is laid out by them): a module
# imports only from its package and the ones before it, lazily or not.
PACKAGE_ORDER = ("common", "job", "cluster_resolver", "backend", "training",
                 "input", "checkpoint", "integration", "strategies",
                 "planning", "callbacks", "launch", "root")
ROOT_MODULES = {"keras_distribute", "keras_distribute.experimental",
                "keras_distribute.layouts"}


def _package(module: str) -> str:
    return "root" if module in ROOT_MODULES else module.split(".")[1]


def test_every_module_has_a_package(graph):
    # The package root holds only `__init__` and the public namespaces
    # `experimental` and `layouts`; every other module lives in a package.
    _, files = graph
    assert {_package(m) for m in files} <= set(PACKAGE_ORDER), sorted(
        m for m in files if _package(m) not in PACKAGE_ORDER)
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
        "__init__.py", "experimental.py", "layouts.py"]


def test_packages_import_only_the_packages_before_them(graph):
    imports, files = graph
    upward = set()
    for module, found in imports.items():
        for name, _ in found:  # lazy imports count
            if name in files and PACKAGE_ORDER.index(
                    _package(name)) > PACKAGE_ORDER.index(_package(module)):
                upward.add((module, name))
    assert upward == set()


def test_the_checkpoints_folders_import_only_the_folders_below(graph):
    # #44 item 4: checkpoint/ shows its layers as folders. `storage/` (the
    # checkpoint on disk) imports no Keras, no framework and nothing else
    # of kd but the engine contract's `whole_region`; `objects/` imports
    # `storage/` and nothing above it in `checkpoint/`.
    imports, files = graph
    storage = [m for m in files
               if m.startswith("keras_distribute.checkpoint.storage.")]
    objects = [m for m in files
               if m.startswith("keras_distribute.checkpoint.objects.")]
    assert len(storage) >= 9 and len(objects) >= 4
    above = []
    for module in storage:
        for name, _ in imports[module]:  # lazy imports count
            root = name.split(".")[0]
            if root in ("keras",) + FRAMEWORKS or (
                    root == "keras_distribute" and not name.startswith(
                        "keras_distribute.checkpoint.storage")
                    and name != "keras_distribute.backend.interface"):
                above.append((module, name))
    for module in objects:
        for name, _ in imports[module]:
            if name.startswith("keras_distribute.checkpoint.") and not (
                    name.startswith(("keras_distribute.checkpoint.storage",
                                     "keras_distribute.checkpoint.objects"))):
                above.append((module, name))
    assert above == []


def test_importing_the_package_and_the_script_launcher_imports_no_keras():
    # `python -m keras_distribute.launch` imports the package first: a
    # Keras import there cost every launch ~5 s of CPU in a process that
    # only starts and watches the workers. Keras (and its backend) load
    # when a strategy, a callback or a layout map is first used.
    import os
    import subprocess
    import sys

    program = (
        "import sys\n"
        "import keras_distribute as kd\n"
        "import keras_distribute.launch.script\n"
        "heavy = {'keras', 'jax', 'tensorflow', 'torch'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "kd.layouts.fully_sharded\n"
        "assert 'keras' in sys.modules\n")
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True,
        timeout=120, cwd=str(pathlib.Path(__file__).resolve().parent.parent),
        env=dict(os.environ, PYTHONPATH=str(
            pathlib.Path(__file__).resolve().parent.parent)))
    assert done.returncode == 0, done.stderr[-3000:]
