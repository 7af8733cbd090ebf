"""The run config's schema: a frozen dataclass per section, and the :class:`Config` tree.

A run is described by one :class:`Config` tree whose defaults train a small
byte-level GPT on the Python standard library in a few minutes on a laptop CPU:
4 layers x 128 wide, 64-byte windows, 32 rows, 800 steps of AdamW at 4e-3 reach
a validation loss near 1.57 nats/byte (uniform: 5.55) in about 4 minutes on two
CPU cores. Short windows are chosen because on CPU they cost less per token.
Everything a researcher may change is a field here, so the resolved config that
``jaxzero train`` writes into the run directory reproduces the run.

Reading one (files, ``--set``, the checks between fields) is :mod:`jaxzero.train.config`'s,
where these names are read from too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jaxzero.models.fields import ModelConfig  # the model section's schema, defined there


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. ``path=None`` uses this Python's standard library sources."""

    path: str | None = None  # text file, directory of text files, .bin token file or directory
    format: Literal["auto", "bytes", "uint16"] = "auto"
    # tokenizer.json or a model directory: text and JSONL (text, prompt/completion, chat
    # messages) are tokenized once into a cached store and packed (jaxzero.data.store)
    tokenizer: str | None = None
    # with a tokenizer: False gives each document a row of its own (padded, cut at seq_len
    # + 1 tokens) instead of packed windows
    packing: bool = True
    # cap on the text read, whatever its source (stdlib, text files, JSONL with a tokenizer;
    # whole lines then), the first bytes in file order; not token files; null: everything
    max_bytes: int | None = 4_000_000
    val_fraction: float = 0.05  # tail of the corpus held out when there is no val.bin


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1  # on weight matrices only (train.optimizer.DECAYED)
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # global-norm clipping inside the engine; None: off
    # the cosine's horizon (None: train.steps); a resume with more --steps keeps the
    # original one unless this is set, then decays from its last rate to the floor by 2x it
    decay_steps: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """Devices and ZeRO stage. ``devices=None`` uses every device."""

    stage: Literal[0, 1, 2, 3] = 3
    devices: int | None = None
    simulate_devices: int | None = None  # CPU only; None: 8 when only one CPU device exists
    micro_batches: int = 1  # gradient accumulation steps inside one optimizer step


@dataclass(frozen=True)
class MeshConfig:
    """Hybrid sharding: ZeRO state sharded within groups of devices, replicated across groups;
    tensor parallelism: each layer split over ``model`` neighbouring devices.

    ``group_size=None`` shards over every device (plain ZeRO); ``"node"`` uses the
    devices of one node, so the sharding collectives stay on the node's fast links
    and only one all-reduce of the gradient shard per step crosses nodes. ``model``
    (1: none) splits each layer's weights over that many devices, which see the same
    rows of the batch; ``ulysses`` splits each sequence over the devices that shard the
    state (DeepSpeed-Ulysses: long sequences), the groups of ``group_size`` splitting
    the rows (Llama-family models: docs/tensor-parallel.md).
    """

    group_size: int | Literal["node"] | None = None
    model: int = 1
    ulysses: bool = False


@dataclass(frozen=True)
class ZeroConfig:
    """Will the run fit? The pre-flight compiles the step before the first one (nothing is
    allocated) and stops a run whose peak exceeds the memory, naming what would fit;
    ``auto`` lets the planner (``jaxzero plan``) choose the stage, remat and micro-batches.
    """

    auto: bool = False  # take the planner's first choice of stage, remat and micro-batches
    # bytes per device the step is held to ("80GB", "79.6GiB"); null: the device's own limit
    # (CPU: the host's MemAvailable, shared by the simulated devices)
    device_memory: str | float | None = None
    preflight: bool = True  # false: start without the check (an out-of-memory error then)
    # the share of the budget kept free for what the compiled step does not count (the
    # runtime, the allocator, host buffers: docs/planning.md measures it); null: the
    # backend's default (planning.HEADROOM)
    headroom: float | None = None
    # stop in one line (exit 1) before the host runs out of memory, or past device_memory
    memory_guard: bool = True
    # host bytes per device that offloaded state may use ("256GB"); null: the host's
    # MemAvailable shared by its devices (on CPU none apart: the devices are host memory)
    host_memory: str | float | None = None
    # beyond ZeRO (docs/offload.md, docs/zeropp.md): "optimizer" keeps the fp32 master
    # and the optimizer state in host memory (stages 1-3); qwz gathers stage 3's weights
    # in int8, qgz reduces gradients in int8 or int4 (stages 1-3), hpz keeps a params copy
    # sharded within each mesh.group_size group (stage 3); a scale per quant_block elements
    offload: Literal["optimizer"] | None = None
    qwz: bool = False
    qgz: Literal["int8", "int4"] | None = None
    hpz: bool = False
    quant_block: int = 2048


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision of the working params; the master copy is always fp32."""

    compute: Literal["fp32", "bf16"] = "fp32"
    reduce_dtype: Literal["fp32", "bf16"] | None = None  # gradient collectives; None: engine's


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint cadence and retention.

    ``final`` (on by default) saves at the end of training, so every finished run can be
    exported, sampled and extended; ``every=K`` also saves every K steps (the long
    configs in configs set it), and SIGTERM/SIGINT save where they stop.
    """

    dir: str | None = None  # None: RUN_DIR/checkpoints
    every: int = 0  # save every K steps (0: only at the end and on a signal)
    final: bool = True  # save when training ends
    keep_last: int = 3  # recent checkpoints kept
    keep_every: int | None = None  # also keep steps that are multiples of this
    on_nan: Literal["stop", "rollback"] = "stop"  # rollback: latest checkpoint, skip the batch


@dataclass(frozen=True)
class LoggingConfig:
    """Run directory, cadence of logs/evaluation, and what to print."""

    root: str = "runs"
    name: str | None = None  # None: "stage{S}-{N}dev-{timestamp}"
    overwrite: bool = False  # allow reusing an existing run directory
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 8
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    tensorboard: bool = True
    sample_tokens: int = 200  # length of the text sample generated at the end; 0: none
    # null: the start of the first validation document (for prompt/completion and chat
    # data its prompt: the tokens before the first one a loss is taken on); fine-tunes
    # default to null
    sample_prompt: str | None = "def "
    sample_temperature: float = 0.8


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on a frozen base: a fine-tune (``train.init_from``) that trains only
    a low-rank update of each target projection (:mod:`jaxzero.models.lora`, peft's
    definition). Checkpoints then hold the adapters and the base's fingerprint."""

    rank: int = 0  # 0: off (every weight trains)
    alpha: float = 16.0  # the update is scaled by alpha / rank (use_rslora: alpha / sqrt(rank))
    # all-linear (every projection, as peft) | names, comma-separated (q_proj,v_proj) | a regex
    targets: str = "all-linear"
    use_rslora: bool = False
    dropout: float = 0.0  # on the adapters' input (peft's lora_dropout), a mask per row
    # a PEFT adapter directory to start from (its rank, alpha and targets)
    adapter: str | None = None
    # QLoRA: the targets' frozen weights quantized, int8 or nf4 (blocks of 64 inputs);
    # null: the base in its own dtype (no wider than the run's compute dtype)
    base_dtype: str | None = None


@dataclass(frozen=True)
class TrainConfig:
    """Length and size of training, and the FLOP/s the MFU estimate is measured against."""

    steps: int = 800
    batch_size: int = 32  # global rows per optimizer step
    seed: int = 0
    # None: the data-sheet figure of a known accelerator; on CPUs none (no MFU is printed)
    peak_flops_per_device: float | None = None
    # "hf:PATH": fine-tune a Hugging Face checkpoint; its config sets the model fields and
    # its tokenizer the data's (jaxzero.train.finetune)
    init_from: str | None = None
    # the decay of an EMA of the weights kept in the state (0.999: Engine(ema=...)),
    # sharded as the master and saved with it; `jaxzero export --ema` writes it; null: none
    ema: float | None = None


@dataclass(frozen=True)
class Config:
    """Everything about one run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraSection = field(default_factory=LoraSection)
