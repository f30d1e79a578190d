"""One suite of behaviour, run against every store that implements ``hierps.StoreInterface``.

In the style of zarr-python's ``StoreTests``: :class:`StoreInterfaceTests` holds the tests and a
``make_store(path, **settings)`` hook; each subclass builds one kind of store:

- :class:`TestStore`: ``hierps.Store``;
- :class:`TestShardedStore`: ``hierps.ShardedStore`` over one rank, through :class:`LoopbackTransport`
  (a world of one: every collective hands the rank its own data back).

Where a plain-PyTorch result exists it is the oracle: ``torch.optim`` steps for ``gather`` /
``step``, ``torch.nn.EmbeddingBag`` for the modules, numpy counts for ``observe``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from oracle import TORCH_OPTIMIZERS, TinyModel, make_optimizers, train, twin_models, zipf_batches
from torch import nn

import hierps
import hierps.interface
from hierps.sharding import Transport

DIM = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}
# Keys far apart, negative ones included: raw int64 feature ids, not row positions.
KEYS = [-(2**40), -7, 0, 3, 10, 42, 1_000_003, 2**50]


def _keys(store: hierps.StoreInterface, keys: Any) -> torch.Tensor:
    """Sorted unique int64 keys on the store's device, as ``gather`` takes them."""
    return torch.unique(torch.as_tensor(keys, dtype=torch.int64)).to(store.device)


def _weights(n: int, dim: int = DIM, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def _loss(rows: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient depends on the rows themselves (so that every step differs)."""
    return (rows * coef).sum() + 0.5 * rows.pow(2).sum()


class LoopbackTransport:
    """The collectives of a world of one rank: whatever is sent to all ranks comes back to it.

    Implements :class:`hierps.sharding.Transport`. Received tensors are copies, as a real
    collective hands over new tensors; counts are checked, as a real collective would.
    """

    rank = 0
    world_size = 1

    def all_to_all(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        assert send_counts == [send.shape[0]], (send_counts, tuple(send.shape))
        return send.clone(), list(send_counts)

    def all_to_all_known(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        assert send_counts == recv_counts == [send.shape[0]], (send_counts, recv_counts, tuple(send.shape))
        return send.clone()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def barrier(self) -> None:
        return None


def test_loopback_transport_has_every_method_of_the_protocol():
    wanted = {n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_")}
    assert wanted == {"all_to_all", "all_to_all_known", "all_reduce_sum", "barrier"}
    assert all(callable(getattr(LoopbackTransport, n, None)) for n in wanted)
    _: Transport = LoopbackTransport()  # and it type-checks as one


class StoreInterfaceTests:
    """The behaviour every ``StoreInterface`` has. Subclasses implement :meth:`make_store`."""

    store_type: type

    # -- hooks ------------------------------------------------------------------------------------
    def make_store(self, path: Path, **settings: Any) -> hierps.StoreInterface:
        """A store in directory ``path`` (new, or reopened when it holds one) with ``settings``."""
        raise NotImplementedError

    def read_counters(self, store: hierps.StoreInterface, table: str, keys: Any) -> dict[str, np.ndarray]:
        """The show / click counters of ``keys``, read from the store that holds their rows."""
        raise NotImplementedError

    @pytest.fixture(autouse=True)
    def _close_stores(self):
        self._opened: list[hierps.StoreInterface] = []
        yield
        for store in self._opened:
            store.close()

    def open(self, path: Path, **settings: Any) -> hierps.StoreInterface:
        settings.setdefault("device", "cpu")
        store = self.make_store(path, **settings)
        self._opened.append(store)
        return store

    # -- the interface ----------------------------------------------------------------------------
    def test_is_a_store_interface(self, tmp_path):
        store = self.open(tmp_path / "s")
        assert isinstance(store, self.store_type)
        assert isinstance(store, hierps.StoreInterface)

    def test_conforms_to_the_protocol_of_hierps_interface(self, tmp_path):
        store = self.open(tmp_path / "s")
        assert isinstance(store, hierps.interface.StoreInterface)
        assert store.device == torch.device("cpu")
        assert Path(store.path) == tmp_path / "s"
        assert store.tables == {}

    # -- tables -----------------------------------------------------------------------------------
    def test_table_is_created_then_reopened(self, tmp_path):
        store = self.open(tmp_path / "s")
        info = store.table("t", DIM)
        assert info.dim == DIM
        assert set(store.tables) == {"t"}
        again = store.table("t", DIM)
        assert again.dim == DIM
        assert set(store.tables) == {"t"}
        with pytest.raises(hierps.TableMismatchError):
            store.table("t", DIM + 1)
        with pytest.raises(hierps.TableMismatchError):
            store.table("t", DIM, optimizer={"type": "sgd", "params": {"lr": 0.1}})
        assert store.tables["t"].dim == DIM

    def test_table_is_reopened_from_a_checkpoint(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        store.checkpoint()
        store.close()
        store = self.open(tmp_path / "s")
        assert set(store.tables) == {"t"}
        assert store.tables["t"].dim == DIM
        with pytest.raises(hierps.TableMismatchError):
            store.table("t", DIM * 2)

    # -- rows -------------------------------------------------------------------------------------
    def test_write_then_lookup_returns_the_written_weights(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        w = _weights(len(KEYS))
        store.write("t", torch.tensor(KEYS), w)
        assert torch.equal(store.lookup("t", torch.tensor(KEYS)), w)
        # Any order, repeats, any shape of ids, lists and arrays too.
        ids = torch.tensor([[42, -7, 42], [2**50, 0, -(2**40)]])
        expect = w[torch.tensor([[5, 1, 5], [7, 2, 0]])]
        got = store.lookup("t", ids)
        assert got.shape == (2, 3, DIM)
        assert got.dtype == torch.float32
        assert torch.equal(got, expect)
        assert torch.equal(store.lookup("t", [3, 10]), w[3:5])
        assert torch.equal(store.lookup("t", np.array([10, 3])), w[[4, 3]])

    def test_write_overwrites_weights(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        store.write("t", torch.tensor(KEYS), _weights(len(KEYS), seed=1))
        w2 = _weights(3, seed=2)
        store.write("t", torch.tensor([10, -7, 2**50]), w2)
        got = store.lookup("t", torch.tensor([-7, 10, 2**50]))
        assert torch.equal(got, w2[[1, 0, 2]])

    def test_write_with_weights_of_the_wrong_shape_raises_config_error(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        with pytest.raises(hierps.ConfigError):
            store.write("t", torch.tensor([1, 2, 3]), torch.zeros(3, DIM + 1))
        with pytest.raises(hierps.ConfigError):
            store.write("t", torch.tensor([1, 2, 3]), torch.zeros(2, DIM))

    def test_unknown_keys_read_the_initializers_rows_deterministically(self, tmp_path):
        a = self.open(tmp_path / "a", seed=5)
        b = self.open(tmp_path / "b", seed=5)
        c = self.open(tmp_path / "c", seed=6)
        ids = torch.arange(-2048, 2048) * 7919
        for s in (a, b, c):
            s.table("t", 8)
        rows_a = a.lookup("t", ids)
        assert rows_a.shape == (len(ids), 8)
        assert torch.equal(a.lookup("t", ids), rows_a)  # reading has no side effects
        assert torch.equal(b.lookup("t", ids.flip(0)), rows_a.flip(0))  # same seed: same rows
        assert not torch.equal(c.lookup("t", ids), rows_a)  # another seed: other rows
        # "normal" is nn.Embedding's N(0, 1); every key its own row.
        assert abs(float(rows_a.mean())) < 0.05
        assert abs(float(rows_a.std()) - 1.0) < 0.05
        assert torch.unique(rows_a, dim=0).shape[0] == len(ids)

    def test_initializer_of_a_table(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("z", DIM, initializer="zeros")
        store.table("u", DIM, initializer={"type": "uniform", "params": {"low": -0.1, "high": 0.1}})
        ids = torch.arange(1000)
        assert torch.equal(store.lookup("z", ids), torch.zeros(1000, DIM))
        u = store.lookup("u", ids)
        assert float(u.min()) >= -0.1
        assert float(u.max()) <= 0.1
        assert float(u.std()) > 0.05  # spread over the interval, not a constant

    def test_lookup_creates_no_rows(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        store.lookup("t", torch.arange(100))
        assert store.num_rows("t") == {"device": 0, "memory": 0, "ssd": 0}

    # -- training ---------------------------------------------------------------------------------
    def _written(self, tmp_path, optimizer):
        """A store with table "t" trained by ``optimizer`` and the rows of KEYS written:
        (store, keys, their weights)."""
        store = self.open(tmp_path / "s")
        store.table("t", DIM, optimizer=optimizer)
        keys = _keys(store, KEYS)
        w = _weights(len(keys))
        store.write("t", keys, w)
        return store, keys, w

    def _with_reference(self, tmp_path, opt):
        """A store with table "t" of KEYS written (optimizer ``opt``) and the plain-PyTorch table
        and optimizer holding the same rows: (store, keys, weights, reference, its optimizer)."""
        torch_opt, params = TORCH_OPTIMIZERS[opt]
        store, keys, w = self._written(tmp_path, {"type": opt, "params": params})
        ref = nn.Embedding(len(keys), DIM, sparse=True, _weight=w.clone())
        return store, keys, w, ref, torch_opt(ref.parameters(), **params)

    @pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
    def test_gather_backward_step_equals_a_torch_optimizer_step(self, tmp_path, opt):
        store, keys, w, ref, ref_opt = self._with_reference(tmp_path, opt)
        coef = _weights(len(keys), seed=3)
        # Two steps (optimizer state carries over), the second on some rows only.
        for positions in (torch.arange(len(keys)), torch.tensor([1, 2, 5])):
            rows = store.gather("t", keys[positions], requires_grad=True)
            assert rows.requires_grad and rows.is_leaf
            torch.testing.assert_close(rows.detach(), ref.weight.detach()[positions], **TOL)
            _loss(rows, coef[positions]).backward()
            store.step()
            _loss(ref(positions), coef[positions]).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(store.lookup("t", keys), ref.weight.detach(), **TOL)
        assert not torch.equal(store.lookup("t", keys), w)

    def test_two_gathers_before_one_step_sum_their_gradients(self, tmp_path):
        store, keys, w, ref, ref_opt = self._with_reference(tmp_path, "adagrad")
        coef = _weights(len(keys), seed=4)
        first, second = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([3, 4, 5, 6])  # 3, 4 in both
        for positions in (first, second):
            _loss(store.gather("t", keys[positions], requires_grad=True), coef[positions]).backward()
            _loss(ref(positions), coef[positions]).backward()
        store.step()
        ref_opt.step()
        torch.testing.assert_close(store.lookup("t", keys), ref.weight.detach(), **TOL)

    def test_gather_without_grad_reads_the_rows_and_steps_nothing(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        keys = _keys(store, KEYS)
        w = _weights(len(keys))
        store.write("t", keys, w)
        rows = store.gather("t", keys, requires_grad=False)
        assert not rows.requires_grad
        assert torch.equal(rows, w)
        store.step()
        assert torch.equal(store.lookup("t", keys), w)

    def test_zero_grad_drops_the_gathered_rows(self, tmp_path):
        store, keys, w = self._written(tmp_path, {"type": "sgd", "params": {"lr": 0.5}})
        _loss(store.gather("t", keys, requires_grad=True), torch.ones(len(keys), DIM)).backward()
        store.zero_grad()
        store.step()
        assert torch.equal(store.lookup("t", keys), w)
        # The next gather steps as usual: w - lr * (1 + w).
        _loss(store.gather("t", keys, requires_grad=True), torch.ones(len(keys), DIM)).backward()
        store.step()
        torch.testing.assert_close(store.lookup("t", keys), w - 0.5 * (1 + w), **TOL)

    # -- passes -----------------------------------------------------------------------------------
    def _twins(self, tmp_path, seed):
        """Batches, a plain-PyTorch reference trained on them (and its losses), and two stores of
        2 KiB of RAM each with a twin model and its dense optimizer, to train the same batches."""
        vocab, dim = 300, 8
        batches = zipf_batches(12, batch=8, bag=4, vocab=vocab, seed=seed, bags=False)
        a, b = (
            self.open(tmp_path / "a", memory_budget="2KiB"),
            self.open(tmp_path / "b", memory_budget="2KiB"),
        )
        ref, twin_a = twin_models("plain", vocab, dim, a, "adagrad")
        _, twin_b = twin_models("plain", vocab, dim, b, "adagrad")
        sparse_ref, dense_ref, dense_a = make_optimizers(ref, twin_a, "adagrad")
        dense_b = torch.optim.Adam(twin_b.head.parameters(), lr=0.01)
        ref_losses = train(ref, sparse_ref, dense_ref, batches)
        return batches, ref, ref_losses, (a, twin_a, dense_a), (b, twin_b, dense_b)

    def test_training_in_passes_equals_training_without(self, tmp_path):
        batches, ref, ref_losses, passes, plain = self._twins(tmp_path, seed=2)
        (with_passes, twin_p, dense_p), (without, twin_n, dense_n) = passes, plain
        losses_n = train(twin_n, None, dense_n, batches, store=without)
        losses_p = []
        for start in range(0, len(batches), 4):
            group = batches[start : start + 4]
            with with_passes.run_pass([{"t": b.ids} for b in group]):
                losses_p += train(twin_p, None, dense_p, group, store=with_passes)
        assert losses_p == pytest.approx(losses_n, rel=1e-6, abs=1e-7)
        assert losses_p == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        ids = torch.arange(300)
        torch.testing.assert_close(with_passes.lookup("t", ids), without.lookup("t", ids), **TOL)
        torch.testing.assert_close(with_passes.lookup("t", ids), ref.emb.weight.detach(), **TOL)

    def test_prefetch_then_begin_pass_gives_the_same_rows(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        keys = _keys(store, torch.arange(0, 400, 3))
        w = _weights(len(keys))
        store.write("t", keys, w)
        first = [{"t": keys[:60]}, {"t": keys[30:90]}]
        second = [{"t": keys[50:120]}, {"t": keys[100:]}]
        with store.run_pass(first):
            store.prefetch(second)  # during a pass: read ahead now
            assert torch.equal(store.gather("t", keys[:60], requires_grad=False), w[:60])
        store.begin_pass(second)
        try:
            assert torch.equal(store.gather("t", keys[50:120], requires_grad=False), w[50:120])
            assert torch.equal(store.gather("t", keys[100:], requires_grad=False), w[100:])
        finally:
            store.end_pass()
        store.prefetch(first)  # between passes: read ahead with the next begin_pass
        with store.run_pass(first):
            assert torch.equal(store.gather("t", keys[:90], requires_grad=False), w[:90])
        assert torch.equal(store.lookup("t", keys), w)

    def test_training_with_prefetch_equals_training_without(self, tmp_path):
        batches, ref, _, (ahead, twin_a, dense_a), (plain, twin_p, dense_p) = self._twins(tmp_path, seed=4)
        passes = [batches[i : i + 4] for i in range(0, len(batches), 4)]
        for i, group in enumerate(passes):
            with ahead.run_pass([{"t": b.ids} for b in group]):
                if i + 1 < len(passes):
                    ahead.prefetch([{"t": b.ids} for b in passes[i + 1]])
                train(twin_a, None, dense_a, group, store=ahead)
            with plain.run_pass([{"t": b.ids} for b in group]):
                train(twin_p, None, dense_p, group, store=plain)
        ids = torch.arange(300)
        torch.testing.assert_close(ahead.lookup("t", ids), plain.lookup("t", ids), **TOL)
        torch.testing.assert_close(ahead.lookup("t", ids), ref.emb.weight.detach(), **TOL)

    # -- durability -------------------------------------------------------------------------------
    def test_checkpoint_close_reopen_gives_the_same_rows(self, tmp_path):
        # ~20 rows of RAM for 300 rows: most rows are read back from the SSD tier.
        store = self.open(tmp_path / "s", memory_budget="2KiB")
        store.table("t", 8, optimizer={"type": "adagrad", "params": {"lr": 0.3}})
        keys = _keys(store, torch.arange(300) * 13 - 1000)
        store.write("t", keys, _weights(len(keys), dim=8))
        sub = keys[::3].contiguous()
        _loss(store.gather("t", sub, requires_grad=True), torch.ones(len(sub), 8)).backward()
        store.step()
        ids = torch.cat([keys, torch.tensor([7, 2**45])])  # two keys never written
        before = store.lookup("t", ids)
        ckpt = store.checkpoint("mine")
        store.write("t", keys[:5], torch.zeros(5, 8))  # after the checkpoint: not durable
        store.close()
        store = self.open(tmp_path / "s", memory_budget="2KiB")
        assert store.tables["t"].dim == 8
        assert [c["id"] for c in store.list_checkpoints()] == [ckpt]
        assert torch.equal(store.lookup("t", ids), before)
        # The optimizer state came back too: the next step equals one on a store that never closed.
        twin = self.open(tmp_path / "twin", memory_budget="2KiB")
        twin.table("t", 8, optimizer={"type": "adagrad", "params": {"lr": 0.3}})
        twin.write("t", keys, _weights(len(keys), dim=8))
        _loss(twin.gather("t", sub, requires_grad=True), torch.ones(len(sub), 8)).backward()
        twin.step()
        for s in (store, twin):
            _loss(s.gather("t", sub, requires_grad=True), torch.ones(len(sub), 8)).backward()
            s.step()
        torch.testing.assert_close(store.lookup("t", keys), twin.lookup("t", keys), rtol=0, atol=0)

    def test_restore_returns_to_a_checkpoint(self, tmp_path):
        store, keys, w = self._written(tmp_path, {"type": "sgd", "params": {"lr": 0.5}})
        first = store.checkpoint("first")
        _loss(store.gather("t", keys, requires_grad=True), torch.ones(len(keys), DIM)).backward()
        store.step()
        trained = store.lookup("t", keys)
        second = store.checkpoint()
        new_key = torch.tensor([123_456])
        fresh = store.lookup("t", new_key)  # the initializer's row
        store.write("t", new_key, torch.full((1, DIM), 9.0))
        store.write("t", keys, torch.zeros(len(keys), DIM))
        assert store.restore(first) == first
        assert torch.equal(store.lookup("t", keys), w)
        assert torch.equal(store.lookup("t", new_key), fresh)
        assert store.restore() == second  # the latest
        assert torch.equal(store.lookup("t", keys), trained)
        assert store.restore("first") == first  # by tag
        assert torch.equal(store.lookup("t", keys), w)

    def test_list_checkpoints_lists_ids_in_order(self, tmp_path):
        store = self.open(tmp_path / "s", keep_checkpoints=3)
        assert store.list_checkpoints() == []
        store.table("t", DIM)
        made = []
        for i, tag in enumerate(["a", None, "c", "d"]):
            store.write("t", torch.tensor([i]), torch.ones(1, DIM))
            made.append(store.checkpoint(tag))
        assert made == sorted(made)
        listed = store.list_checkpoints()
        assert [c["id"] for c in listed] == made[1:]  # oldest first; beyond keep_checkpoints, retired
        assert [c["tag"] for c in listed] == [None, "c", "d"]
        assert all(set(c) >= {"id", "tag", "created"} for c in listed)

    def test_num_rows_counts_rows_per_tier(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        rows = store.num_rows("t")
        assert rows == {"device": 0, "memory": 0, "ssd": 0}
        keys = _keys(store, torch.arange(50))
        store.write("t", keys, _weights(50))
        store.checkpoint()
        rows = store.num_rows("t")
        assert set(rows) == {"device", "memory", "ssd"}
        assert all(isinstance(n, int) and n >= 0 for n in rows.values())
        assert rows["ssd"] == 50  # durable: every row on disk

    # -- modules ----------------------------------------------------------------------------------
    @pytest.mark.parametrize(("opt", "mode"), [("adagrad", "sum"), ("sgd", "mean")])
    def test_embedding_bag_trains_like_torch(self, tmp_path, opt, mode):
        vocab, dim = 200, 8
        store = self.open(tmp_path / "s", memory_budget="2KiB")
        torch.manual_seed(1)
        ref = TinyModel(nn.EmbeddingBag(vocab, dim, mode=mode, sparse=True), dim)
        twin = copy.deepcopy(ref)
        params = TORCH_OPTIMIZERS[opt][1]
        twin.emb = hierps.EmbeddingBag(
            vocab, dim, mode=mode, store=store, name="bag", optimizer={"type": opt, "params": params}
        )
        store.write("bag", torch.arange(vocab), ref.emb.weight.detach())
        batches = zipf_batches(8, batch=8, bag=4, vocab=vocab, seed=6)
        sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
        ref_losses = train(ref, sparse_ref, dense_ref, batches)
        twin_losses = train(twin, None, dense_twin, batches, store=store, pass_batches=4)
        assert twin_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(twin.emb.lookup(torch.arange(vocab)), ref.emb.weight.detach(), **TOL)
        for a, b in zip(ref.head.parameters(), twin.head.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), **TOL)

    # -- admission --------------------------------------------------------------------------------
    def test_admission_gives_a_key_its_row_at_its_min_count_th_sighting(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM, optimizer={"type": "sgd", "params": {"lr": 0.5}}, admission={"min_count": 3})
        keys = _keys(store, [-7, 3, 2**40])
        init = store.lookup("t", keys)  # the initializer's rows
        rows = store.gather("t", keys, requires_grad=True, counts=torch.tensor([1, 2, 3]))
        assert torch.equal(rows.detach(), init)
        _loss(rows, torch.ones(3, DIM)).backward()
        store.step()
        got = store.lookup("t", keys)
        assert torch.equal(got[:2], init[:2])  # seen once and twice: pending, no row, no step
        torch.testing.assert_close(got[2], init[2] - 0.5 * (1 + init[2]), **TOL)  # admitted, stepped
        # The key seen twice earns its row at its third sighting, and steps from then on.
        _loss(store.gather("t", keys[1:2], requires_grad=True), torch.ones(1, DIM)).backward()
        store.step()
        got = store.lookup("t", keys)
        assert torch.equal(got[0], init[0])
        torch.testing.assert_close(got[1], init[1] - 0.5 * (1 + init[1]), **TOL)

    # -- counters ---------------------------------------------------------------------------------
    def test_observe_counts_shows_and_clicks(self, tmp_path):
        store = self.open(tmp_path / "s")
        store.table("t", DIM)
        keys = np.array([-5, 1, 2, 3, 2**40], dtype=np.int64)
        store.write("t", keys, _weights(len(keys)))
        ids = np.array([1, 1, 2, 3, 3, 3, 2**40, 1], dtype=np.int64)
        clicks = np.array([1, 0, 1, 0, 0, 1, 1, 1], dtype=np.float32)
        store.observe("t", torch.from_numpy(ids), torch.from_numpy(clicks))
        store.observe("t", torch.tensor([3, -5]))  # impressions only
        pos = np.searchsorted(keys, ids)
        shows = np.bincount(pos, minlength=len(keys)) + np.isin(keys, [3, -5])
        clicked = np.bincount(pos, weights=clicks, minlength=len(keys))
        got = self.read_counters(store, "t", keys)
        np.testing.assert_array_equal(got["show"], shows.astype(np.float32))
        np.testing.assert_array_equal(got["click"], clicked.astype(np.float32))


class TestStore(StoreInterfaceTests):
    store_type = hierps.Store

    def make_store(self, path: Path, **settings: Any) -> hierps.Store:
        return hierps.Store(path, **settings)

    def read_counters(self, store, table, keys):
        return store.counters(table, keys)


class TestShardedStore(StoreInterfaceTests):
    store_type = hierps.ShardedStore

    def make_store(self, path: Path, **settings: Any) -> hierps.ShardedStore:
        return hierps.ShardedStore(path, LoopbackTransport(), **settings)

    def read_counters(self, store, table, keys):
        return store.counters(table, keys)  # asked of the keys' owners
