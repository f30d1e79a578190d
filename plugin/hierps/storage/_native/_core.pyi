"""hierps' compiled loops over bytes (``_core.c``); the Python side is :mod:`hierps.storage._native`.

Buffers are anything with the buffer protocol (numpy arrays, bytes, memoryviews), C-contiguous;
"int64 array" means a contiguous numpy int64 (or uint64) array. Every function checks the offsets
and lengths it is given (``ValueError``) and releases the GIL while it loops.
"""

from typing import TypeAlias

from numpy import ndarray
from typing_extensions import Buffer as _Buffer

Buffer: TypeAlias = _Buffer | ndarray  # numpy's stubs give arrays __buffer__ only from Python 3.12

def crc32c(data: Buffer, value: int = 0) -> int:
    """The crc32c of ``data`` continuing ``value``: ``crc32c.crc32c(data, value)``."""

def check_gather(
    buf: Buffer,
    at: Buffer,
    chunks: Buffer,
    payload: int,
    seed: int,
    pos: Buffer,
    chunk_rows: int,
    row_bytes: int,
    out: Buffer | None,
    slot: Buffer | None = None,
) -> tuple[int, int, int, int]:
    """Check the chunks at byte offsets ``at`` (c,) int64 of ``buf`` (each ``payload`` bytes, its
    crc32c, its binding tag for chunk number ``chunks[i]`` in an array of ``seed``), and copy row
    ``pos[j]`` (k,) int64 of its chunk (``chunk_rows`` rows of ``row_bytes``) to row ``j`` of ``out``
    (k * row_bytes bytes, or None: check only). The chunk of a row is ``slot[j]``, or, without
    ``slot``, the chunk of ``chunks`` (sorted) that holds it, rows given in chunk order.

    Returns (first chunk whose crc32c fails or -1, their count, first chunk whose crc32c passes and
    binding tag fails or -1, their count); rows are copied either way.
    """

def plan_chunks(pos: Buffer, chunk_rows: int, n: int, chunks: Buffer) -> tuple[int, int, int, int]:
    """The rows ``pos`` (k,) int64 (k >= 1) of an array of ``n`` rows in chunks of ``chunk_rows``:
    (c, kind, min row, max row). kind 0: a row lies outside the array; 1: a range of consecutive
    rows; 2: rows in chunk order; 3: rows out of chunk order. For 1 and 2, ``chunks[:c]`` ((>= k,)
    int64) holds the chunks holding them, in order, each once."""

def plan_runs(
    start: Buffer,
    file: Buffer,
    chunk_bytes: int,
    gap: int,
    piece: int,
    at: Buffer,
    run_chunk: Buffer,
    run_file: Buffer,
    run_start: Buffer,
    run_dest: Buffer,
    pos: Buffer | None,
    chunks: Buffer | None,
    chunk_rows: int,
    run_row: Buffer | None,
) -> int:
    """Cut chunks at offsets ``start`` (c,) int64 of files ``file`` (c,), each ``chunk_bytes`` long, into
    runs of one pread, as :meth:`hierps.storage._reads._Plan.place` does in numpy: same file, in order,
    gaps up to ``gap`` read through, cut where the offset from the group's first chunk crosses a
    multiple of ``piece``. Fills ``at`` (c,), ``run_chunk`` (c + 1,: the first r + 1 used), ``run_file``,
    ``run_start`` (c,: r used), ``run_dest`` (c + 1,: r + 1 used), and, given rows ``pos`` (k,) in chunk
    order of ``chunks`` (c,) of ``chunk_rows`` rows, ``run_row`` (c + 1,: r + 1 used). Returns r."""

def read_check_gather(
    fds: Buffer,
    run_start: Buffer,
    run_dest: Buffer,
    run_chunk: Buffer,
    run_row: Buffer,
    first: int,
    stop: int,
    scratch: Buffer,
    at: Buffer,
    chunks: Buffer,
    pos: Buffer,
    payload: int,
    seed: int,
    chunk_rows: int,
    row_bytes: int,
    out: Buffer,
    cached: bool = False,
) -> tuple[int, int, int, int, int, int]:
    """Runs ``first:stop`` of a request, all in one call without the GIL: ``pread`` run ``i``
    (``run_dest[i + 1] - run_dest[i]`` bytes at ``run_start[i]`` of descriptor ``fds[i]``; (r,) and
    (r + 1,) int64) into ``scratch``, one after the other (chunk ``c`` then lies at ``at[c] -
    run_dest[first]``), retrying short reads and EINTR; then :func:`check_gather` of their chunks
    ``run_chunk[first]:run_chunk[stop]`` and rows ``run_row[first]:run_row[stop]`` of ``pos`` into the
    same rows of ``out`` (every row of the request, ``len(pos) * row_bytes`` bytes).

    Returns (the first run that failed or -1, the bytes it got before its file ended or ``-errno``,
    then :func:`check_gather`'s four numbers, chunk indices counted in ``chunks``), or, when a run
    failed, no check (-1, 0, -1, 0).

    With ``cached``, only what the page cache holds (``RWF_NOWAIT``): the first run not wholly there
    stops the call as failed with ``-EAGAIN`` (also where the kernel or file system cannot say), the
    runs before it read and checked. Such a call keeps the GIL when its runs come to less than 256 KiB.
    """

def encode_chunks(
    rows: Buffer, chunk_rows: int, first: int, seed: int, stride: int, out: Buffer, content: int
) -> int:
    """Chunks ``first``.. of an array of ``seed`` from ``rows`` (n, row bytes) uint8, each row contiguous,
    the rows any step apart (a column slice of a wider array), n a multiple of ``chunk_rows``: each chunk's
    rows to ``out`` at a step of ``stride`` bytes, followed by its crc32c and binding tag (little endian)
    and zeros. Returns the crc32c of the rows' bytes in order, continuing ``content``."""

def binding_tags(chunks: Buffer, crcs: Buffer, seed: int, out: Buffer) -> None:
    """The binding tags (c,) uint32 into ``out`` of chunks ``chunks`` (c,) int64 with crc32c ``crcs`` (c,) uint32."""

def bloom_add(filt: Buffer, keys: Buffer) -> None:
    """Set the bits of ``keys`` (n,) int64 in the one-block filter ``filt`` (w,) uint64 (w >= 1), as
    :func:`hierps.storage._filter.bloom_add` does."""

def bloom_may_contain(filt: Buffer, keys: Buffer, block: Buffer | None, full_words: int, out: Buffer) -> None:
    """``out`` (n,) bool: False where the filter ``filt`` proves ``keys[i]`` absent; with ``block`` (n,)
    int64, key i is in block ``block[i]`` of ``full_words`` words (the last block: the rest of ``filt``),
    as :func:`hierps.storage._filter.blocks_may_contain`; without, one block."""

def slot_find(index: Buffer, keys: Buffer, slots: Buffer, found: Buffer) -> int:
    """Look ``keys`` (n,) int64 up in ``index`` (2 * cap,) int64 (cap a power of two; entries ``(key,
    slot + 1)``, 0 empty; linear probing from splitmix64): ``slots`` (n,) int64 the slot or 0,
    ``found`` (n,) bool; returns how many were found (:class:`hierps.tiers._slot_index.SlotIndex`)."""

def slot_put(index: Buffer, used: int, keys: Buffer, slots: Buffer) -> int:
    """Put ``keys`` (n,) int64 at ``slots`` (n,) int64 >= 0 in ``index``, which holds ``used`` entries
    (added, or moved where present); returns how many were added. ``ValueError`` (and no later key put) where a slot is
    negative or the index would be more than half full."""

def slot_drop(index: Buffer, keys: Buffer) -> int:
    """Remove ``keys`` (n,) int64 from ``index`` (those absent are ignored), shifting back the entries
    after each so that every probe sequence still ends at an empty entry; returns how many were removed."""

def match_rows(
    block: Buffer,
    width: int,
    keys: Buffer,
    which: Buffer,
    found: Buffer,
    holder: Buffer,
    seg: int,
    rows: Buffer | None,
) -> int:
    """A segment's rows read for a lookup to the keys asked: ``block`` (k, 2 + width) float32 in key
    order (each row's int64 key in its first 8 bytes), ``keys`` (n,) int64 sorted, ``which`` (m,) int64
    ascending positions among them. Where ``keys[which[j]]`` is in the block and ``found`` (n,) bool is
    still False there: ``found`` True, ``holder`` (n,) int64 = ``seg`` and, unless ``rows`` is None,
    ``rows`` (n, width) float32 at that position = the block row's weights. Returns how many it found
    (as ``hierps.tiers._ssd.SsdTier._locate_slice``'s numpy code)."""

def insert_sorted(
    keys: Buffer, slots: Buffer, new_keys: Buffer, new_slots: Buffer, out_keys: Buffer, out_slots: Buffer
) -> None:
    """``keys`` (n,) int64 ascending with their ``slots`` (n,) int64, and ``new_keys`` (m,) int64 ascending
    (none among ``keys``) with ``new_slots`` (m,): both into ``out_keys`` / ``out_slots`` (n + m,) int64,
    ascending, each new key before the first key not below it (``np.insert`` at ``np.searchsorted``, as
    ``hierps.tiers._memory._Slab.insert``'s numpy code)."""

def find_sorted(sorted_keys: Buffer, keys: Buffer, found: Buffer, at: Buffer) -> int:
    """Where ``keys`` (m,) int64 stand in ``sorted_keys`` (n,) int64 ascending: ``at`` (m,) int64 the
    first position whose key is not below each (``np.searchsorted``, side left) clamped to ``n - 1``
    (0 when ``n`` is 0), ``found`` (m,) bool where that position holds the key. Returns how many were
    found (as ``hierps.rows._ids.find_sorted``'s numpy code). Ascending keys are searched from where the
    one before stopped."""

def unique_ids(ids: Buffer, keys: Buffer, inverse: Buffer, counts: Buffer) -> int:
    """``torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)`` of ``ids`` (n,) int64:
    returns u, the distinct ids, sorted, in ``keys[:u]`` and their counts in ``counts[:u]`` ((n,) int64
    each), each id's position among them in ``inverse`` (n,) int64."""

def group_ids(
    ids: Buffer,
    keep: Buffer,
    at: Buffer,
    search: bool,
    local: Buffer,
    order: Buffer,
    where: Buffer,
    counts: Buffer,
) -> int:
    """A mini-batch's ids (n,) int64 of one table grouped by key: ``keep`` (K,) int64, strictly increasing,
    holds every id; ``at`` (n,) int64 is each id's position in ``keep``, given, or (``search``) found by
    binary search and written. Returns u, the distinct ids' count; fills ``where[:u]`` (their positions in
    ``keep``, increasing) and ``counts[:u]``, ``local`` (each id's number among them) and ``order``
    (``np.argsort(local, kind="stable")``), each (n,) int64. ``ValueError`` for an id not in ``keep``."""

def merge_runs(
    keys: list[Buffer],
    rows: list[Buffer],
    ranks: Buffer,
    newest_only: bool,
    out_keys: Buffer,
    out_rows: Buffer,
    out_src: Buffer,
) -> int:
    """Merge k sorted parts: ``keys[i]`` (n_i,) int64 strictly increasing, ``rows[i]`` (n_i, ...) of
    equal row bytes (each row contiguous, any row stride), part i of rank ``ranks[i]``. Entries in key
    order and, within a key, by rank descending (``newest_only``: only the first of each key) into
    ``out_keys`` (N,) int64, ``out_rows`` (N rows, contiguous) and ``out_src`` (N,) int64 (their ranks),
    N the parts' total; returns how many were written. As :func:`hierps.storage._merge.merged_sources`
    sorts them with ``np.lexsort``."""

def hardware() -> bool:
    """Whether crc32c runs on the CPU's crc32 instruction (SSE4.2), not on the table."""

def set_hardware(on: bool) -> bool:
    """Use the crc32 instruction (where the CPU has it) or the table; returns the previous setting."""

def index_add_rows(dst: Buffer, rows: Buffer, src: Buffer, width: int) -> None:
    """``dst[rows[i]] += src[i]`` for each entry ``i`` in order, rows of ``width`` float32: ``dst``
    (U * width,) float32, ``rows`` (n,) int64 in [0, U) (``IndexError`` before anything is added),
    ``src`` (n * width,) float32. The floats of ``torch.Tensor.index_add_(0, rows, src)`` on the CPU."""
