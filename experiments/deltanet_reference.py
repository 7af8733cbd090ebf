"""Gated DeltaNet reference outputs by ``transformers``' pure-torch path, as a test fixture.

CI has no torch, so :mod:`jaxzero.models.deltanet` is checked (tests/test_deltanet.py)
against what ``transformers`` 5.25's Qwen3.5 functions computed once, here, on seeded
random inputs, saved to tests/fixtures/deltanet/reference.npz (fp32, a few tens of KB):

    rule_*      torch_chunk_gated_delta_rule (chunk 64 and 16) and
                torch_recurrent_gated_delta_rule, use_qk_l2norm_in_kernel=True, final
                states kept: case a (B 2, S 37: no chunk divides it; G 2 key heads for
                H 4 value heads, K 8, V 6, an initial state), case b (B 1, S 130, chunk
                64: three chunks, the last padded; G = H = 2, no initial state). g and
                beta come from the layer's own formulas (A_log, dt_bias, a, b stored).
    conv_*      causal_conv1d_fn(..., activation="silu"): x (B 2, S 11, C 12), weight
                HF's [C, 1, W] squeezed to [C, W] (W 4)
    norm_*      Qwen3_5RMSNormGated (weight drawn, not ones)
    layer_*     a whole Qwen3_5GatedDeltaNet (hidden 32, 2 key heads of 8, 4 value heads
                of 6, conv 4) on B 2 x S 19 hidden states, its weights in HF's
                orientation (``layer_w_<name>``), its output

Needs torch and transformers (not jax). Regenerate:

    /path/to/venv-with-torch/bin/python -m experiments.deltanet_reference \\
        [--out tests/fixtures/deltanet/reference.npz]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as m
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

OUT = pathlib.Path("tests/fixtures/deltanet/reference.npz")


def _rule_inputs(gen: torch.Generator, b: int, s: int, groups: int, heads: int, k: int, v: int):
    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    a_log = torch.log(torch.empty(heads).uniform_(0.5, 4.0, generator=gen))
    dt_bias = randn(heads, scale=0.5)
    a = randn(b, s, heads)
    bb = randn(b, s, heads)
    return {
        "q": randn(b, s, groups, k),
        "k": randn(b, s, groups, k),
        "v": randn(b, s, heads, v),
        "a_log": a_log,
        "dt_bias": dt_bias,
        "a": a,
        "b": bb,
        # the layer's formulas (Qwen3_5GatedDeltaNet.forward)
        "g": -a_log.float().exp() * F.softplus(a.float() + dt_bias),
        "beta": bb.sigmoid(),
    }


def _rules(out: dict[str, np.ndarray], gen: torch.Generator) -> None:
    cases = {"a": (2, 37, 2, 4, 8, 6, True, (64, 16)), "b": (1, 130, 2, 2, 8, 8, False, (64,))}
    for name, (b, s, groups, heads, k, v, with_state, chunks) in cases.items():
        x = _rule_inputs(gen, b, s, groups, heads, k, v)
        state = torch.randn(b, heads, k, v, generator=gen) * 0.5 if with_state else None
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        for c in chunks:
            o, final = m.torch_chunk_gated_delta_rule(
                *args,
                chunk_size=c,
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            out[f"rule_{name}_chunk{c}_o"], out[f"rule_{name}_chunk{c}_state"] = o, final
        o, final = m.torch_recurrent_gated_delta_rule(
            *args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        out[f"rule_{name}_recurrent_o"], out[f"rule_{name}_recurrent_state"] = o, final
        for key, val in x.items():
            out[f"rule_{name}_{key}"] = val
        if state is not None:
            out[f"rule_{name}_state0"] = state


def _conv_and_norm(out: dict[str, np.ndarray], gen: torch.Generator) -> None:
    x = torch.randn(2, 11, 12, generator=gen)
    w = torch.randn(12, 1, 4, generator=gen) * 0.5  # HF's conv1d.weight orientation
    y = m.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), None, activation="silu")
    out.update(conv_x=x, conv_w=w.squeeze(1), conv_y=y.transpose(1, 2))

    norm = m.Qwen3_5RMSNormGated(6, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(6, generator=gen))
    x, gate = torch.randn(3, 5, 6, generator=gen), torch.randn(3, 5, 6, generator=gen)
    out.update(norm_x=x, norm_gate=gate, norm_w=norm.weight, norm_y=norm(x, gate))


def _layer(out: dict[str, np.ndarray], gen: torch.Generator) -> None:
    cfg = Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rms_norm_eps=1e-6,
    )
    layer = m.Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen)))
            elif name == "norm.weight":
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            out[f"layer_w_{name}"] = p
        x = torch.randn(2, 19, 32, generator=gen)
        out.update(layer_x=x, layer_y=layer(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    args = p.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(50)
    out: dict = {}
    with torch.no_grad():
        _rules(out, gen)
        _conv_and_norm(out, gen)
    _layer(out, gen)
    arrays = {k: v.detach().to(torch.float32).numpy() for k, v in out.items()}
    arrays["transformers_version"] = np.array(transformers.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: {len(arrays)} arrays, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
