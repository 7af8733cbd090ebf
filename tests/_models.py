"""Small models and a single-device reference trainer shared by the tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.models.gpt import GPT, GPTConfig

TINY_GPT = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2)


def mlp_params(seed: int = 0) -> dict:
    """An MLP whose dimensions are not divisible by 8, plus a scalar leaf."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (0.3 * rng.standard_normal((37, 53))).astype(np.float32),
        "b1": np.zeros(53, np.float32),
        "w2": (0.3 * rng.standard_normal((53, 11))).astype(np.float32),
        "b2": np.zeros(11, np.float32),
        "scale": np.ones((), np.float32),
    }


def mlp_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((p["scale"] * (h @ p["w2"] + p["b2"]) - batch["y"]) ** 2)


def eigen_dots(hlo_text: str) -> int:
    """Dots of a compiled XLA:CPU program outside any fusion (the entry computation, loop
    bodies): the ones it runs with Eigen rather than inside its fused (YNNPACK) kernels."""
    n, fused = 0, False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):  # a computation's header
            fused = line.startswith("%fused_computation")
        elif " dot(" in line and not fused:
            n += 1
    return n


def mlp_batches(n: int, batch: int = 16, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((batch, 37)).astype(np.float32),
            "y": rng.standard_normal((batch, 11)).astype(np.float32),
        }
        for _ in range(n)
    ]


def gpt_batches(n: int, batch: int = 16, cfg: GPTConfig = TINY_GPT, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1)).astype(np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


@functools.cache
def _init(cls: type, cfg) -> dict:
    # jit: an eager init dispatches op by op (GPT.init compiles itself; Llama's does
    # not); cached because several modules share one xdist worker.
    return jax.tree.map(np.asarray, jax.jit(cls(cfg).init)(jax.random.key(0)))


def params_of(cls: type, cfg) -> dict:
    """``cls(cfg).init(key(0))`` as numpy, a private copy (callers may write into it)."""
    return jax.tree.map(np.copy, _init(cls, cfg))


def gpt(cfg: GPTConfig = TINY_GPT):
    return GPT(cfg), params_of(GPT, cfg)


def train_reference(loss_fn, params, batches, tx, extra_args=False):
    """Plain single-device training: the answer every stage must reproduce.
    ``extra_args``: the update also gets the loss, the gradient and the loss as a
    function of the params on the same batch, as optax documents for L-BFGS."""

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        if extra_args:
            u, s = tx.update(g, s, p, value=loss, grad=g, value_fn=lambda q: loss_fn(q, b))
        else:
            u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p = jax.tree.map(jnp.asarray, params)
    s, losses = tx.init(p), []
    for b in batches:
        p, s, loss = step(p, s, b)
        losses.append(float(loss))
    return np.array(losses), jax.tree.map(np.asarray, p)


def train_engine(engine, params, batches):
    state = engine.init(params)
    losses = []
    for b in batches:
        state, metrics = engine.step(state, b)
        losses.append(float(metrics["loss"]))
    return np.array(losses), engine.gather_params(state), state


def rel_diff(a, b) -> float:
    """Largest per-leaf ||a - b|| / ||b|| over two pytrees (or arrays)."""
    diffs = jax.tree.map(
        lambda x, y: float(
            np.linalg.norm(np.asarray(x, np.float64) - y)
            / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)
        ),
        a,
        b,
    )
    return max(jax.tree.leaves(diffs))


# A tiny Qwen3.5 over a tiny Llama config: two groups of a DeltaNet layer (G = 2 key heads
# serving H = 4 value heads) and a gated full-attention layer with partial rotary
QWEN3_5_FIELDS = dict(
    num_hidden_layers=4,
    head_dim=8,
    qkv_bias=False,
    qk_norm=True,
    norm_offset=True,
    attn_output_gate=True,
    partial_rotary_factor=0.5,
    layer_types=("linear_attention", "full_attention") * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    linear_conv_kernel_dim=3,
)
