"""hook_check follows stored params through every control-flow primitive it claims to.

Each case is a loss written two ways: a correct one, whose params reach compute only
through ``use_params``, and a misuse, which reads the stored arrays some other way
inside that primitive. The check must accept the first and name the second, on
every JAX line we support (it reads no private parameters of JAX primitives). The
unit cases build ``Stored`` leaves by hand (stage 2's whole params: no collective,
so no mesh); the engine cases train accepted losses at stage 3 against one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import rel_diff, train_engine, train_reference

import jaxzero
from jaxzero.hook_check import check_uses, misuses
from jaxzero.hooks import Stored, UseOp
from jaxzero.partition import LeafLayout

L, D = 3, 8
raw = lambda p: jax.tree.leaves(p)[0]  # what jax.tree utilities hand out: the stored array


def _stored(path: str, shape: tuple[int, ...], dim: int | None = 0) -> Stored:
    value = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    op = UseOp(LeafLayout(path, shape, dim, 2), gather=False, reduce_dtype="float32")
    return Stored(value, jnp.zeros_like(value), op)


def _params() -> dict:
    return {
        "w": _stored("w", (D, D)),
        "stack": _stored("stack", (L, D, D), dim=1),
        "s": _stored("s", (), dim=None),
    }


def _layer(p, h):
    return jnp.tanh(h @ jaxzero.use_params(p)["w"])


_jitted_layer = jax.jit(_layer)  # module level: the probe trace must not poison its cache


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


_softplus.defjvp(lambda p, t: (_softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


@jax.custom_vjp
def _half_grad(x):
    return x


_half_grad.defvjp(lambda x: (x, None), lambda _, g: (g / 2,))


def _scan_layers(p, h):
    def body(h, layer):  # layer: one stacked slice, a Stored
        return jnp.tanh(h @ jaxzero.use_params(layer)), None

    return jax.lax.scan(body, h, p["stack"])[0]


def _finite(x):
    """A predicate every device agrees on. One that differs between devices (their own
    batches) around a stage-3 layer deadlocks: only some of them reach its all-gather."""
    return jnp.all(jnp.isfinite(x))


# name -> (correct loss, misusing loss, the primitive the misuse is named by)
CASES = {
    "jit": (
        lambda p, x: jnp.sum(_jitted_layer(p, x)),
        lambda p, x: jnp.sum(jax.jit(lambda w, x: x @ w)(raw(p["w"]), x)),
        "dot_general",
    ),
    "scan": (
        lambda p, x: jnp.sum(_scan_layers(p, x)),
        lambda p, x: (
            jax.lax.scan(lambda c, w: (c + jnp.sum(w * w), None), 0.0, raw(p["stack"]))[0]
            + jnp.sum(x)
        ),
        "mul",
    ),
    # the carry is clean in the first iteration and holds the raw param from the second
    "scan_carry": (
        lambda p, x: jax.lax.scan(lambda c, _: (_layer(p, c), None), x, None, length=L)[0].sum(),
        lambda p, x: (
            jax.lax.scan(
                lambda c, _: (raw(p["w"]), jnp.sum(c * 2.0)), jnp.zeros((D, D)), None, length=L
            )[1].sum()
            + jnp.sum(x)
        ),
        "mul",
    ),
    "while": (
        lambda p, x: jax.lax.while_loop(
            lambda c: c[0] < L, lambda c: (c[0] + 1, _layer(p, c[1])), (0, x)
        )[1].sum(),
        lambda p, x: jax.lax.while_loop(
            lambda c: c[0] < L, lambda c: (c[0] + 1, c[1] @ raw(p["w"])), (0, x)
        )[1].sum(),
        "dot_general",
    ),
    "while_cond": (
        None,
        lambda p, x: jax.lax.while_loop(
            lambda c: c[0] < jnp.sum(raw(p["w"])), lambda c: (c[0] + 1, c[1]), (0.0, x)
        )[1].sum(),
        "reduce_sum",
    ),
    "fori_loop": (
        lambda p, x: jax.lax.fori_loop(0, L, lambda i, h: _layer(p, h), x).sum(),
        lambda p, x: jax.lax.fori_loop(0, L, lambda i, h: h @ raw(p["stack"])[i], x).sum(),
        "dot_general",
    ),
    "cond": (
        lambda p, x: jax.lax.cond(_finite(x), lambda h: _layer(p, h), lambda h: h, x).sum(),
        lambda p, x: jax.lax.cond(_finite(x), lambda h: h @ raw(p["w"]), lambda h: h, x).sum(),
        "dot_general",
    ),
    "cond_predicate": (
        None,
        lambda p, x: jax.lax.cond(raw(p["s"]).astype(bool), lambda h: h, lambda h: -h, x).sum(),
        "cond",
    ),
    "remat": (
        lambda p, x: jax.checkpoint(_layer)(p, x).sum(),
        lambda p, x: jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(raw(p["w"]), x).sum(),
        "dot_general",
    ),
    "custom_jvp": (
        lambda p, x: jnp.sum(_softplus(x @ jaxzero.use_params(p["w"]))),
        lambda p, x: jnp.sum(_softplus(raw(p["w"]))) + jnp.sum(x),
        "exp",
    ),
    "custom_vjp": (
        lambda p, x: jnp.sum(_half_grad(jaxzero.use_params(p["w"])) @ x.T),
        lambda p, x: jnp.sum(_half_grad(raw(p["w"])) @ x.T),
        "dot_general",
    ),
}


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[0] is not None])
def test_correct_use_is_accepted(name):
    x = jnp.ones((4, D), jnp.float32)
    assert misuses(CASES[name][0], _params(), x) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_is_caught_and_named(name):
    x = jnp.ones((4, D), jnp.float32)
    found = misuses(CASES[name][1], _params(), x)
    assert found and not any(m.opaque for m in found)
    assert all(m.path in ("w", "stack", "s") for m in found)
    assert found[0].primitive == CASES[name][2], found
    assert "test_hook_check.py" in found[0].where, found  # the user's line
    with pytest.raises(TypeError, match=r"only through jaxzero.use_params"):
        check_uses(CASES[name][1], _params(), x)


def test_a_primitive_the_check_cannot_follow_is_refused_by_name():
    """custom_linear_solve has sub-programs the walk does not map: refuse, never pass."""

    def loss(p, x):
        w = raw(p["w"])
        sol = jax.lax.custom_linear_solve(lambda v: w @ v, x[0], lambda mv, b: b)
        return jnp.sum(sol)

    x = jnp.ones((4, D), jnp.float32)
    found = misuses(loss, _params(), x)
    assert found and all(m.opaque for m in found) and {m.path for m in found} == {"w"}
    with pytest.raises(TypeError, match=r"(?s)cannot follow:.*linear_solve at .*'w'"):
        check_uses(loss, _params(), x)

    # the same solve on params that went through use_params first is fine
    def ok(p, x):
        w = jaxzero.use_params(p["w"])
        return jnp.sum(jax.lax.custom_linear_solve(lambda v: w @ v, x[0], lambda mv, b: b))

    assert misuses(ok, _params(), x) == []


def test_a_view_that_cuts_the_sharded_dim_is_caught():
    """``stack`` is sharded on dim 1: slicing that dim away is no view but a misuse."""
    found = misuses(
        lambda p, x: jnp.sum(raw(p["stack"])[:, 0]) + jnp.sum(x), _params(), jnp.ones((4, D))
    )
    assert found and found[0].path == "stack"


# --- accepted losses train at stage 3 as on one device --------------------------------


def _engine_params():
    rng = np.random.default_rng(1)
    return {
        "w": (rng.standard_normal((D, D)) / D**0.5).astype(np.float32),
        "stack": (rng.standard_normal((L, D, D)) / D**0.5).astype(np.float32),
    }


def _as_loss(case):
    def loss(p, b):
        return case(p, b["x"]) / b["x"].shape[0]

    return loss


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "name", ["jit", "scan", "scan_carry", "fori_loop", "cond", "remat", "custom_jvp", "custom_vjp"]
)
def test_accepted_losses_train_like_one_device_at_stage_3(name):
    loss = _as_loss(CASES[name][0])
    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((8, D)).astype(np.float32)} for _ in range(2)]
    ref_losses, ref_params = train_reference(loss, _engine_params(), batches, optax.adam(1e-2))
    engine = jaxzero.Engine(
        loss, optax.adam(1e-2), mesh=jaxzero.make_mesh(2), stage=3, per_layer=True, stacked="^stack"
    )
    losses, final, _ = train_engine(engine, _engine_params(), batches)
    assert rel_diff(losses, ref_losses) <= 1e-5 and rel_diff(final, ref_params) <= 1e-5


def _with_l2(params_of):
    """The ``jit`` case's loss plus an L2 penalty over ``jax.tree.leaves(params_of(p))``."""
    base = _as_loss(CASES["jit"][0])

    def loss(p, b):
        return base(p, b) + 1e-2 * sum(jnp.sum(w * w) for w in jax.tree.leaves(params_of(p)))

    return loss


@pytest.mark.equivalence  # it trains an engine: not a unit test
def test_engine_refuses_a_loss_that_bypasses_use_params_and_trains_one_that_uses_it():
    """The same L2 penalty two ways. Over the stored leaves it reads each device's raw
    slice and zero slot (a wrong loss, no error by itself): the step must stop, naming
    the params. Over ``use_params(p)`` it is right: the step trains like one device."""
    rng = np.random.default_rng(3)
    batches = [{"x": rng.standard_normal((8, D)).astype(np.float32)} for _ in range(2)]

    def engine(loss):
        return jaxzero.Engine(
            loss, optax.adam(1e-2), mesh=jaxzero.make_mesh(2), stage=3, per_layer=True
        )

    bypass = engine(_with_l2(lambda p: p))
    with pytest.raises(TypeError, match=r"(?s)only through jaxzero.use_params.*'stack'.*'w'"):
        bypass.step(bypass.init(_engine_params()), batches[0])

    uses = _with_l2(jaxzero.use_params)
    ref_losses, ref_params = train_reference(uses, _engine_params(), batches, optax.adam(1e-2))
    losses, final, _ = train_engine(engine(uses), _engine_params(), batches)
    assert rel_diff(losses, ref_losses) <= 1e-5 and rel_diff(final, ref_params) <= 1e-5
