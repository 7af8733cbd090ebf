"""The plan: built once from the params' shapes, printed, compared; other shapes refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_batches, mlp_loss, mlp_params

import jaxzero
from jaxzero import plan as plan_lib


def _engine(**kw):
    kw = {"mesh": jaxzero.make_mesh(8), "stage": 3, **kw}
    return jaxzero.Engine(mlp_loss, optax.adamw(1e-3), **kw)


def test_the_plan_prints_each_leafs_layout():
    engine = _engine()
    engine.init(mlp_params())
    text = str(engine.plan)
    assert text == engine.plan.describe()
    lines = text.splitlines()
    assert lines[0].startswith("plan: stage 3, N=8 of 8 devices, fp32, micro_batches=1")
    assert "  w1  (37, 53)  dim 1  pad 3  stored (37, 56)" in lines  # 53 -> 56 = 8 x 7
    assert "  scale  ()  replicated" in lines  # too small to shard
    assert "  0/mu/w1  (37, 53)  dim 1  pad 3  stored (37, 56)" in lines  # Adam's moment


def test_plans_are_equal_when_the_step_would_compile_the_same():
    shapes = jax.eval_shape(mlp_params)
    a, b = _engine(), jaxzero.Engine(mlp_loss, optax.adamw(5e-2), mesh=jaxzero.make_mesh(8))
    a.abstract_state(shapes)
    b.abstract_state(shapes)
    assert a.plan == b.plan  # the learning rate (the optax object) is not compared
    assert a.plan is not b.plan
    for other in (
        _engine(stage=2),
        _engine(mesh=jaxzero.make_mesh(4)),
        _engine(micro_batches=2),
        _engine(precision="bf16"),
        jaxzero.Engine(mlp_loss, optax.sgd(0.1), mesh=jaxzero.make_mesh(8)),  # other opt state
    ):
        other.abstract_state(shapes)
        assert other.plan != a.plan
    with pytest.raises(TypeError):
        hash(a.plan)


def test_a_second_init_with_the_same_shapes_reuses_the_plan():
    traces = []

    def loss(p, b):  # runs only while the step is traced
        traces.append(1)
        return mlp_loss(p, b)

    engine = jaxzero.Engine(loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(8), stage=3)
    state = engine.init(mlp_params())
    plan, step = engine.plan, plan_lib.jitted_step(engine.plan)
    state, _ = engine.step(state, mlp_batches(1)[0])
    traced = len(traces)
    again = engine.init(mlp_params(seed=1))
    assert engine.plan is plan and plan_lib.jitted_step(engine.plan) is step
    engine.step(again, mlp_batches(1)[0])
    assert len(traces) == traced  # the same compiled step: no new trace
    engine.abstract_state(jax.eval_shape(mlp_params))
    assert engine.plan is plan


def test_a_second_init_with_other_shapes_is_refused_in_one_line():
    engine = _engine()
    engine.init(mlp_params())
    params = mlp_params()
    params["w1"] = params["w1"][:, :50]
    for init in (
        lambda: engine.init(params),
        lambda: engine.abstract_state(jax.eval_shape(lambda: params)),
        lambda: engine.init_from(lambda: jax.tree.map(jnp.asarray, params)),
    ):
        with pytest.raises(ValueError, match="the engine was built for params of shapes") as e:
            init()
        assert "make a new Engine for other shapes" in str(e.value)
        assert "\n" not in str(e.value)


def test_the_plan_before_init_says_what_to_call():
    engine = _engine()
    assert not engine.has_plan
    for name in ("plan", "layouts", "opt_layouts", "state_shardings", "step_fn", "num_params"):
        with pytest.raises(RuntimeError, match=r"engine.init\(params\)"):
            getattr(engine, name)
    assert engine.stage == 3 and engine.batch_sharding.mesh is engine.mesh  # settings: known


def test_engine_attributes_are_the_plans():
    engine = _engine(precision="bf16")
    engine.init(mlp_params())
    plan = engine.plan
    assert engine.layouts is plan.layouts and engine.opt_layouts is plan.opt_layouts
    assert engine.state_shardings is plan.state_shardings and engine.step_fn is plan.step_fn
    assert (
        engine.num_params
        == plan.num_params
        == sum(np.size(x) for x in jax.tree.leaves(mlp_params()))
    )
    with pytest.raises(AttributeError):
        engine.layouts = None


def test_process_rows_of_one_process_are_all_rows():
    engine = _engine(micro_batches=2)
    assert engine.process_rows(32) == slice(0, 32)
    with pytest.raises(ValueError, match="global batch 24 is not divisible by 8 devices x 2"):
        engine.process_rows(24)
    with pytest.raises(ValueError, match="positive integer"):
        engine.process_rows(0)


CORE = {
    "mesh", "partition", "collectives", "hooks", "hook_check", "backend", "state", "step",
    "step_config", "gradients", "update", "ema", "model_state", "readback", "frozen",
    "plan", "settings", "batch", "engine", "loss", "nnx", "types", "errors", "offload", "zeropp",
    "tensor_parallel",
}  # fmt: skip


def test_the_core_imports_nothing_above_it():
    """No core module imports (lazily or not) accounting, models, hf, data, checkpoint,
    train or cli: the engine sits at the bottom."""
    import ast
    from pathlib import Path

    root = Path(jaxzero.__file__).parent
    for name in sorted(CORE):
        path = root / f"{name}.py"
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            for module in found:
                parts = module.split(".")
                if parts[0] == "jaxzero" and len(parts) > 1 and parts[1][0].islower():
                    below = parts[1] in CORE or module == "jaxzero"
                    assert below, f"{name}.py imports {module}"
