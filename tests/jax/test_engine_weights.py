"""Placing and writing an engine's weight leaves (``backends/jax/engine_weights.py``), and the
trainer's export feeding them, on plain jax arrays on CPU: no engine is started.

The leaves here mimic sglang-jax's: linear kernels stored ``[in, out]`` (HF ``[out, in]``, the
mapping's ``transpose``), every other weight as in HF, on a mesh of their own.
"""

from __future__ import annotations

import mmap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mllm_rl.backends.jax import engine_weights as ew
from mllm_rl.backends.jax.export_layout import KernelInOut, Owned, hf_layout
from mllm_rl.backends.jax.fingerprint import read_sums, tensor_sums
from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import Placed

ENGINE_MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
REPLICATED = NamedSharding(ENGINE_MESH, PartitionSpec())
W, N = "w.weight", "norm.weight"  # a kernel (HF [out=6, in=4], leaf [4, 6]) and a vector


def _leaves(dtype=jnp.float32, chunk_bytes: int = 0) -> tuple[list[jax.Array], ew.EngineLeaves]:
    leaves = [jnp.zeros((4, 6), dtype, device=REPLICATED), jnp.zeros((6,), dtype, device=REPLICATED)]
    return leaves, ew.EngineLeaves(lambda: leaves, {W: (0, True), N: (1, False)}, chunk_bytes)


def _hf_kernel(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((6, 4)).astype(np.float32)  # [out, in]


def _assert_close(got: dict, want: dict, rel: float = 1e-6) -> None:
    """Two fingerprints ``{name: (sum, sumsq)}`` equal up to float32 summation order."""
    assert got.keys() == want.keys()
    for name, pair in want.items():
        assert got[name] == pytest.approx(pair, rel=rel, abs=1e-6), name


def _ptr(x: jax.Array) -> int:
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


@pytest.fixture
def chunked_on_cpu(monkeypatch) -> None:
    """Leaves on one CPU device written as on an accelerator: chunks into the existing buffer
    (a fake of the platform check; on one CPU device a large tensor is placed whole instead)."""
    monkeypatch.setattr(ew, "on_cpu", lambda sharding, one=False: False)


@pytest.fixture
def layouts(monkeypatch) -> list[tuple[bool, object]]:
    """Every ``(transpose, dtype)`` the placement computes with (the only place it transposes
    or casts a jax array)."""
    calls: list[tuple[bool, object]] = []
    real = ew._to_layout

    def spy(x, transpose, dtype):
        calls.append((transpose, jnp.dtype(dtype)))
        return real(x, transpose, dtype)

    monkeypatch.setattr(ew, "_to_layout", spy)
    return calls


# -- place ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["host", "jax"])
def test_hf_layout_tensor_is_transposed_onto_a_kernel_leaf_and_kept_for_a_vector(kind):
    leaves, w = _leaves()
    hf, norm = _hf_kernel(), np.arange(6, dtype=np.float32)
    conv = np.asarray if kind == "host" else jnp.asarray
    placed = w.place(W, conv(hf))
    assert placed.shape == (4, 6) and placed.sharding == leaves[0].sharding
    np.testing.assert_array_equal(np.asarray(placed), hf.T)
    np.testing.assert_array_equal(np.asarray(w.place(N, conv(norm))), norm)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_host_layout_diagnostic_lays_out_host_tensors_on_the_host(monkeypatch, layouts, dtype):
    """``MLLM_RL_HOST_LAYOUT=1``: a host kernel is transposed (and cast) on the host, never by a
    device program, with the same values; a jax array is still laid out where it lives."""
    leaves, w = _leaves(dtype)
    hf = _hf_kernel()
    want = np.asarray(jnp.asarray(hf.T, dtype))
    monkeypatch.setenv(ew.HOST_LAYOUT, "1")
    placed = w.place(W, hf)
    assert layouts == [] and placed.dtype == dtype and placed.sharding == leaves[0].sharding
    np.testing.assert_array_equal(np.asarray(placed), want)
    np.testing.assert_array_equal(np.asarray(w.place(W, jnp.asarray(hf))), want)
    assert layouts == [(True, jnp.dtype(dtype))]


@pytest.mark.parametrize("kind", ["host", "jax", "kernel_in_out"])
def test_placement_casts_to_the_leaf_dtype(kind):
    leaves, w = _leaves(jnp.bfloat16)
    hf = _hf_kernel()
    value = {"host": hf, "jax": jnp.asarray(hf), "kernel_in_out": KernelInOut(jnp.asarray(hf.T))}[kind]
    placed = w.place(W, value)
    assert placed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(jnp.asarray(hf.T, jnp.bfloat16)))


def test_kernel_in_out_goes_onto_an_in_out_leaf_without_a_transpose(layouts):
    _, w = _leaves()
    kernel = jnp.asarray(_hf_kernel().T)  # [in, out], as a trainer holds it
    placed = w.place(W, KernelInOut(kernel))
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(kernel))
    assert layouts == []  # no transpose, and no cast: only the copy onto the engine's sharding
    _, w16 = _leaves(jnp.bfloat16)
    w16.place(W, KernelInOut(kernel))
    assert layouts == [(False, jnp.dtype(jnp.bfloat16))]  # the cast alone


def test_kernel_in_out_onto_an_hf_layout_leaf_is_transposed_once(layouts):
    leaves = [jnp.zeros((6, 4), jnp.float32, device=REPLICATED)]
    w = ew.EngineLeaves(lambda: leaves, {W: (0, False)})
    hf = _hf_kernel()
    np.testing.assert_array_equal(np.asarray(w.place(W, KernelInOut(jnp.asarray(hf.T)))), hf)
    assert layouts == [(True, jnp.dtype(jnp.float32))]


def test_hf_layout_jax_array_is_transposed_once(layouts):
    _, w = _leaves()
    w.place(W, jnp.asarray(_hf_kernel()))
    assert layouts == [(True, jnp.dtype(jnp.float32))]


def test_placed_array_owns_its_buffer():
    """Same dtype and an equivalent sharding: ``device_put`` alone would alias the sender's
    buffer, which a trainer deletes when it offloads its params."""
    _, w = _leaves()
    norm = jnp.arange(6, dtype=jnp.float32)
    placed = w.place(N, norm)
    assert _ptr(placed) != _ptr(norm)
    norm.delete()
    np.testing.assert_array_equal(np.asarray(placed), np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("kernel", [False, True])
def test_an_owned_export_is_installed_without_a_copy(kernel):
    """A cast the trainer made for the export is nobody else's: its buffer becomes the leaf."""
    _, w = _leaves()
    x = jnp.asarray(_hf_kernel().T if kernel else np.arange(6, dtype=np.float32))
    name, value = (W, KernelInOut(x)) if kernel else (N, x)
    placed = w.place(name, Owned(value))
    assert _ptr(placed) == _ptr(x)
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(x))
    assert _ptr(w.place(name, value)) != _ptr(x)  # not owned: copied


@pytest.mark.parametrize("kind", ["host", "jax", "kernel_in_out"])
def test_shape_mismatch_names_the_tensor(kind):
    _, w = _leaves()
    bad = np.zeros((5, 4), np.float32)  # HF [out=5, in=4] for a leaf [4, 6]
    value = {"host": bad, "jax": jnp.asarray(bad), "kernel_in_out": KernelInOut(jnp.asarray(bad.T))}[kind]
    with pytest.raises(ValueError, match=r"w\.weight: shape \(4, 5\) does not match engine \(4, 6\)"):
        w.place(W, value)


def test_unknown_name_and_mismatched_install_are_refused():
    leaves, w = _leaves()
    with pytest.raises(KeyError, match="unknown parameter 'nope.weight'"):
        w.place("nope.weight", np.zeros(3))
    with pytest.raises(ValueError, match="norm.weight: placed"):
        w.install(N, jnp.zeros((6,), jnp.bfloat16, device=REPLICATED))
    assert not leaves[1].is_deleted()


# -- install / stream ----------------------------------------------------------------------
def test_install_replaces_the_leaf_and_frees_the_old_one():
    leaves, w = _leaves()
    old = leaves[0]
    new = w.place(W, _hf_kernel())
    w.install(W, new)
    assert leaves[0] is new and old.is_deleted()


def test_stream_fingerprint_is_of_what_was_installed():
    leaves, w = _leaves()
    hf, norm = _hf_kernel(1), np.linspace(-1, 1, 6, dtype=np.float32)
    sums, nbytes, _ = w.stream([(W, KernelInOut(jnp.asarray(hf.T))), (N, norm)])
    sent = read_sums(sums)
    assert nbytes == (24 + 6) * 4
    assert sent == w.fingerprint()  # read back from the leaves the forward uses
    assert sent[W] == pytest.approx((float(hf.sum()), float((hf.astype(np.float64) ** 2).sum())), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(leaves[0]), hf.T)


def test_stream_installs_placed_arrays_as_they_are():
    leaves, w = _leaves()
    new = jnp.ones((4, 6), jnp.float32, device=REPLICATED)
    w.stream([(W, Placed(new))])
    assert leaves[0] is new


def test_installed_proves_the_summed_arrays_are_the_leaves_and_nothing_else(monkeypatch):
    """A tensor placed whole is proven installed (its summed array is the leaf), on one CPU device
    also one above ``chunk_bytes``; one written in chunks, one dropped instead of installed (fault
    ``swap_noop``) or one replaced since is not, so the update check reads those back (and only
    those: ``fingerprint(names)``)."""
    hf, norm = _hf_kernel(1), np.linspace(-1, 1, 6, dtype=np.float32)
    leaves, w = _leaves()
    _, _, summed = w.stream([(W, hf), (N, norm)])
    assert w.installed(summed) == {W, N}
    w.install(W, w.place(W, _hf_kernel(2)))  # replaced after the stream
    assert w.installed(summed) == {N}
    assert set(w.fingerprint([N])) == {N} and w.fingerprint([N])[N] == w.fingerprint()[N]
    _, large = _leaves(chunk_bytes=24)
    _, _, summed = large.stream([(W, hf), (N, norm)])
    assert large.installed(summed) == {W, N}
    with monkeypatch.context() as m:
        m.setattr(ew, "on_cpu", lambda sharding, one=False: False)  # chunks, as on an accelerator
        _, chunked = _leaves(chunk_bytes=24)
        _, _, summed = chunked.stream([(W, hf), (N, norm)])
        assert chunked.installed(summed) == {N}
    monkeypatch.setenv("MLLM_RL_FAULTS", "swap_noop")
    for chunk_bytes in (0, 24):
        _, dropped = _leaves(chunk_bytes=chunk_bytes)
        _, _, summed = dropped.stream([(W, hf)])
        assert dropped.installed(summed) == set()
        assert not np.asarray(dropped.target_of(W)).any()  # the dummy leaf, neither freed nor written


# -- chunked writes ------------------------------------------------------------------------
def test_chunked_write_equals_whole_write(chunked_on_cpu):
    """A host tensor above ``chunk_bytes`` written slice by slice into the existing buffer:
    the same leaf and the same sums as placing it whole."""
    hf = _hf_kernel(2)
    whole_leaves, whole = _leaves(chunk_bytes=0)
    chunked_leaves, chunked = _leaves(chunk_bytes=24)  # one 6-float row of the [4, 6] leaf = 24 B
    assert whole.chunk_axis(W, hf) is None and chunked.chunk_axis(W, hf) == 0
    high_points: list[str] = []
    sums_whole, _, _ = whole.stream([(W, hf)])
    sums_chunked, nbytes, _ = chunked.stream(
        [(W, hf)], on_tensor=lambda name, nbytes: high_points.append(name)
    )
    np.testing.assert_array_equal(np.asarray(chunked_leaves[0]), np.asarray(whole_leaves[0]))
    np.testing.assert_array_equal(np.asarray(chunked_leaves[0]), hf.T)
    _assert_close(read_sums(sums_chunked), read_sums(sums_whole))
    assert nbytes == 96 and high_points == [W]


@pytest.mark.parametrize("transpose", [True, False])
def test_chunks_on_cpu_go_through_one_staging_buffer(monkeypatch, transpose):
    """``write_in_chunks`` on CPU devices (several of them in a run; called directly here) stages
    every chunk in one reused host buffer, waiting for each chunk's readers first: the leaf is the
    whole tensor, not the last chunk repeated, and the sums are the tensor's."""
    staged: list[int] = []
    real = ew.host_copy

    def spy(arr, dtype, into=None):
        out = real(arr, dtype, into)
        staged.append(out.ctypes.data)
        return out

    monkeypatch.setattr(ew, "host_copy", spy)
    hf = _hf_kernel(5)
    leaves, w = _leaves(chunk_bytes=24)  # [4, 6] float32 leaf: one 24-byte row a chunk
    if not transpose:
        w.mappings[W] = (0, False)
        leaves[0] = jnp.zeros((6, 4), jnp.float32, device=REPLICATED)
    sums = w.write_in_chunks(W, hf)
    np.testing.assert_array_equal(np.asarray(leaves[0]), hf.T if transpose else hf)
    assert len(staged) == (4 if transpose else 6) and len(set(staged)) == 1
    _assert_close(read_sums({W: sums}), {W: (float(hf.sum()), float((hf * hf).sum()))}, rel=1e-5)


def test_chunked_write_checks_the_shape():
    _, w = _leaves(chunk_bytes=24)
    with pytest.raises(ValueError, match=r"w\.weight: shape \(4, 5\) does not match engine \(4, 6\)"):
        w.write_in_chunks(W, np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"w\.weight: shape \(4, 5\) does not match engine \(4, 6\)"):
        w.replace_on_host(W, np.zeros((5, 4), np.float32))
    assert not w.target_of(W).is_deleted()  # refused before the leaf was freed


@pytest.mark.parametrize("transpose", [False, True])
def test_on_one_cpu_device_a_large_tensor_replaces_the_leaf_in_one_copy(monkeypatch, transpose):
    """On one CPU device the leaf is host memory: a host tensor above ``chunk_bytes`` is copied
    once, after the old leaf is freed, into an aligned buffer that the new leaf aliases (no XLA
    pass, no second copy), then proven installed; at the high point only the new copy is live."""
    monkeypatch.setattr(ew, "FRESH_BYTES", 64)  # the [4, 6] float32 leaf (96 B) in a map of its own
    hf = _hf_kernel(4)
    leaves, w = _leaves(chunk_bytes=24)
    if not transpose:
        w.mappings[W] = (0, False)
        leaves[0] = jnp.zeros((6, 4), jnp.float32, device=REPLICATED)
    old, live = leaves[0], []
    sums, nbytes, summed = w.stream([(W, hf)], on_tensor=lambda n, b: live.append(old.is_deleted()))
    new = leaves[0]
    assert live == [True] and nbytes == 96 and w.installed(summed) == {W}
    host = new.addressable_shards[0].data
    assert _ptr(new) % ew.ALIGN == 0 and np.asarray(host).ctypes.data == _ptr(new)  # aliased, not copied
    np.testing.assert_array_equal(np.asarray(new), hf.T if transpose else hf)
    _assert_close(read_sums(sums), {W: (float(hf.sum()), float((hf * hf).sum()))}, rel=1e-5)


@pytest.mark.parametrize("nbytes", [0, 40, 4096])
def test_host_copy_is_aligned_so_the_device_array_aliases_it(monkeypatch, nbytes):
    """JAX CPU's ``device_put`` aliases an ``ALIGN``-byte aligned host array (no second copy);
    from ``FRESH_BYTES`` on the copy is an anonymous map; ``into`` reuses a staging buffer."""
    monkeypatch.setattr(ew, "FRESH_BYTES", 1024)
    src = np.arange(nbytes // 4, dtype=np.float32)[::-1]  # a strided view: copied contiguous
    out = ew.host_copy(src, np.float32)
    assert out.flags.c_contiguous and out.shape == src.shape and (out == src).all()
    owner = out
    while isinstance(owner, np.ndarray | memoryview):  # the object that owns the memory
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    assert isinstance(owner, mmap.mmap) == (nbytes >= 1024)
    if nbytes:  # (an empty array has no buffer to align)
        assert out.ctypes.data % ew.ALIGN == 0
        assert jax.device_put(out).unsafe_buffer_pointer() == out.ctypes.data
    staging = ew.aligned_empty(8192)
    again = ew.host_copy(src, jnp.bfloat16, into=staging)
    assert again.ctypes.data == staging.ctypes.data and again.dtype == jnp.bfloat16
    np.testing.assert_array_equal(again, src.astype(jnp.bfloat16))


def test_dotted_names_a_key_path():
    tree = {"layers": [{"mlp": {"kernel": {"value": 1}}}], "norm": 2}
    paths = [ew.dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths == ["layers.0.mlp.kernel", "norm"]


def test_zeros_are_allocated_with_the_sharding():
    z = ew.zeros((3, 2), jnp.bfloat16, REPLICATED)
    assert z.sharding == REPLICATED and z.dtype == jnp.bfloat16 and not np.asarray(z).any()


# -- the trainer's export into engine leaves -----------------------------------------------
def _engine_like(md: ModelDir) -> tuple[list[jax.Array], ew.EngineLeaves]:
    """Dummy leaves laid out as sglang-jax's: projection kernels [in, out], the rest (embeddings,
    lm_head, norms) as in HF."""
    leaves, mappings = [], {}
    for name, (_, t) in md.tensors.items():
        transpose = name.endswith("_proj.weight")
        shape = tuple(t.shape)[::-1] if transpose else tuple(t.shape)
        mappings[name] = (len(leaves), transpose)
        leaves.append(jnp.zeros(shape, jnp.float32, device=REPLICATED))
    return leaves, ew.EngineLeaves(lambda: leaves, mappings)


@pytest.mark.parametrize(("lora", "scan"), [(0, False), (0, True), (4, False), (4, True)])
def test_trainer_export_is_installed_without_a_transpose(tiny_ckpt, layouts, lora, scan):
    """Kernels leave the trainer as ``KernelInOut`` [in, out] (LoRA: the merged kernel) and
    land in [in, out] leaves with no transpose anywhere; the engine's fingerprint of what it
    installed is the trainer's; the engine keeps its weights when the trainer offloads."""
    from mllm_rl.backends.jax.model import get_weight, linear_layers
    from mllm_rl.backends.jax.options import ModelOptions
    from mllm_rl.backends.jax.trainer import JaxTrainer
    from mllm_rl.trainer import PARAMS, TrainConfig

    md = ModelDir.open(tiny_ckpt)
    t = JaxTrainer(md, TrainConfig(lora_rank=lora), ModelOptions(scan_layers=scan))
    if lora:  # adapters that change the kernels (lora_b starts at zero)
        key = iter(jax.random.split(jax.random.key(1), 64))
        t.trainable = jax.tree.map(
            lambda x: x + 0.05 * jax.random.normal(next(key), x.shape, x.dtype), t.trainable
        )
    model = t._model_view()
    lins = linear_layers(model)
    leaves, engine = _engine_like(md)
    export = t.export_weights(full=True)
    items = list(export)
    for name, value in items:
        if name.endswith("_proj.weight"):
            kernel = get_weight(model, name)[0]  # [in, out], as stored (LoRA: the frozen base)
            assert isinstance(value, KernelInOut) and value.array.shape == kernel.shape, name
            want = lins[name].merged_kernel()
            assert lora == 0 or not np.array_equal(np.asarray(want), np.asarray(kernel)), name
            np.testing.assert_array_equal(np.asarray(value.array), np.asarray(want), err_msg=name)
            if not lora and not scan:  # the trainer's own buffer: no copy was made to export it
                assert _ptr(value.array) == _ptr(kernel), name
        else:
            assert isinstance(value, jax.Array), name
        assert hf_layout(value).shape == tuple(md.tensors[name][1].shape), name
    sums, _, _ = engine.stream(items)
    assert layouts == []  # same dtype: neither a transpose nor a cast, only the engine's copy
    _assert_close(read_sums(sums), t.weights_fingerprint(export.names))
    _assert_close(export.fingerprint(), t.weights_fingerprint(export.names))  # in the export's pass
    for name, value in items:
        i, transpose = engine.mappings[name]
        hf = np.asarray(hf_layout(value))
        np.testing.assert_array_equal(np.asarray(leaves[i]), hf.T if transpose else hf, err_msg=name)
    before = engine.fingerprint()
    t.offload([PARAMS])  # deletes the trainer's device arrays
    assert engine.fingerprint() == before


def test_tensor_sums_are_transpose_invariant():
    """Why the engine may fingerprint [in, out] while the HF tensor is [out, in]."""
    x = jnp.asarray(_hf_kernel(3))
    (s, q), (st, qt) = jax.device_get(tensor_sums(x)), jax.device_get(tensor_sums(x.T))
    assert float(s) == pytest.approx(float(st), rel=1e-6) and float(q) == pytest.approx(float(qt), rel=1e-6)


@pytest.mark.parametrize(
    ("lora", "scan", "param_dtype"), [(0, False, None), (4, True, None), (0, True, "bfloat16")]
)
def test_an_update_holds_at_most_the_planned_copies_in_flight(tiny_ckpt, lora, scan, param_dtype):
    """What the memory plan's ``staging`` counts (``memplan.STAGING_COPIES`` x the largest engine
    tensor): at every tensor's high point, the live arrays beyond the engine's leaves and the
    trainer's state are at most that many copies of the largest leaf: the trainer's export (a
    merged LoRA kernel, a stacked layer's row, params stored in another dtype cast to the
    engine's) and the engine's placed copy."""
    from mllm_rl.backends.jax.memplan import STAGING_COPIES
    from mllm_rl.backends.jax.options import ModelOptions
    from mllm_rl.backends.jax.trainer import JaxTrainer
    from mllm_rl.trainer import TrainConfig

    md = ModelDir.open(tiny_ckpt)
    t = JaxTrainer(md, TrainConfig(lora_rank=lora), ModelOptions(scan_layers=scan, param_dtype=param_dtype))
    leaves, engine = _engine_like(md)
    assert {x.dtype for x in leaves} == {jnp.dtype(t.export_dtype)}  # the engine holds what is exported
    largest = max(x.nbytes for x in leaves)

    def live() -> int:  # the per-tensor sums (2 scalars each) are not staging
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.size > 2)

    base, extra = live(), []
    engine.stream(t.export_weights(full=True), on_tensor=lambda name, nbytes: extra.append(live() - base))
    assert len(extra) == len(md.tensors)
    assert 0 < max(extra) <= STAGING_COPIES * largest, (max(extra), largest)
