"""Announced mini-batches are translated ahead; training through the plans is the generic training.

The planned path (ids deduplicated and translated into working-set slots before the forward,
counters recorded lazily, one fused optimizer step for all tables of a width) must give exactly
the rows, optimizer state and counters of the generic path (unique + search per forward), and
must never use a plan for ids that are not the announced ones.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

import hierps
from hierps._store import store_parts

DIMS = {"a": 8, "b": 8, "c": 4}  # a and b share an arena and are updated together
KEYS = np.arange(600, dtype=np.int64) * 7_919 - 1_000_000
UNUSED = torch.tensor([123_456_789])  # an id no forward uses


def _unmatched(group: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The pass's batches with one extra id each: the same pass, but no forward matches a plan."""
    return [{t: torch.cat([ids, UNUSED]) for t, ids in b.items()} for b in group]


def _batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [
        {t: torch.from_numpy(KEYS[(rng.zipf(1.3, size=48) - 1) % len(KEYS)]) for t in DIMS} for _ in range(n)
    ]


def _model(
    store: hierps.Store, optimizer: dict, eviction: dict | None, mode: str = "sum"
) -> tuple[dict, nn.Linear]:
    torch.manual_seed(0)
    bags = {
        t: hierps.EmbeddingBag(
            None, d, mode=mode, store=store, name=t, optimizer=optimizer, eviction=eviction
        )
        for t, d in DIMS.items()
    }
    return bags, nn.Linear(sum(DIMS.values()), 1)


def _step(store, bags, head, opt, batch, offsets) -> None:
    out = torch.cat([bags[t](batch[t], offsets) for t in DIMS], dim=1)
    head(out).square().mean().backward()
    opt.step()
    opt.zero_grad()
    store.step()


def _train(store, passes, *, planned: bool, optimizer: dict, eviction: dict | None = None):
    """Train pass by pass; ``planned`` False announces batches no forward matches (generic path)."""
    bags, head = _model(store, optimizer, eviction)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    offsets = torch.arange(0, 48, 2)
    announced = passes if planned else [_unmatched(g) for g in passes]
    for p, group in enumerate(passes):
        store.begin_pass(announced[p])
        if p + 1 < len(passes):
            store.prefetch(announced[p + 1])
        for batch in group:
            _step(store, bags, head, opt, batch, offsets)
        assert (store._passes.batches.cursor.get("a", 0) == len(group)) == planned
        store.end_pass()
    store.checkpoint()
    return {t: store._core.whole_rows(t, KEYS) for t in DIMS}


@pytest.mark.parametrize(
    "optimizer",
    [{"type": "adagrad", "params": {"lr": 0.1}}, {"type": "adam", "params": {"lr": 0.01}}],
    ids=["adagrad", "adam"],
)
@pytest.mark.parametrize("decay", [1.0, 0.5])
@pytest.mark.parametrize("pipeline", [True, False], ids=["piped", "sync"])
def test_planned_training_equals_generic_training(make_store, optimizer, decay, pipeline):
    passes = [_batches(3, seed=p) for p in range(5)]
    eviction = {"decay": decay}
    generic = make_store("generic", memory_budget="4KiB", pipeline=False)
    planned = make_store("planned", memory_budget="4KiB", pipeline=pipeline)
    want = _train(generic, passes, planned=False, optimizer=optimizer, eviction=eviction)
    got = _train(planned, passes, planned=True, optimizer=optimizer, eviction=eviction)
    for t in DIMS:  # weights, optimizer state and counters, exactly
        np.testing.assert_array_equal(got[t], want[t])
    assert store_parts(planned).core.memory.evicted_rows > 0


def _train_tables(store, passes, planned: bool, forwards, keys: np.ndarray) -> dict[str, np.ndarray]:
    """Train each pass's mini-batches through ``forwards`` ({table: batch ids -> output}), the loss
    weighting each table's output apart; ``planned`` False announces batches no forward matches
    (the generic path). -> each table's whole rows of ``keys`` after a checkpoint."""
    for group in passes:
        store.begin_pass(group if planned else _unmatched(group))
        for batch in group:
            outs = [forward(batch[t]) for t, forward in forwards.items()]
            sum((o * (i + 1)).square().sum() for i, o in enumerate(outs)).backward()
            store.step()
        assert all((store._passes.batches.cursor.get(t, 0) == len(group)) == planned for t in forwards)
        store.end_pass()
    store.checkpoint()
    return {t: store._core.whole_rows(t, keys) for t in forwards}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("per_bag", [1, 3])
def test_tables_sharing_offsets_through_plans_equal_generic_training(make_store, optimizer, per_bag):
    """Tables of one width that share one offsets tensor (one id a bag, as in the demo DLRM, or
    several) are pooled at once, and each key's gradient is summed from its ids' bags in the order
    sorted ahead: the rows, optimizer state and counters are those of the generic path, bit for
    bit, with rows spilling from RAM."""
    rng = np.random.default_rng(5)
    names = ["u", "v", "w"]
    passes = [
        [{t: torch.from_numpy(KEYS[(rng.zipf(1.3, size=48) - 1) % 60]) for t in names} for _ in range(3)]
        for _ in range(4)
    ]
    opt = {"type": optimizer, "params": {"lr": 0.01 if optimizer == "adam" else 0.1}}
    offsets = torch.arange(0, 48, per_bag)
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}", memory_budget="4KiB", pipeline=planned)
        torch.manual_seed(0)
        mods = {
            t: hierps.EmbeddingBag(None, 8, mode="sum", store=store, name=t, optimizer=opt) for t in names
        }
        forwards = {t: partial(mods[t], offsets=offsets) for t in names}
        results.append(_train_tables(store, passes, planned, forwards, KEYS[:60]))
    assert store_parts(store).trainer._pool_alike
    for t in names:
        np.testing.assert_array_equal(results[1][t], results[0][t], err_msg=t)


def test_forwards_go_through_the_plans(make_store):
    store = make_store(pipeline=True)
    passes = [_batches(2, seed=p) for p in range(3)]
    bags, _ = _model(store, {"type": "sgd", "params": {"lr": 0.1}}, None)
    offsets = torch.arange(0, 48, 2)
    for p, group in enumerate(passes):
        store.begin_pass(group)
        if p + 1 < len(passes):
            store.prefetch(passes[p + 1])
        for batch in group:
            for t in DIMS:
                bags[t](batch[t], offsets).sum().backward()
            store.step()
        assert store._passes.batches is not None and store._passes.batches.cursor == {t: 2 for t in DIMS}
        assert store._passes.batches.batches == [None, None]  # each mini-batch's plans let go once run
        store.end_pass()


def test_ids_that_were_not_announced_take_the_generic_path(make_store):
    passes = [_batches(2, seed=p) for p in range(4)]
    # What really runs: the announced tensors' contents changed in place after the announcement,
    # one mini-batch swapped for another, and an extra unannounced forward.
    ran = [[{t: ids.clone() for t, ids in b.items()} for b in group] for group in passes]
    ran[1][0]["a"][:5] = torch.from_numpy(KEYS[590:595])
    ran[2][0], ran[2][1] = ran[2][1], ran[2][0]
    generic = make_store("generic", pipeline=False)
    want = _train(generic, ran, planned=False, optimizer={"type": "adagrad", "params": {"lr": 0.1}})
    store = make_store("planned")
    bags, head = _model(store, {"type": "adagrad", "params": {"lr": 0.1}}, None)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    offsets = torch.arange(0, 48, 2)
    announced = [[{t: ids.clone() for t, ids in b.items()} for b in group] for group in passes]
    for p, group in enumerate(ran):
        store.begin_pass(announced[p])
        if p + 1 < len(passes):
            store.prefetch(announced[p + 1])
        announced[p][0]["a"].copy_(ran[p][0]["a"])  # the caller reuses its buffer after announcing
        for batch in group:
            _step(store, bags, head, opt, batch, offsets)
        store.end_pass()
    store.checkpoint()
    for t in DIMS:
        np.testing.assert_array_equal(store._core.whole_rows(t, KEYS), want[t])


def test_non_finite_gradient_of_one_fused_table_changes_no_row(make_store):
    store = make_store()
    bags, _ = _model(store, {"type": "adagrad", "params": {"lr": 0.1}}, None)
    batch = _batches(1, seed=0)[0]
    offsets = torch.arange(0, 48, 2)
    store.begin_pass([batch])
    before = {t: store._core.whole_rows(t, KEYS) for t in DIMS}
    loss = bags["a"](batch["a"], offsets).sum() + bags["b"](batch["b"], offsets).sum() * float("inf")
    loss.backward()
    with pytest.raises(hierps.NonFiniteGradientError, match=r"\['b'\]"):
        store.step()
    for t in DIMS:
        np.testing.assert_array_equal(
            store._core.whole_rows(t, KEYS)[:, : DIMS[t] * 2], before[t][:, : DIMS[t] * 2]
        )


@pytest.mark.parametrize("bag", [1, 3], ids=["one-hot", "bags-of-3"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooled_tables_backpropagate_one_by_one(make_store, mode, bag):
    """Tables pooled together still take separate backward calls, one loss per table."""
    passes = [_batches(2, seed=p) for p in range(3)]
    offsets = torch.arange(0, 48, bag)
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}", memory_budget="2KiB")
        bags, _ = _model(store, {"type": "adam", "params": {"lr": 0.01}}, None, mode=mode)
        for group in passes:
            store.begin_pass(group if planned else _unmatched(group))
            for batch in group:
                for i, t in enumerate(DIMS):
                    (bags[t](batch[t], offsets).square().sum() * (i + 1)).backward()
                    if planned and t == "a":
                        assert (
                            len(store._passes.batches.groups) == 1
                        )  # a gathered b's rows with its own; b has not taken them
                store.step()
            assert not store._passes.batches.groups  # let go once every table has taken its rows
            store.end_pass()
        results.append({t: store._core.whole_rows(t, KEYS) for t in DIMS})
    for t in DIMS:
        np.testing.assert_array_equal(results[1][t], results[0][t])


def _planned_equals_generic(make_store, passes, loss) -> None:
    """Train ``passes`` planned and generic with ``loss(bags, batch)``; the rows must be equal."""
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}")
        bags, _ = _model(store, {"type": "adagrad", "params": {"lr": 0.1}}, None)
        for group in passes:
            store.begin_pass(group if planned else _unmatched(group))
            for batch in group:
                loss(bags, batch).backward()
                store.step()
            assert all((store._passes.batches.cursor.get(t, 0) == len(group)) == planned for t in DIMS)
            store.end_pass()
        results.append({t: store._core.whole_rows(t, KEYS) for t in DIMS})
    for t in DIMS:
        np.testing.assert_array_equal(results[1][t], results[0][t])


def test_tables_pooled_differently_fall_back_to_one_by_one(make_store):
    other = torch.arange(0, 48, 4)  # table b pools other bags than table a

    def loss(bags, batch):
        out = bags["a"](batch["a"], torch.arange(0, 48, 2)).sum()
        return out + bags["b"](batch["b"], other).square().sum() + bags["c"](batch["c"], other).sum()

    _planned_equals_generic(make_store, [_batches(2, seed=p) for p in range(2)], loss)


def test_tables_with_other_id_counts_pool_apart(make_store):
    """A table of the same width with fewer ids (and its own offsets) is not pooled with the others."""
    rng = np.random.default_rng(5)
    sizes = {"a": 48, "b": 20, "c": 48}
    passes = [
        [{t: torch.from_numpy(KEYS[rng.integers(0, 600, n)]) for t, n in sizes.items()} for _ in range(2)]
        for _ in range(2)
    ]
    offsets = {"a": torch.arange(0, 48, 2), "b": torch.arange(0, 20, 5), "c": torch.arange(0, 48, 2)}
    _planned_equals_generic(
        make_store,
        passes,
        lambda bags, batch: sum(bags[t](batch[t], offsets[t]).square().sum() for t in DIMS),
    )


def _ragged_offsets(rng: np.random.Generator, n: int, bags: int) -> torch.Tensor:
    """Offsets of ``bags`` bags over ``n`` ids of random sizes, some empty (each table its own)."""
    cuts = np.sort(rng.integers(0, n + 1, bags - 1))
    return torch.from_numpy(np.concatenate([[0], cuts]).astype(np.int64))


_MODULES = {
    # name: (module keywords, how its forward is called with (ids, rng))
    "sum": ({"mode": "sum"}, lambda m, ids, r: m(ids, _ragged_offsets(r, ids.numel(), 16))),
    "mean": ({"mode": "mean"}, lambda m, ids, r: m(ids, _ragged_offsets(r, ids.numel(), 12))),
    "max": ({"mode": "max"}, lambda m, ids, r: m(ids, _ragged_offsets(r, ids.numel(), 8))),
    "last_offset": (
        {"mode": "sum", "include_last_offset": True},
        lambda m, ids, r: m(
            ids, torch.cat([_ragged_offsets(r, ids.numel(), 10), torch.tensor([ids.numel()])])
        ),
    ),
    "weighted": (
        {"mode": "sum"},
        lambda m, ids, r: m(
            ids,
            _ragged_offsets(r, ids.numel(), 16),
            torch.from_numpy(r.random(ids.numel()).astype(np.float32)),
        ),
    ),
    "padding": (
        {"mode": "sum", "padding_idx": int(KEYS[0])},
        lambda m, ids, r: m(ids, torch.arange(0, 48, 3)),
    ),
    "two_d": ({"mode": "mean"}, lambda m, ids, r: m(ids.view(12, 4))),
    "embedding": ({}, lambda m, ids, r: m(ids.view(6, 8)).sum(dim=1)),
    "embedding_pad": ({"padding_idx": int(KEYS[0])}, lambda m, ids, r: m(ids.view(8, 6)).mean(dim=1)),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_every_kind_of_lookup_through_plans_is_the_generic_training(make_store, optimizer):
    """Each table with its own offsets, mode, weights, padding or shape, all of one width: trained
    through the announced plans (one gather for all, each pooled on its own), the rows, optimizer
    state and counters are bit-identical to the generic path's, table by table."""
    names = list(_MODULES)
    rng = np.random.default_rng(11)
    passes = [
        [
            {t: torch.from_numpy(KEYS[(rng.zipf(1.3, size=48) - 1) % 40]) for t in names}  # KEYS[0] is common
            for _ in range(3)
        ]
        for _ in range(2)
    ]
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}", memory_budget="4KiB")
        mods = {}
        for t in names:
            kwargs = dict(_MODULES[t][0])
            cls = hierps.Embedding if t.startswith("embedding") else hierps.EmbeddingBag
            mods[t] = cls(
                None, 8, store=store, name=t, optimizer={"type": optimizer, "params": {"lr": 0.05}}, **kwargs
            )
        call_rng = np.random.default_rng(3)
        forwards = {t: (lambda ids, f=_MODULES[t][1], m=mods[t], r=call_rng: f(m, ids, r)) for t in names}
        results.append(_train_tables(store, passes, planned, forwards, KEYS[:40]))
    for t in names:
        np.testing.assert_array_equal(results[1][t], results[0][t], err_msg=t)
    assert not np.array_equal(results[1]["padding"], results[1]["sum"])  # the modules did differ


def test_planned_padding_row_stays_zero_and_unused_tables_do_not_step(make_store):
    """The padding key's row gets no gradient on the planned path; a table whose output is not in
    the loss is not stepped (as with a torch module left out of the loss)."""
    store = make_store(memory_budget="4KiB")
    opt = {"type": "adam", "params": {"lr": 0.1}}
    pad = hierps.EmbeddingBag(
        None, 8, mode="sum", padding_idx=int(KEYS[0]), store=store, name="pad", optimizer=opt
    )
    idle = hierps.EmbeddingBag(None, 8, mode="sum", store=store, name="idle", optimizer=opt)
    batch = {"pad": torch.from_numpy(KEYS[[0, 1, 0, 2]]), "idle": torch.from_numpy(KEYS[[3, 4]])}
    before = store._core.whole_rows("idle", KEYS[[3, 4]]).copy()
    store.begin_pass([batch])
    out = pad(batch["pad"], torch.tensor([0, 2]))
    idle(batch["idle"], torch.tensor([0, 1]))
    out.square().sum().backward()
    store.step()
    assert store._passes.batches.cursor == {"pad": 1, "idle": 1}
    np.testing.assert_array_equal(store.lookup("pad", torch.from_numpy(KEYS[:1])).numpy(), np.zeros((1, 8)))
    assert not np.array_equal(store.lookup("pad", torch.from_numpy(KEYS[1:2])).numpy(), before[:1, :8])
    # its weights and Adam state as they were (its keys' sightings were counted: its forward ran)
    np.testing.assert_array_equal(store._core.whole_rows("idle", KEYS[[3, 4]])[:, :24], before[:, :24])


def test_a_table_pooled_with_the_others_but_left_out_of_the_loss_is_not_stepped(make_store):
    """Tables that share one offsets tensor are pooled at once; one whose output no loss uses keeps
    its weights and Adam state (a zero-gradient Adam step would move rows with momentum)."""
    store = make_store(memory_budget="4KiB")
    bags, _ = _model(store, {"type": "adam", "params": {"lr": 0.1}}, None)
    offsets = torch.arange(0, 48, 2)
    first, second = _batches(2, seed=0)
    store.begin_pass([first, second])
    sum(bags[t](first[t], offsets).square().sum() for t in DIMS).backward()
    store.step()
    keys = np.unique(second["a"].numpy())
    before = store._core.whole_rows("a", keys)
    outs = {t: bags[t](second[t], offsets) for t in DIMS}
    assert store_parts(store).trainer._pool_alike  # a and b took pieces of one pooling
    (outs["b"].square().sum() + outs["c"].sum()).backward()
    store.step()
    after = store._core.whole_rows("a", keys)
    np.testing.assert_array_equal(after[:, :24], before[:, :24])  # weights, Adam's m and v
    assert not np.array_equal(store._core.whole_rows("b", keys)[:, :8], before[:, :8])


def _bag_passes(seed: int, sizes: dict[str, int]) -> list[list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """Two passes of two mini-batches; each table its own id count and ragged bags (some empty)."""
    rng = np.random.default_rng(seed)
    return [
        [
            {
                t: (torch.from_numpy(KEYS[(rng.zipf(1.3, size=n) - 1) % 300]), _ragged_offsets(rng, n, 12))
                for t, n in sizes.items()
            }
            for _ in range(2)
        ]
        for _ in range(2)
    ]


@pytest.mark.parametrize("dims", [DIMS, {"a": 8, "b": 8, "c": 8}], ids=["two-arenas", "one-arena"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_tables_announced_with_their_own_bags_pool_in_one_call_as_one_by_one(
    make_store, monkeypatch, mode, optimizer, dims
):
    """Tables announced as hierps.Bags, each with its own offsets and id count, are pooled by one
    embedding_bag over their concatenated bags (and, summed, their gradient by one more), with the
    rows and optimizer state of the generic path, table by table. A forward whose offsets are not
    the announced ones (table b's, in the last mini-batch) pools its own, as exactly."""
    from hierps.training import _trainer

    fused: list[bool] = []
    real = _trainer.pool_bags

    def spy(*args, **kwargs):
        fused.append(len(args) > 7 and args[7] is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(_trainer, "pool_bags", spy)
    passes = _bag_passes(7, {"a": 48, "b": 30, "c": 20})
    other = torch.tensor([0, 5, 5, 29])  # the last mini-batch's b: not the announced bags
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}", memory_budget="4KiB")
        opt = {"type": optimizer, "params": {"lr": 0.1}}
        bags = {
            t: hierps.EmbeddingBag(None, d, mode=mode, store=store, name=t, optimizer=opt)
            for t, d in dims.items()
        }
        for p, group in enumerate(passes):
            announced = [{t: hierps.Bags(i, o) for t, (i, o) in b.items()} for b in group]
            unmatched = [{t: torch.cat([i, UNUSED]) for t, (i, _) in b.items()} for b in group]
            store.begin_pass(announced if planned else unmatched)
            for k, batch in enumerate(group):
                last = (p, k) == (1, 1)
                outs = [bags[t](i, other if last and t == "b" else o) for t, (i, o) in batch.items()]
                sum((out * (j + 1)).square().sum() for j, out in enumerate(outs)).backward()
                store.step()
            store.end_pass()
        store.checkpoint()
        results.append({t: store._core.whole_rows(t, KEYS[:300]) for t in DIMS})
    for t in DIMS:
        np.testing.assert_array_equal(results[1][t], results[0][t], err_msg=t)
    # each arena's tables pooled at once in every mini-batch of the planned run
    assert len(fused) == 4 * len(set(dims.values())) and all(fused) == (mode == "sum")


def test_bags_announced_wrong_are_refused_naming_the_table(make_store):
    store = make_store()
    hierps.EmbeddingBag(None, 8, mode="sum", store=store, name="a")
    ids = torch.from_numpy(KEYS[:6])
    for offsets, says in [
        (torch.tensor([1, 3]), "must start at 0"),
        (torch.tensor([0, 4, 2]), "must start at 0, never decrease"),
        (torch.tensor([0, 7]), "within the 6 ids"),
        (torch.zeros((2, 2), dtype=torch.int64), "offsets must be 1-D"),
    ]:
        with pytest.raises(hierps.OffsetsError, match=says) as err:
            store.begin_pass([{"a": hierps.Bags(ids, offsets)}])
        assert "'a'" in str(err.value)
    with pytest.raises(hierps.OffsetsError, match="ids must be 1-D"):
        store.begin_pass([{"a": hierps.Bags(ids.view(2, 3), torch.tensor([0]))}])


def test_the_pass_loader_finds_each_tables_offsets_and_announces_bags(make_store):
    """Given no ids, the PassLoader finds where each module's ids and offsets are in a batch (a
    tuple of lists, as the reference DLRM's), then announces hierps.Bags: the tables train pooled
    at once, with the rows of the loop without a loader."""
    from types import SimpleNamespace

    from hierps.integrations.loader import PassLoader

    rng = np.random.default_rng(2)
    names = ["a", "b", "c"]
    batches = []
    for _ in range(10):
        n = [int(rng.integers(20, 40)) for _ in names]
        batches.append(
            (
                [torch.from_numpy(KEYS[rng.integers(0, 300, k)]) for k in n],
                [_ragged_offsets(rng, k, 8) for k in n],
            )
        )
    results = []
    for with_loader in (False, True):
        store = make_store(f"s{with_loader}", memory_budget="4KiB")
        mods = {t: hierps.EmbeddingBag(None, 8, mode="sum", store=store, name=t) for t in names}
        loader = PassLoader(batches, None, SimpleNamespace(hierps_store=store, hierps_modules=mods), 2)
        for ids, offsets in loader if with_loader else batches:
            sum(mods[t](i, o).square().sum() for t, i, o in zip(names, ids, offsets)).backward()
            store.step()
        store.checkpoint()
        results.append({t: store._core.whole_rows(t, KEYS[:300])[:, :8] for t in names})  # weights
    for t in names:
        np.testing.assert_array_equal(results[1][t], results[0][t], err_msg=t)
    announced = loader.ids_of(batches[0])
    for k, t in enumerate(names):
        assert isinstance(announced[t], hierps.Bags)
        assert torch.equal(announced[t].ids, batches[0][0][k])
        assert torch.equal(announced[t].offsets, batches[0][1][k])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_embedding_lookups_of_a_mini_batch_are_one_call_and_train_as_one_by_one(
    make_store, monkeypatch, optimizer
):
    """nn.Embedding tables of one width (ids (B, 1) each, as DeepFM-style models call them) are
    looked up by one index_select and their gradient summed by one embedding_bag; rows and optimizer
    state equal the generic path's. A table whose output no loss uses (c, in the last mini-batch)
    is not stepped."""
    from hierps.training import _trainer

    calls: list[int] = []
    real = _trainer.look_up

    def spy(*args, **kwargs):
        calls.append(len(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_trainer, "look_up", spy)
    rng = np.random.default_rng(4)
    names = ["a", "b", "c"]
    passes = [
        [{t: torch.from_numpy(KEYS[(rng.zipf(1.3, size=32) - 1) % 300]) for t in names} for _ in range(2)]
        for _ in range(2)
    ]
    results = []
    for planned in (False, True):
        store = make_store(f"s{planned}", memory_budget="4KiB")
        opt = {"type": optimizer, "params": {"lr": 0.05}}
        mods = {t: hierps.Embedding(None, 8, store=store, name=t, optimizer=opt) for t in names}
        for p, group in enumerate(passes):
            store.begin_pass(group if planned else _unmatched(group))
            for k, batch in enumerate(group):
                outs = [mods[t](batch[t].view(-1, 1)) for t in names]
                used = outs[:2] if (p, k) == (1, 1) else outs
                sum((o * (j + 1)).square().sum() for j, o in enumerate(used)).backward()
                store.step()
            store.end_pass()
        store.checkpoint()
        results.append({t: store._core.whole_rows(t, KEYS[:300]) for t in names})
    for t in names:
        np.testing.assert_array_equal(results[1][t], results[0][t], err_msg=t)
    assert calls == [3, 3, 3, 3]  # one lookup of all three tables per mini-batch


@pytest.mark.parametrize("n", [0, 1, 2, 7, 5_600, 70_000])
def test_distinct_and_union_equal_numpy(n):
    from hierps.rows._ids import distinct, union

    rng = np.random.default_rng(n)
    for ids in (
        (rng.zipf(1.3, n) % 1000).astype(np.int64) - 500,  # many repeats, both signs
        rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),  # all distinct
        np.resize(np.array([2**63 - 1, -(2**63), 0, -1], np.int64), n).reshape(-1, 1),  # extremes, 2-D
    ):
        got = distinct(ids)
        assert got.dtype == np.int64 and got.tolist() == np.unique(ids).tolist()
        other = ids.reshape(-1)[::3] + 1
        assert union(ids, other).tolist() == np.union1d(ids, other).tolist()


@pytest.mark.parametrize("n", [0, 1, 3, 5_600])
def test_grouping_of_ids_by_counting_equals_numpy(n):
    """The compiled grouping of a mini-batch's ids in the pass's keys (positions given or searched)
    gives numpy's distinct positions, counts, numbering and stable order; an id not among the keys is
    refused."""
    from hierps.storage import _native
    from hierps.training._batchplan import _grouped

    if not _native.enabled():
        pytest.skip("the compiled core is off (HIERPS_NATIVE=0): nothing to compare numpy with")
    rng = np.random.default_rng(n)
    keep = np.unique(rng.integers(-(2**63), 2**63 - 1, 3 * n + 5, dtype=np.int64))
    at = (rng.zipf(1.2, n) % len(keep)).astype(np.int64)
    ids = keep[at]
    with _native.disabled():
        want = _grouped(ids, keep, None)
    assert want[3] is None
    order = np.argsort(want[2], kind="stable")
    for known in (None, at):
        got = _grouped(ids, keep, known)
        for g, w in zip(got, (*want[:3], order)):
            assert g is not None and g.dtype == np.int64 and g.tolist() == w.tolist()
        # what a caller may keep (each id's number, the order) holds no scratch of the grouping alive
        _, _, local, by_key = got
        for kept in (local, by_key):
            assert kept is not None and (kept.base if kept.base is not None else kept).nbytes == kept.nbytes


def test_union_positions_equal_numpy_with_or_without_the_compiled_core():
    from hierps.storage import _native
    from hierps.training._batchplan import union_positions

    rng = np.random.default_rng(3)
    batches = [
        {"a": (rng.zipf(1.2, 700) % 500).astype(np.int64) - 250, "b": rng.integers(0, 2**40, 300)},
        {"a": np.empty(0, np.int64)},
        {"b": np.array([2**63 - 1, -(2**63), 7], np.int64)},
    ]
    got = union_positions(batches)
    with _native.disabled():
        want = union_positions(batches)
    for t in ("a", "b"):
        ids = np.concatenate([b[t] for b in batches if t in b])
        assert got[0][t].tolist() == want[0][t].tolist() == np.unique(ids).tolist()
    for g, w, b in zip(got[1], want[1], batches):
        assert g.keys() == w.keys() == b.keys()
        for t in b:
            assert g[t].tolist() == w[t].tolist() and got[0][t][g[t]].tolist() == b[t].tolist()


def _storages(obj, seen=None):
    """Every tensor storage reachable from a plan or batch (its fields, lists and dicts): ptr -> bytes."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, seen)
    elif hasattr(obj, "__dict__"):
        _storages(vars(obj), seen)
    return seen


@pytest.mark.parametrize("all_bags", [True, False])
def test_a_plan_keeps_its_arrays_once_joined_and_gives_each_tables_own(all_bags):
    """Each table's ids' numbers, order, key starts and bags come out of the joined arrays as numpy
    computes them table by table (int64, whatever the joined arrays hold); until asked for, the plans
    keep only the joined arrays (20 bytes an id, where each table's own beside them took 56)."""
    from hierps.training._batchplan import bag_ids, sum_order, translate, union_positions

    rng = np.random.default_rng(5)
    batch, offsets = {}, {}
    for t, n in (("a", 900), ("b", 1_300), ("c", 40)):
        ids = (rng.zipf(1.3, n) % 700).astype(np.int64) * 3
        offsets[t] = np.unique(np.concatenate([[0], rng.integers(1, n, n // 4)])).astype(np.int64)
        batch[t] = bag_ids(ids, offsets[t]) if all_bags or t != "b" else ids
    keep, positions = union_positions([batch])
    base = {"a": 0, "b": len(keep["a"]), "c": len(keep["a"]) + len(keep["b"])}
    (planned,) = translate([batch], keep, base, torch.device("cpu"), positions, coalesced={"c"})
    assert (planned.bags is not None) == all_bags
    n = sum(len(v) for v in batch.values())
    u = sum(p.keys.numel() for p in planned.plans.values())
    b = sum(len(o) for o in offsets.values())
    held = sum(_storages(planned).values())
    # an id: its copy (8 bytes) and its number, order and bag within the mini-batch (4 each)
    assert held <= 20 * n + 24 * u + 12 * b + 4096, (held, n, u, b)
    for t, plan in planned.plans.items():
        ids = np.asarray(batch[t])
        keys, local = np.unique(ids, return_inverse=True)
        order = np.argsort(local, kind="stable")
        if t == "c":  # summed in torch's coalesce order
            order = sum_order(torch.from_numpy(ids)).numpy()
        counts = np.bincount(local)
        assert all(x.dtype == torch.int64 for x in (plan.local, plan.order, plan.starts))
        assert plan.keys.tolist() == keys.tolist() and plan.local.tolist() == local.tolist()
        assert plan.order.tolist() == order.tolist()
        assert plan.starts.tolist() == (np.cumsum(counts) - counts).tolist()
        assert plan.slots.tolist() == (base[t] + np.searchsorted(keep[t], keys)).tolist()
        if all_bags or t != "b":
            bag_of = np.repeat(np.arange(len(offsets[t])), np.diff(offsets[t], append=len(ids)))
            assert (
                plan.offsets.tolist() == offsets[t].tolist() and plan.bags.tolist() == bag_of[order].tolist()
            )
        else:
            assert plan.offsets is None and plan.bags is None


def test_a_mini_batch_translates_alike_whatever_its_tables_order_and_whether_positions_are_known():
    """The tables of a mini-batch are grouped joined: in the pass's order or not, with the positions
    of union_positions or searched, each table's plan is the same; an id its table's keys lack is
    refused, even where the next table's first key equals it."""
    from hierps.training._batchplan import bag_ids, translate, union_positions

    rng = np.random.default_rng(11)
    batches = []
    for _ in range(3):
        batch = {}
        for t, n in (("a", 500), ("b", 20), ("c", 800)):
            ids = (rng.zipf(1.2, n) % 300).astype(np.int64)
            batch[t] = bag_ids(ids, np.arange(0, n, 4, dtype=np.int64)) if t != "b" else ids
        batches.append(batch)
    keep, positions = union_positions(batches)
    base = {"a": 1000, "b": 0, "c": 5000}
    cpu = torch.device("cpu")
    want = translate(batches, keep, base, cpu, positions, coalesced={"c"})
    backwards = [{t: b[t] for t in ("c", "b", "a")} for b in batches]
    for got in (
        translate(batches, keep, base, cpu, None, coalesced={"c"}),
        translate(backwards, keep, base, cpu, positions, coalesced={"c"}),
    ):
        for g, w in zip(got, want):
            assert g.bags is None and w.bags is None  # "b" came without bags
            for t, plan in w.plans.items():
                other = g.plans[t]
                for field in ("ids", "keys", "counts", "slots", "local", "order", "starts"):
                    assert torch.equal(getattr(other, field), getattr(plan, field)), (t, field)
                assert (plan.bags is None) == (t == "b") and (t == "b" or torch.equal(other.bags, plan.bags))
    # key 7 lies past table "a"'s keys here, and "b"'s first key is 7
    lonely = {"a": np.array([1, 2], np.int64), "b": np.array([7], np.int64)}
    with pytest.raises((ValueError, IndexError)):
        translate(
            [{"a": np.array([7], np.int64), "b": np.array([7], np.int64)}], lonely, {"a": 0, "b": 2}, cpu
        )
    # and a table with no keys at all, after one whose last key is the id
    with pytest.raises((ValueError, IndexError)):
        translate(
            [{"a": np.array([2], np.int64), "b": np.array([2], np.int64)}],
            {**lonely, "b": lonely["b"][:0]},
            {"a": 0, "b": 2},
            cpu,
        )
