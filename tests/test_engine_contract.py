"""The engine contract is code: `backend/interface.py`'s protocols declare
everything the neutral layer reads from an engine, and every backend's
engines follow the protocols they declare (`contract`), with signatures
that take the protocol's arguments (#31)."""

import ast
import inspect
import pathlib

import pytest

from conftest import BACKEND
from keras_distribute.backend import interface

PACKAGE = pathlib.Path(interface.__file__).parent.parent
PROTOCOLS = (interface.ReplicaEngine, interface.ProcessDataEngine,
             interface.TorchDdpEngine, interface.ShardedForwardEngine,
             interface.LayoutEngine, interface.LogicalDeviceEngine,
             interface.TpuEngine)


def _declared(protocol) -> dict:
    """`{member: function or None (a data member)}` of a protocol, its
    bases' included."""
    members = {}
    for cls in reversed(protocol.__mro__):
        if cls in PROTOCOLS:
            members.update({name: None for name in getattr(
                cls, "__annotations__", {})})
            members.update({name: value for name, value in vars(cls).items()
                            if inspect.isfunction(value)
                            and not name.startswith("_")})
    return members


def _reads_from_an_engine(node) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("engine", "_engine")
    if isinstance(node, ast.Attribute):
        return node.attr in ("engine", "_engine")
    return isinstance(node, ast.Call) and isinstance(
        node.func, ast.Attribute) and node.func.attr == "_engine"


def _neutral_engine_reads() -> dict:
    """`{member: [files]}` the layers above `backend/` read from engines:
    `engine.x`, `strategy._engine.x`, `self._engine().x`, and the
    `getattr`/`hasattr(engine, "x")` probes."""
    reads = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "backend" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and _reads_from_an_engine(
                    node.value) and isinstance(node.ctx, ast.Load):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func,
                  ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2
                  and _reads_from_an_engine(node.args[0])
                  and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if name is not None:
                reads.setdefault(name, []).append(
                    str(path.relative_to(PACKAGE)))
    return reads


def test_the_neutral_layer_reads_only_what_a_protocol_declares():
    declared = set()
    for protocol in PROTOCOLS:
        declared.update(_declared(protocol))
    reads = _neutral_engine_reads()
    assert len(reads) > 30  # the scan sees the engine reads
    undeclared = {name: files for name, files in reads.items()
                  if name not in declared}
    assert not undeclared, (
        "The neutral layer reads these from an engine, but no protocol in "
        f"backend/interface.py declares them: {undeclared}")


def _check_follows(engine_class, protocol, instance=None):
    for name, function in _declared(protocol).items():
        if function is None:  # a data member: set on the instance
            if instance is not None:
                assert hasattr(instance, name), (engine_class, name)
            continue
        implementation = getattr(engine_class, name, None)
        assert callable(implementation), (
            f"{engine_class.__name__} declares {protocol.__name__} but has "
            f"no {name}()")
        wanted = [p for p in inspect.signature(function).parameters.values()
                  if p.name != "self"]
        arguments = [object()] * sum(
            p.default is inspect.Parameter.empty for p in wanted)
        inspect.signature(implementation).bind(object(), *arguments)
        inspect.signature(implementation).bind(object(), *[object()] * len(
            wanted))


def _engine_classes():
    if BACKEND == "jax":
        from keras_distribute.backend.jax.engine import JaxEngine
        from keras_distribute.backend.jax.engine import JaxTpuEngine
        return [JaxEngine, JaxTpuEngine]
    if BACKEND == "tensorflow":
        from keras_distribute.backend.tensorflow.engine import TfEngine
        from keras_distribute.backend.tensorflow.engine import TfTpuEngine
        return [TfEngine, TfTpuEngine]
    from keras_distribute.backend.torch.engine import TorchEngine
    from keras_distribute.backend.torch.sharding import ShardedTorchEngine
    return [TorchEngine, ShardedTorchEngine]


@pytest.mark.parametrize("index", [0, 1])
def test_every_engine_class_follows_what_it_declares(index):
    # (a TPU engine is a class of its own: #44, no contract changes on an
    # instance at run time)
    classes = _engine_classes()
    if index >= len(classes):
        pytest.skip(f"{BACKEND} has {len(classes)} engine class(es)")
    engine_class = classes[index]
    assert engine_class.contract, engine_class
    for protocol in (interface.ReplicaEngine,) + engine_class.contract:
        assert protocol in PROTOCOLS
        _check_follows(engine_class, protocol)


def test_the_strategy_engine_of_this_backend_follows_its_contract():
    from keras_distribute.backend import get_backend

    backend = get_backend()
    engine = backend.make_engine(backend.default_devices())
    for protocol in (interface.ReplicaEngine,) + engine.contract:
        assert isinstance(engine, protocol), protocol
        _check_follows(type(engine), protocol, engine)

def test_this_backend_module_has_every_declared_function():
    # #44: checkpoints, RNG state, layouts and TPUs were asked of backend
    # modules by name (`getattr(backend, "checkpoint_pieces", None)`),
    # each backend exporting some; now every backend declares them all.
    from keras_distribute.backend import get_backend

    backend = get_backend()
    declared = {name: value for name, value in vars(
        interface.BackendModule).items() if inspect.isfunction(value)
        and not name.startswith("_")}
    assert len(declared) >= 17, sorted(declared)
    assert isinstance(backend.name, str)
    for name, function in declared.items():
        implementation = getattr(backend, name, None)
        assert callable(implementation), (
            f"the {backend.name} backend module has no {name}()")
        wanted = [p for p in inspect.signature(function).parameters.values()
                  if p.name != "self"]
        inspect.signature(implementation).bind(*[object()] * sum(
            p.default is inspect.Parameter.empty for p in wanted))
        inspect.signature(implementation).bind(*[object()] * len(wanted))


def _is_a_backend_module(target) -> bool:
    return (isinstance(target, ast.Name) and target.id == "backend") or (
        isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
        and target.func.id == "get_backend")


def _neutral_probes(probes) -> list:
    """`path:line` of every `getattr`/`hasattr(target, name, ...)` above
    `backend/` for which `probes(target, name)` holds."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "backend" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2
                    and probes(node.args[0], node.args[1])):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_the_neutral_layer_never_probes_a_backend_module_by_name():
    probes = _neutral_probes(lambda target, _: _is_a_backend_module(target))
    assert not probes, (
        "Declare the member in interface.BackendModule and implement it in "
        f"every backend instead of probing for it: {probes}")


def test_the_rules_around_a_trainer_call_keep_it_whole_in_one_process():
    # The integration hook hands `engine.call_trainer` Keras' method wrapped
    # in the neutral layer's rules (`with_process_rules`): the engine sees
    # the method's name and signature (it picks its work by name), and in
    # one process the rules call it with exactly what they were given.
    import types

    import keras

    from keras_distribute.input import process_data

    engine = types.SimpleNamespace(fit_per_process=False, process_count=1,
                                   num_replicas=1,
                                   process_id=0)
    wrapped = process_data.with_process_rules(engine, keras.Model.evaluate)
    assert wrapped.__name__ == "evaluate"
    assert inspect.signature(wrapped) == inspect.signature(
        keras.Model.evaluate)

    def fit(model, x=None, epochs=1, callbacks=None):
        return model, x, epochs, callbacks

    rules = process_data.with_process_rules(engine, fit)
    assert rules("model", 1, epochs=3) == ("model", 1, 3, None)
    marker = [object()]
    assert rules("model", x=2, callbacks=marker) == ("model", 2, 1, marker)


def test_the_neutral_layer_never_probes_an_engine_by_name():
    # #44: a capability is a protocol checked with `isinstance`; a member
    # every engine has is read as it is.
    probes = _neutral_probes(lambda target, name: _reads_from_an_engine(
        target) or (isinstance(name, ast.Constant) and name.value == "_engine"))
    assert not probes, (
        "Read a member every engine has directly, and check a capability "
        f"with isinstance(engine, interface.<Protocol>): {probes}")
