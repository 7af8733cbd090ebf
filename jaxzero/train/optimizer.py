"""The training app's optimizer: AdamW with a warmup + cosine learning-rate schedule.

``jaxzero train`` builds its optimizer here from the ``optimizer`` section of the
config: AdamW with linear warmup then cosine decay to a floor, and no weight decay
on norms, biases and embeddings (only weight matrices decay: :data:`DECAYED`). Gradient clipping
is not part of this optax chain: it is the engine's ``max_grad_norm``.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.partition import path_str
from jaxzero.train import config as config_lib

# The params that decay, by name: GPT's ``.../kernel``, the Llama's ``..._proj/weight`` and
# ``lm_head/weight``.
DECAYED = re.compile(r"(^|/)kernel$|_proj/weight$|(^|/)lm_head/weight$")


def lr_schedule(opt: config_lib.OptimizerConfig, steps: int):
    """The learning rate of each step (``count`` 0 is step 1) of a ``steps``-step run.

    Over the horizon ``H = optimizer.decay_steps or steps``: linear warmup from
    ``lr / W`` to ``lr`` over ``W = min(warmup_steps, H)`` steps, then a cosine from
    ``lr`` to the floor ``lr * min_lr_ratio`` at step ``H``. Warmup starts above zero
    (unlike ``optax.warmup_cosine_decay_schedule``) so that no step of a short run is
    wasted on a zero learning rate.

    Steps after the horizon (a run resumed with more ``--steps`` keeps the horizon it
    was trained with, so the rate never jumps back up) go on from the rate of step
    ``H`` by a cosine down to the floor at step ``2H``, then stay there: the floor
    throughout when the horizon had decayed to it, the decay it never had when its
    warmup filled it. The tail depends on ``H`` only, not on ``steps``, so extending a
    run again changes no rate it already trained with.
    """
    horizon = opt.decay_steps or steps
    warmup, floor = min(opt.warmup_steps, horizon), opt.lr * opt.min_lr_ratio

    def cosine(start: Any, progress: Any, xp: Any) -> Any:
        return floor + 0.5 * (start - floor) * (1 + xp.cos(xp.pi * xp.clip(progress, 0.0, 1.0)))

    def within(count: Any, xp: Any) -> Any:
        warm = opt.lr * (count + 1) / max(warmup, 1)
        decay = cosine(opt.lr, (count - warmup) / max(horizon - warmup - 1, 1), xp)
        return xp.where(count < warmup, warm, decay)

    end = float(within(np.float64(horizon - 1), np))  # the rate of step H

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        rate = within(count, jnp)
        if steps <= horizon:
            return rate
        after = cosine(end, (count - horizon + 1) / horizon, jnp)
        return jnp.where(count < horizon, rate, after)

    return schedule


def decay_mask(params: Any) -> Any:
    """True for matrices: the GPT's ``.../kernel``, the Llama's projections
    (``..._proj/weight``, ``lm_head/weight``); no weight decay on norms, biases and
    embeddings."""

    def is_kernel(path, _):
        return DECAYED.search(path_str(path)) is not None

    return jax.tree_util.tree_map_with_path(is_kernel, params)


def make_optimizer(opt: config_lib.OptimizerConfig, steps: int):
    """AdamW with the schedule and mask above; clipping is the engine's ``max_grad_norm``."""
    schedule = lr_schedule(opt, steps)
    tx = optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
    )
    return tx, schedule
