"""The benchmark zoo: models written the way users write them, not tuned by us.

Each entry builds, from ``bench_step.py``'s arguments, a loss, an init, a batch and
the engine a user would make for it. None of these models was written for a
benchmark or changed to make jaxzero look good:

* ``user_gpt``: the GPT of issue 22. A plain pytree; attention by hand
  (``q @ k.T``, a ``jnp.where`` causal mask, ``jax.nn.softmax``); biases on every
  projection; an untied output head; embeddings by indexing; LayerNorm by hand.
* ``user_gpt_small``: the same model at 4 rows per device (global batch 8): a small step,
  where a fixed cost per step (per collective, per leaf) shows (issue 37).
* ``user_gpt_d260``: the same model at d_model 260 and 127 tokens: a control. At the
  power-of-two shapes XLA:CPU lays its temporaries out 4 KiB apart and some steps,
  plain jit's too, land on a slow placement (``cpu_placement.py``); here none does.
* ``plain``: ``plain_gpt.py``: a pytree GPT with ``jax.nn.dot_product_attention`` and
  tied embeddings.
* ``gpt``: jaxzero's reference GPT (Flax Linen, scanned blocks, per-layer gathering).
* ``llama``: ``jaxzero.models.llama`` (Flax NNX, scanned layers, per-layer gathering).
* ``convnet``: a Flax Linen ConvNet on 32x32 images: many small leaves (biases,
  GroupNorm scales) next to 4-D conv kernels.
* ``embed``: a Flax Linen bag-of-words classifier whose largest leaf, by far, is its
  embedding (the gather's gradient is a scatter-add).

Models that mark nothing per layer train with ``per_layer=False`` (the default);
``gpt`` and ``llama`` gather per layer through their ``engine()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# devices, d_model, layers, heads, seq_len, vocab, batch, steps. For ``convnet``
# d_model is the first stage's channels, seq_len the image side, vocab the classes;
# for ``embed`` d_model is the embedding width, layers the hidden layers.
DEFAULTS: dict[str, dict[str, Any]] = {
    "user_gpt": dict(
        devices=2, d_model=256, layers=4, heads=4, seq_len=128, vocab=256, batch=16, steps=21
    ),
    "user_gpt_small": dict(
        devices=2, d_model=256, layers=4, heads=4, seq_len=128, vocab=256, batch=8, steps=21
    ),
    "user_gpt_d260": dict(
        devices=2, d_model=260, layers=4, heads=4, seq_len=127, vocab=256, batch=16, steps=21
    ),
    "plain": dict(
        devices=2, d_model=256, layers=4, heads=4, seq_len=128, vocab=256, batch=16, steps=21
    ),
    "gpt": dict(
        devices=8, d_model=128, layers=4, heads=4, seq_len=64, vocab=256, batch=16, steps=21
    ),
    # and kv_heads (grouped-query attention); intermediate: None is about 8/3 x d_model
    "llama": dict(
        devices=8,
        d_model=128,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate=None,
        seq_len=64,
        vocab=256,
        batch=16,
        steps=21,
    ),
    "convnet": dict(
        devices=4, d_model=32, layers=3, heads=0, seq_len=32, vocab=10, batch=32, steps=21
    ),
    "embed": dict(
        devices=8, d_model=128, layers=2, heads=0, seq_len=64, vocab=32768, batch=64, steps=21
    ),
}
PER_LAYER = {"gpt", "llama"}


@dataclasses.dataclass
class Built:
    """What the benchmark needs of a model."""

    loss_fn: Callable[[Any, dict], jax.Array]
    init_fn: Callable[[jax.Array], Any]
    batch: dict[str, np.ndarray]
    new_engine: Callable[..., Any]  # (stage, donate=None) -> Engine
    flops_per_step: float | None  # for MFU on GPUs; None: not counted


# --- user_gpt: issue 22's model --------------------------------------------------------


def user_gpt_init(key: jax.Array, vocab: int, seq_len: int, d: int, n_layers: int) -> dict:
    keys = iter(jax.random.split(key, 3 + 4 * n_layers))
    dense = lambda i, o: {"w": 0.02 * jax.random.normal(next(keys), (i, o)), "b": jnp.zeros(o)}
    norm = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}
    return {
        "tok": 0.02 * jax.random.normal(next(keys), (vocab, d)),
        "pos": 0.01 * jax.random.normal(next(keys), (seq_len, d)),
        "blocks": [
            {
                "ln1": norm(),
                "qkv": dense(d, 3 * d),
                "proj": dense(d, d),
                "ln2": norm(),
                "fc": dense(d, 4 * d),
                "out": dense(4 * d, d),
            }
            for _ in range(n_layers)
        ],
        "ln_f": norm(),
        "head": dense(d, vocab),
    }


def _norm(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def user_gpt_attention(q, k, v, causal):
    """Attention by hand, as issue 22's user wrote it: (B, heads, S, head dim) in and out."""
    att = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(q.shape[-1])
    return jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1) @ v


def user_gpt_loss(params: dict, batch: dict, n_heads: int) -> jax.Array:
    tokens = batch["inputs"]
    b, s = tokens.shape
    x = params["tok"][tokens] + params["pos"][jnp.arange(s)]
    d = x.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    for blk in params["blocks"]:
        qkv = _norm(x, blk["ln1"]) @ blk["qkv"]["w"] + blk["qkv"]["b"]
        q, k, v = (
            t.reshape(b, s, n_heads, d // n_heads).transpose(0, 2, 1, 3)
            for t in jnp.split(qkv, 3, axis=-1)
        )
        y = user_gpt_attention(q, k, v, causal).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = x + y @ blk["proj"]["w"] + blk["proj"]["b"]
        h = jax.nn.gelu(_norm(x, blk["ln2"]) @ blk["fc"]["w"] + blk["fc"]["b"])
        x = x + h @ blk["out"]["w"] + blk["out"]["b"]
    logits = _norm(x, params["ln_f"]) @ params["head"]["w"] + params["head"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


# --- convnet and embed: Flax Linen ------------------------------------------------------


def _linen_models(args):
    import flax.linen as nn

    class ConvNet(nn.Module):
        width: int
        stages: int
        classes: int

        @nn.compact
        def __call__(self, x):
            for i in range(self.stages):
                w = self.width * 2**i
                x = nn.relu(nn.GroupNorm(num_groups=8)(nn.Conv(w, (3, 3))(x)))
                x = nn.relu(nn.GroupNorm(num_groups=8)(nn.Conv(w, (3, 3))(x)))
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(256)(x.mean(axis=(1, 2))))
            return nn.Dense(self.classes)(x)

    class BagOfWords(nn.Module):
        vocab: int
        width: int
        hidden: int
        classes: int

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(self.vocab, self.width)(tokens).mean(axis=1)
            for _ in range(self.hidden):
                x = nn.relu(nn.Dense(512)(x))
            return nn.Dense(self.classes)(x)

    if args.model == "convnet":
        return ConvNet(args.d_model, args.layers, args.vocab)
    return BagOfWords(args.vocab, args.d_model, args.layers, 16)


def _classifier(args, rng) -> tuple[Any, Callable, Callable, dict]:
    module = _linen_models(args)
    if args.model == "convnet":
        side = args.seq_len
        x = rng.standard_normal((args.batch, side, side, 3)).astype(np.float32)
        n_classes = args.vocab
    else:
        x = rng.integers(0, args.vocab, (args.batch, args.seq_len)).astype(np.int32)
        n_classes = 16
    batch = {"x": x, "y": rng.integers(0, n_classes, args.batch).astype(np.int32)}

    def loss_fn(params, b):
        logits = module.apply({"params": params}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    init_fn = lambda key: module.init(key, batch["x"][:1])["params"]
    return module, loss_fn, init_fn, batch


def build(args, mesh, tx) -> Built:
    """The model ``args.model`` at ``args``' shapes, and how a user would engine it."""
    import jaxzero

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq_len + 1))
    tokens = tokens.astype(np.int32)
    lm_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    kw = lambda stage, donate: dict(
        mesh=mesh, stage=stage, precision=args.precision, donate=donate, bucket_mb=args.bucket_mb
    )
    tokens_per_step = args.batch * args.seq_len
    gpt_flops = lambda n: (
        (6.0 * n + 12.0 * args.layers * args.d_model * args.seq_len) * (tokens_per_step)
    )

    if args.model in ("gpt", "llama"):
        if args.model == "gpt":
            from jaxzero.models.gpt import GPT, GPTConfig

            model = GPT(
                GPTConfig(
                    vocab_size=args.vocab,
                    seq_len=args.seq_len,
                    d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    remat=args.remat,
                )
            )
        else:
            from jaxzero.models.llama import Llama, LlamaConfig

            model = Llama(
                LlamaConfig(
                    vocab_size=args.vocab,
                    hidden_size=args.d_model,
                    intermediate_size=args.intermediate,
                    num_hidden_layers=args.layers,
                    num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads,
                    seq_len=args.seq_len,
                    max_position_embeddings=max(2048, args.seq_len),
                    tie_word_embeddings=False,
                    remat=args.remat,
                )
            )
        n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
        flops = (
            model.flops_per_token(n) * tokens_per_step if args.model == "llama" else gpt_flops(n)
        )
        return Built(
            model.loss_fn,
            model.init,
            lm_batch,
            lambda stage, donate=None: model.engine(tx, **kw(stage, donate)),
            flops,
        )

    if args.model == "plain" or args.model.startswith("user_gpt"):
        if args.model == "plain":
            from experiments import plain_gpt

            loss_fn = lambda p, b: plain_gpt.loss_fn(p, b, n_heads=args.heads)
            init_fn = lambda key: plain_gpt.init(
                key, args.vocab, args.seq_len, args.d_model, args.layers
            )
        else:
            loss_fn = lambda p, b: user_gpt_loss(p, b, n_heads=args.heads)
            init_fn = lambda key: user_gpt_init(
                key, args.vocab, args.seq_len, args.d_model, args.layers
            )
        n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_fn, jax.random.key(0))))
        batch, flops = lm_batch, gpt_flops(n)
    else:
        _, loss_fn, init_fn, batch = _classifier(args, rng)
        flops = None
    return Built(
        loss_fn,
        init_fn,
        batch,
        lambda stage, donate=None: jaxzero.Engine(loss_fn, tx, **kw(stage, donate)),
        flops,
    )
