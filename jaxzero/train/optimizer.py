"""The training app's optimizer: AdamW with a warmup + cosine learning-rate schedule.

``jaxzero train`` builds its optimizer here from the ``optimizer`` section of the
config: AdamW with linear warmup then cosine decay to a floor, and no weight decay
on norms, biases and embeddings (only ``kernel`` matrices decay). Gradient clipping
is not part of this optax chain: it is the engine's ``max_grad_norm``.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxzero.partition import path_str
from jaxzero.train import config as config_lib

# The params that decay, by name: GPT's ``.../kernel``, the Llama's ``..._proj/weight`` and
# ``lm_head/weight``.
DECAYED = re.compile(r"(^|/)kernel$|_proj/weight$|(^|/)lm_head/weight$")


def lr_schedule(opt: config_lib.OptimizerConfig, steps: int):
    """Linear warmup from ``lr / warmup`` to ``lr``, then cosine to ``lr * min_lr_ratio``.

    Warmup starts above zero (unlike ``optax.warmup_cosine_decay_schedule``) so
    that no step of a short run is wasted on a zero learning rate.
    """
    warmup, floor = min(opt.warmup_steps, steps), opt.lr * opt.min_lr_ratio

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = opt.lr * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count - warmup) / max(steps - warmup - 1, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (opt.lr - floor) * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, warm, cosine)

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
    schedule = lr_schedule(opt, opt.decay_steps or steps)
    tx = optax.adamw(
        schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask
    )
    return tx, schedule
