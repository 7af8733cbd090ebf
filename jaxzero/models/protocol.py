"""The model protocol: what the engine, the commands and :mod:`jaxzero.hf` use of a model.

:class:`Model` is the contract (a ``typing.Protocol``: any object with these methods
is one, checkable with ``isinstance``); :class:`ReferenceModel` is what the GPT
(Flax Linen) and the Llama (Flax NNX) share of it, written once: the engine with
per-layer gathering, the parameter count, the training FLOPs per token and sampling
with a key/value cache. A model supplies its shapes and its forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import numpy as np
import optax

from jaxzero.engine import Engine
from jaxzero.mesh import make_mesh, model_shards, num_shards
from jaxzero.models.common import KVCache, generate


@runtime_checkable
class Model(Protocol):
    """A language model jaxzero trains, counts, samples from and saves.

    ``config`` is the model's frozen shape (``GPTConfig``, ``LlamaConfig``), with at
    least ``vocab_size`` and ``seq_len`` (the training and sampling window).
    """

    config: Any

    def init(self, rng: jax.Array) -> Any:
        """Fresh fp32 params (pure: ``Engine.init_from`` runs it sharded)."""
        ...

    def apply(
        self, params: Any, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None
    ) -> jax.Array:
        """fp32 logits of every position."""
        ...

    def loss_fn(self, params: Any, batch: dict[str, jax.Array]) -> Any:
        """The training loss of a batch (``inputs``, ``targets``, optional masks)."""
        ...

    def engine(self, optimizer: optax.GradientTransformation, **kwargs: Any) -> Engine:
        """An :class:`jaxzero.Engine` training this model's ``loss_fn``."""
        ...

    def num_params(self, params: Any) -> int:
        """How many numbers ``params`` (or their shapes) hold."""
        ...

    def flops_per_token(self, num_params: int | None = None, frozen: int = 0) -> float:
        """Training FLOPs per token (forward and backward; ``frozen`` params: no weight
        gradient)."""
        ...

    def generate(
        self,
        params: Any,
        prompt: np.ndarray,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 0.8,
        top_k: int | None = None,
        eos: int | Iterable[int] | None = None,
    ) -> np.ndarray:
        """``prompt`` and up to ``max_new_tokens`` sampled after it."""
        ...


class ReferenceModel:
    """The pieces of :class:`Model` the reference models share.

    A subclass sets ``STACKED`` (the regex of its stacked per-layer params), says its
    shapes (:meth:`attention_shape`, :meth:`lookup_params`) and implements ``init``,
    ``apply``, ``loss_fn`` and, for sampling, ``new_cache`` and ``decode``.
    """

    config: Any
    STACKED: ClassVar[str]  # the stacked per-layer params, gathered one layer at a time

    def init(self, rng: jax.Array) -> Any:
        raise NotImplementedError

    def loss_fn(self, params: Any, batch: dict[str, jax.Array]) -> Any:
        raise NotImplementedError

    def new_cache(self, params: Any) -> KVCache:
        raise NotImplementedError

    def decode(
        self, params: Any, tokens_BxT: jax.Array, start: jax.Array, cache: KVCache, last: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        raise NotImplementedError

    def attention_shape(self) -> tuple[int, int]:
        """``(layers, heads x head_dim)``: what attention's FLOPs grow with."""
        raise NotImplementedError

    def lookup_params(self) -> int:
        """Params only looked up, never multiplied (an untied input embedding)."""
        return 0

    def engine(self, optimizer: optax.GradientTransformation, **kwargs: Any) -> Engine:
        """An :class:`jaxzero.Engine` for this model, gathering one layer at a time
        (``per_layer``, ``stacked``: the model's; any other keyword is the engine's).
        On a mesh with a ``model`` axis (``make_mesh(n, model=m)``) the layers are split
        over it: the model's :meth:`tensor_parallel_rules` after the caller's ``rules``,
        and its :meth:`tensor_parallel_loss`."""
        kwargs.setdefault("per_layer", True)
        kwargs.setdefault("stacked", self.STACKED)
        mesh = kwargs.setdefault("mesh", make_mesh())
        m = model_shards(mesh)
        if kwargs.get("ulysses"):
            return Engine(self.ulysses_loss(num_shards(mesh)), optimizer, **kwargs)
        if m == 1:
            return Engine(self.loss_fn, optimizer, **kwargs)
        kwargs["rules"] = (*kwargs.get("rules", ()), *self.tensor_parallel_rules(m))
        return Engine(self.tensor_parallel_loss(m), optimizer, **kwargs)

    def tensor_parallel_rules(self, m: int) -> list[Any]:
        """Where tensor parallelism over ``m`` devices splits each weight (layout rules
        naming the ``model`` axis)."""
        raise ValueError(
            f"{type(self).__name__} does not support tensor parallelism yet: use a mesh "
            "without a model axis (model=1)"
        )

    def ulysses_loss(self, n: int) -> Any:
        """:meth:`loss_fn` with each sequence split over the ``data`` axis of ``n``
        devices (DeepSpeed-Ulysses, ``Engine(ulysses=True)``)."""
        raise ValueError(
            f"{type(self).__name__} does not support Ulysses yet: train it without ulysses"
        )

    def tensor_parallel_loss(self, m: int) -> Any:
        """:meth:`loss_fn` with the layers split over the ``model`` axis of ``m`` devices."""
        raise ValueError(
            f"{type(self).__name__} does not support tensor parallelism yet: use a mesh "
            "without a model axis (model=1)"
        )

    @staticmethod
    def num_params(params: Any) -> int:
        """How many numbers ``params`` hold (arrays or ``ShapeDtypeStruct`` shapes)."""
        return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))

    def flops_per_token(self, num_params: int | None = None, frozen: int = 0) -> float:
        """Training FLOPs per token: 6 x the matmul params (fwd+bwd; every param but
        :meth:`lookup_params`) + 12·L·S·(heads·head_dim) for attention's two matmuls;
        ``frozen`` of the ``num_params`` get no weight gradient (LoRA's base): 4, not 6
        (a frozen lookup table: none).

        ``num_params`` default: counted from :meth:`init`'s shapes (nothing allocated).
        """
        if num_params is None:
            num_params = self.num_params(jax.eval_shape(self.init, jax.random.key(0)))
        layers, width = self.attention_shape()
        attention = 12.0 * layers * self.config.seq_len * width
        lookup = self.lookup_params()
        no_grad = max(frozen - lookup, 0) if frozen else 0
        return 6.0 * (num_params - lookup) - 2.0 * no_grad + attention

    def generate(
        self,
        params: Any,
        prompt: np.ndarray,
        max_new_tokens: int,
        rng: jax.Array,
        temperature: float = 0.8,
        top_k: int | None = None,
        eos: int | Iterable[int] | None = None,
    ) -> np.ndarray:
        """``prompt`` (int array ``[1, P]``) and up to ``max_new_tokens`` sampled after it
        over the ``seq_len`` window, stopping after a token in ``eos``
        (:func:`jaxzero.models.common.generate`); ``top_k`` keeps the k likeliest tokens
        (None: all)."""
        window = self.config.seq_len
        return generate(self, window, params, prompt, max_new_tokens, rng, temperature, top_k, eos)
