"""The estimator reproduces the ZeRO paper's and the slides' numbers to their printed precision."""

import json
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import _procs
import pytest

from jaxzero.accounting import estimate as est
from jaxzero.commands import estimate as command

GB = 1e9


def printed(value: float, reference: str) -> bool:
    """True when ``value`` rounds (half up, as papers do) to ``reference`` as printed."""
    places = Decimal(reference).as_tuple().exponent
    got = Decimal(repr(value)).quantize(Decimal(1).scaleb(places), rounding=ROUND_HALF_UP)
    return got == Decimal(reference)


def test_printed_helper_can_fail():
    assert printed(41.25, "41.3") and not printed(41.24, "41.3") and not printed(31.4, "31.41")


def _gb(psi: float, n: int, stage: int) -> float:
    return est.model_state_bytes(psi, n, stage).total / GB


@pytest.mark.parametrize("stage, reference", [(0, "120"), (1, "31.4"), (2, "16.6"), (3, "1.9")])
def test_paper_figure1(stage, reference):
    assert printed(_gb(7.5e9, 64, stage), reference)


@pytest.mark.parametrize(
    "n, stage, reference",
    [
        (4, 1, "52.5"),
        (4, 2, "41.3"),
        (4, 3, "30"),
        (1024, 1, "30.1"),
        (1024, 2, "15.1"),
        (1024, 3, "0.12"),
    ],
)
def test_paper_table1(n, stage, reference):
    assert printed(_gb(7.5e9, n, stage), reference)


@pytest.mark.parametrize(
    "n, stage, reference", [(1, 0, "112"), (8, 1, "38.5"), (8, 2, "26.25"), (8, 3, "14")]
)
def test_slides_7b(n, stage, reference):
    assert printed(_gb(7e9, n, stage), reference)


def test_slides_7b_does_not_fit_80gb_in_plain_dp():
    e = est.estimate(7e9, 1, 80 * GB)
    assert not e.stages[0].fits
    e8 = est.estimate(7e9, 8, 80 * GB)
    assert [r.fits for r in e8.stages] == [False, True, True, True]


@pytest.mark.parametrize("stage, reference", [(1, "7.6"), (2, "14.4"), (3, "128")])
def test_paper_section5_largest_model(stage, reference):
    assert printed(est.max_params(32 * GB, 64, stage) / 1e9, reference)


def test_largest_model_inverts_memory():
    for stage in est.STAGES:
        psi = est.max_params(40 * GB, 16, stage)
        assert est.model_state_bytes(psi, 16, stage).total == pytest.approx(40 * GB)


def test_fp32_and_optimizers():
    fp32 = est.precision_bytes("fp32", "adam")
    assert (fp32.param, fp32.grad, fp32.k) == (4, 4, 8)
    assert est.precision_bytes("mixed", "adam").k == 12
    assert est.precision_bytes("mixed", "sgd-momentum").k == 8
    assert est.precision_bytes("mixed", "adafactor").k == 4
    ms = est.model_state_bytes(1e9, 8, 0, fp32)
    assert (ms.persistent, ms.total) == (12e9, 16e9)


def test_communication_formulas():
    psi, n, b = 1e9, 8, 2
    frac = (n - 1) / n
    assert est.comm_bytes(psi, n, 0, b).total == pytest.approx(2 * psi * b * frac)
    assert est.comm_bytes(psi, n, 1, b).total == pytest.approx(2 * psi * b * frac)
    assert est.comm_bytes(psi, n, 2, b).total == pytest.approx(2 * psi * b * frac)
    assert est.comm_bytes(psi, n, 3, b).total == pytest.approx(3 * psi * b * frac)
    # gradient accumulation: stage 2 reduce-scatters per micro-batch, stage 3 also gathers
    assert est.comm_bytes(psi, n, 1, b, micro_batches=4).total == pytest.approx(2 * psi * b * frac)
    assert est.comm_bytes(psi, n, 2, b, micro_batches=4).total == pytest.approx(5 * psi * b * frac)
    assert est.comm_bytes(psi, n, 3, b, micro_batches=4).total == pytest.approx(12 * psi * b * frac)
    assert est.comm_bytes(psi, 1, 3, b).total == 0


def test_ring_formulas():
    assert est.ring_bytes("all-reduce", 800, 8) == 1400
    assert est.ring_bytes("reduce-scatter", 800, 8) == 700
    assert est.ring_bytes("all-gather", 800, 4) == 600
    assert est.ring_bytes("all-gather", 800, 1) == 0


def test_activation_formula():
    shape = est.GPTShape(layers=2, d_model=1024, heads=16, vocab=1000, seq_len=2048)
    a = est.activation_bytes(shape, micro_batch=4)
    s, b, h, heads = 2048, 4, 1024, 16
    assert a.per_layer == s * b * h * (34 + 5 * heads * s / h)
    assert a.layers == 2 * a.per_layer
    fused = est.activation_bytes(shape, micro_batch=4, fused_attention=True)
    assert fused.per_layer == s * b * h * 34
    remat = est.activation_bytes(shape, micro_batch=4, remat="full")
    assert remat.layers == 2 * 2 * s * b * h + a.per_layer < a.layers
    assert est.activation_bytes(shape, 4, bytes_per_value=4).per_layer == 2 * a.per_layer


def test_decoder_formula_counts_each_layer_kind_and_only_attention_grows_with_s():
    """A Llama decoder's attention layer keeps 7h + 6f + 2(q + kv) + kv + q values a token
    and 2·a·s scores; a Gated DeltaNet layer's bytes a token do not depend on s."""
    h, f, a, d = 256, 768, 4, 64
    llama = est.DecoderShape(layers=2, d_model=h, heads=a, kv_heads=a, head_dim=d, d_ff=f,
                             vocab=512, seq_len=1024)  # fmt: skip
    act = est.activation_bytes(llama, micro_batch=2)
    s, b = 1024, 2
    per_token = 7 * h + 6 * f + 2 * (a * d + a * d) + a * d + a * d + 2 * a * s
    assert act.per_layer == s * b * per_token * 2.0 and act.linear_per_layer == 0
    assert act.layers == 2 * act.per_layer and act.workspace == act.per_layer
    assert act.output == 2.0 * s * b * (h + 512) * 2.0
    fused = est.activation_bytes(llama, 2, fused_attention=True)
    assert fused.per_layer == s * b * ((per_token - 2 * a * s) * 2.0 + 4.0 * a)
    remat = est.activation_bytes(llama, 2, remat="full")
    assert remat.layers == 2 * s * b * h * 2.0 + act.per_layer

    def qwen35(seq: int) -> est.DecoderShape:
        return est.DecoderShape(layers=1, d_model=h, heads=a, kv_heads=2, head_dim=d, d_ff=f,
                                vocab=512, seq_len=seq, qk_norm=True, output_gate=True,
                                linear_layers=3, linear_key_heads=2, linear_value_heads=4,
                                linear_key_dim=d, linear_value_dim=d, chunk=64)  # fmt: skip

    short, long = (est.activation_bytes(qwen35(seq), 1) for seq in (256, 8192))
    assert long.linear_per_layer / 8192 == pytest.approx(short.linear_per_layer / 256)
    # an attention layer's bytes a token grow by its a·s scores, twice, in 16-bit
    assert long.per_layer / 8192 - short.per_layer / 256 == 2 * a * (8192 - 256) * 2.0
    assert short.layers == short.per_layer + 3 * short.linear_per_layer
    assert short.workspace == max(short.per_layer, short.linear_per_layer)
    with pytest.raises(ValueError, match="at least one layer"):
        est.DecoderShape(layers=0, d_model=h, heads=a, kv_heads=a, head_dim=d, d_ff=f,
                         vocab=512, seq_len=64)  # fmt: skip


def test_estimate_of_a_fine_tune_counts_its_checkpoint_and_its_layer_kinds(tmp_path, capsys):
    """``estimate --config`` with ``train.init_from: hf:DIR`` counts the checkpoint's
    params (a LoRA run: the adapters trainable, the base frozen in its stored dtype) and
    the activations of its own layers: Qwen3.5's attention and Gated DeltaNet apart."""
    import jax

    from jaxzero import hf
    from jaxzero.models.llama import Llama

    ckpt = Path(__file__).parent / "fixtures" / "hf" / "qwen3_5" / "single"
    path = tmp_path / "run.yaml"
    path.write_text(f"train: {{init_from: 'hf:{ckpt}', batch_size: 8}}\n")
    assert command.main(["--config", str(path), "-n", "2", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    m = hf.model(ckpt)
    count = sum(x.size for x in jax.tree.leaves(hf.param_shapes(ckpt, Llama(m.config), "float32")))
    assert full["num_params"] == count and full["frozen_params"] == 0
    act = full["activations"]
    assert act["linear_per_layer"] > 0 and act["per_layer"] > 0  # both kinds, apart

    path.write_text(
        f"train: {{init_from: 'hf:{ckpt}', batch_size: 8}}\nlora: {{rank: 4}}\n"
        "precision: {compute: bf16}\n"
    )
    assert command.main(["--config", str(path), "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "Gated DeltaNet layer" in out and "frozen" in out
    assert command.main(["--config", str(path), "-n", "2", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert lora["frozen_params"] == count and 0 < lora["num_params"] < count / 2
    assert lora["frozen_bytes_per_param"] == 2.0  # a bf16 run's base, stored bf16


def test_gpt_param_count():
    # GPT-2 small: 124M parameters with tied embeddings
    gpt2 = est.GPTShape(layers=12, d_model=768, heads=12, vocab=50257, seq_len=1024)
    assert gpt2.num_params() == 124_439_808


def test_cli_table_and_json(capsys):
    assert command.main(["--params", "7.5B", "--devices", "64", "--device-memory", "32"]) == 0
    out = capsys.readouterr().out
    assert "31.41" in out and "16.64" in out and "128B" in out
    assert command.main(["--params", "7e9", "-n", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [round(r["model_states"] / GB, 2) for r in data["stages"]] == [112, 38.5, 26.25, 14]
    args = ["--layers", "4", "--d-model", "128", "--heads", "4", "--vocab", "256", "--json"]
    assert command.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["activations"]["per_layer"] > 0


def test_frozen_params_cost_their_stored_bytes_alone():
    """The ZeRO paper's 2Ψ per frozen bf16 param (no gradient, master or optimizer state),
    divided by N at stage 3 only; the trainable Ψ's 16Ψ as before."""
    psi, frozen, n = 1e8, 7e9, 8
    for stage in est.STAGES:
        plain = est.model_state_bytes(psi, n, stage)
        ms = est.model_state_bytes(psi, n, stage, frozen=frozen)
        assert ms.frozen == 2 * frozen / (n if stage == 3 else 1)
        assert (ms.params, ms.grads, ms.master, ms.optimizer) == (
            plain.params, plain.grads, plain.master, plain.optimizer
        )  # fmt: skip
        assert ms.trainable == plain.persistent and ms.persistent == plain.persistent + ms.frozen
        assert ms.total == pytest.approx(plain.total + ms.frozen)
        fp32 = est.model_state_bytes(psi, n, stage, frozen=frozen, frozen_bytes_per_param=4)
        assert fp32.frozen == 2 * ms.frozen
        # traffic: nothing to reduce; gathered at stage 3 as the params are (twice a pass)
        cm = est.comm_bytes(psi, n, stage, 2, micro_batches=2, frozen=frozen)
        base = est.comm_bytes(psi, n, stage, 2, micro_batches=2)
        gathered = 2 * 2 * 2 * frozen * 7 / 8 if stage == 3 else 0.0
        assert cm.grad == base.grad and cm.frozen == pytest.approx(gathered)
        assert cm.param == pytest.approx(base.param + gathered)
    # a 7B bf16 base beside 100M trainable params: 14 GB at stage 0, 1.75 GB at stage 3
    assert est.model_state_bytes(psi, n, 0, frozen=frozen).frozen == 14e9
    assert est.formula(0) == "16Ψ" and est.formula(2) == "2Ψ + 14Ψ/N"
    assert est.formula(0, None, 2) == "16Ψ + 2Ψf" and est.formula(3, None, 2) == "16Ψ/N + 2Ψf/N"
    # the largest trainable Ψ beside the frozen base; none when the base fills the device
    left = est.max_params(80 * GB, n, 0, frozen=frozen)
    assert est.model_state_bytes(left, n, 0, frozen=frozen).total == pytest.approx(80 * GB)
    assert est.max_params(10 * GB, 1, 0, frozen=frozen) == 0.0
    with pytest.raises(ValueError, match="frozen parameter count"):
        est.model_state_bytes(psi, n, 0, frozen=-1)


def test_cli_frozen_params_prints_trainable_and_frozen_with_their_formulas(capsys):
    argv = ["--params", "100M", "--frozen-params", "7B", "-n", "8"]
    assert command.main(argv) == 0
    out = capsys.readouterr().out
    assert "Ψ = 1e+08 trainable + Ψf = 7e+09 frozen" in out
    for formula in ("16Ψ + 2Ψf", "4Ψ + 12Ψ/N + 2Ψf", "2Ψ + 14Ψ/N + 2Ψf", "16Ψ/N + 2Ψf/N"):
        assert formula in out
    assert "(2 + 2 + K)Ψ = 16Ψ" in out and "frozen: 2Ψf" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln and ln[0] in "0123"}
    assert rows["0"][6:8] == ["14.00", "15.60"] and rows["3"][6:8] == ["1.75", "1.95"]
    assert command.main([*argv, "--frozen-dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["frozen_params"] == 7e9 and data["frozen_bytes_per_param"] == 4
    assert [r["frozen"] / GB for r in data["stages"]] == [28, 28, 28, 3.5]
    assert data["stages"][3]["comm_frozen"] == pytest.approx(2 * 28e9 * 7 / 8)
    # without frozen params the table is the one it always was
    assert command.main(["--params", "7e9", "-n", "8"]) == 0
    plain = capsys.readouterr().out
    assert "frozen" not in plain and "Ψf" not in plain and "max Ψ (states only)" in plain


NONSENSE = [
    ["--params", "-5"],
    ["--params", "1e9", "--devices", "0"],
    ["--params", "1e9", "--optimizer", "lion"],
    ["--params", "1e9", "--precision", "fp7"],
    ["--params", "banana"],
    ["--params", "1e9", "--device-memory", "-1"],
    ["--params", "1e9", "--devices", "eight"],
    ["--layers", "2", "--d-model", "100", "--heads", "3"],
    [],
    ["--params", "1e9", "--frozen-params", "lots"],
    ["--params", "1e9", "--frozen-params=-7B"],
    ["--params", "1e9", "--frozen-params", "7B", "--frozen-dtype", "fp7"],
    ["--config", "configs/tiny.yaml", "--frozen-params", "7B"],
]


@pytest.mark.parametrize("argv", NONSENSE)
def test_nonsense_exits_nonzero_with_one_line(argv, capsys):
    assert command.main(argv) != 0
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxzero estimate: error:"), err


@pytest.mark.system
def test_cli_process_nonsense_has_no_traceback():
    """Through the real ``jaxzero`` dispatcher, in a fresh process."""
    code = "import sys; from jaxzero.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = _procs.run(
        [sys.executable, "-c", code, "estimate", "--params", "-1", "--optimizer", "adam"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_gpt_shape_counts_the_reference_gpt_closely():
    import jax

    from jaxzero.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    actual = GPT.num_params(jax.eval_shape(GPT(cfg).init, jax.random.key(0)))
    shape = est.GPTShape(layers=4, d_model=128, heads=4, vocab=256, seq_len=64)
    # GPT-2 counts a QKV bias that jaxzero's GPT leaves out: 3h per layer
    assert abs(shape.num_params() - actual) <= 3 * 128 * 4


# ------------------------------------------------------- beyond ZeRO: offload, qwZ, qgZ


def test_offload_moves_k_psi_over_n_from_the_device_to_the_host():
    """Mixed-precision Adam: the fp32 master and the moments, 12Ψ/N, leave the device for
    host memory at stages 1-3; in fp32 the params are the master and 8Ψ/N moves."""
    psi, n = 7e9, 8
    for stage in (1, 2, 3):
        plain = est.model_state_bytes(psi, n, stage)
        off = est.model_state_bytes(psi, n, stage, offload=True)
        assert off.host == pytest.approx(12 * psi / n) and plain.host == 0
        assert off.device == pytest.approx(plain.persistent - 12 * psi / n)
        assert off.device_total == pytest.approx(plain.total - 12 * psi / n)
        assert off.total == plain.total  # the paper's figure: the bytes exist, elsewhere
        fp32 = est.model_state_bytes(psi, n, stage, est.precision_bytes("fp32"), offload=True)
        assert fp32.host == pytest.approx(8 * psi / n) and fp32.master == 0
    # 7B on 8 GPUs at stage 3: 14 GB of states a device, 3.5 GB with offload (10.5 GB host)
    off3 = est.model_state_bytes(psi, n, 3, offload=True)
    assert (off3.device_total / GB, off3.host / GB) == (3.5, 10.5)
    assert est.formula(3, offload=True) == "4Ψ/N" and est.host_formula(3) == "12Ψ/N"
    assert est.formula(1, offload=True) == "4Ψ" and est.formula(2, offload=True) == "2Ψ + 2Ψ/N"
    assert est.host_formula(3, est.precision_bytes("fp32")) == "8Ψ/N"
    left = est.max_params(80 * GB, n, 3, offload=True)  # the device's states alone
    assert est.model_state_bytes(left, n, 3, offload=True).device_total == pytest.approx(80 * GB)
    with pytest.raises(ValueError, match="offload needs stage 1, 2 or 3"):
        est.model_state_bytes(psi, n, 0, offload=True)


def test_an_ema_takes_4_psi_over_n_laid_out_as_the_master(capsys):
    """An EMA of the weights (``Engine(ema=...)``) is fp32 and sharded as the master: 4Ψ
    at stage 0, 4Ψ/N from stage 1; in host memory with offload, which moves it too."""
    psi, n = 7e9, 8
    for stage in (0, 1, 2, 3):
        plain = est.model_state_bytes(psi, n, stage)
        ema = est.model_state_bytes(psi, n, stage, ema=True)
        assert ema.ema == pytest.approx(4 * psi / (n if stage else 1)) and plain.ema == 0
        assert ema.persistent == pytest.approx(plain.persistent + ema.ema)
        assert ema.total == pytest.approx(plain.total + ema.ema) and ema.host == 0
        if stage:
            off = est.model_state_bytes(psi, n, stage, offload=True, ema=True)
            assert off.host == pytest.approx(16 * psi / n)
            assert off.device_total == pytest.approx(plain.total - 12 * psi / n)
    assert est.formula(0, ema=True) == "20Ψ" and est.formula(3, ema=True) == "20Ψ/N"
    assert est.formula(3, offload=True, ema=True) == "4Ψ/N"
    assert est.host_formula(3, ema=True) == "16Ψ/N"
    left = est.max_params(80 * GB, n, 3, ema=True)
    assert left == pytest.approx(80 * GB / (20 / n))
    assert command.main(["--params", "7B", "-n", "8", "--ema"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    # stage  params grads optim ema device +act fits comm/step max-Ψ formula
    assert rows["0"][2:7] == ["14.00", "14.00", "84.00", "28.00", "140.00"]
    assert rows["3"][2:7] == ["1.75", "1.75", "10.50", "3.50", "17.50"]
    assert rows["3"][-1] == "20Ψ/N" and rows["1"][-3:] == ["4Ψ", "+", "16Ψ/N"]
    assert "ema: an EMA of the weights, fp32 and laid out as the master" in out


def _rows(out: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in out.splitlines() if ln and ln[0] in "0123"}


def test_cli_offload_optimizer_prints_device_and_host_bytes(capsys):
    """``jaxzero estimate --params 7B -n 8 --offload optimizer``: what offload saves for 7B
    on 8 GPUs (GB per device)."""
    assert command.main(["--params", "7B", "-n", "8", "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    # stage  params grads optim device host +act fits comm/step host-link max-Ψ formula
    assert rows["0"][2:8] == ["14.00", "14.00", "84.00", "112.00", "0.00", "-"]  # no offload
    assert rows["1"][2:8] == ["14.00", "14.00", "10.50", "28.00", "10.50", "-"]
    assert rows["2"][5:7] == ["15.75", "10.50"] and rows["3"][5:7] == ["3.50", "10.50"]
    assert rows["3"][-3:] == ["4Ψ/N", "|", "12Ψ/N"] and rows["3"][10] == "10.50"  # host link
    assert "offload: the fp32 master and the optimizer state (12Ψ/N) live in host memory" in out
    assert command.main(["--params", "7B", "-n", "8", "--offload", "optimizer", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    s3 = data["stages"][3]
    assert data["offload"] and s3["offload"] and not data["stages"][0]["offload"]
    assert (s3["device"], s3["host"], s3["host_link"]) == (3.5e9, 10.5e9, 10.5e9)
    assert s3["total"] == s3["device"] and s3["fits"]


def test_quantized_collectives_count_zeropps_wire_bytes(capsys):
    """qwZ gathers int8 weights and qgZ reduce-scatters int8/int4 gradients, each with an
    fp32 scale per block: the formulas are :mod:`jaxzero.zeropp`'s."""
    from jaxzero import zeropp

    psi, n, block = 7e9, 8, 2048
    plain = est.comm_bytes(psi, n, 3, 2)
    q = est.comm_bytes(psi, n, 3, 2, qwz=True, qgz_bits=8, quant_block=block)
    assert q.param == pytest.approx(2 * zeropp.gather_wire_bytes(int(psi), n, block))
    assert q.grad == pytest.approx(zeropp.reduce_scatter_wire_bytes(int(psi), n, block, 8))
    assert q.total / plain.total == pytest.approx(0.501, abs=1e-3)  # bf16 -> int8 + scales
    q4 = est.comm_bytes(psi, n, 1, 2, qgz_bits=4)
    assert q4.grad / est.comm_bytes(psi, n, 1, 2).grad == pytest.approx(0.2505, abs=1e-3)
    for bad in (dict(qwz=True), dict(qgz_bits=3)):
        with pytest.raises(ValueError, match="qwz|qgz"):
            est.comm_bytes(psi, n, 1, 2, **bad)
    argv = ["--params", "7B", "-n", "8", "--qwz", "--qgz", "int8"]
    assert command.main(argv) == 0
    rows = _rows(capsys.readouterr().out)
    # stage  params grads optim device +act fits comm/step unquantized max-Ψ formula
    assert rows["3"][8:10] == ["18.41", "36.75"] and rows["1"][8:10] == ["18.39", "24.50"]
    assert rows["0"][8:10] == ["24.50", "24.50"]  # stage 0 all-reduces: nothing quantized


BEYOND_NONSENSE = [
    ["--params", "7B", "--qgz", "int3"],
    ["--params", "7B", "--offload", "gpu"],
    ["--params", "7B", "--qwz", "--quant-block", "0"],
]


@pytest.mark.parametrize("argv", BEYOND_NONSENSE)
def test_beyond_zero_nonsense_exits_nonzero_with_one_line(argv, capsys):
    assert command.main(argv) != 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
