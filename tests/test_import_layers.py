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
STRATEGY_MODULES = (
    "keras_distribute.strategy", "keras_distribute.mirrored_strategy",
    "keras_distribute.multi_worker_strategy", "keras_distribute.tpu_strategy",
    "keras_distribute.default_strategy")


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
    return parts[1] if len(parts) > 2 else "neutral"


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
    tree = ast.parse("def f():\n    from keras_distribute import context\n")
    assert _imports(tree, {"keras_distribute.context"}) == [
        ("keras_distribute.context", False)]


# The packages the modules belong to (#31: the tree is to be laid out by
# them), lowest first: a module imports only from its package and the ones
# before it, lazily or not.
PACKAGE_ORDER = ("common", "job", "cluster_resolver", "backend", "training",
                 "input", "checkpoint", "integration", "strategies",
                 "callbacks", "launch", "root")
PACKAGE_OF = {
    "common": "context values reduce_op devices layouts errors "
              "cross_device_ops keras_services simulate",
    "job": "peer_board process_notes launch_processes",
    "cluster_resolver": "cluster_resolver cluster_resolver_base cluster_spec "
                        "scheduler_resolvers",
    "training": "custom_loop losses collectives model_state training_config",
    "input": "input_lib distributed_iterator data_sources process_data",
    "strategies": "strategy strategy_extended mirrored_strategy "
                  "multi_worker_strategy tpu_strategy default_strategy",
    "callbacks": "training_state callbacks backup_callback checkpoint_callback "
                 "preemption preemption_handler horovod_callbacks "
                 "ray_callbacks state_callbacks",
    "launch": "launch launch_script",
    "root": "__init__ experimental",
}
# The upward imports left, each to be removed (then removed from here):
# the engines' `call_trainer` still calls the per-process `fit` and the
# model-state rules (the fit path bounces), and a distributed iterator's
# state is read by the checkpoint's iterator module.
KNOWN_UPWARD = {
    ("keras_distribute.backend.jax_engine", "keras_distribute.process_data"),
    ("keras_distribute.backend.torch_engine", "keras_distribute.process_data"),
    ("keras_distribute.backend.tf_engine", "keras_distribute.input_lib"),
    ("keras_distribute.backend.tf_engine", "keras_distribute.model_state"),
    ("keras_distribute.backend.tf_engine",
     "keras_distribute.training_config"),
    ("keras_distribute.distributed_iterator",
     "keras_distribute.checkpoint.iterator_state"),
}


def _package(module: str) -> str:
    for package, names in PACKAGE_OF.items():
        for name in names.split():
            if module == ("keras_distribute" if name == "__init__"
                          else f"keras_distribute.{name}"):
                return package
    return module.split(".")[1]  # backend, checkpoint, integration


def test_every_module_has_a_package(graph):
    _, files = graph
    assert {_package(m) for m in files} <= set(PACKAGE_ORDER), sorted(
        m for m in files if _package(m) not in PACKAGE_ORDER)


def test_packages_import_only_the_packages_before_them(graph):
    imports, files = graph
    upward = set()
    for module, found in imports.items():
        for name, _ in found:  # lazy imports count
            if name in files and PACKAGE_ORDER.index(
                    _package(name)) > PACKAGE_ORDER.index(_package(module)):
                upward.add((module, name))
    assert upward - KNOWN_UPWARD == set(), "new upward imports"
    assert KNOWN_UPWARD - upward == set(), (
        "these upward imports are gone: remove them from KNOWN_UPWARD")
