"""Where a run's numbers go while it trains: JSONL and TensorBoard, the console, the summary.

Every writer here is inert on processes other than 0, so the loop calls them
unconditionally and a multi-process run prints and writes once. The summary states its
FLOP formula and the peak it divides by, because an MFU without both is not a number.
The run directory and its files are :mod:`jaxzero.train.rundir`'s; the event file
:mod:`jaxzero.train.events`'s.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import jax
from tqdm.auto import tqdm

from jaxzero.train.config import Config
from jaxzero.train.events import EventFile, write_all
from jaxzero.train.rundir import METRICS_FILE, jsonable

# Dense bf16 peak FLOP/s per chip, matched against ``device.device_kind``; nominal figures
# from vendor data sheets. Unknown kinds get no MFU unless train.peak_flops_per_device is set.
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6", 918e12),
)
# CPUs get no MFU unless train.peak_flops_per_device is set: a nominal per-core figure was
# off by 2x and more (AVX-512 parts, boost clocks, cores shared with other work: "MFU 80.6%"
# for a bf16 fine-tune), and a matmul timed at start-up measures the load of the moment,
# not a peak, so neither is a number to divide by.
NO_CPU_PEAK = "no peak for CPUs: set train.peak_flops_per_device to get one"


class MetricsWriter:
    """Appends one JSON record per logged step to ``metrics.jsonl`` and mirrors it to TensorBoard.

    Both files are written unbuffered in the caller's thread, record by record, so a
    run killed with SIGKILL keeps every step it logged in both, and a write that fails
    (a full disk) raises ``OSError`` naming the file here, not in a background thread.
    (tensorboardX's ``SummaryWriter`` queues events for a thread that flushes every
    two minutes: the last ~40 steps of a killed run were lost.) See :class:`EventFile`.

    Args:
      run_dir: the run directory, or None to write nothing (processes other than 0).
      tensorboard: also write a TensorBoard event file into ``run_dir``.
    """

    def __init__(self, run_dir: Path | None, tensorboard: bool = True):
        self._file: BinaryIO | None = None
        self._tb: EventFile | None = None
        if run_dir is None:
            return
        self._path = run_dir / METRICS_FILE
        self._file = open(self._path, "ab", buffering=0)
        if tensorboard:
            self._tb = EventFile(run_dir)

    def text(self, tag: str, text: str) -> None:
        """A text blob in TensorBoard (the resolved config, the final sample)."""
        if self._tb is not None:
            from tensorboardX.summary import text as summary

            self._tb.write(summary(tag, f"```\n{text}\n```"), 0)

    def write(self, record: Mapping[str, Any]) -> None:
        """Writes ``record`` (which has an int ``step``); non-finite floats become null."""
        if self._file is None:
            return
        clean = {k: jsonable(v) for k, v in record.items()}
        write_all(self._file, self._path, (json.dumps(clean) + "\n").encode())
        if self._tb is not None:
            from tensorboardX.summary import scalar

            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.write(scalar(key, value), int(record["step"]))

    def close(self) -> None:
        file, tb, self._file, self._tb = self._file, self._tb, None, None
        try:
            if file is not None:
                file.close()
        finally:
            if tb is not None:
                tb.close()


# --------------------------------------------------------------------------- console


def format_duration(seconds: float) -> str:
    """``"1h02m"``, ``"3m05s"`` or ``"12.3s"``."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.1f}s"


def format_record(record: Mapping[str, Any], total_steps: int) -> str:
    """One plain log line of a metrics record."""
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("eta_s") is not None:
        parts.append(f"eta {format_duration(record['eta_s'])}")
    return " | ".join(parts)


class Progress:
    """A tqdm bar on a terminal, or one plain line per log interval elsewhere.

    Args:
      total: steps in the run.
      mode: ``"bar"``, ``"lines"``, ``"none"``, or ``"auto"`` (bar when ``stream`` is a TTY).
      enabled: False on processes other than 0.
      stream: where to print (stdout).
    """

    def __init__(
        self, total: int, mode: str = "auto", enabled: bool = True, stream: TextIO | None = None
    ):
        self.total, self.stream = total, stream or sys.stdout
        if not enabled:
            mode = "none"
        elif mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self._bar = None
        if mode == "bar":
            self._bar = tqdm(total=total, unit="step", file=self.stream, dynamic_ncols=True)

    def print(self, message: str) -> None:
        """A message that does not break the bar."""
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Advances the bar to ``step`` (every step; the bar computes its own ETA)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def log(self, record: Mapping[str, Any]) -> None:
        """A logged record: a plain line in ``lines`` mode; above the bar only with a val loss."""
        if self.mode == "lines" or (self.mode == "bar" and record.get("val_loss") is not None):
            self.print(format_record(record, self.total))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# --------------------------------------------------------------------------- reports


def summarize(
    cfg: Config, engine: Any, model: Any, watch: Stopwatch, loss: float, val_loss: float
) -> dict[str, Any]:
    """The end-of-run figures: tokens, throughput, MFU (formula stated), losses, memory."""
    local = jax.local_devices()
    n_dev = engine.mesh.size
    total, frozen = engine.num_params + engine.num_frozen, engine.num_frozen
    flops_per_token = model.flops_per_token(total, frozen)
    peak, source = peak_flops_per_device(local[0], cfg.train.peak_flops_per_device)
    tps = watch.tokens_per_s
    m = cfg.model
    return {
        "name": cfg.logging.name,
        "stage": cfg.parallel.stage,
        "devices": n_dev,
        "params": engine.num_params,
        "steps": cfg.train.steps,
        "tokens": cfg.train.steps * cfg.train.batch_size * m.seq_len,
        "wall_s": watch.wall,
        "train_s": watch.seconds,
        "tokens_per_s": tps,
        "flops_per_token": flops_per_token,
        "flops_formula": _flops_formula(model, total, m.seq_len, frozen),
        "achieved_flops": flops_per_token * tps,
        "peak_flops_per_device": peak,
        "peak_flops_source": source,
        "mfu": mfu(flops_per_token, tps, peak, n_dev),
        "final_loss": loss,
        "final_val_loss": val_loss,
        "peak_memory_bytes_per_device": peak_memory_bytes(local),
    }


def _flops_formula(model: Any, num_params: int, seq: int, frozen: int = 0) -> str:
    c = model.config
    if hasattr(c, "num_key_value_heads"):  # the Llama: the untied input embedding is a lookup
        lookup = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        layers = len(c.attention_layers)  # Qwen3.5: the linear-attention layers apart
        rule = model.linear_rule_flops()
        delta = (" + DeltaNet", f" + {rule:.6g}") if rule else ("", "")
        if frozen:  # no weight gradient of a frozen param
            return (
                f"6*(N - lookup) - 2*(frozen - lookup) + 12*L*S*H*K{delta[0]} = 6*({num_params} - "
                f"{lookup}) - 2*({frozen} - {lookup}) + "
                f"12*{layers}*{seq}*{c.num_attention_heads}*{c.head_size}{delta[1]}"
            )
        return (
            f"6*(N - lookup) + 12*L*S*H*K{delta[0]} = 6*({num_params} - {lookup}) + "
            f"12*{layers}*{seq}*{c.num_attention_heads}*{c.head_size}{delta[1]}"
        )
    return f"6*N + 12*L*D*S = 6*{num_params} + 12*{c.n_layers}*{c.d_model}*{seq}"


def format_summary(s: dict) -> str:
    """The end-of-run report, a few lines a person reads."""
    fmt = format_duration
    mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
    peak = s["peak_flops_per_device"]
    against = "" if peak is None else f" of {peak:.3g} FLOP/s per device"
    mem = s["peak_memory_bytes_per_device"]
    lines = [
        "",
        f"== {s['name']}: stage {s['stage']} on {s['devices']} devices, {s['params']:,} params ==",
        f"steps {s['steps']} | tokens {s['tokens']:,} | wall {fmt(s['wall_s'])} (training "
        f"{fmt(s['train_s'])}; the rest is start-up, compilation, evaluation and sampling)",
        f"throughput {s['tokens_per_s']:,.0f} tokens/s | {s['achieved_flops'] / 1e9:.2f} GFLOP/s "
        f"| MFU {mfu}{against} ({s['peak_flops_source']})",
        f"FLOPs per token {s['flops_per_token']:.4g} = {s['flops_formula']} (attention term)",
        f"final loss: train {s['final_loss']:.4f} | val {s['final_val_loss']:.4f} nats/token",
        "peak memory per device: "
        + ("not reported by this backend" if mem is None else f"{mem / 2**20:,.1f} MiB"),
    ]
    if s.get("sample"):
        lines += ["sample:", s["sample"]]
    return "\n".join(lines)


def run_line(cfg: Config) -> str:
    """The banner's first line, the run and where it writes: printed before the data is
    read, so that tokenizing a large corpus never starts in silence."""
    return f"jaxzero train: {cfg.logging.name} -> {Path(cfg.logging.root) / str(cfg.logging.name)}"


def banner(
    cfg: Config, corpus: Any, num_params: int, simulated: int | None, frozen: str = ""
) -> str:
    """What is about to run: data, model, ZeRO layout (printed before the first step, under
    :func:`run_line`); ``frozen``: a LoRA run's line on what trains and what is frozen."""
    p, m = cfg.parallel, cfg.model
    unit = "bytes" if corpus.kind == "bytes" else f"{corpus.kind} tokens"
    dev = f"{p.devices} device(s)"
    if simulated is not None:
        dev = f"{p.devices} of {simulated} simulated CPU devices (--simulate-devices {simulated})"
    return "\n".join(
        [
            f"  data   {corpus.source}: {len(corpus.train):,} train / {len(corpus.val):,} val "
            f"{unit}, vocab {corpus.vocab_size}",
            *(f"  data   {w}" for w in corpus.warnings),
            f"  model  {m.arch.upper() if m.arch == 'gpt' else m.arch.capitalize()} "
            f"{m.n_layers} layers x {m.d_model} wide, {m.n_heads} heads"
            f"{f' ({m.n_kv_heads} kv)' if m.n_kv_heads else ''}, "
            f"seq {m.seq_len}, {num_params:,} params, remat {m.remat}",
            f"  zero   stage {p.stage} on {dev}, {cfg.precision.compute}, micro-batches "
            f"{p.micro_batches}, global batch {cfg.train.batch_size} x {m.seq_len} tokens"
            f"{beyond_zero(cfg.zero)}",
            *([f"  lora   {frozen}"] if frozen else []),
        ]
    )


def beyond_zero(z: Any) -> str:
    """The banner's words for offload and ZeRO++ (empty when none is on)."""
    words = [
        *([f"{z.offload} state in host memory (zero.offload)"] if z.offload else []),
        *([f"int8 weight gathers (qwZ, blocks of {z.quant_block})"] if z.qwz else []),
        *([f"{z.qgz} gradient reduction (qgZ)"] if z.qgz else []),
        *(["params sharded within groups (hpZ)"] if z.hpz else []),
    ]
    return "".join(f", {w}" for w in words)


# --------------------------------------------------------------------------- throughput


def peak_flops_per_device(device: Any, configured: float | None) -> tuple[float | None, str]:
    """The FLOP/s one device is measured against for MFU, and where the figure came from.

    A configured figure wins; a known accelerator gets its data-sheet peak; a CPU gets
    none (see ``NO_CPU_PEAK``), so no MFU is printed for it.
    """
    if configured is not None:
        return configured, "train.peak_flops_per_device"
    if device.platform == "cpu":
        return None, NO_CPU_PEAK
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS:
        if name.lower() in kind.lower():
            return flops, f"nominal dense bf16 peak of {kind}"
    return None, f"unknown peak for {kind!r}: set train.peak_flops_per_device"


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, num_devices: int
) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' peak."""
    if not peak_per_device or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * num_devices)


def peak_memory_bytes(devices: list[Any]) -> int | None:
    """Largest ``peak_bytes_in_use`` over ``devices``; None where the backend does not report it."""
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class Stopwatch:
    """Training time excluding compilation and evaluation, for honest tokens/s."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.seconds = 0.0
        self.tokens = 0
        self.steps = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.start
