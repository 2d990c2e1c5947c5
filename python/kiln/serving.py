"""The paged KV cache's host bookkeeping (C ABI version 7, docs/serving.md): KVCacheManager (blocks,
per-request block tables, reference counts, prefix caching, copy-on-write fork), SlotPlan (the
slots of new tokens and the block copies the kernels run), RadixCache (SGLang-style radix tree
over the manager's blocks) and plan_paged_decode / plan_paged_cascade_decode (a decode batch's
host plan for the paged kernels).

Not thread-safe: a manager, its radix caches and plans are used by one thread at a time. Errors
are kiln's: NotFoundError (unknown or finished request, evicted node), InvalidArgumentError (bad
configuration, request id in use, block outside the pool or already free), UnavailableError (not
enough free blocks now), ShapeMismatchError (context past a block table); a failed call changes
nothing.
"""
import ctypes
import weakref

from ._errors import InvalidArgumentError, ShapeMismatchError
from ._lib import check, lib

_P = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)

KV_DTYPES = ("f16", "bf16", "fp8_e4m3", "fp8_e5m2")
ADMISSIONS = ("now", "later", "never")


class _Config(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("num_blocks", "page_size", "dtype", "num_layers", "num_kv_heads",
                                               "head_dim", "enable_prefix_caching")]


_STAT_FIELDS = ("num_blocks", "free_blocks", "cached_free_blocks", "used_blocks", "cached_blocks", "num_requests",
                "prefix_queried_tokens", "prefix_hit_tokens", "evictions", "cow_copies")


class _Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in _STAT_FIELDS] + [("bytes_per_block", ctypes.c_uint64)]


_RADIX_STAT_FIELDS = ("nodes", "cached_tokens", "cached_blocks", "evictable_blocks", "protected_blocks",
                      "evicted_blocks", "reclaimable_blocks")


class _RadixStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in _RADIX_STAT_FIELDS]


_I64, _I32, _STR = ctypes.c_int64, ctypes.c_int32, ctypes.c_char_p
_PROTOTYPES = {
    "kiln_kv_manager_create": (ctypes.POINTER(_Config), _P),
    "kiln_kv_plan_create": (_P,),
    "kiln_kv_plan_get": (_P, _P, _P, _P, _P),
    "kiln_kv_can_allocate": (_P, _I64, _I64, _P),
    "kiln_kv_can_allocate_prompt": (_P, _I32P, _I64, _STR, _STR, _P),
    "kiln_kv_allocate": (_P, _I64, _I32P, _I64, _STR, _STR, _I32P, _I64, _P, _P),
    "kiln_kv_append_slots": (_P, _I64, _I32P, _I64, _P),
    "kiln_kv_fork": (_P, _I64, _I64),
    "kiln_kv_free": (_P, _I64),
    "kiln_kv_retain": (_P, _I32P, _I64),
    "kiln_kv_release": (_P, _I32P, _I64),
    "kiln_kv_block_table": (_P, _I64, _P, _P, _P),
    "kiln_kv_block_info": (_P, _I32, _P, _P, _P),
    "kiln_kv_get_stats": (_P, ctypes.POINTER(_Stats)),
    "kiln_kv_check": (_P,),
    "kiln_kv_enable_swap": (_P, _I32),
    "kiln_kv_swap_out": (_P, _I64, _I32P, _I64, _P),
    "kiln_kv_swap_in": (_P, _I64, _I32P, _I64, _P),
    "kiln_kv_can_swap_in": (_P, _I64, _P),
    "kiln_kv_swap_state": (_P, _I64, _P, _P, _P),
    "kiln_kv_validate_block_table": (_I32P, _I64, _I64, _I32, _I32),
    "kiln_paged_decode_plan": (_I32P, _I64, _I32P, _I32P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P),
    "kiln_paged_cascade_decode_plan": (_I32P, _I64, _I64, _I32P, _I64, _I32P, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                       _P),
    "kiln_radix_create": (_P, _P),
    "kiln_radix_match": (_P, _I32P, _I64, _I32P, _I64, _P, _P),
    "kiln_radix_insert": (_P, _I32P, _I64, _I32P, _I64, _P, _P),
    "kiln_radix_lock": (_P, _I64),
    "kiln_radix_unlock": (_P, _I64),
    "kiln_radix_evict": (_P, _I64, _P),
    "kiln_radix_get_stats": (_P, ctypes.POINTER(_RadixStats)),
    "kiln_radix_check": (_P,),
}
for _name, _argtypes in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = ctypes.c_int
    _fn.argtypes = _argtypes
for _name in ("kiln_kv_manager_destroy", "kiln_kv_plan_destroy", "kiln_kv_plan_clear", "kiln_radix_destroy"):
    getattr(lib, _name).restype = None
    getattr(lib, _name).argtypes = (_P,)


def _i32(values):
    """(pointer, count, keep-alive) of an int32 copy of a sequence of ints (or None)."""
    if values is None:
        return None, 0, None
    values = list(values)
    arr = (ctypes.c_int32 * len(values))(*values)
    return ctypes.cast(arr, _I32P), len(values), arr


def _text(s):
    return None if s is None else s.encode("utf-8")


class SlotPlan:
    """The slots of new tokens (block * page_size + offset, what reshape_and_cache takes) and the
    (src, dst) block copies to run before them; allocate and append_slots add to it."""

    def __init__(self):
        h = _P()
        check(lib.kiln_kv_plan_create(ctypes.byref(h)))
        self._h = h
        self._finalizer = weakref.finalize(self, lib.kiln_kv_plan_destroy, h)

    def clear(self):
        lib.kiln_kv_plan_clear(self._h)

    def _get(self):
        slots, n, copies, nc = _I64P(), _I64(), _I32P(), _I64()
        check(lib.kiln_kv_plan_get(self._h, ctypes.byref(slots), ctypes.byref(n), ctypes.byref(copies), ctypes.byref(nc)))
        return slots, n.value, copies, nc.value

    @property
    def slot_mapping(self):
        slots, n, _, _ = self._get()
        return slots[:n] if n else []

    @property
    def copies(self):
        _, _, copies, nc = self._get()
        flat = copies[:2 * nc] if nc else []
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(nc)]


class KVCacheManager:
    """Blocks of page_size tokens in a pool of num_blocks (the caller allocates the device memory:
    bytes_per_block each), per-request block tables, reference counts, prefix caching (full blocks
    keyed by a SHA-256 chain over the tokens and the adapter / salt), copy-on-write fork, and
    swapping requests to a host pool of num_host_blocks blocks (swap_out / swap_in)."""

    def __init__(self, num_blocks, page_size=16, dtype="bf16", num_layers=1, num_kv_heads=1, head_dim=128,
                 prefix_caching=True, num_host_blocks=0):
        if dtype not in KV_DTYPES:
            raise ValueError(f"kv cache: dtype must be one of {KV_DTYPES}, not {dtype!r}")
        cfg = _Config(num_blocks, page_size, KV_DTYPES.index(dtype), num_layers, num_kv_heads, head_dim,
                      1 if prefix_caching else 0)
        h = _P()
        check(lib.kiln_kv_manager_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h
        self.page_size = page_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self._radixes = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, lib.kiln_kv_manager_destroy, h)
        if num_host_blocks:
            self.enable_swap(num_host_blocks)

    def close(self):
        """Destroys the manager (and its radix caches first)."""
        for r in list(self._radixes):
            r.close()
        self._finalizer()

    def can_allocate(self, request, num_new_tokens):
        """"now", "later" or "never" for num_new_tokens more tokens of request (a new one when not live)."""
        out = _I32()
        check(lib.kiln_kv_can_allocate(self._h, request, num_new_tokens, ctypes.byref(out)))
        return ADMISSIONS[out.value]

    def can_allocate_prompt(self, tokens, adapter=None, salt=None):
        """"now", "later" or "never" for a new request with this prompt, counting prefix-cache hits."""
        p, n, _keep = _i32(tokens)
        out = _I32()
        check(lib.kiln_kv_can_allocate_prompt(self._h, p, n, _text(adapter), _text(salt), ctypes.byref(out)))
        return ADMISSIONS[out.value]

    def allocate(self, request, tokens, plan, adapter=None, salt=None, prefix_blocks=None):
        """Starts request with its prompt; returns how many leading tokens were cached (prefix_blocks,
        then prefix-cache hits). The slots of the other tokens go to plan."""
        p, n, _keep = _i32(tokens)
        b, nb, _keep2 = _i32(prefix_blocks)
        cached = _I64()
        check(lib.kiln_kv_allocate(self._h, request, p, n, _text(adapter), _text(salt), b, nb, plan._h,
                                   ctypes.byref(cached)))
        return cached.value

    def append_slots(self, request, tokens, plan):
        """Grows request by tokens: their slots, and a copy of a shared partly filled last block, go to plan."""
        p, n, _keep = _i32(tokens)
        check(lib.kiln_kv_append_slots(self._h, request, p, n, plan._h))

    def fork(self, parent, child):
        check(lib.kiln_kv_fork(self._h, parent, child))

    def free(self, request):
        check(lib.kiln_kv_free(self._h, request))

    def retain(self, blocks):
        p, n, _keep = _i32(blocks)
        check(lib.kiln_kv_retain(self._h, p, n))

    def release(self, blocks):
        p, n, _keep = _i32(blocks)
        check(lib.kiln_kv_release(self._h, p, n))

    def block_table(self, request):
        blocks, n, tokens = _I32P(), _I64(), _I64()
        check(lib.kiln_kv_block_table(self._h, request, ctypes.byref(blocks), ctypes.byref(n), ctypes.byref(tokens)))
        return blocks[:n.value] if n.value else []

    def num_tokens(self, request):
        n, tokens = _I64(), _I64()
        check(lib.kiln_kv_block_table(self._h, request, None, ctypes.byref(n), ctypes.byref(tokens)))
        return tokens.value

    def block_info(self, block):
        """{"ref_count", "external_refs", "cached"} of one block."""
        rc, ext, cached = _I32(), _I32(), _I32()
        check(lib.kiln_kv_block_info(self._h, block, ctypes.byref(rc), ctypes.byref(ext), ctypes.byref(cached)))
        return {"ref_count": rc.value, "external_refs": ext.value, "cached": bool(cached.value)}

    def stats(self):
        s = _Stats()
        check(lib.kiln_kv_get_stats(self._h, ctypes.byref(s)))
        return {n: getattr(s, n) for n, _ in _Stats._fields_}

    def check(self):
        """Raises InternalError naming the first broken invariant."""
        check(lib.kiln_kv_check(self._h))

    # Swapping: the manager's side (kiln/kv_cache.h). The copies are kiln.torch.swap_blocks_to_cpu /
    # swap_blocks_from_cpu (or the op swap_blocks) over the pairs these return.

    def enable_swap(self, num_host_blocks):
        """Sets the host pool (page-locked, allocated by the caller, bytes_per_block each) to
        num_host_blocks blocks; InvalidArgumentError while a request is swapped out."""
        check(lib.kiln_kv_enable_swap(self._h, num_host_blocks))

    def _swap(self, fn, request):
        n = len(self.block_table(request))
        arr = (ctypes.c_int32 * max(2 * n, 2))()
        got = _I64()
        check(fn(self._h, request, ctypes.cast(arr, _I32P), n, ctypes.byref(got)))
        return [(arr[2 * i], arr[2 * i + 1]) for i in range(got.value)]

    def swap_out(self, request):
        """Moves request's blocks to the host pool: [(device block, host block)] to copy, in table
        order. UnavailableError when the host pool has too few free blocks."""
        return self._swap(lib.kiln_kv_swap_out, request)

    def swap_in(self, request):
        """Brings a swapped-out request back into new device blocks: [(host block, device block)].
        UnavailableError when too few device blocks are free (can_swap_in says whether waiting helps)."""
        return self._swap(lib.kiln_kv_swap_in, request)

    def can_swap_in(self, request):
        out = _I32()
        check(lib.kiln_kv_can_swap_in(self._h, request, ctypes.byref(out)))
        return ADMISSIONS[out.value]

    def is_swapped(self, request):
        out = _I32()
        check(lib.kiln_kv_swap_state(self._h, request, ctypes.byref(out), None, None))
        return bool(out.value)

    def host_blocks(self):
        """(host pool blocks, free host blocks)."""
        total, free = _I32(), _I32()
        check(lib.kiln_kv_swap_state(self._h, 0, None, ctypes.byref(total), ctypes.byref(free)))
        return total.value, free.value


class RadixCache:
    """A token-level radix tree over a KVCacheManager's blocks (whole pages): match the longest cached
    prefix, insert, lock the nodes running requests use, evict unlocked leaves least recently used
    first. The tree holds one reference on each block it lists."""

    def __init__(self, manager):
        h = _P()
        check(lib.kiln_radix_create(manager._h, ctypes.byref(h)))
        self._h = h
        self._manager = manager  # destroyed after the tree
        manager._radixes.add(self)
        self._finalizer = weakref.finalize(self, lib.kiln_radix_destroy, h)

    def close(self):
        """Releases the tree's references and destroys it."""
        self._finalizer()

    def match(self, tokens):
        """(blocks of the longest cached prefix, node ending it); the prefix is len(blocks) * page_size tokens."""
        p, n, _keep = _i32(tokens)
        cap = n // self._manager.page_size
        out = (ctypes.c_int32 * max(cap, 1))()
        count, node = _I64(), _I64()
        check(lib.kiln_radix_match(self._h, p, n, ctypes.cast(out, _I32P), cap, ctypes.byref(count), ctypes.byref(node)))
        return out[:count.value], node.value

    def insert(self, tokens, blocks):
        """Caches tokens[:len(blocks) * page_size] held by blocks; returns (node, tokens already cached)."""
        p, n, _keep = _i32(tokens)
        b, nb, _keep2 = _i32(blocks)
        node, cached = _I64(), _I64()
        check(lib.kiln_radix_insert(self._h, p, n, b, nb, ctypes.byref(node), ctypes.byref(cached)))
        return node.value, cached.value

    def lock(self, node):
        check(lib.kiln_radix_lock(self._h, node))

    def unlock(self, node):
        check(lib.kiln_radix_unlock(self._h, node))

    def evict(self, num_blocks):
        """Evicts unlocked leaves until num_blocks blocks are freed in the manager; returns those freed."""
        freed = _I64()
        check(lib.kiln_radix_evict(self._h, num_blocks, ctypes.byref(freed)))
        return freed.value

    def stats(self):
        s = _RadixStats()
        check(lib.kiln_radix_get_stats(self._h, ctypes.byref(s)))
        return {n: getattr(s, n) for n in _RADIX_STAT_FIELDS}

    def check(self):
        check(lib.kiln_radix_check(self._h))


def validate_block_table(table, context_len, num_blocks, page_size):
    """What a paged kernel checks before launch: InvalidArgumentError for an entry outside the pool,
    ShapeMismatchError for a context longer than the table covers."""
    p, n, _keep = _i32(table)
    check(lib.kiln_kv_validate_block_table(p, n, context_len, num_blocks, page_size))


class _PagedDecodePlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "total_q", "max_seqlen_q", "max_seq_len", "splits",
                                               "workspace_elements")]


def _i32_array(values):
    """(pointer, count, keep-alive) of int32 values without a Python loop when numpy can view them
    (numpy arrays, CPU torch tensors); None stays None."""
    if values is None:
        return None, 0, None
    try:
        import numpy as np
        arr = np.ascontiguousarray(np.asarray(values).reshape(-1), dtype=np.int32)
        return arr.ctypes.data_as(_I32P), int(arr.size), arr
    except ImportError:
        return _i32(list(values))


def plan_paged_decode(seq_lens, *, heads, kv_heads, head_dim, page_size, num_blocks, block_tables=None,
                      max_blocks=None, cu_seqlens_q=None, sm_count=0):
    """The host plan of a paged decode batch (kiln::plan_paged_decode): seq_lens [batch] (keys per
    request), block_tables [batch, max_blocks] (checked when given: InvalidArgumentError for an entry
    outside the pool, ShapeMismatchError for keys past a table), cu_seqlens_q [batch + 1] (None: one
    query per request); host sequences, numpy arrays or CPU tensors. Returns a dict: batch, total_q,
    max_seqlen_q, max_seq_len, splits (for sm_count SMs; 0: an H100's 132) and workspace_elements
    (f32), the values the paged_decode op takes."""
    lp, batch, keep_l = _i32_array(seq_lens)
    cp, ncu, keep_c = _i32_array(cu_seqlens_q)
    tp, nt, keep_t = _i32_array(block_tables)
    if max_blocks is None:
        if block_tables is None:
            raise InvalidArgumentError("plan_paged_decode: give block_tables or max_blocks")
        max_blocks = nt // batch if batch else 0
    if cu_seqlens_q is not None and ncu != batch + 1:
        raise ShapeMismatchError("plan_paged_decode: cu_seqlens_q must hold batch + 1 offsets")
    if block_tables is not None and nt != batch * max_blocks:
        raise ShapeMismatchError("plan_paged_decode: block_tables must hold batch * max_blocks entries")
    out = _PagedDecodePlan()
    check(lib.kiln_paged_decode_plan(lp, batch, cp, tp, max_blocks, heads, kv_heads, head_dim, page_size, num_blocks,
                                     sm_count, ctypes.byref(out)))
    del keep_l, keep_c, keep_t
    return {n: int(getattr(out, n)) for n, _ in _PagedDecodePlan._fields_}


class _PagedCascadePlan(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "shared_len", "max_seq_len", "shared_splits", "splits",
                                               "workspace_elements")]


def plan_paged_cascade_decode(shared_block_table, shared_len, seq_lens, *, heads, kv_heads, head_dim, page_size,
                              num_blocks, block_tables=None, max_blocks=None, sm_count=0):
    """The host plan of a cascade decode step (kiln::plan_paged_cascade_decode): the shared prefix's
    blocks and length, each request's own seq_lens [batch] and block_tables [batch, max_blocks]
    (checked when given). Returns a dict: batch, shared_len, max_seq_len, shared_splits, splits and
    workspace_elements (f32), the values the paged_cascade_decode op takes."""
    sp, ns, keep_s = _i32_array(shared_block_table)
    lp, batch, keep_l = _i32_array(seq_lens)
    tp, nt, keep_t = _i32_array(block_tables)
    if max_blocks is None:
        if block_tables is None:
            raise InvalidArgumentError("plan_paged_cascade_decode: give block_tables or max_blocks")
        max_blocks = nt // batch if batch else 0
    if block_tables is not None and nt != batch * max_blocks:
        raise ShapeMismatchError("plan_paged_cascade_decode: block_tables must hold batch * max_blocks entries")
    out = _PagedCascadePlan()
    check(lib.kiln_paged_cascade_decode_plan(sp, ns, shared_len, lp, batch, tp, max_blocks, heads, kv_heads, head_dim,
                                             page_size, num_blocks, sm_count, ctypes.byref(out)))
    del keep_s, keep_l, keep_t
    return {n: int(getattr(out, n)) for n, _ in _PagedCascadePlan._fields_}


__all__ = ["KVCacheManager", "RadixCache", "SlotPlan", "validate_block_table", "plan_paged_decode",
           "plan_paged_cascade_decode", "KV_DTYPES", "ADMISSIONS"]
