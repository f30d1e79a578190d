"""hierps training equals plain PyTorch sparse-embedding training, with rows spilled to SSD."""

from __future__ import annotations

import pytest
import torch
from oracle import make_optimizers, train, twin_models, zipf_batches

from hierps._store import store_parts

VOCAB, DIM = 400, 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _compare(ref, twin, ref_losses, twin_losses):
    assert twin_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    rows = twin.emb.lookup(torch.arange(VOCAB))
    torch.testing.assert_close(rows, ref.emb.weight.detach(), **TOL)
    for a, b in zip(ref.head.parameters(), twin.head.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)


@pytest.mark.parametrize(
    ("opt", "mode"),
    [(o, m) for o in ("sgd", "adagrad", "adam") for m in ("sum", "mean")]
    + [("sgd", "max"), ("adagrad", "max")],
)
def test_bag_matches_torch_with_rows_on_ssd(make_store, opt, mode):
    # ~30 rows of RAM for a 400-row table: most rows live on SSD between passes.
    store = make_store(memory_budget="2KiB", device_budget="1MiB")
    ref, twin = twin_models("bag", VOCAB, DIM, store, opt, mode=mode)
    batches = zipf_batches(24, batch=16, bag=5, vocab=VOCAB)
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
    ref_losses = train(ref, sparse_ref, dense_ref, batches)
    twin_losses = train(twin, None, dense_twin, batches, store=store, pass_batches=4)
    assert store_parts(store).core.ssd.num_rows("t") > 10 * store_parts(store).core.memory.num_rows("t")
    assert store_parts(store).core.ssd.bytes_read > 0
    _compare(ref, twin, ref_losses, twin_losses)


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_on_demand_fetch_and_split_passes_match_torch(make_store, opt):
    # Device budget of ~60 rows: a pass of 8 batches does not fit and is split; no pass set-up
    # at all for half of the run (rows fetched on demand).
    row = DIM * (1 + {"sgd": 0, "adagrad": 1, "adam": 2}[opt]) * 4 + 25
    store = make_store(memory_budget="1KiB", device_budget=60 * row)
    ref, twin = twin_models("bag", VOCAB, DIM, store, opt, mode="sum")
    batches = zipf_batches(24, batch=8, bag=4, vocab=VOCAB, seed=3, weights=True)
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
    ref_losses = train(ref, sparse_ref, dense_ref, batches)
    twin_losses = train(twin, None, dense_twin, batches[:12], store=store, pass_batches=8)
    twin_losses += train(twin, None, dense_twin, batches[12:], store=store)
    _compare(ref, twin, ref_losses, twin_losses)


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_gradient_accumulation_sums_before_one_step(make_store, opt):
    store = make_store(memory_budget="2KiB")
    ref, twin = twin_models("bag", VOCAB, DIM, store, opt, mode="mean")
    batches = zipf_batches(16, batch=16, bag=3, vocab=VOCAB, seed=5)
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
    ref_losses = train(ref, sparse_ref, dense_ref, batches, accumulate=4)
    twin_losses = train(twin, None, dense_twin, batches, store=store, accumulate=4, pass_batches=8)
    _compare(ref, twin, ref_losses, twin_losses)


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_embedding_matches_torch(make_store, opt):
    store = make_store(memory_budget="2KiB")
    ref, twin = twin_models("plain", VOCAB, DIM, store, opt)
    batches = zipf_batches(16, batch=8, bag=6, vocab=VOCAB, seed=7, bags=False)
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, opt)
    ref_losses = train(ref, sparse_ref, dense_ref, batches)
    twin_losses = train(twin, None, dense_twin, batches, store=store)
    _compare(ref, twin, ref_losses, twin_losses)


@pytest.mark.parametrize("kind", ["bag", "plain"])
def test_padding_idx_behaves_like_torch(make_store, kind):
    store = make_store(memory_budget="2KiB")
    ref, twin = twin_models(kind, VOCAB, DIM, store, "adagrad", mode="mean", padding_idx=0)
    batches = zipf_batches(12, batch=8, bag=4, vocab=VOCAB, seed=9, bags=kind == "bag")
    sparse_ref, dense_ref, dense_twin = make_optimizers(ref, twin, "adagrad")
    ref_losses = train(ref, sparse_ref, dense_ref, batches)
    twin_losses = train(twin, None, dense_twin, batches, store=store)
    _compare(ref, twin, ref_losses, twin_losses)
    assert torch.count_nonzero(twin.emb.lookup(torch.tensor([0]))) == 0


def test_swapping_a_module_in_changes_no_output(make_store):
    store = make_store(memory_budget="1KiB")
    ref, twin = twin_models("bag", VOCAB, DIM, store, "adagrad", mode="max")
    b = zipf_batches(1, batch=32, bag=7, vocab=VOCAB, seed=11)[0]
    ref.eval()
    twin.eval()
    with torch.no_grad():
        assert torch.equal(ref(b.ids, b.offsets), twin(b.ids, b.offsets))
