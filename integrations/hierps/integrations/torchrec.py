"""hierps under TorchRec: ``EmbeddingBagCollection`` / ``EmbeddingCollection`` with their tables in a store.

A model written for TorchRec keeps its code: its collections take a ``KeyedJaggedTensor`` and
return what TorchRec's return (a ``KeyedTensor`` of pooled embeddings, keys and layout as
``torchrec.EmbeddingBagCollection`` gives them; a ``dict[str, JaggedTensor]`` as
``torchrec.EmbeddingCollection`` does), but each table is a :class:`hierps.EmbeddingBag` /
:class:`hierps.Embedding` whose rows live in a store: no table is an ``nn.Parameter``, and
:meth:`hierps.Store.step` updates the rows a mini-batch touched. Three ways in::

    # 1. a TorchRec model as it is, its collections swapped, their rows copied into the store
    model = DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables), ...)
    hierps.integrations.torchrec.swap_torchrec(model, store)

    # 2. under DeepSpeed: nothing to call; hierps.deepspeed.initialize swaps the collections'
    #    tables as it swaps nn.EmbeddingBag modules ("modules": "auto" or their qualified names,
    #    e.g. "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0")

    # 3. built directly: rows from each config's init (uniform within +-sqrt(1/num_embeddings))
    ebc = hierps.integrations.torchrec.EmbeddingBagCollection(tables, store=store)

Semantics, against TorchRec's unsharded modules (``torchrec/modules/embedding_modules.py``):

- ``features`` (a KJT with ``F`` keys, batch ``B``, lengths ``L[f][i]``) -> ``KeyedTensor`` of
  values ``(B, sum of D over the features)`` float32, keys the features in table order (``f@t``
  for a feature two tables read), ``length_per_key`` their dims; a weighted collection
  (``is_weighted=True``) reads the KJT's ``weights()`` as per-sample weights (SUM pooling only, as
  torch's ``nn.EmbeddingBag``). Inverse indices (a deduplicated KJT) are expanded as TorchRec does.
- ids are raw int64 keys: an id past ``num_embeddings`` gets a row of its own (from the table's
  initializer) where TorchRec's module would index out of range.
- a table's name in the store is the qualified name of its module (``<prefix>embedding_bags.<t>``),
  so ``state_dict()`` keys are TorchRec's (``embedding_bags.<t>.weight``, within
  :attr:`~hierps.EmbeddingBag.state_dict_max_bytes`) and a checkpoint of the plain TorchRec model
  warm-starts this one.
- ``data_type`` FP32 / FP16 / BF16 become the rows' ``weights_dtype`` (fp32 / fp16 / bf16) unless the
  table's settings give one; computed in float32, as TorchRec's ``.float()`` outputs.

Not supported, each a :mod:`hierps.errors` error saying why: quantised data types (INT8, INT4,
INT2, FP8: inference formats, no optimizer steps them); ``PoolingType.NONE`` in a bag collection;
a custom ``init_fn`` for a table built directly (the store draws rows key by key, lazily: give an
``initializer=``, or copy a built collection's rows with :meth:`EmbeddingBagCollection.from_collection`);
sharded collections (``DistributedModelParallel``, ``Sharded*Collection``): swap before sharding,
and shard rows with :class:`hierps.ShardedStore`, which sends rows and gradients by all-to-all itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack, cast

import torch
from torch import nn

from hierps.config import TableSettings, TableSpec
from hierps.errors import ConfigError, NotSupportedError
from hierps.integrations.swap import retire_weights
from hierps.interface import StoreInterface
from hierps.modules import Embedding, EmbeddingBag, get_default_store
from hierps.rows._ids import same_device

try:
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardedModule
    from torchrec.modules.embedding_configs import (
        BaseEmbeddingConfig,
        DataType,
        EmbeddingBagConfig,
        EmbeddingConfig,
        PoolingType,
    )
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollectionInterface,
        EmbeddingCollectionInterface,
        get_embedding_names_by_table,
        process_pooled_embeddings,
        reorder_inverse_indices,
    )
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"hierps.integrations.torchrec needs torchrec, which cannot be imported here ({exc}). Install it "
        "with its CPU kernels next to torch 2.13: `pip install -c constraints.txt 'hierps[torchrec]'` then "
        "`pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0` (`make setup` does both; --no-deps "
        "because torchrec asks for the CUDA fbgemm-gpu). The rest of hierps works without it."
    ) from exc

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "adapt_collections",
    "swap_torchrec",
]

# TorchRec's data types -> the precision the store keeps the rows in.
_WEIGHTS_DTYPES = {DataType.FP32: "fp32", DataType.FP16: "fp16", DataType.BF16: "bf16"}
_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


def _check_tables(tables: Sequence[BaseEmbeddingConfig], kind: type[BaseEmbeddingConfig], what: str) -> None:
    """The configs of one collection: of ``kind``, named, unique, of a data type the store keeps."""
    names: set[str] = set()
    for cfg in tables:
        if not isinstance(cfg, kind):
            raise ConfigError(
                f"{what}: tables must be {kind.__name__}s. Got a {type(cfg).__name__}: {cfg!r}."
            )
        if not cfg.name:
            raise ConfigError(f"{what}: a table has no name ({cfg!r}); the store keeps tables by name.")
        if cfg.name in names:
            raise ConfigError(f"{what}: table name {cfg.name!r} appears twice; table names must be unique.")
        names.add(cfg.name)
        if cfg.data_type not in _WEIGHTS_DTYPES:
            raise NotSupportedError(
                f"{what}: table {cfg.name!r} has data_type {cfg.data_type.name}, a quantised inference format "
                "no optimizer steps; the store keeps rows as FP32, FP16 or BF16 (hierps weights_dtype fp32, "
                "fp16, bf16). Train with one of those, and quantise for serving."
            )
        if isinstance(cfg, EmbeddingBagConfig) and cfg.pooling not in _POOLING:
            raise NotSupportedError(
                f"{what}: table {cfg.name!r} has pooling {cfg.pooling.name}; a bag collection pools SUM or "
                "MEAN. Put unpooled tables in an EmbeddingCollection."
            )
        if not cfg.feature_names:  # TorchRec's rule: a table without features reads its own name
            cfg.feature_names = [cfg.name]


def _uniform_bounds(cfg: BaseEmbeddingConfig) -> tuple[float, float] | None:
    """(low, high) when ``init_fn`` is the config's default (uniform within its weight_init bounds)."""
    fn = cfg.init_fn
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args:
        return float(fn.keywords.get("a", 0.0)), float(fn.keywords.get("b", 1.0))
    return None


def _table_spec(cfg: BaseEmbeddingConfig, spec: TableSpec, *, fresh: bool, what: str) -> TableSpec:
    """The table's settings: ``spec``'s, with the config's data type and init where ``spec`` gives none.

    ``fresh``: no rows are copied in, so every row comes from the initializer: a custom
    ``init_fn`` (which fills a whole tensor at once) cannot give them.
    """
    weights_dtype = spec.weights_dtype or _WEIGHTS_DTYPES[cfg.data_type]
    initializer: Any = spec.initializer
    if initializer is None:
        bounds = _uniform_bounds(cfg)
        if bounds is not None:
            initializer = {"type": "uniform", "params": {"low": bounds[0], "high": bounds[1]}}
        elif fresh:
            raise ConfigError(
                f"{what}: table {cfg.name!r} has a custom init_fn ({cfg.init_fn!r}), which fills a whole "
                "(num_embeddings, dim) tensor; the store draws each row when its key is first read. Give the "
                "table an initializer (initializer={'type': 'normal' | 'uniform' | 'zeros', 'params': {...}}), "
                "or build TorchRec's collection and copy its rows with from_collection(collection, store=...)."
            )
    return TableSpec.of(spec, weights_dtype=weights_dtype, initializer=initializer)


def _check_device(device: torch.device | str | None, store: StoreInterface, what: str) -> None:
    if (
        device is None
        or torch.device(device).type == "meta"
        or same_device(torch.device(device), store.device)
    ):
        return
    raise ConfigError(
        f"{what}: device {device} was asked for, but the store trains on {store.device}; the store's "
        "device tier holds the rows. Leave device unset (or open the store on that device)."
    )


class _Tables(nn.Module):
    """What both collections share: configs checked once, the names TorchRec gives their outputs."""

    _ATTR = ""  # the ModuleDict of tables, named as in TorchRec (so are the state_dict keys)

    def _setup(self, tables: Sequence[BaseEmbeddingConfig], children: Mapping[str, nn.Module]) -> None:
        self._configs = list(tables)
        self._feature_names: list[list[str]] = [list(cfg.feature_names) for cfg in tables]
        self._names_by_table: list[list[str]] = get_embedding_names_by_table(self._configs)
        setattr(self, self._ATTR, nn.ModuleDict({cfg.name: children[cfg.name] for cfg in tables}))

    def _tables(self) -> nn.ModuleDict:
        return getattr(self, self._ATTR)

    @property
    def device(self) -> torch.device:
        """The device the outputs are on: the store's (or the dense tables' while none is swapped)."""
        child = next(iter(self._tables().values()), None)
        if isinstance(child, (EmbeddingBag, Embedding)):
            return child.store.device
        return cast(torch.Tensor, child.weight).device if child is not None else torch.device("cpu")

    def batch_ids(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """One mini-batch's ids per store table, as :meth:`hierps.Store.run_pass` (``begin_pass``,
        ``prefetch``) takes them: features KJT -> {table name: (N_t,) int64 ids of its features}.

        ``with store.run_pass([ebc.batch_ids(kjt) for kjt in pass_batches]): ...`` loads the pass's
        rows before it runs; a table read by one feature then also takes the announced fast path (its
        forward's ids are the announced ones). Tables left dense (under ``initialize``) are not listed.
        """
        by_feature = features.to_dict()
        out: dict[str, torch.Tensor] = {}
        for child, names in zip(self._tables().values(), self._feature_names, strict=True):
            if isinstance(child, (EmbeddingBag, Embedding)):
                ids = [by_feature[name].values().long() for name in names]
                out[child.table] = ids[0] if len(ids) == 1 else torch.cat(ids)
        return out

    def extra_repr(self) -> str:
        return f"tables={[cfg.name for cfg in self._configs]}"


def _store_children(
    tables: Sequence[BaseEmbeddingConfig],
    store: StoreInterface,
    prefix: str,
    attr: str,
    spec: TableSpec,
    weights: Mapping[str, torch.Tensor] | None,
    what: str,
) -> dict[str, nn.Module]:
    """One hierps module per config, its table ``<prefix><attr>.<name>``; rows from ``weights``
    (rows 0..N-1; a meta tensor: none) unless the store already holds the table (a resumed run)."""
    out: dict[str, nn.Module] = {}
    for cfg in tables:
        table_spec = _table_spec(cfg, spec, fresh=weights is None, what=what)
        name = f"{prefix}{attr}.{cfg.name}"
        weight = None if weights is None else weights[cfg.name]
        if isinstance(cfg, EmbeddingBagConfig):
            out[cfg.name] = EmbeddingBag(
                cfg.num_embeddings,
                cfg.embedding_dim,
                mode=_POOLING[cfg.pooling],
                _weight=weight,
                store=store,
                name=name,
                spec=table_spec,
            )
        else:
            out[cfg.name] = Embedding(
                cfg.num_embeddings, cfg.embedding_dim, _weight=weight, store=store, name=name, spec=table_spec
            )
    return out


class EmbeddingBagCollection(_Tables, EmbeddingBagCollectionInterface):
    """``torchrec.EmbeddingBagCollection`` with its tables in a store: one :class:`hierps.EmbeddingBag`
    per ``EmbeddingBagConfig`` (SUM / MEAN pooling), in ``self.embedding_bags[<table name>]``.

    forward: ``features`` KJT with keys covering every table's ``feature_names``, values (N,) int
    ids on the store's device, per feature ``B`` bags (``weights()`` (N,) float when
    ``is_weighted``) -> ``KeyedTensor``, values (B, sum of dims) float32, keys and
    ``length_per_key`` as TorchRec's. Example::

        tables = [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
                  EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])]
        ebc = EmbeddingBagCollection(tables, store=store)   # tables embedding_bags.t1, .t2 in the store
        kt = ebc(KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                                   offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8])))
        kt.values().shape, kt.keys(), kt.offset_per_key()   # (3, 7), ['f1', 'f2'], [0, 3, 7]
        kt.values().sum().backward(); store.step()

    ``store`` (default: :func:`hierps.get_default_store`), ``prefix`` (of the table names in the
    store, ``prefix + "embedding_bags." + name``: the qualified names of the tables' modules when
    ``prefix`` is the collection's qualified name and a dot, as :func:`swap_torchrec` sets it), ``spec`` and
    the keywords (``optimizer=``, ``weights_dtype=``, ...) are the tables' settings, as
    :meth:`hierps.Store.table` takes them. Rows come from each config's default init (uniform
    within ``weight_init_min`` / ``weight_init_max``) as the store's initializer, key by key;
    :meth:`from_collection` copies a built collection's rows instead.
    """

    _ATTR = "embedding_bags"
    embedding_bags: nn.ModuleDict

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        store: StoreInterface | None = None,
        prefix: str = "",
        spec: TableSpec | None = None,
        _bags: Mapping[str, nn.Module] | None = None,
        **settings: Unpack[TableSettings],
    ) -> None:
        super().__init__()
        what = type(self).__name__
        _check_tables(tables, EmbeddingBagConfig, what)
        if is_weighted:
            means = [cfg.name for cfg in tables if cfg.pooling is not PoolingType.SUM]
            if means:
                raise ConfigError(
                    f"{what}: is_weighted=True needs SUM pooling, tables {means} pool MEAN: per-sample weights "
                    "are summed (torch's nn.EmbeddingBag refuses them with mode='mean'). Pool those tables SUM, "
                    "or divide each id's weight by its bag's length for a weighted mean."
                )
        self._is_weighted = is_weighted
        if _bags is None:
            store = store if store is not None else get_default_store()
            _check_device(device, store, what)
            _bags = _store_children(
                tables, store, prefix, self._ATTR, TableSpec.of(spec, **settings), None, what
            )
        self._setup(tables, _bags)
        self._lengths = [cfg.embedding_dim for cfg in tables for _ in cfg.feature_names]
        self._keys = [name for names in self._names_by_table for name in names]
        self._flat_features = [name for names in self._feature_names for name in names]

    @classmethod
    def from_collection(
        cls,
        collection: torchrec.EmbeddingBagCollection,
        *,
        store: StoreInterface | None = None,
        prefix: str = "",
        spec: TableSpec | None = None,
        **settings: Unpack[TableSettings],
    ) -> EmbeddingBagCollection:
        """The store-backed twin of a built ``torchrec.EmbeddingBagCollection``: its configs, and its
        rows 0..N-1 copied in (none from a collection on the meta device: the initializer's), unless
        the store already holds a table (a resumed run keeps its rows)."""
        store = store if store is not None else get_default_store()
        weights = {name: bag.weight for name, bag in collection.embedding_bags.items()}
        tables = collection.embedding_bag_configs()
        bags = _store_children(
            tables, store, prefix, cls._ATTR, TableSpec.of(spec, **settings), weights, cls.__name__
        )
        return cls(tables, collection.is_weighted(), _bags=bags)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: KJT (F keys, B bags each; or a TensorDict) -> KeyedTensor (B, sum of dims) float32."""
        features = maybe_td_to_kjt(features, None)
        inverse = reorder_inverse_indices(features.inverse_indices_or_none(), self._flat_features)
        by_feature = features.to_dict()
        pooled: list[torch.Tensor] = []
        for bag, names in zip(self.embedding_bags.values(), self._feature_names, strict=True):
            for name in names:
                jt = by_feature[name]
                # offsets without the last one (= the feature's ids count): the same bags, and the
                # store's pooled path of announced mini-batches wants include_last_offset=False.
                weights = jt.weights() if self._is_weighted else None
                pooled.append(bag(jt.values(), jt.offsets()[:-1], per_sample_weights=weights).float())
        return KeyedTensor(
            keys=self._keys,
            values=process_pooled_embeddings(pooled_embeddings=pooled, inverse_indices=inverse),
            length_per_key=self._lengths,
        )

    def is_weighted(self) -> bool:
        """Whether the KJT's weights are per-sample weights of the bags."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The tables' configs, as TorchRec's collection returns them."""
        return self._configs


class EmbeddingCollection(_Tables, EmbeddingCollectionInterface):
    """``torchrec.EmbeddingCollection`` with its tables in a store: one :class:`hierps.Embedding` per
    ``EmbeddingConfig`` (one dim for all, TorchRec's rule), in ``self.embeddings[<table name>]``.

    forward: ``features`` KJT (keys covering every table's ``feature_names``, values (N,) int ids on
    the store's device) -> ``{embedding name: JaggedTensor}``, each of values (N_f, D) float32 and
    the feature's lengths (its ``weights()`` the ids when ``need_indices``), as TorchRec's.
    Arguments as :class:`EmbeddingBagCollection`'s (``prefix + "embeddings." + name`` in the store).
    """

    _ATTR = "embeddings"
    embeddings: nn.ModuleDict

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        store: StoreInterface | None = None,
        prefix: str = "",
        spec: TableSpec | None = None,
        _embeddings: Mapping[str, nn.Module] | None = None,
        **settings: Unpack[TableSettings],
    ) -> None:
        super().__init__()
        what = type(self).__name__
        _check_tables(tables, EmbeddingConfig, what)
        dims = sorted({cfg.embedding_dim for cfg in tables})
        if len(dims) > 1:
            raise ConfigError(
                f"{what}: tables of dims {dims}; an EmbeddingCollection has one embedding_dim for all its "
                "tables (TorchRec's rule). Use one collection per dim."
            )
        self._embedding_dim = dims[0] if dims else -1
        self._need_indices = need_indices
        if _embeddings is None:
            store = store if store is not None else get_default_store()
            _check_device(device, store, what)
            _embeddings = _store_children(
                tables, store, prefix, self._ATTR, TableSpec.of(spec, **settings), None, what
            )
        self._setup(tables, _embeddings)

    @classmethod
    def from_collection(
        cls,
        collection: torchrec.EmbeddingCollection,
        *,
        store: StoreInterface | None = None,
        prefix: str = "",
        spec: TableSpec | None = None,
        **settings: Unpack[TableSettings],
    ) -> EmbeddingCollection:
        """The store-backed twin of a built ``torchrec.EmbeddingCollection`` (rows copied, as
        :meth:`EmbeddingBagCollection.from_collection`)."""
        store = store if store is not None else get_default_store()
        weights = {name: emb.weight for name, emb in collection.embeddings.items()}
        tables = collection.embedding_configs()
        made = _store_children(
            tables, store, prefix, cls._ATTR, TableSpec.of(spec, **settings), weights, cls.__name__
        )
        return cls(tables, need_indices=collection.need_indices(), _embeddings=made)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """features: KJT (F keys; or a TensorDict) -> {name: JaggedTensor (N_f, D) float32}."""
        features = maybe_td_to_kjt(features, None)
        by_feature = features.to_dict()
        out: dict[str, JaggedTensor] = {}
        for emb, features_of, names in zip(
            self.embeddings.values(), self._feature_names, self._names_by_table, strict=True
        ):
            for feature, name in zip(features_of, names, strict=True):
                jt = by_feature[feature]
                out[name] = JaggedTensor(
                    values=emb(jt.values()).float(),
                    lengths=jt.lengths(),
                    weights=jt.values() if self._need_indices else None,
                )
        return out

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The tables' configs, as TorchRec's collection returns them."""
        return self._configs

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table


# -- swapping a model's collections ------------------------------------------------------------


def _references(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(module) -> every (parent, attribute) holding it (named_children() would hide a second one)."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for attr, child in parent._modules.items():
            refs.setdefault(id(child), []).append((parent, attr))
    return refs


def _collections(model: nn.Module, what: str) -> dict[str, Any]:
    """Qualified name -> each TorchRec (unsharded) collection of ``model``; refuses sharded ones."""
    if isinstance(model, (torchrec.EmbeddingBagCollection, torchrec.EmbeddingCollection)):
        raise ConfigError(
            f"{what}: the model is itself a {type(model).__name__}, which has no parent to hold its twin. "
            f"Use hierps.integrations.torchrec.{type(model).__name__}.from_collection(collection, store=...)."
        )
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, (DistributedModelParallel, ShardedModule)):
            raise NotSupportedError(
                f"{what}: {name or 'the model'} is a {type(module).__name__}: its tables are already sharded "
                "over ranks by TorchRec. Swap the unsharded model instead (before DistributedModelParallel); "
                "hierps.ShardedStore shards the rows over ranks itself (rows and gradients by all-to-all)."
            )
        if type(module) in (torchrec.EmbeddingBagCollection, torchrec.EmbeddingCollection):
            found[name] = module
    return found


def _replace(
    model: nn.Module, twins: Mapping[str, nn.Module], found: Mapping[str, nn.Module], undo: list[Any] | None
) -> None:
    """Every reference to ``found[name]`` in ``model`` becomes ``twins[name]`` (a shared one stays shared)."""
    refs = _references(model)
    for name, module in found.items():
        for parent, attr in refs.get(id(module), []):
            if undo is not None:
                undo.append((parent, attr, module))
            setattr(parent, attr, twins[name])


def _torch_bag(bag: nn.EmbeddingBag) -> nn.EmbeddingBag:
    """An ``nn.EmbeddingBag`` reading bags by offsets without the last one, on ``bag``'s very weight."""
    out = nn.EmbeddingBag(bag.num_embeddings, bag.embedding_dim, mode=bag.mode, device="meta")
    out.weight = bag.weight  # the same Parameter: the model's optimizer and parameter lists hold it
    return out


def _torch_embedding(emb: nn.Embedding) -> nn.Embedding:
    out = nn.Embedding(emb.num_embeddings, emb.embedding_dim, device="meta")
    out.weight = emb.weight
    return out


def adapt_collections(model: nn.Module, *, undo: list[Any] | None = None) -> dict[str, nn.Module]:
    """Replace each ``torchrec.EmbeddingBagCollection`` / ``EmbeddingCollection`` of ``model`` by this
    module's twin holding the same tables as plain ``nn.EmbeddingBag`` / ``nn.Embedding`` modules
    (the very same weight Parameters, nothing copied): the model computes what it did, and its tables
    are torch embedding modules that :func:`hierps.deepspeed.initialize` swaps into the store like any
    other, under the qualified names TorchRec gives them (``...embedding_bags.<table>``).

    ``undo`` receives ``(parent, attribute, original)`` for each replacement. Returns qualified
    name -> twin.
    """
    found = _collections(model, "adapt_collections")
    twins: dict[str, nn.Module] = {}
    for name, module in found.items():
        if isinstance(module, torchrec.EmbeddingBagCollection):
            bags = {t: _torch_bag(bag) for t, bag in module.embedding_bags.items()}
            twins[name] = EmbeddingBagCollection(
                module.embedding_bag_configs(), module.is_weighted(), _bags=bags
            )
        else:
            embs = {t: _torch_embedding(emb) for t, emb in module.embeddings.items()}
            twins[name] = EmbeddingCollection(
                module.embedding_configs(), need_indices=module.need_indices(), _embeddings=embs
            )
    _replace(model, twins, found, undo)
    return twins


def swap_torchrec(
    model: nn.Module,
    store: StoreInterface | None = None,
    spec: TableSpec | None = None,
    *,
    collections: Iterable[str] | None = None,
    **settings: Unpack[TableSettings],
) -> dict[str, nn.Module]:
    """Put the tables of ``model``'s TorchRec collections into ``store``: each
    ``torchrec.EmbeddingBagCollection`` / ``EmbeddingCollection`` (or those named in
    ``collections``, qualified names) becomes an :class:`EmbeddingBagCollection` /
    :class:`EmbeddingCollection`, its rows 0..N-1 copied in (none from the meta device), each table
    named by its module's qualified name (``sparse_arch.embedding_bag_collection.embedding_bags.t1``;
    a table the store already holds keeps its rows: a resumed run).

    The old tables' weights become :class:`~hierps.integrations.swap.StaleWeight` (their memory
    freed; a use raises ``StaleWeightError``): leave them out of the dense optimizer, whose
    parameters are now ``model.parameters()``. ``spec`` and the keywords are the tables' settings
    (:meth:`hierps.Store.table`). Returns qualified name -> new collection. Then train with
    ``loss.backward(); dense_optimizer.step(); store.step()``.
    """
    store = store if store is not None else get_default_store()
    spec = TableSpec.of(spec, **settings)
    found = _collections(model, "swap_torchrec")
    if collections is not None:
        wanted = list(collections)
        missing = [n for n in wanted if n not in found]
        if missing:
            raise ConfigError(
                f"swap_torchrec: collections {missing} are not TorchRec collections of the model; its "
                f"collections are {sorted(found)}."
            )
        found = {n: found[n] for n in wanted}
    twins: dict[str, nn.Module] = {}
    old: dict[str, nn.Module] = {}
    for name, module in found.items():
        prefix = f"{name}." if name else ""
        if isinstance(module, torchrec.EmbeddingBagCollection):
            twins[name] = EmbeddingBagCollection.from_collection(
                module, store=store, prefix=prefix, spec=spec
            )
            old.update({f"{prefix}embedding_bags.{t}": m for t, m in module.embedding_bags.items()})
        else:
            twins[name] = EmbeddingCollection.from_collection(module, store=store, prefix=prefix, spec=spec)
            old.update({f"{prefix}embeddings.{t}": m for t, m in module.embeddings.items()})
    _replace(model, twins, found, None)
    retire_weights(old, {n: n for n in old})
    return twins
