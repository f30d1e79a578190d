"""Compact rows (bf16 / fp16 weights, bf16 optimizer state) and FTRL-Proximal, against references.

The references are written here from the definitions, independently of hierps' code:

- stochastic rounding from its definition (the two neighbours of a value, and the random bits that
  choose between them), with the random bits from the documented hash of (table salt ^ key, step,
  column);
- training: torch's own optimizers (``Adagrad``, ``SparseAdam``) on a plain ``nn.Embedding``, or the
  optimizer's equations written out (partial row-wise Adam; FTRL-Proximal from McMahan et al. 2013,
  Algorithm 1, coordinate by coordinate), each followed by the rounding of what the step wrote.

Compact tables must equal their reference bit for bit, through every tier and a reopen.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import hierps
from hierps._store import store_parts
from hierps.rows._layout import rounding_bits, row_layout, stochastic_round
from hierps.storage._files import read_json_checked, write_json_atomic

VOCAB, DIM = 96, 16
M32 = np.uint64(0xFFFFFFFF)


# -- the reference rounding ---------------------------------------------------------------------------
def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & M32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & M32
    return x ^ (x >> np.uint64(16))


def ref_bits(keys: np.ndarray, salt: np.uint64, step: int, columns: int) -> np.ndarray:
    """(n, columns) uint64 random bits of the documented hash."""
    seeds = keys.astype(np.int64).view(np.uint64) ^ np.uint64(salt)
    lo, hi = seeds & M32, seeds >> np.uint64(32)
    h = _mix(lo ^ _mix(hi ^ _mix(np.uint64(step) & M32)))
    cols = (np.arange(columns, dtype=np.uint64) * np.uint64(0x9E3779B9)) & M32
    return _mix((h[:, None] + cols[None, :]) & M32)


def ref_round(x: np.ndarray, dtype: str, bits: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded stochastically to ``dtype`` by definition, returned as float32."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    for i in np.ndindex(x.shape):
        out[i] = _ref_round_one(x[i], dtype, int(bits[i]))
    return out


def _ref_round_one(v: np.float32, dtype: str, r: int) -> np.float32:
    if dtype == "fp16":
        v = np.float32(min(max(v, -65504.0), 65504.0))
        if abs(v) < 2.0**-14:  # fp16's subnormal grid of 2**-24: up (toward +inf) when u < distance
            below = math.floor(float(v) * 2**24)
            frac = float(v) * 2**24 - below  # exact in float64
            return np.float32((below + ((r >> 8) / 2**24 < frac)) * 2.0**-24)
        drop = 13
    else:
        drop = 16
    # Truncated toward zero to the target's grid, and the next value away from zero.
    mag = np.array(abs(v), np.float32).view(np.uint32).item()
    toward = mag & ~((1 << drop) - 1)
    away = toward + (1 << drop)
    dropped = mag - toward
    r_part = (r >> 16) if dtype == "bf16" else (r & 0x1FFF)
    chosen = away if dropped and r_part >= (1 << drop) - dropped else toward
    out = np.array(chosen, np.uint32).view(np.float32).item()
    out = min(out, 65504.0) if dtype == "fp16" else out
    return np.float32(math.copysign(out, float(v)))


# -- rounding itself ------------------------------------------------------------------------------------
def test_rounding_bits_follow_the_documented_hash():
    keys = np.array([0, 1, -1, 2**62 + 7, -(2**40)], np.int64)
    salt = np.uint64(0xDEADBEEF12345678)
    for step in (1, 2, 2**33 + 5):
        seeds = torch.from_numpy(keys ^ np.array(salt).view(np.int64))
        got = rounding_bits(seeds, step, 40).numpy()
        np.testing.assert_array_equal(got.astype(np.uint64), ref_bits(keys, salt, step, 40))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_stochastic_rounding_equals_its_definition(dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.normal(0, 1, 300),
            rng.normal(0, 1e-3, 100),
            rng.normal(0, 3e-6, 100),  # fp16 subnormals
            [0.0, -0.0, 1.0, -2.5, 65504.0, 70000.0, -1e9, 2.0**-14, -(2.0**-24) * 3.5],
        ]
    ).astype(np.float32)
    bits = rng.integers(0, 2**32, x.shape, dtype=np.uint64)
    got = stochastic_round(torch.from_numpy(x), dtype, torch.from_numpy(bits.astype(np.int64)))
    np.testing.assert_array_equal(got.float().numpy(), ref_round(x, dtype, bits))
    # Rounding a value the dtype holds gives it back, whatever the bits.
    held = got.float().numpy()
    again = stochastic_round(torch.from_numpy(held), dtype, torch.from_numpy(bits[::-1].astype(np.int64)))
    np.testing.assert_array_equal(again.float().numpy(), held)


@pytest.mark.parametrize(("dtype", "drop"), [("bf16", 16), ("fp16", 13)])
def test_stochastic_rounding_is_unbiased_over_every_draw(dtype, drop):
    # Every value of the random bits that matter, once each: the mean of the roundings is x exactly.
    x = np.array([1.0 + 2.0**-12 * 3, -0.3, 1234.567], np.float32)
    draws = np.arange(1 << drop, dtype=np.int64)
    bits = (draws << 16) if dtype == "bf16" else draws
    for v in x:
        out = stochastic_round(torch.full((len(draws),), float(v)), dtype, torch.from_numpy(bits))
        assert out.double().mean().item() == pytest.approx(float(v), rel=0, abs=1e-12)
        assert len(set(out.float().tolist())) == 2  # the two neighbours only


# -- training against references ----------------------------------------------------------------------
def _batches(n: int, seed: int) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.sort(rng.choice(VOCAB, 24, replace=False)).astype(np.int64)
        c = torch.from_numpy(rng.normal(0, 0.5, (len(ids), DIM)).astype(np.float32))
        d = torch.from_numpy(rng.normal(0, 0.5, (len(ids), DIM)).astype(np.float32))
        out.append((ids, c, d))
    return out


def _loss(w: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (w * w * c + w * d).sum()  # a gradient that depends on the weights


def _train_store(store: hierps.Store, batches) -> None:
    for i, (ids, c, d) in enumerate(batches):
        w = store.gather("t", torch.from_numpy(ids), requires_grad=True)
        _loss(w, c, d).backward()
        store.step()
        if i % 3 == 2:
            store.flush()  # rows go down to RAM and (tiny RAM budget) SSD, and come back


class _Ref:
    """A plain embedding trained by a reference step, then rounded as the table's layout says."""

    def __init__(self, store: hierps.Store, opt: str, params: dict, wdt: str, sdt: str) -> None:
        self.info = store.info("t")
        self.layout = row_layout(opt, DIM, wdt, sdt)
        rows = store.read_rows("t", np.arange(VOCAB))  # the initial rows, decoded
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.emb.weight.data = torch.from_numpy(rows[:, :DIM].copy())
        self.state = torch.from_numpy(rows[:, DIM:].copy())  # columns of the optimizer's state
        self.opt, self.params, self.step = opt, params, 0
        self.torch_opt = {
            "adagrad": lambda: torch.optim.Adagrad([self.emb.weight], **params),
            "adam": lambda: torch.optim.SparseAdam([self.emb.weight], **params),
        }.get(opt, lambda: None)()

    def train(self, batches) -> None:
        for ids, c, d in batches:
            self.step += 1
            w = self.emb(torch.from_numpy(ids))
            _loss(w, c, d).backward()
            grad = self.emb.weight.grad.coalesce()
            g = grad.values()
            if self.torch_opt is not None:
                self.torch_opt.step()
                self._sync_state_from_torch(ids)
            else:
                self._own_step(ids, g)
            self.emb.weight.grad = None
            self._round(ids)

    def _sync_state_from_torch(self, ids: np.ndarray) -> None:
        st = self.torch_opt.state[self.emb.weight]
        parts = [st["sum"]] if self.opt == "adagrad" else [st["exp_avg"], st["exp_avg_sq"]]
        self.state[ids] = torch.cat([p[ids] for p in parts], dim=1)

    def _own_step(self, ids: np.ndarray, g: torch.Tensor) -> None:
        w = self.emb.weight.data
        if self.opt == "partial_rowwise_adam":  # SparseAdam with v one value per row: mean of g²
            b1, b2 = self.params["betas"]
            lr, eps = self.params["lr"], 1e-8
            m, v = self.state[ids, :DIM], self.state[ids, DIM : DIM + 1]
            m_new = m + (g - m) * (1 - b1)
            v_new = v + ((g * g).mean(dim=1, keepdim=True) - v) * (1 - b2)
            step_size = lr * math.sqrt(1 - b2**self.step) / (1 - b1**self.step)
            w[ids] = w[ids] + (-step_size * (m_new / (v_new.sqrt() + eps)))
            self.state[ids, :DIM], self.state[ids, DIM : DIM + 1] = m_new, v_new
        elif self.opt == "ftrl":
            self._ftrl(ids, g.numpy())
        else:
            raise AssertionError(self.opt)

    def _ftrl(self, ids: np.ndarray, g: np.ndarray) -> None:
        """McMahan et al. 2013, Algorithm 1, per coordinate i, in float32."""
        p = {k: np.float32(v) for k, v in self.params.items()}
        alpha, beta, l1, l2 = p["alpha"], p["beta"], p["lambda1"], p["lambda2"]
        w_all, st = self.emb.weight.data.numpy(), self.state.numpy()
        for row, key in enumerate(ids):
            for i in range(DIM):
                z, n, w, gi = st[key, i], st[key, DIM + i], w_all[key, i], g[row, i]
                sigma = (np.sqrt(n + gi * gi) - np.sqrt(n)) / alpha
                z = z + (gi - sigma * w)
                n = n + gi * gi
                if abs(z) <= l1:
                    w = np.float32(0.0)
                else:
                    w = -(z - np.sign(z) * l1) / ((beta + np.sqrt(n)) / alpha + l2)
                st[key, i], st[key, DIM + i], w_all[key, i] = z, n, w

    def _round(self, ids: np.ndarray) -> None:
        bits = ref_bits(ids, self.info.salt, self.step, self.layout.width)
        rows = self.rows()[ids]
        for f in self.layout.fields:
            if f.rounded:
                cols = slice(f.column, f.column + f.count)
                rows[:, cols] = ref_round(rows[:, cols], f.dtype, bits[:, cols])
        self.emb.weight.data[ids] = torch.from_numpy(rows[:, :DIM])
        self.state[ids] = torch.from_numpy(rows[:, DIM:])
        if self.torch_opt is not None:  # torch's optimizer goes on from the rounded state
            st = self.torch_opt.state[self.emb.weight]
            names = ["sum"] if self.opt == "adagrad" else ["exp_avg", "exp_avg_sq"]
            for k, name in enumerate(names):
                st[name][ids] = self.state[ids, k * DIM : (k + 1) * DIM]

    def rows(self) -> np.ndarray:
        return torch.cat([self.emb.weight.data, self.state], dim=1).numpy().copy()


CASES = [
    ("adam", {"lr": 0.05}, "fp32", "fp32"),  # the reference itself: torch, no rounding
    ("adagrad", {"lr": 0.1}, "bf16", "fp32"),
    ("adagrad", {"lr": 0.1}, "fp16", "bf16"),
    ("adam", {"lr": 0.05}, "bf16", "bf16"),
    ("partial_rowwise_adam", {"lr": 0.05, "betas": (0.9, 0.999)}, "bf16", "bf16"),
    ("ftrl", {"alpha": 0.5, "beta": 1.0, "lambda1": 0.05, "lambda2": 0.1}, "fp32", "fp32"),
    ("ftrl", {"alpha": 0.5, "beta": 1.0, "lambda1": 0.05, "lambda2": 0.1}, "bf16", "bf16"),
]


@pytest.mark.parametrize(("opt", "params", "wdt", "sdt"), CASES)
def test_training_equals_the_reference_of_the_same_arithmetic(make_store, tmp_path, opt, params, wdt, sdt):
    store = make_store(memory_budget="4KiB", device_budget="1MiB")
    store.table("t", DIM, optimizer={"type": opt, "params": params}, weights_dtype=wdt, state_dtype=sdt)
    ref = _Ref(store, opt, params, wdt, sdt)
    batches = _batches(12, seed=1)
    _train_store(store, batches)
    ref.train(batches)
    assert store_parts(store).core.ssd.num_rows("t") > 0  # rows went through the SSD tier
    got = store.read_rows("t", np.arange(VOCAB))
    np.testing.assert_array_equal(got, ref.rows()[:, : got.shape[1]])
    store.checkpoint()
    store.close()
    with hierps.Store(tmp_path / "store", device="cpu") as again:
        again.table("t", DIM)
        np.testing.assert_array_equal(again.read_rows("t", np.arange(VOCAB)), got)


def test_ftrl_gives_sparse_weights_and_starts_at_the_initializer(make_store):
    store = make_store()
    params = {"alpha": 0.5, "beta": 1.0, "lambda1": 2.0, "lambda2": 0.0}
    store.table("t", DIM, optimizer={"type": "ftrl", "params": params}, initializer="normal")
    first = store.read_rows("t", np.arange(VOCAB))
    w0, z0 = first[:, :DIM], first[:, DIM : 2 * DIM]
    assert np.all(first[:, 2 * DIM :] == 0)  # n starts at 0
    # z starts where the closed form gives back the initial weights.
    closed = np.where(np.abs(z0) <= 2.0, 0.0, -(z0 - np.sign(z0) * 2.0) / (1.0 / 0.5))
    np.testing.assert_allclose(closed, w0, rtol=1e-6, atol=1e-6)
    assert not np.any(w0 == 0)
    _train_store(store, _batches(20, seed=2))
    w = store.lookup("t", torch.arange(VOCAB)).numpy()
    assert (w == 0).mean() > 0.05  # L1 sets weights to exactly zero


# -- bytes, format, refusals ---------------------------------------------------------------------------
def test_a_compact_adam_row_of_dim_16_takes_at_most_half_the_bytes():
    full = row_layout("adam", 16)
    compact = row_layout("partial_rowwise_adam", 16, "bf16", "bf16")
    assert full.row_bytes == 4 * (16 + 32 + 5)
    assert compact.row_bytes == 2 * 16 + 2 * 16 + 4 + 4 * 5
    assert compact.row_bytes <= 0.5 * full.row_bytes


def test_compact_rows_take_fewer_bytes_on_ssd(make_store):
    sizes = {}
    for wdt in ("fp32", "bf16"):
        store = make_store(wdt, memory_budget="4KiB")
        store.table("t", DIM, optimizer="adam", weights_dtype=wdt, state_dtype=wdt)
        store.write("t", np.arange(5000), np.ones((5000, DIM), np.float32))
        store.checkpoint()
        sizes[wdt] = store_parts(store).core.ssd.bytes_written
    assert sizes["bf16"] / sizes["fp32"] == pytest.approx((8 + 4 * (24 + 5)) / (8 + 4 * (48 + 5)), rel=0.02)


def test_the_manifest_records_the_precisions(make_store, tmp_path):
    store = make_store()
    store.table("t", DIM, optimizer="adam", weights_dtype="fp16", state_dtype="bf16")
    store.checkpoint()
    meta = hierps.CheckpointReader(tmp_path / "store").tables["t"]
    assert (meta["weights_dtype"], meta["state_dtype"]) == ("fp16", "bf16")
    assert meta["layout"]["words"] == 8 + 16 + 5
    from hierps.lifecycle._inspection import format_report, inspect_path

    text = format_report(inspect_path(tmp_path / "store"))
    assert "(53 floats a row, stored in 116 bytes: weights fp16, state bf16)" in text, text


@pytest.mark.parametrize(
    ("asked", "what"),
    [({"weights_dtype": "fp32"}, "weights_dtype"), ({"state_dtype": "fp32"}, "state_dtype")],
)
def test_a_table_cannot_be_reopened_with_another_precision(make_store, tmp_path, asked, what):
    store = make_store()
    store.table("t", DIM, optimizer="adam", weights_dtype="bf16", state_dtype="bf16")
    store.checkpoint()
    store.close()
    with hierps.Store(tmp_path / "store", device="cpu") as again:
        with pytest.raises(hierps.TableMismatchError, match=f"{what} 'bf16', asked for 'fp32'"):
            again.table("t", DIM, **asked)
        info = again.table("t", DIM)  # not naming the precisions keeps them
        assert (info.weights_dtype, info.state_dtype) == ("bf16", "bf16")


def test_a_tampered_layout_in_the_manifest_is_refused(make_store, tmp_path):
    store = make_store()
    store.table("t", DIM, optimizer="adam", weights_dtype="bf16")
    store.checkpoint()
    store.close()
    manifest = next((tmp_path / "store" / "checkpoints").glob("*.json"))
    body = read_json_checked(manifest)
    body["tables"]["t"]["weights_dtype"] = "fp32"  # rows written as bf16, claimed fp32
    write_json_atomic(manifest, body)  # a valid checksum: the layout check must catch it
    with pytest.raises(hierps.StoreFormatError, match="table 't': the manifest records the row layout"):
        hierps.Store(tmp_path / "store", device="cpu")
    with pytest.raises(hierps.StoreFormatError, match="row layout"):
        hierps.CheckpointReader(tmp_path / "store")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights_dtype": "fp8"}, "weights_dtype: expected one of fp32, bf16, fp16. Got 'fp8'"),
        ({"state_dtype": "fp16"}, "state_dtype: expected one of fp32, bf16. Got 'fp16' instead"),
        ({"optimizer": {"type": "ftrl", "params": {"alpha": 0}}}, "optimizer.params.alpha"),
        ({"optimizer": {"type": "ftrl", "params": {"lr": 0.1}}}, "ftrl takes no parameter 'lr'"),
    ],
)
def test_bad_precisions_and_ftrl_settings_are_refused(make_store, kwargs, message):
    store = make_store()
    with pytest.raises(hierps.ConfigError, match=message):
        store.table("t", DIM, **kwargs)


# -- where the precisions are named --------------------------------------------------------------------
def test_modules_and_the_deepspeed_section_name_the_precisions(make_store):
    from hierps.integrations.config import parse_section
    from hierps.integrations.deepspeed import swap_embeddings

    store = make_store()
    bag = hierps.EmbeddingBag(None, DIM, store=store, name="u", weights_dtype="bf16", state_dtype="bf16")
    assert (store.info(bag.table).weights_dtype, store.info(bag.table).state_dtype) == ("bf16", "bf16")
    section = parse_section({"path": "/x", "weights_dtype": "fp16", "optimizer": "ftrl"})
    original = nn.Embedding(10, DIM)
    model = nn.Sequential(original)
    swap_embeddings(
        model, {"0": original}, store, optimizer=section.optimizer, weights_dtype=section.weights_dtype
    )
    info = store.info("0")
    assert (info.optimizer.type, info.weights_dtype, info.state_dtype) == ("ftrl", "fp16", "fp32")
    # Rows 0..9 of the module, stored in fp16 (rounded to nearest).
    assert torch.equal(store.lookup("0", torch.arange(10)), original.weight.detach().half().float())
    with pytest.raises(hierps.ConfigError, match="hierarchical_ps.state_dtype: expected one of fp32, bf16"):
        parse_section({"path": "/x", "state_dtype": "fp16"})


# -- exports in fp16 -------------------------------------------------------------------------------------
def test_an_fp16_export_is_plain_zarr_and_serves_the_rounded_weights(make_store, tmp_path):
    import zarr

    from hierps import serving

    store = make_store(memory_budget="4KiB")
    store.table("t", DIM, optimizer="adagrad", weights_dtype="bf16")
    _train_store(store, _batches(6, seed=3))
    store.checkpoint()
    weights = store.lookup("t", torch.arange(VOCAB)).numpy()
    manifest = store.export(tmp_path / "full", dtype="fp16")
    assert manifest["tables"]["t"]["dtype"] == "fp16"
    group = zarr.open_group(str(tmp_path / "full"), mode="r")  # a plain Zarr reader
    keys, values = group["t/keys"][:], group["t/values"][:]
    assert values.dtype == np.float16
    np.testing.assert_array_equal(values, weights[keys].astype(np.float16))
    served = serving.open(tmp_path / "full").lookup("t", np.arange(VOCAB))
    np.testing.assert_array_equal(served, weights.astype(np.float16).astype(np.float32))
    # A delta in fp16 holds the rows whose fp16 weights changed, and serves the newest.
    _train_store(store, _batches(2, seed=4))
    store.checkpoint()
    later = store.lookup("t", torch.arange(VOCAB)).numpy()
    store.export(tmp_path / "delta", since=manifest["checkpoint"], dtype="fp16")
    both = serving.open(tmp_path / "full", deltas=[tmp_path / "delta"])
    np.testing.assert_array_equal(
        both.lookup("t", np.arange(VOCAB)), later.astype(np.float16).astype(np.float32)
    )
    # fp32 exports are as before: values float32.
    store.export(tmp_path / "f32")
    assert zarr.open_group(str(tmp_path / "f32"), mode="r")["t/values"].dtype == np.float32


def test_an_export_dtype_that_cannot_hold_the_weights_is_refused(make_store, tmp_path):
    store = make_store()
    store.table("t", 4, optimizer={"type": "sgd", "params": {"lr": 0.1}})
    store.write("t", [1, 2], np.array([[1e5, 0, 0, 0], [1, 2, 3, 4]], np.float32))
    store.checkpoint()
    with pytest.raises(hierps.ConfigError, match="bf16 has no Zarr v3 data type"):
        store.export(tmp_path / "a", dtype="bf16")
    with pytest.raises(hierps.ConfigError, match="a weight of magnitude 100000 is beyond the range of fp16"):
        store.export(tmp_path / "b", dtype="fp16")
    assert not (tmp_path / "b").exists()


def test_a_sharded_store_resharded_keeps_the_precisions_and_the_rows(tmp_path):
    from thread_world import ThreadTransport, run_ranks

    keys = np.arange(-40, 40, dtype=np.int64) * 7919
    weights = np.random.default_rng(5).normal(0, 1, (len(keys), DIM)).astype(np.float32)

    def write(transport: ThreadTransport) -> None:
        store = hierps.ShardedStore(tmp_path / "s", transport, device="cpu")
        try:
            store.table("t", DIM, optimizer="adam", weights_dtype="fp16", state_dtype="bf16")
            store.write("t", keys, weights)
            store.checkpoint("two")
        finally:
            store.close()

    def reopen(transport: ThreadTransport) -> tuple[tuple[str, str], np.ndarray]:
        store = hierps.ShardedStore(tmp_path / "s", transport, device="cpu")
        try:
            info = store.table("t", DIM)
            return (info.weights_dtype, info.state_dtype), store.lookup("t", keys).numpy()
        finally:
            store.close()

    run_ranks(2, write)
    for dtypes, got in run_ranks(3, reopen):  # three ranks: every row moves to its new owner
        assert dtypes == ("fp16", "bf16")
        np.testing.assert_array_equal(got, weights.astype(np.float16).astype(np.float32))


def test_the_sharded_fast_path_trains_compact_rows_as_one_process(tmp_path):
    from thread_world import ThreadTransport, run_ranks

    keys = (np.arange(120, dtype=np.int64) - 40) * 7919
    rng = np.random.default_rng(7)
    batches = [{t: keys[(rng.zipf(1.3, 12) - 1) % len(keys)] for t in "abc"} for _ in range(8)]
    # a and b pool together in bf16; c shares their row width in fp32 words but not their layout.
    tables = {
        "a": {"weights_dtype": "bf16", "state_dtype": "bf16"},
        "b": {"weights_dtype": "bf16", "state_dtype": "bf16"},
        "c": {"weights_dtype": "fp32", "state_dtype": "fp32"},
    }
    dims = {"a": 8, "b": 8, "c": 8}  # bf16 adagrad at dim 8: 4 + 4 + 5 words; fp32 sgd: 8 + 5

    def train(store, rank: int, world: int) -> dict[str, np.ndarray]:
        opt = {"a": "adagrad", "b": "adagrad", "c": "sgd"}
        bags = {
            t: hierps.EmbeddingBag(
                None,
                dims[t],
                mode="sum",
                store=store,
                name=t,
                optimizer={"type": opt[t], "params": {"lr": 0.3}},
                **tables[t],
            )
            for t in tables
        }
        share = 12 // world
        mine = [{t: v[rank * share : (rank + 1) * share] for t, v in b.items()} for b in batches]
        for p in range(0, len(mine), 4):
            store.begin_pass(mine[p : p + 4])
            for batch in mine[p : p + 4]:
                offsets = torch.arange(share)
                outs = [bags[t](torch.from_numpy(batch[t]), offsets) for t in tables]
                x = torch.cat([outs[0] * outs[1], outs[2]], dim=1)
                (x.sum(1) + 0.5 * x.pow(2).sum(1)).mean().backward()
                store.step()
            store.end_pass()
        return {t: store.lookup(t, torch.from_numpy(keys)).numpy() for t in tables}

    with hierps.Store(tmp_path / "one", device="cpu", memory_budget="4KiB") as one:
        ref = train(one, 0, 1)
        assert one.info("a").words == one.info("c").words  # one arena holds both layouts

    def rank_main(transport: ThreadTransport) -> dict[str, np.ndarray]:
        store = hierps.ShardedStore(tmp_path / "many", transport, device="cpu", memory_budget="4KiB")
        try:
            return train(store, transport.rank, 2)
        finally:
            store.close()

    for got in run_ranks(2, rank_main):
        for t in tables:
            # Sums in another order can move a value by one float32 ulp, and its stochastic rounding
            # then (rarely) by one bf16 ulp; everything else is equal.
            differ = got[t] != ref[t]
            assert differ.mean() < 0.02, t
            np.testing.assert_allclose(got[t], ref[t], rtol=2.0**-7, atol=1e-6, err_msg=t)
