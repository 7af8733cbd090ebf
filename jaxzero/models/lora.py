"""LoRA: a low-rank update ``scale * B @ A`` beside each frozen target weight.

peft's definition, so adapters go both ways (:mod:`jaxzero.hf.peft`): a target linear
``y = x W^T`` becomes ``y = x W^T + scale * (x A^T) B^T`` with ``A`` (r x in),
``B`` (out x r), ``scale = alpha / r`` (``use_rslora``: ``alpha / sqrt(r)``); ``A``
starts as peft's ``kaiming_uniform_(a=sqrt(5))``, i.e. uniform in +-1/sqrt(in), and ``B``
at zero, so a fresh adapter leaves the model's output exactly as it was.

In a model's params an adapted projection holds ``lora_A`` and ``lora_B`` beside its
``weight`` (stacked layers: a leading layer dim on each); :func:`trainable` is the
engine's ``trainable=`` predicate that trains them alone.

Example:
  >>> cfg = LoraConfig(rank=8, alpha=16)
  >>> cfg.scale, cfg.targets_in(["self_attn.q_proj", "mlp.down_proj", "lm_head"])
  (2.0, ['self_attn.q_proj', 'mlp.down_proj'])
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from jaxzero.models.quant import KINDS

__all__ = ["LoraConfig", "trainable"]

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
MARK = ("lora_A", "lora_B")  # the adapter leaves' names under their projection
QUANTIZED = r"/weight_(codes|scale)$"  # a QLoRA target's frozen weight, quantized


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The adapters: ``rank`` r, ``alpha``, which linears (``targets``), rsLoRA's scale.

    ``targets``: ``"all-linear"`` (every linear layer but the LM head, as peft), a
    regular expression matched in full against a module's name (``self_attn.q_proj``;
    peft's ``model.layers.0.self_attn.q_proj`` form matches too), or a list of names,
    each matching modules whose name ends with it (peft's ``target_modules`` list).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: str | tuple[str, ...] = ALL_LINEAR
    use_rslora: bool = False
    base_dtype: str | None = None  # QLoRA: "int8" or "nf4" (jaxzero.models.quant)
    dropout: float = 0.0  # on the adapters' input, a mask per row (the engine's key)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype is not None and self.base_dtype not in KINDS:
            raise ValueError(
                f"lora.base_dtype {self.base_dtype!r} is not a quantization: use one of "
                f"{KINDS} (or null: the base in its own dtype)"
            )
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            try:
                re.compile(self.targets)
            except re.error as e:
                raise ValueError(f"lora.targets {self.targets!r} is not a regex: {e}") from None

    @property
    def scale(self) -> float:
        """peft's scaling of ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def matches(self, name: str, head: bool = False) -> bool:
        """Whether the linear module ``name`` (``self_attn.q_proj``) is a target;
        ``head``: it is the output head, which ``all-linear`` leaves out."""
        t = self.targets
        if t == ALL_LINEAR:
            return not head
        if isinstance(t, str):
            full = f"model.layers.0.{name}" if "." in name else name
            return bool(re.fullmatch(t, name) or re.fullmatch(t, full))
        return any(name == s or name.endswith("." + s) for s in t)

    def targets_in(self, names: Sequence[str], head: str = "lm_head") -> list[str]:
        """The targets among a model's linear modules ``names``; refuses (one line,
        naming what could match) a set that matches none."""
        found = [n for n in names if self.matches(n, head=n == head)]
        if not found:
            raise ValueError(
                f"lora.targets {self.targets!r} matches none of the model's linear "
                f"modules: {', '.join(names)}"
            )
        return found


def trainable(path: str) -> bool:
    """The engine's ``trainable=`` predicate of a LoRA run: the adapters train, the
    rest is frozen."""
    return path.rsplit("/", 1)[-1] in MARK


def init_a(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh ``lora_A`` (``... x r x in``) as peft draws it: uniform in +-1/sqrt(in)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def check_rank(cfg: LoraConfig, name: str, d_in: int, d_out: int) -> None:
    """Refuse a rank no smaller than a target's dimensions (one line)."""
    if cfg.rank > min(d_in, d_out):
        raise ValueError(
            f"lora.rank {cfg.rank} exceeds {name}'s dimensions ({d_out} x {d_in}): a "
            f"rank above {min(d_in, d_out)} adds parameters and no expressiveness"
        )
