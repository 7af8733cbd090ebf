"""An exponential moving average of the weights, kept in the train state (``Engine(ema=...)``).

``ema = d * ema + (1 - d) * master`` after every optimizer update, on the fp32 master
params (in fp32 training, the params: they are the master). The EMA is stored as the
master is (:func:`jaxzero.state.master_specs`: replicated at stage 0, sharded and
zero-padded from stage 1, over every device with hpZ, in host memory with offload),
so each device updates its own shard and the step gains no collective: 4Ψ/N bytes a
device, no communication (``docs/stages.md``). Frozen params have none: they do not
change. The decay ``d`` is a float in (0, 1) or a function of the step,
``ema(step) -> decay``, evaluated inside the step on the traced ``int32`` counter (the
updates before this one: 0 at the first step), as optax's and timm's warmups are:
``lambda step: jnp.minimum(0.999, (1 + step) / (10 + step))`` (``jnp.minimum``: Python's
``min`` cannot compare a traced value).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.types import Params

Decay = float | Callable[[jax.Array], Any]  # Engine(ema=...): a decay, or step -> decay
NO_EMA = "this state has no EMA: build the engine with ema=0.999 (a run: --set train.ema=0.999)"


class EMAWarning(UserWarning):
    """A restore that starts an EMA at the restored params, or drops a checkpoint's."""


def check(ema: Any) -> Decay | None:
    """``ema`` as :class:`~jaxzero.Engine` keeps it: None, a float in (0, 1), or a
    function of the step; anything else is refused in one line naming it."""
    if ema is None:
        return None
    if callable(ema):
        try:
            inspect.signature(ema).bind(0)
        except TypeError:
            raise TypeError(
                f"ema={_name(ema)} must be a function of the step, ema(step) -> decay "
                "(one argument)"
            ) from None
        except ValueError:  # no signature to read (a builtin): its trace below decides
            pass
        try:
            out = jax.eval_shape(ema, jax.ShapeDtypeStruct((), jnp.int32))
        except Exception as e:  # noqa: BLE001 - the user's function: any error is its own
            raise TypeError(
                f"ema={_name(ema)} must compute the decay from the traced step with jax.numpy "
                f"(jnp.minimum, not min); it raised {type(e).__name__}"
            ) from None
        if getattr(out, "shape", None) != () or not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(
                f"ema={_name(ema)} must return a float scalar decay, got "
                f"{getattr(out, 'dtype', '?')}{list(getattr(out, 'shape', ()))}"
            )
        return ema
    if isinstance(ema, bool) or not isinstance(ema, (int, float)):
        raise TypeError(f"ema must be a decay in (0, 1) or a function of the step, got {ema!r}")
    if not 0.0 < float(ema) < 1.0:
        raise ValueError(f"ema={ema!r}: the decay must lie in (0, 1), e.g. 0.999")
    return float(ema)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def decay_at(decay: Decay, step: jax.Array) -> jax.Array:
    """The decay of the update from ``step`` (traced int32): fp32."""
    value = decay(step) if callable(decay) else decay
    return jnp.asarray(value, jnp.float32)


def update(ema: Params, master: Params, d: jax.Array) -> Params:
    """``d * ema + (1 - d) * master``, leaf by leaf (elementwise: on each device's shard
    when both lie alike). Zero padding stays zero."""
    return jax.tree.map(lambda e, m: d * e + (1 - d) * m, ema, master)
