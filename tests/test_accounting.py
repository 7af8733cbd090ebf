"""Accounting: the HLO collective parser, loop trip counts, measured vs. theory on the Engine."""

# ruff: noqa: E501  (HLO text below is kept verbatim, one instruction per line)

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxzero.accounting import comm, hlo
from jaxzero.accounting import estimate as est
from jaxzero.accounting import measure as acc

# A GPU-style module written by hand: async collectives, iota replica groups, tuple
# shapes, a while loop nested in a while loop, a collective in a called computation
# and in an async-wrapped computation, a conditional.
HAND_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (p: f32[16,8]) -> f32[2,8] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(f32[16,8]{1,0} %p), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%inner_body (t: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %t = (s32[], f32[2,8]{1,0}) parameter(0)
  %x = f32[2,8]{1,0} get-tuple-element(%t), index=1
  %ags = (f32[2,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[2,8]{1,0} %x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[16,8]{1,0} all-gather-done((f32[2,8]{1,0}, f32[16,8]{1,0}) %ags)
  %rss = ((f32[16,8]{1,0}), f32[2,8]{1,0}) async-start(f32[16,8]{1,0} %agd), calls=%wrapped_reduce_scatter
  %rsd = f32[2,8]{1,0} async-done(((f32[16,8]{1,0}), f32[2,8]{1,0}) %rss), calls=%wrapped_reduce_scatter
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[2,8]{1,0}) tuple(%i, %rsd)
}

%inner_cond (t: (s32[], f32[2,8])) -> pred[] {
  %t = (s32[], f32[2,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (t: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %t = (s32[], f32[2,8]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[2,8]{1,0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}

%outer_cond (t: (s32[], f32[2,8])) -> pred[] {
  %t = (s32[], f32[2,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%helper (y: bf16[32,4]) -> bf16[32,4] {
  %y = bf16[32,4]{1,0} parameter(0)
  ROOT %ar = bf16[32,4]{1,0} all-reduce(%y), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
}

%branch_true (z: f32[4]) -> f32[4] {
  %z = f32[4]{0} parameter(0)
  ROOT %ar2 = f32[4]{0} all-reduce(%z), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

%branch_false (z: f32[4]) -> f32[4] {
  ROOT %z = f32[4]{0} parameter(0)
}

ENTRY %main (p0: f32[2,8], p1: bf16[32,4], p2: f32[4], p3: pred[]) -> f32[2,8] {
  %p0 = f32[2,8]{1,0} parameter(0)
  %p1 = bf16[32,4]{1,0} parameter(1)
  %p2 = f32[4]{0} parameter(2)
  %p3 = pred[] parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,8]{1,0}) tuple(%zero, %p0)
  %loop = (s32[], f32[2,8]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, metadata={op_name="body=%helper"}, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"3"}}
  %c1 = bf16[32,4]{1,0} call(%p1), to_apply=%helper
  %c2 = bf16[32,4]{1,0} call(%c1), to_apply=%helper
  %cond = f32[4]{0} conditional(%p3, %p2, %p2), true_computation=%branch_true, false_computation=%branch_false
  %ars = (f32[], f32[1024]{0}, /*index=2*/bf16[64,2]{1,0}) all-reduce-start(f32[] %s0, f32[1024]{0} %s1, bf16[64,2]{1,0} %s2), channel_id=5, replica_groups={}, to_apply=%add
  %ard = (f32[], f32[1024]{0}, bf16[64,2]{1,0}) all-reduce-done((f32[], f32[1024]{0}, bf16[64,2]{1,0}) %ars)
  %cps = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) collective-permute-start(f32[8,8]{1,0} %q), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,8]{1,0} collective-permute-done((f32[8,8]{1,0}, f32[8,8]{1,0}, u32[], u32[]) %cps)
  ROOT %out = f32[2,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def _by_name(collectives):
    return {c.name: c for c in collectives}


@pytest.mark.unit
def test_parse_type_tuples_layouts_and_comments():
    t = hlo.parse_type("((f32[8,16]{1,0:T(8,128)}, bf16[]), /*index=2*/s32[3]{0}, token[])")
    bufs = hlo.flatten_type(t)
    assert [(b.dtype, b.shape) for b in bufs] == [
        ("f32", (8, 16)),
        ("bf16", ()),
        ("s32", (3,)),
        ("token", ()),
    ]
    assert [b.nbytes for b in bufs] == [512, 2, 12, 0]
    assert isinstance(t, tuple) and len(t) == 3 and isinstance(t[0], tuple)


@pytest.mark.unit
def test_replica_group_forms():
    assert comm.parse_replica_groups("{{0,1},{2,3}}", 4) == ((0, 1), (2, 3))
    assert comm.parse_replica_groups("{}", 4) == ((0, 1, 2, 3),)
    assert comm.parse_replica_groups("[1,8]<=[8]", 8) == (tuple(range(8)),)
    assert comm.parse_replica_groups("[2,4]<=[4,2]T(1,0)", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert comm.parse_replica_groups("[4,2]<=[8]", 8) == ((0, 1), (2, 3), (4, 5), (6, 7))


# XLA's newer mesh-axes form (jaxlib 0.12 for shard_map collectives; GSPMD's on 0.10 too):
# the devices that differ only along the listed axes, as the older forms would list them
MESH_FORMS = {
    "mesh['r'=2,'d'=4] {'r'}": ((0, 4), (1, 5), (2, 6), (3, 7)),
    "mesh['r'=2,'d'=4] {'d'}": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "mesh['r'=2,'d'=4] {'r','d'}": (tuple(range(8)),),
    "mesh['a'=2,'b'=2,'c'=2] {'a','c'}": ((0, 1, 4, 5), (2, 3, 6, 7)),
    "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}": (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    ),
    "mesh['x'=2,'y'=2], device_ids=({{3,1},{2,0}}) {'y'}": ((3, 1), (2, 0)),
    "mesh['x'=8] {'x':(2)2}": ((0, 2), (1, 3), (4, 6), (5, 7)),
}


@pytest.mark.unit
@pytest.mark.parametrize("text", sorted(MESH_FORMS))
def test_mesh_axes_replica_groups(text):
    assert comm.parse_replica_groups(text, 8) == MESH_FORMS[text]


@pytest.mark.unit
def test_replica_groups_in_a_form_we_do_not_know_are_an_error_not_all_devices():
    hlo = HAND_HLO.replace("replica_groups={{0,1},{2,3},{4,5},{6,7}}", "replica_groups=new<0:4>", 1)
    assert hlo != HAND_HLO
    with pytest.raises(ValueError, match="cannot parse replica groups"):
        comm.collectives_from_hlo(hlo)


@pytest.mark.unit
def test_hand_written_module_counts_every_collective_once_with_its_loops():
    found = comm.collectives_from_hlo(HAND_HLO)
    cols = _by_name(found.collectives)
    # the -done halves are skipped; the async-wrapped reduce-scatter counts once
    assert set(cols) == {"ags", "rs", "ar", "ar2", "ars", "cps"}
    # nested loops multiply: 3 outer x 4 inner; the metadata string "body=%helper" is ignored
    assert cols["ags"].runs == 12 and cols["rs"].runs == 12
    assert cols["ags"].kind == "all-gather" and cols["ags"].buffers == (hlo.Buffer("f32", (16, 8)),)
    # a reduce-scatter's full buffer is its input: output x N along the scatter dimension
    assert cols["rs"].buffers == (hlo.Buffer("f32", (16, 8)),) and cols["rs"].group_size == 8
    # a computation called from two call sites runs twice; transposed iota groups of 4
    assert cols["ar"].runs == 2 and cols["ar"].group_size == 4
    assert cols["ar"].replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert cols["ar2"].runs == 1 and cols["ar2"].group_size == 2
    assert any("conditional" in n for n in found.notes)
    # an async all-reduce of a tuple; empty replica_groups means all 8 partitions
    assert cols["ars"].kind == "all-reduce" and cols["ars"].group_size == 8
    assert [b.shape for b in cols["ars"].buffers] == [(), (1024,), (64, 2)]
    assert cols["cps"].kind == "collective-permute"
    assert cols["cps"].buffers == (hlo.Buffer("f32", (8, 8)),)

    tr = comm.traffic(found.collectives)
    frac = 7 / 8
    expected_big = (
        12 * 512 * frac  # all-gather, 16x8 f32
        + 12 * 512 * frac  # reduce-scatter, 16x8 f32 input
        + 2 * 2 * 256 * 3 / 4  # all-reduce bf16 32x4 over groups of 4, twice
        + 2 * (4096 + 256) * frac  # the tuple all-reduce's big members
        + 256  # collective-permute sends its buffer once
    )
    # the f32[4] all-reduce (4 elements) and the f32[] member are scalars
    expected_small = 2 * 16 * 1 / 2 + 2 * 4 * frac
    assert tr.grad_param == pytest.approx(expected_big)
    assert tr.scalars == pytest.approx(expected_small)
    assert tr.ops == 6 and tr.runs == 12 + 12 + 2 + 1 + 1 + 1


@pytest.mark.unit
def test_unknown_trip_count_is_noted():
    text = HAND_HLO.replace('"known_trip_count":{"n":"4"}', '"other":1')
    found = comm.collectives_from_hlo(text)
    assert _by_name(found.collectives)["ags"].runs == 3
    assert any("no known_trip_count" in n for n in found.notes)


# ---------------------------------------------------------------- real compiled programs


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def _compile_text(fn, mesh, in_specs, out_specs, *args) -> str:
    sm = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(sm).lower(*args).compile().as_text()


def _fsdp_mlp_text(mesh, layers: int, width: int = 64) -> str:
    """Stage-3 style MLP: scanned layers gather their weight; grad reduce-scatters per layer."""

    def loss(w, x):
        def layer(h, wl):
            return jnp.tanh(h @ lax.all_gather(wl, "data", tiled=True)), None

        def remat_layer(h, wl):
            return jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(h, wl)

        h, _ = lax.scan(remat_layer, x, w)
        return lax.psum(jnp.sum(h**2), "data")

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return value, grad

    w = jnp.ones((layers, width, width)) * 0.01
    x = jnp.ones((16, width))
    return _compile_text(step, mesh, (P(None, "data"), P("data")), (P(), P(None, "data")), w, x)


def test_scanned_collectives_scale_with_layers_not_ops(mesh8):
    width = 64
    t4 = comm.traffic(comm.collectives_from_hlo(_fsdp_mlp_text(mesh8, 4, width)).collectives)
    t8 = comm.traffic(comm.collectives_from_hlo(_fsdp_mlp_text(mesh8, 8, width)).collectives)
    assert t4.ops == t8.ops  # the same distinct HLO ops ...
    assert t8.grad_param == pytest.approx(2 * t4.grad_param)  # ... but twice the traffic
    # gather fwd + gather bwd + reduce-scatter per layer: 3 Ψ b (N-1)/N
    psi = 4 * width * width
    assert t4.grad_param == pytest.approx(est.comm_bytes(psi, 8, 3, 4).total)
    assert t4.by_kind["all-gather"] == pytest.approx(2 * t4.by_kind["reduce-scatter"])


def test_psum_psum_scatter_all_gather_sizes(mesh8):
    def f(a, b, c):
        return (
            lax.psum(a, "data"),
            lax.psum_scatter(b, "data", scatter_dimension=1, tiled=True),
            lax.all_gather(c, "data", axis=0, tiled=True),
        )

    a = jnp.ones((8 * 3, 100), jnp.bfloat16)
    b = jnp.ones((8, 8 * 40))
    c = jnp.ones((8 * 5, 7))
    text = _compile_text(f, mesh8, (P("data"), P("data"), P("data")), (P("data"),) * 3, a, b, c)
    cols = {c.kind: c for c in comm.collectives_from_hlo(text).collectives}
    # the CPU backend widens bf16 collectives to f32 (convert before and after); the
    # logical buffer keeps the type the program asked for
    assert cols["all-reduce"].logical_buffers == (hlo.Buffer("bf16", (3, 100)),)
    assert cols["all-reduce"].buffers[0].shape == (3, 100)
    wire_bytes = cols["all-reduce"].buffers[0].nbytes
    assert cols["reduce-scatter"].buffers == (hlo.Buffer("f32", (1, 320)),)
    assert cols["all-gather"].buffers == (hlo.Buffer("f32", (40, 7)),)
    assert all(c.runs == 1 and c.group_size == 8 for c in cols.values())
    assert cols["all-reduce"].bytes_per_step == 2 * wire_bytes * 7 / 8
    assert not cols["all-gather"].promoted
    tr = comm.traffic(list(cols.values()))
    f32_bytes = 2 * 300 * 4 * 7 / 8 + (320 * 4 + 280 * 4) * 7 / 8
    assert tr.grad_param_logical == pytest.approx(f32_bytes - 2 * 300 * 2 * 7 / 8)


def test_nested_scan_multiplies_trip_counts(mesh8):
    def f(w, x):
        def outer(h, _):
            def inner(h2, wl):
                return jnp.tanh(h2 @ lax.all_gather(wl, "data", tiled=True)), None

            return lax.scan(inner, h, w)[0], None

        return lax.psum(lax.scan(outer, x, None, length=3)[0], "data")

    text = _compile_text(
        f, mesh8, (P(None, "data"), P("data")), P(), jnp.ones((5, 64, 64)), jnp.ones((8, 64))
    )
    runs = {c.kind: c.runs for c in comm.collectives_from_hlo(text).collectives}
    assert runs == {"all-gather": 15, "all-reduce": 1}


def test_two_axis_mesh_groups():
    mesh = jax.make_mesh((2, 4), ("r", "d"), axis_types=(AxisType.Auto,) * 2)

    def f(x):
        return lax.psum(x, "r"), lax.psum_scatter(x, "d", tiled=True)

    spec = P(("r", "d"))
    text = _compile_text(f, mesh, spec, (spec, spec), jnp.ones((64, 128)))
    cols = {c.kind: c for c in comm.collectives_from_hlo(text).collectives}
    assert cols["all-reduce"].group_size == 2 and len(cols["all-reduce"].replica_groups) == 4
    assert cols["reduce-scatter"].group_size == 4
    assert cols["reduce-scatter"].buffers == (hlo.Buffer("f32", (8, 128)),)


def test_compiled_memory_peak(mesh8):
    fn = jax.jit(lambda x: x * 2, donate_argnums=0)
    m = acc.compiled_memory(fn.lower(jnp.ones((256,))).compile())
    assert m.argument == 1024 and m.output == 1024
    assert m.peak == m.argument + m.output + m.temp - m.alias


def test_device0_bytes_reads_shards(mesh8):
    sharded = jax.device_put(jnp.ones((64, 8)), jax.NamedSharding(mesh8, P("data")))
    replicated = jax.device_put(jnp.ones((10,)), jax.NamedSharding(mesh8, P()))
    assert acc.device0_bytes({"a": sharded, "b": replicated, "c": None}) == 8 * 8 * 4 + 40
    assert math.isclose(np.asarray(sharded).sum(), 512)


# ---------------------------------------------------------------- the Engine, measured

REFERENCE_GPT = dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)


def _gpt_report(stage: int, **cfg_overrides):
    import optax

    import jaxzero
    from jaxzero.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**{**REFERENCE_GPT, **cfg_overrides})
    model = GPT(cfg)
    engine = model.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(8), stage=stage)
    # accounting needs shapes, not values: zeros skip compiling the model's init
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    state = engine.init(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes))
    tokens = jnp.zeros((16, cfg.seq_len), jnp.int32)
    return acc.report(engine, state, {"inputs": tokens, "targets": tokens})


def _mlp_params() -> dict:
    """A plain-pytree MLP, no dimension divisible by 8; every leaf big enough to shard."""
    rng = np.random.default_rng(0)
    return {
        "w1": (0.1 * rng.standard_normal((97, 515))).astype(np.float32),
        "b1": np.zeros(515, np.float32),
        "w2": (0.1 * rng.standard_normal((515, 301))).astype(np.float32),
        "b2": np.zeros(301, np.float32),
    }


def _mlp_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)


def _mlp_report(stage: int, **engine_kwargs):
    import optax

    import jaxzero

    engine = jaxzero.Engine(
        _mlp_loss, optax.adamw(1e-3), mesh=jaxzero.make_mesh(8), stage=stage, **engine_kwargs
    )
    state = engine.init(_mlp_params())
    batch = {"x": jnp.ones((16, 97)), "y": jnp.ones((16, 301))}
    return acc.report(engine, state, batch)


def _check_against_theory(r: acc.Report) -> None:
    # docs/zero.md's formulas, within the tolerances
    assert 0.98 <= r.persistent_ratio <= 1.02, r.table()
    assert 0.98 <= r.comm_ratio <= 1.05, r.table()
    # leaf by leaf (padding, replicated small leaves) the persistent bytes are exact
    assert r.persistent["total"] == pytest.approx(r.expected.persistent, rel=1e-4, abs=64)
    assert r.persistent["params"] > 0 and r.persistent["optimizer"] > 0
    assert r.compiled.peak >= r.compiled.argument > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reference_gpt_memory_and_traffic_match_theory(stage):
    r = _gpt_report(stage)
    _check_against_theory(r)
    assert r.config["num_params"] == r.theory.params * (8 if stage == 3 else 1) / 4
    kinds = set(r.traffic.by_kind)
    assert kinds >= ({"all-reduce"} if stage == 0 else {"reduce-scatter", "all-gather"})
    if stage < 3:  # stage 3 leaves the embeddings' backward re-gather out (see report)
        assert r.traffic.grad_param == pytest.approx(r.expected.comm, rel=1e-3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_odd_mlp_memory_matches_theory(stage):
    r = _mlp_report(stage)
    assert r.config["padded_params"] > r.config["num_params"]  # padding really happens
    assert 0.98 <= r.persistent_ratio <= 1.02, r.table()
    assert r.persistent["total"] == pytest.approx(r.expected.persistent, rel=1e-4, abs=64)
    if stage == 3:  # everything sharded: the excess over the formula is the padding alone
        excess = r.config["padded_params"] / r.config["num_params"]
        assert r.persistent_ratio == pytest.approx(excess, rel=1e-3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_odd_mlp_traffic_matches_theory(stage):
    r = _mlp_report(stage)
    assert 0.98 <= r.comm_ratio <= 1.05, r.table()
    assert r.traffic.grad_param == pytest.approx(r.expected.comm, rel=1e-3)


def test_coarse_stage3_gathers_exactly_once():
    """per_layer=False gathers the tree once and keeps it: one gather per reduce-scatter."""
    r = _mlp_report(3)
    f = 7 / 8
    once = r.config["padded_params"] * 4 * f  # fp32, every leaf sharded
    assert r.traffic.grad_param == pytest.approx(2 * once, rel=1e-6)
    assert r.traffic.grad_param == pytest.approx(r.expected.comm, rel=1e-6)
    assert r.traffic.by_kind["all-gather"] == pytest.approx(r.traffic.by_kind["reduce-scatter"])
    assert any("per_layer=False" in n for n in r.notes)


@pytest.mark.parametrize("reduce_dtype", [None, "fp32"])
def test_bf16_traffic_counts_the_program_dtypes(reduce_dtype):
    r = _mlp_report(1, precision="bf16", reduce_dtype=reduce_dtype)
    # bf16 gather + bf16 (or fp32) reduce-scatter: what the program asked for, even
    # though the CPU backend widens bf16 collectives to f32 on the wire
    assert 0.98 <= r.comm_ratio_logical <= 1.05, r.table()
    assert r.traffic.grad_param_logical <= r.traffic.grad_param
    assert 0.98 <= r.persistent_ratio <= 1.02  # 2 Ψ params + 12 Ψ / N (master, moments)
    assert r.persistent["master"] > 0


def test_stage3_traffic_scales_with_scanned_layers():
    small = _gpt_report(3, n_layers=4, d_model=64, seq_len=32)
    big = _gpt_report(3, n_layers=8, d_model=64, seq_len=32)
    # the same HLO ops (one scanned block body) ...
    assert small.traffic.ops == big.traffic.ops
    assert {c.runs for c in small.collectives} == {1, 4}
    assert {c.runs for c in big.collectives} == {1, 8}
    per_op_once = sum(c.bytes_per_run for c in big.collectives) / sum(
        c.bytes_per_run for c in small.collectives
    )
    assert per_op_once == pytest.approx(1.0, abs=0.01)  # counting each op once cannot tell
    # ... but the traffic inside the loop doubles with the layers, and the total follows
    # the parameter count (embeddings outside the loop are the same in both)
    loop = lambda r, n: sum(c.bytes_per_step for c in r.collectives if c.runs == n)
    assert loop(big, 8) == pytest.approx(2 * loop(small, 4), rel=1e-9)
    measured = big.traffic.grad_param / small.traffic.grad_param
    params = big.config["num_params"] / small.config["num_params"]
    assert measured == pytest.approx(params, rel=0.03)
    assert measured > 1.8


def test_report_cli_json(capsys, tmp_path):
    from jaxzero.commands import report

    hlo = tmp_path / "new" / "dir" / "step.txt"  # missing parents are created
    argv = [
        "--stage",
        "2",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--devices",
        "4",
        "--json",
        "--dump-hlo",
        str(hlo),
    ]
    assert report.main(argv) == 0
    assert [p.name for p in hlo.parent.iterdir()] == ["step.stage2.txt"]  # stage before .txt
    assert "HloModule" in (hlo.parent / "step.stage2.txt").read_text()
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["stage"] == 2 and data["config"]["num_shards"] == 4
    assert data["ratios"]["persistent_vs_layouts"] == pytest.approx(1.0, abs=1e-3)
    assert data["ratios"]["comm_logical_vs_layouts"] == pytest.approx(1.0, abs=1e-3)
    assert {c["kind"] for c in data["collectives"]} >= {"reduce-scatter", "all-gather"}
    assert data["compiled"]["peak"] > 0


@pytest.mark.parametrize("base", ["bf16", "int8"])
def test_report_cli_lora_counts_the_frozen_base_apart(capsys, base):
    """``jaxzero report --arch llama --lora-rank R``: the base frozen in bf16 (2 bytes a
    param; QLoRA int8: a byte a weight and an fp32 scale a block of 64), / N at stage 3,
    gathered with the adapters and never reduced."""
    from jaxzero.commands import report

    argv = [
        "--stage", "3", "--arch", "llama", "--lora-rank", "4", "--layers", "2",
        "--d-model", "64", "--heads", "4", "--seq-len", "16", "--vocab", "64", "--json",
        "--base-dtype", base,
    ]  # fmt: skip
    assert report.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    c, p, t = data["config"], data["persistent"], data["theory"]
    assert c["num_frozen"] > 10 * c["num_params"] > 0
    assert p["frozen"] == pytest.approx(t["frozen"], rel=0.01)
    assert p["total"] == pytest.approx(t["persistent"], rel=0.01)
    reduced = sum(x["bytes_per_step"] for x in data["collectives"] if x["kind"] == "reduce-scatter")
    assert reduced == pytest.approx(t["comm_grad"], rel=0.01)  # the adapters' alone
    if base == "int8":  # the quantized weights are stored elements of 1 and 4 bytes
        assert 1 < t["frozen"] * 8 / c["num_frozen"] < 2
        return
    assert t["frozen"] == pytest.approx(2 * c["num_frozen"] / 8)  # bf16, / N
    assert t["comm_frozen"] == pytest.approx(2 * 2 * c["num_frozen"] * 7 / 8)
    # the embeddings are kept for the backward pass, not gathered again (the notes say so)
    assert data["ratios"]["comm_logical"] == pytest.approx(1.0, abs=0.03)


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv",
    [
        ["--heads", "3"], ["--stage", "5"], ["--micro-batches", "0"], ["--devices", "x"],
        ["--lora-rank", "4"], ["--arch", "llama", "--lora-rank", "0"],
    ],
)  # fmt: skip
def test_report_cli_nonsense_is_one_line(argv, capsys):
    from jaxzero.commands import report

    assert report.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("jaxzero report: error:")


@pytest.mark.unit
def test_report_hlo_path_puts_the_stage_before_the_extension():
    from jaxzero.commands import report

    assert report.hlo_path("out/x.txt", 3) == Path("out/x.stage3.txt")
    assert report.hlo_path("x", 0) == Path("x.stage0")


@pytest.mark.unit
def test_report_dump_hlo_bad_path_fails_before_compiling(tmp_path, capsys, monkeypatch):
    from jaxzero.commands import report

    def no_compile(*args):
        raise AssertionError("compiled before checking --dump-hlo")

    monkeypatch.setattr(report, "build", no_compile)
    (tmp_path / "file").write_text("")
    assert report.main(["--dump-hlo", str(tmp_path / "file" / "x.txt")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("jaxzero report: error: --dump-hlo: cannot write")
    assert "is a file, not a directory" in err


@pytest.mark.unit
def test_scope_of_replica_groups_on_a_hybrid_mesh():
    # 2 groups of 4: devices 0-3 and 4-7
    assert comm.scope(((0, 1, 2, 3), (4, 5, 6, 7)), 4) == "intra"
    assert comm.scope(((0, 4), (1, 5), (2, 6), (3, 7)), 4) == "inter"
    assert comm.scope(((0, 4, 1, 5, 2, 6, 3, 7),), 4) == "both"
    assert comm.scope(((0, 1, 2, 3, 4, 5, 6, 7),), 8) == "intra"  # one group: a plain mesh
    assert comm.scope(((0, 1), (4, 5)), 4) == "intra" and comm.scope(((0, 5),), 4) == "both"


def test_hybrid_2x4_stage3_intra_and_inter_group_bytes_match_the_formulas():
    """Shard over 4, replicate over 2: ZeRO-3 traffic inside a group, one all-reduce across."""
    import optax

    import jaxzero
    from jaxzero.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=4, n_heads=4)
    model = GPT(cfg)
    engine = model.engine(optax.adamw(1e-3), mesh=jaxzero.make_mesh(8, replicas=2), stage=3)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    state = engine.init(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes))
    tokens = jnp.zeros((16, cfg.seq_len), jnp.int32)
    r = acc.report(engine, state, {"inputs": tokens, "targets": tokens})
    psi, b = r.config["num_params"], 4
    assert (r.config["num_shards"], r.config["replicas"]) == (4, 2)
    intra_formula = 3 * psi * b * 3 / 4  # gather fwd + gather bwd + reduce-scatter, N = 4
    inter_formula = 2 * (psi * b / 4) * 1 / 2  # all-reduce of the gradient shard, R = 2
    assert r.theory.comm_intra == pytest.approx(intra_formula)
    assert r.theory.comm_inter == pytest.approx(inter_formula)
    measured = r.traffic.by_scope
    assert measured["intra"] == pytest.approx(intra_formula, rel=0.02), r.table()
    assert measured["inter"] == pytest.approx(inter_formula, rel=0.02), r.table()
    assert measured["both"] == 0.0  # nothing big spans both
    assert sum(measured.values()) == pytest.approx(r.traffic.grad_param)
    assert "across groups (R = 2)" in r.table()
    assert r.to_dict()["ratios"]["comm_inter"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("qgz", [None, "int8"])
def test_hpz_2x4_state_over_every_device_and_traffic_across_groups_match_the_formulas(qgz):
    """hpZ: the master and Adam's moments over all 8 devices (12 bytes / 8 a param), the
    fp32 working params over the group's 4 (fp32: XLA:CPU widens bf16 collectives); across the groups a reduce-scatter of the gradient shard
    and one all-gather of the new params (with qgZ: a quantized all-to-all), measured
    in the compiled step beside the formulas."""
    import optax

    import jaxzero
    from jaxzero.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    engine = model.engine(
        optax.adamw(1e-3), mesh=jaxzero.make_mesh(8, replicas=2), stage=3, hpz=True,
        qgz=qgz, quant_block=256,
    )  # fmt: skip
    state = engine.init_from(model.init, jax.random.key(0))
    tokens = jnp.zeros((16, cfg.seq_len), jnp.int32)
    r = acc.report(engine, state, {"inputs": tokens, "targets": tokens})
    psi = r.config["num_params"]
    assert r.theory.params == pytest.approx(4 * psi / 4)
    # + Adam's count, a few bytes
    assert r.theory.master + r.theory.optimizer == pytest.approx(12 * psi / 8, rel=1e-4)
    ratios = r.to_dict()["ratios"]
    assert ratios["persistent"] == pytest.approx(1.0, abs=0.01), r.table()
    if qgz is None:  # a reduce-scatter of the shard + an all-gather of it, R = 2
        assert r.theory.comm_inter == pytest.approx(2 * (psi * 4 / 4) / 2)
    assert r.traffic.by_scope["inter"] == pytest.approx(r.theory.comm_inter, rel=0.02), r.table()
    assert r.traffic.by_scope["intra"] == pytest.approx(r.theory.comm_intra, rel=0.03), r.table()
    assert "the master and optimizer state over every device (hpZ)" in r.table()


# ------------------------------------------------------- frozen params (a LoRA-like model)

LORA_L, LORA_D, LORA_R = 4, 64, 4  # layers, width, adapter rank


def _lora_params(base_dtype, stacked: bool) -> dict:
    """A frozen base ``w`` (D x D a layer) and small trainable adapters ``a``, ``b``."""
    rng = np.random.default_rng(0)
    L, D, R = LORA_L, LORA_D, LORA_R
    w = (rng.standard_normal((L, D, D)) / np.sqrt(D)).astype(base_dtype)
    a = (0.1 * rng.standard_normal((L, R, D))).astype(np.float32)
    b = (0.1 * rng.standard_normal((L, D, R))).astype(np.float32)
    if stacked:
        return {"layers": {"w": w, "a": a, "b": b}}
    return {"layers": [{"w": w[i], "a": a[i], "b": b[i]} for i in range(L)]}


def _lora_loss(p, batch):
    """Each layer's params through ``use_params`` (stage 3 gathers the frozen ``w`` with
    the adapters), re-gathered in the backward pass (``remat_layer``)."""
    import jaxzero

    def layer(x, lp):
        lp = jaxzero.use_params(lp)
        return jnp.tanh(x @ lp["w"] + (x @ lp["a"].T) @ lp["b"].T), None

    block = jaxzero.remat_layer(layer)
    x = batch["x"]
    if isinstance(p["layers"], list):
        for lp in p["layers"]:
            x = block(x, lp)[0]
    else:
        x = lax.scan(block, x, p["layers"])[0]
    return jnp.mean((x - batch["y"]) ** 2)


def _adapters(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in ("a", "b")


def _lora_report(stage, base_dtype, stacked, precision="fp32", micro_batches=1, per_layer=True):
    import optax

    import jaxzero

    engine = jaxzero.Engine(
        _lora_loss,
        optax.adamw(1e-3),
        mesh=jaxzero.make_mesh(8),
        stage=stage,
        precision=precision,
        micro_batches=micro_batches,
        per_layer=per_layer,
        stacked="^layers/" if stacked else None,
        trainable=_adapters,
    )
    state = engine.init(_lora_params(base_dtype, stacked))
    rows = 16 * micro_batches
    batch = {"x": jnp.ones((rows, LORA_D)), "y": jnp.ones((rows, LORA_D))}
    return engine, acc.report(engine, state, batch)


# (base dtype, stacked layers, precision, micro-batches, per_layer). Per-layer models are
# scanned: XLA merges an unrolled loop's re-gathers with the forward's (one gather a layer)
LORA_CASES = {
    "fp32-base": ("float32", True, "fp32", 1, True),
    "bf16-base-fp32-run-k2": ("bfloat16", True, "fp32", 2, True),
    "bf16-base-bf16-run": ("bfloat16", True, "bf16", 1, True),
    "bf16-base-unrolled-coarse": ("bfloat16", False, "fp32", 1, False),
}


@pytest.mark.parametrize(
    "stage, case",
    [(s, c) for s in (0, 3) for c in LORA_CASES]
    + [(1, "bf16-base-bf16-run"), (2, "bf16-base-fp32-run-k2")],
)
def test_frozen_base_is_counted_apart_from_the_trainable_params(stage, case):
    """A LoRA-like step: each part of the state (working params, master, optimizer, frozen)
    as the formulas and the layouts say; the gathers at stage 3 include the frozen base's
    (twice a micro-batch per layer, once coarse), the gradient reductions are the adapters'
    alone."""
    base_dtype, stacked, precision, k, per_layer = LORA_CASES[case]
    engine, r = _lora_report(stage, jnp.dtype(base_dtype), stacked, precision, k, per_layer)
    L, D, R, N = LORA_L, LORA_D, LORA_R, 8
    psi_t, psi_f = 2 * L * R * D, L * D * D
    assert (engine.num_params, engine.num_frozen) == (psi_t, psi_f)
    assert (r.config["num_params"], r.config["num_frozen"]) == (psi_t, psi_f)
    base_bytes = jnp.dtype(base_dtype).itemsize
    assert r.theory.frozen == psi_f * base_bytes / (N if stage == 3 else 1)  # 2Ψf (/N)

    # persistent bytes, part by part, against the formulas and the layouts (1%)
    p, t = r.persistent, r.theory
    for part, formula in [
        ("params", t.params), ("master", t.master), ("optimizer", t.optimizer),
        ("frozen", t.frozen),
    ]:  # fmt: skip
        if formula == 0:
            assert p[part] == 0, (part, r.table())
        else:
            assert p[part] == pytest.approx(formula, rel=0.01), (part, r.table())
    assert p["frozen"] == pytest.approx(r.expected.frozen, rel=0.01)
    assert p["total"] == pytest.approx(t.persistent, rel=0.01)
    assert p["total"] == pytest.approx(r.expected.persistent, rel=1e-4, abs=64)
    assert p["total"] - p["other"] == r.expected.persistent  # leaf by leaf, exactly

    # traffic at the program's dtypes: gathers (frozen included) and reductions apart
    tr = r.traffic.by_kind_logical
    gathered = tr.get("all-gather", 0.0)
    reduced = tr.get("reduce-scatter", 0.0) + tr.get("all-reduce", 0.0)
    frac = (N - 1) / N
    grad_bytes = 2 if precision == "bf16" else 4
    trainable_reduce = (
        2 * psi_t * grad_bytes * frac
        if stage == 0
        else (k if stage >= 2 else 1) * psi_t * grad_bytes * frac
    )
    assert r.expected.comm_grad == pytest.approx(trainable_reduce)
    assert r.theory.comm_grad == pytest.approx(trainable_reduce)
    assert reduced == pytest.approx(trainable_reduce, rel=0.01), r.table()  # Ψt's alone
    gathers = 2 if per_layer else 1
    frozen_gathers = k * gathers * psi_f * base_bytes * frac if stage == 3 else 0.0
    assert r.theory.comm_frozen == pytest.approx(frozen_gathers)
    assert r.expected.comm_frozen == pytest.approx(frozen_gathers)
    assert gathered == pytest.approx(r.expected.comm_param, rel=0.01, abs=1), r.table()
    assert gathered == pytest.approx(r.theory.comm_param, rel=0.01, abs=1), r.table()
    if stage == 3:
        param_bytes = 2 if precision == "bf16" else 4
        trainable_gathers = k * gathers * psi_t * param_bytes * frac
        assert gathered - trainable_gathers == pytest.approx(frozen_gathers, rel=0.01)
    assert r.traffic.grad_param_logical == pytest.approx(r.expected.comm, rel=0.01)
    assert r.comm_ratio_logical == pytest.approx(1.0, abs=0.01)
    assert not any("gathers" in n and "again" in n for n in r.notes), r.notes

    text = r.table()
    assert "frozen params" in text and f"Ψf = {psi_f:,} frozen" in text
    assert ("of which frozen gathers" in text) == (stage == 3)
    data = json.loads(r.to_json())
    assert data["persistent"]["frozen"] == p["frozen"] and data["theory"]["frozen"] == t.frozen


def test_without_frozen_params_the_report_has_no_frozen_rows():
    r = _mlp_report(3)
    assert r.persistent["frozen"] == 0 and r.theory.frozen == 0 and r.config["num_frozen"] == 0
    assert "frozen" not in r.table()


@pytest.mark.unit
def test_theory_and_layouts_count_frozen_bytes_apart():
    from types import SimpleNamespace as Lay

    from jaxzero.accounting.expected import layout_expectation, theory

    psi, n = 1000, 8
    plain = theory(psi, n, 3, 2, 2, 4, 8)
    assert plain == theory(psi, n, 3, 2, 2, 4, 8, frozen_bytes=0.0)  # backward compatible
    for stage in (0, 1, 2, 3):
        base = theory(psi, n, stage, 2, 2, 4, 8, micro_batches=2)
        th = theory(psi, n, stage, 2, 2, 4, 8, micro_batches=2, frozen_bytes=7000.0)
        assert th.frozen == 7000.0 / (n if stage == 3 else 1)
        assert th.persistent == pytest.approx(base.persistent + th.frozen)
        assert th.comm_grad == base.comm_grad  # nothing to reduce
        gathered = 2 * 2 * 7000.0 * 7 / 8 if stage == 3 else 0.0
        assert th.comm_frozen == pytest.approx(gathered)
        assert th.comm_param == pytest.approx(base.comm_param + gathered)
    # leaf by leaf: a frozen leaf of 100 rows pads to 104 at stage 3; a small one stays whole
    big = Lay(shape=(100, 10), dim=0, padded_shape=(104, 10))
    small = Lay(shape=(4,), dim=None, padded_shape=(4,))
    trained = [Lay(shape=(64, 8), dim=0, padded_shape=(64, 8))]
    for stage in (0, 3):
        ex = layout_expectation(trained, n, stage, 4, 4, 0, frozen=[(big, 2), (small, 4)])
        no = layout_expectation(trained, n, stage, 4, 4, 0)
        held = 1040 / 8 * 2 + 16 if stage == 3 else 1000 * 2 + 16
        assert ex.frozen == held and ex.persistent == no.persistent + held
        assert (ex.frozen_params, ex.padded_frozen) == (1004, 1044 if stage == 3 else 1004)
        gathered = 2 * 1040 * 2 * 7 / 8 if stage == 3 else 0.0  # the small leaf: replicated
        assert ex.comm_frozen == pytest.approx(gathered)
        assert ex.comm == pytest.approx(no.comm + gathered) and ex.comm_grad == no.comm_grad


# ------------------------------------------------------- beyond ZeRO: offload, qwZ, qgZ


@pytest.fixture(scope="module")
def offloaded_reports():
    """The bf16 MLP with AdamW, offloaded, at stages 1 and 3 on 8 devices: one compile each."""
    return {stage: _mlp_report(stage, precision="bf16", offload="optimizer") for stage in (1, 3)}


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_moves_the_master_and_moments_to_host_memory_as_the_formulas_say(
    offloaded_reports, stage
):
    """12Ψ/N (the fp32 master and Adam's two moments) live in pinned_host memory: the
    device keeps its working params (2Ψ at stage 1, 2Ψ/N at stage 3), leaf by leaf exact."""
    r = offloaded_reports[stage]
    p, t, e = r.persistent, r.theory, r.expected
    psi, n = r.config["num_params"], 8
    assert r.config["offload"] == "optimizer" and r.offloaded
    # leaf by leaf (padding included) the split is exact: host = master + optimizer state
    assert p["host"] == e.host == p["master"] + p["optimizer"] > 0
    assert p["device"] == p["total"] - p["host"] == p["params"] + p["other"]
    assert p["device"] - p["other"] == e.device  # the layouts leave the step counter out
    # the formulas: 12Ψ/N moved to the host, the device's persistent state less by as much
    assert t.host == pytest.approx(12 * psi / n, abs=1)  # AdamW's count: 4 bytes more
    assert t.device == pytest.approx(t.persistent - 12 * psi / n, abs=1)
    assert t.device == pytest.approx(2 * psi / (n if stage == 3 else 1))
    padding = r.config["padded_params"] / psi  # what the layouts add to the formulas
    assert p["host"] / t.host == pytest.approx(padding, rel=1e-3)
    # the compiled step: XLA:CPU counts the host-resident state as ordinary arguments and
    # outputs; the device peak takes it out, the host's holds it (donated: counted once)
    h, c = r.host_transfers, r.compiled
    leaves = 4 + 9  # the master's 4 leaves; AdamW's count, mu (4) and nu (4)
    assert (h.parameters, h.outputs) == (leaves, leaves)
    assert h.parameter_bytes == h.output_bytes == p["host"]
    assert c.host_peak == c.counted_host == h.resident_bytes
    assert c.device_peak == c.peak - c.counted_host < c.peak
    assert (h.to_device, h.to_host, h.copy_done) == (0, 0, 0)  # one memory on CPU
    text = r.table()
    assert "in host memory" in text and "on the device" in text
    assert f"{leaves} entry parameters and {leaves} outputs in S(5)" in text
    d = r.to_dict()
    assert d["compiled"]["device_peak"] == c.device_peak and d["persistent"]["host"] == p["host"]


@pytest.mark.parametrize("stage", [0, 3])
def test_an_ema_is_counted_as_the_master_is_stored(stage):
    """The EMA of the weights (fp32, laid out as the master): its own row, 4Ψ at stage 0
    and 4Ψ/N at stage 3 against the formula, exact leaf by leaf, and in the total."""
    r = _mlp_report(stage, precision="bf16", ema=0.9)
    p, t, e = r.persistent, r.theory, r.expected
    psi = r.config["num_params"]
    assert r.config["ema"] and p["ema"] == e.ema == p["master"] > 0
    assert t.ema == pytest.approx(4 * psi / (8 if stage else 1))
    assert 0.98 <= r.persistent_ratio <= 1.02, r.table()  # the EMA in the formula's total
    assert p["total"] == pytest.approx(e.persistent, rel=1e-4, abs=64)  # and leaf by leaf
    assert "EMA of the weights" in r.table()
    assert "EMA of the weights" not in _mlp_report(stage, precision="bf16").table()


def test_offload_in_fp32_moves_the_optimizer_state_alone(capsys):
    """fp32 training has no master apart from the params: offload moves Adam's 8Ψ/N
    (``jaxzero report --offload optimizer``)."""
    from jaxzero.commands import report

    argv = [
        "--stage", "3", "--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16",
        "--vocab", "64", "--offload", "optimizer", "--json",
    ]  # fmt: skip
    assert report.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    p, t = data["persistent"], data["theory"]
    assert p["master"] == 0 and p["host"] == p["optimizer"] > 0
    # Adam's 8 bytes a param (its step count adds 4 bytes, replicated)
    assert t["host"] == pytest.approx(8 * data["config"]["num_params"] / 8, abs=1)
    # the layer norms' scales, too small to shard, keep their moments whole: 1.6% more
    assert p["host"] == data["expected"]["host"] == pytest.approx(t["host"], rel=0.02)
    assert data["host_transfers"]["parameters"] == data["host_transfers"]["outputs"] > 0
    assert data["compiled"]["device_peak"] < data["compiled"]["peak"]


# a GPU-style module by hand: two host-resident state leaves, one copied to the device for
# an update and back (copy-start: (destination, source, context)), one donated
HOST_HLO = """\
HloModule jit_step, is_scheduled=true, input_output_alias={ {0}: (0, {}, may-alias), {2}: (2, {}, may-alias) }, entry_computation_layout={(f32[64]{0:S(5)}, bf16[64]{0}, /*index=2*/f32[8,8]{1,0:S(5)})->(f32[64]{0:S(5)}, bf16[64]{0}, f32[8,8]{1,0:S(5)})}, num_partitions=8

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %w = f32[8,8]{1,0:S(5)} get-tuple-element(%t), index=1
  %cs = (f32[8,8]{1,0}, f32[8,8]{1,0:S(5)}, u32[]) copy-start(f32[8,8]{1,0:S(5)} %w)
  %cd = f32[8,8]{1,0} copy-done((f32[8,8]{1,0}, f32[8,8]{1,0:S(5)}, u32[]) %cs)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%i, %cd)
}

%cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p0: f32[64], p1: bf16[64], p2: f32[8,8]) -> (f32[64], bf16[64], f32[8,8]) {
  %p0 = f32[64]{0:S(5)} parameter(0)
  %p1 = bf16[64]{0} parameter(1)
  %p2 = f32[8,8]{1,0:S(5)} parameter(2)
  %copy-start = (f32[64]{0}, f32[64]{0:S(5)}, u32[]) copy-start(f32[64]{0:S(5)} %p0)
  %copy-done = f32[64]{0} copy-done((f32[64]{0}, f32[64]{0:S(5)}, u32[]) %copy-start)
  %add = f32[64]{0} add(f32[64]{0} %copy-done, f32[64]{0} %copy-done)
  %copy-start.1 = (f32[64]{0:S(5)}, f32[64]{0}, u32[]) copy-start(f32[64]{0} %add)
  %copy-done.1 = f32[64]{0:S(5)} copy-done((f32[64]{0:S(5)}, f32[64]{0}, u32[]) %copy-start.1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %p2)
  %loop = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %local = f32[8,8]{1,0} copy(f32[8,8]{1,0:S(5)} %p2)
  ROOT %out = (f32[64]{0:S(5)}, bf16[64]{0}, f32[8,8]{1,0:S(5)}) tuple(%copy-done.1, %p1, %p2)
}
"""


@pytest.mark.unit
def test_host_transfers_are_read_from_the_layouts_and_the_copies():
    h = hlo.host_transfers(HOST_HLO)
    assert (h.parameters, h.outputs) == (2, 2)  # the bf16 working params stay on the device
    assert h.parameter_bytes == h.output_bytes == 64 * 4 + 64 * 4
    assert h.alias_bytes == 64 * 4 + 64 * 4 and h.resident_bytes == 512
    # copy-start from S(5) in the loop (3 trips) and in ENTRY, and a synchronous copy: to
    # the device; one copy-start back to S(5)
    assert (h.to_device, h.to_host, h.copy_done) == (3, 1, 3)
    assert h.to_device_bytes == 3 * 256 + 256 + 256 and h.to_host_bytes == 256
    plain = HOST_HLO.replace(":S(5)", "")
    assert hlo.host_transfers(plain) == hlo.HostTransfers()  # nothing in host memory


def test_quantized_collectives_are_counted_at_zeropps_wire_bytes(mesh8):
    """qwZ's int8 all-gather and qgZ's all-to-all of int8/int4 rows (payload and fp32
    scales in one s8 buffer; XLA:CPU prints the all-to-all as a tuple of its N chunks):
    the ring bytes of what compiles equal :mod:`jaxzero.zeropp`'s formulas."""
    from jaxzero import zeropp
    from jaxzero.partition import LeafLayout

    lay, block = LeafLayout("w", (8 * 600, 5), 0, 8), 256

    def f(w, g):
        return (
            zeropp.gather_quantized(w, lay, 0, block),
            zeropp.reduce_scatter_quantized(g, lay, (), 0, block, 8),
            zeropp.reduce_scatter_quantized(g, lay, (), 0, block, 4),
        )

    x = jnp.ones(lay.shape)
    text = _compile_text(f, mesh8, (P("data"), P()), (P(), P("data"), P("data")), x, x)
    cols = comm.collectives_from_hlo(text).collectives
    assert {b.dtype for c in cols for b in c.buffers} == {"s8"}
    assert not any(c.promoted for c in cols)  # int8 goes on the wire as int8, even on CPU
    tr = comm.traffic(cols)
    elements = lay.padded_size
    gather = zeropp.gather_wire_bytes(elements, 8, block)
    reduce = [zeropp.reduce_scatter_wire_bytes(elements, 8, block, bits) for bits in (8, 4)]
    assert tr.by_kind["all-gather"] == pytest.approx(gather)
    assert tr.by_kind["all-to-all"] == pytest.approx(sum(reduce))
    assert tr.scalars == 0
    # the formulas' side takes the same definition
    assert est.quantized_gather_bytes(elements, 8, block) == gather
    assert est.quantized_reduce_bytes(elements, 8, block, 4) == reduce[1]
    assert gather < est.ring_bytes("all-gather", 2 * elements, 8)  # under bf16's


@pytest.mark.unit
def test_theory_and_layouts_with_offload_and_quantized_collectives():
    from types import SimpleNamespace as Lay

    from jaxzero import zeropp
    from jaxzero.accounting.expected import layout_expectation, theory

    psi, n, block = 8 * 4096, 8, 2048
    for stage in (1, 2, 3):
        plain = theory(psi, n, stage, 2, 2, 4, 8)
        off = theory(psi, n, stage, 2, 2, 4, 8, offload=True)
        assert off.host == 12 * psi / n and off.device == plain.persistent - off.host
        assert off.comm == plain.comm  # offload sends nothing more on the wire
        q = theory(psi, n, stage, 2, 2, 4, 8, qwz=stage == 3, qgz_bits=8, quant_block=block)
        reduce = zeropp.reduce_scatter_wire_bytes(psi, n, block, 8)
        assert q.comm_grad == pytest.approx(reduce)
        if stage == 3:
            assert q.comm_param == pytest.approx(2 * zeropp.gather_wire_bytes(psi, n, block))
        else:
            assert q.comm_param == plain.comm_param  # stages 1-2 gather in the working dtype
    # two groups: qgZ's second hop all-gathers the quantized shard across them
    hyb = theory(psi, 4, 3, 2, 2, 4, 8, replicas=2, qgz_bits=4, quant_block=block)
    total = zeropp.reduce_scatter_wire_bytes(psi, 4, block, 4, replicas=2)
    assert hyb.comm_inter == pytest.approx(
        total - zeropp.reduce_scatter_wire_bytes(psi, 4, block, 4)
    )
    # leaf by leaf: the host holds each master leaf's shard and the optimizer's leaves
    w = Lay(shape=(100, 64), dim=0, padded_shape=(104, 64))
    small = Lay(shape=(7,), dim=None, padded_shape=(7,))
    opt = [(w, 4), (w, 4), (small, 4), (small, 4)]
    ex = layout_expectation([w, small], n, 3, 2, 2, 4, opt, offload=True)
    assert ex.host == (104 * 64 / 8 * 4) * 3 + 7 * 4 * 3
    assert ex.device == 104 * 64 / 8 * 2 + 7 * 2
    exq = layout_expectation(
        [w, small], n, 3, 2, 2, 4, opt, qwz=True, qgz_bits=8, quant_block=block
    )
    gathered = 2 * zeropp.gather_wire_bytes(104 * 64, n, block)
    assert exq.comm_param == pytest.approx(gathered)
    replicated = 2 * 7 * 2 * 7 / 8  # the small leaf's all-reduce, unquantized
    assert exq.comm_grad == pytest.approx(
        zeropp.reduce_scatter_wire_bytes(104 * 64, n, block, 8) + replicated
    )


def test_report_counts_qwz_and_qgz_at_their_wire_bytes(capsys):
    """``jaxzero report --qwz --qgz int8``: stage 3's gathers and reduce-scatters go on the
    wire as s8 (payload and scales), and their measured bytes meet the formulas' (short
    by the embeddings' backward gather, as without quantization)."""
    from jaxzero.commands import report

    argv = [
        "--stage", "3", "--precision", "bf16", "--qwz", "--qgz", "int8", "--layers", "2",
        "--d-model", "64", "--heads", "2", "--seq-len", "16", "--vocab", "64", "--json",
    ]  # fmt: skip
    assert report.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["qwz"] and data["config"]["qgz_bits"] == 8
    big = [c for c in data["collectives"] if c["kind"] != "all-reduce"]
    assert {c["kind"] for c in big} == {"all-gather", "all-to-all"}
    assert all(b.startswith("s8[") for c in big for b in c["buffers"])
    assert 0.97 <= data["ratios"]["comm"] <= 1.0
    assert 0.97 <= data["ratios"]["comm_logical_vs_layouts"] <= 1.0
    t, psi = data["theory"], data["config"]["num_params"]
    assert t["comm_param"] == pytest.approx(2 * est.quantized_gather_bytes(psi, 8, 2048))
    assert t["comm_grad"] == pytest.approx(est.quantized_reduce_bytes(psi, 8, 2048, 8))
