"""The engine contract is code: `backend/interface.py`'s protocols declare
everything the neutral layer reads from an engine, and every backend's
engines follow the protocols they declare (`contract`), with signatures
that take the protocol's arguments (#31)."""

import ast
import dataclasses
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
        node.func, ast.Attribute) and node.func.attr == "resolve_engine"


def _neutral_engine_reads() -> dict:
    """`{member: [files]}` the layers above `backend/` read from engines:
    `engine.x`, `strategy.engine.x`, `checkpoint.resolve_engine().x`, and the
    `getattr`/`hasattr(engine, "x")` probes."""
    reads = {}
    for path, node in _package_nodes():
        name = None
        if isinstance(node, ast.Attribute) and _reads_from_an_engine(
                node.value) and isinstance(node.ctx, ast.Load):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2
              and _reads_from_an_engine(node.args[0])
              and isinstance(node.args[1], ast.Constant)):
            name = node.args[1].value
        if name is not None:
            reads.setdefault(name, []).append(str(path))
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
        parameters = [p for p in inspect.signature(
            function).parameters.values() if p.name != "self"]
        wanted = [p for p in parameters if p.kind != p.KEYWORD_ONLY]
        by_name = {p.name: object() for p in parameters
                   if p.kind == p.KEYWORD_ONLY}
        arguments = [object()] * sum(
            p.default is inspect.Parameter.empty for p in wanted)
        inspect.signature(implementation).bind(object(), *arguments)
        inspect.signature(implementation).bind(object(), *[object()] * len(
            wanted), **by_name)


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


@pytest.mark.parametrize("index", [0, 1, 2])
def test_every_engine_class_follows_what_it_declares(index):
    # (a TPU engine is a class of its own: #44, no contract changes on an
    # instance at run time; the default strategy's engine is one as well)
    from keras_distribute.strategies.default import InPlaceEngine

    classes = _engine_classes() + [InPlaceEngine]
    if index >= len(classes):
        pytest.skip(f"{BACKEND} has {len(classes)} engine class(es)")
    engine_class = classes[index]
    # Every backend engine declares a capability; the default one none.
    assert engine_class.contract or engine_class is InPlaceEngine, (
        engine_class)
    for protocol in (interface.ReplicaEngine,) + engine_class.contract:
        assert protocol in PROTOCOLS
        _check_follows(engine_class, protocol)


def test_the_strategy_engine_of_this_backend_follows_its_contract():
    from keras_distribute import integration
    from keras_distribute.backend import get_backend

    backend = get_backend()
    engine = backend.make_engine(backend.default_devices(),
                                 services=integration.services())
    for protocol in (interface.ReplicaEngine,) + engine.contract:
        assert isinstance(engine, protocol), protocol
        _check_follows(type(engine), protocol, engine)


def test_the_keras_services_are_handed_to_every_engine_when_made():
    # #44: the layers below the integration fetched its services from a
    # process-wide locator (`keras_services.get()`); now every strategy
    # hands them to the engine it makes, the default one included.
    import keras_distribute as kd
    from keras_distribute import integration
    from keras_distribute.common import keras_services

    assert not hasattr(keras_services, "get")
    assert not hasattr(keras_services, "provide")
    for strategy in (kd.get_strategy(), kd.MirroredStrategy()):
        assert strategy.engine.keras_services is integration.services()
    services = keras_services.KerasServices(
        *[lambda *a, **k: None] * len(dataclasses.fields(
            keras_services.KerasServices)))
    from keras_distribute.backend import get_backend

    backend = get_backend()
    engine = backend.make_engine(backend.default_devices(),
                                 services=services)
    assert engine.keras_services is services


def test_the_default_strategy_is_made_as_every_strategy_is():
    # #44: its engine lacked four required members and it skipped
    # Strategy.__init__; now its engine follows ReplicaEngine and the
    # strategy hands it out as every strategy does (`strategy.engine`).
    import keras_distribute as kd

    strategy = kd.get_strategy()
    engine = strategy.engine
    assert isinstance(engine, interface.ReplicaEngine)
    _check_follows(type(engine), interface.ReplicaEngine, engine)
    assert engine is strategy.engine and engine.process_count == 1
    assert engine.broadcast_text("chief") == "chief"
    assert engine.process_all_gather([1, 2]).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="compresses nothing. Received: "
                       "compression='fp16'"):
        engine.set_gradient_compression("fp16")


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
        parameters = [p for p in inspect.signature(
            function).parameters.values() if p.name != "self"]
        wanted = [p for p in parameters if p.kind != p.KEYWORD_ONLY]
        by_name = {p.name: object() for p in parameters
                   if p.kind == p.KEYWORD_ONLY}
        inspect.signature(implementation).bind(*[object()] * sum(
            p.default is inspect.Parameter.empty for p in wanted), **by_name)
        inspect.signature(implementation).bind(*[object()] * len(wanted),
                                               **by_name)


def _is_a_backend_module(target) -> bool:
    return (isinstance(target, ast.Name) and target.id == "backend") or (
        isinstance(target, ast.Call) and isinstance(target.func, ast.Name)
        and target.func.id == "get_backend")


def _package_nodes(neutral_only=True):
    """`(path, node)` of every syntax node of the package's modules (above
    `backend/` only, by default)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if neutral_only and "backend" in relative.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            yield relative, node


def _neutral_probes(probes) -> list:
    """`path:line` of every `getattr`/`hasattr(target, name, ...)` above
    `backend/` for which `probes(target, name)` holds."""
    return [f"{path}:{node.lineno}" for path, node in _package_nodes()
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and probes(node.args[0], node.args[1])]


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

    from keras_distribute import integration
    from keras_distribute.input import process_data

    engine = types.SimpleNamespace(fit_per_process=False, process_count=1,
                                   num_replicas=1, process_id=0,
                                   keras_services=integration.services())
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


def test_no_module_reads_another_objects_engine_privately():
    # #44: `strategy._engine` was read 34 times in 15 modules, and
    # `ShardedCheckpoint._engine()` called from 8 others. The engine is
    # handed out as `strategy.engine` and `checkpoint.resolve_engine()`.
    found = [f"{path}:{node.lineno}"
             for path, node in _package_nodes(neutral_only=False)
             if isinstance(node, ast.Attribute) and node.attr == "_engine"
             and not (isinstance(node.value, ast.Name)
                      and node.value.id == "self")]
    assert not found, (
        "Read `strategy.engine` (or `checkpoint.resolve_engine()`), not "
        f"another object's `_engine`: {found}")


def test_the_neutral_layer_writes_no_engine_attribute():
    # #44: `input/process_data.py` set `even_batches`, `step_inputs` and
    # `sync_metrics_each_step` on the engine; now it hands them to
    # `engine.trainer_call(...)`, which puts the previous ones back.
    found = []
    for path, node in _package_nodes():
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(
                       node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"{path}:{node.lineno}" for target in targets
                  if isinstance(target, ast.Attribute)
                  and _reads_from_an_engine(target.value)]
    assert not found, (
        "Hand the engine what it needs through a method of its protocol "
        f"instead of writing its attributes: {found}")


def test_a_trainer_call_inside_another_puts_the_outer_settings_back():
    # `fit`'s validation `evaluate` ran inside `fit` and left its
    # `step_inputs` at None: from epoch 2 a torch step written for `x`
    # alone got `[x]` (test_user_steps.py's autoencoder).
    from keras_distribute.backend.trainer_call import TrainerCallState

    state = TrainerCallState()
    with state.trainer_call(even_batches=True, step_inputs="fit rows",
                            sync_metrics_each_step=False):
        with state.trainer_call(step_inputs="validation rows"):
            assert (state.even_batches, state.step_inputs,
                    state.sync_metrics_each_step) == (
                True, "validation rows", False)
        assert (state.even_batches, state.step_inputs,
                state.sync_metrics_each_step) == (True, "fit rows", False)
    assert (state.even_batches, state.step_inputs,
            state.sync_metrics_each_step) == (False, None, True)
