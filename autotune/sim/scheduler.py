"""A scheduler that behaves like vLLM V1's (v1/core/sched/scheduler.py, kv_cache_manager.py).

Each step has a token budget of max_num_batched_tokens. Running requests are served first,
in order: a decoding request takes one token, a partly prefilled one the rest of its prompt
(a chunk when the budget or long_prefill_token_threshold cuts it). When the KV cache has no
free block for a running request, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the head of the queue, to be recomputed from its
prompt and the tokens it already produced. Only in a step without preemption are waiting
requests admitted, first come first served, while fewer than max_num_seqs run and budget
is left; without chunked prefill a prompt that does not fit the rest of the budget waits.

The KV cache is a pool of blocks of block_size tokens. With prefix caching, every full block
has a hash chained over its tokens; a freed block keeps its hash and stays reusable until it
is evicted (least recently freed first), and an admitted request starts from the longest run
of cached blocks of its prompt (never the whole prompt: the last token is always computed).
A model with sliding-window layers (gpt-oss) sizes its blocks by its full-attention layers;
each running request also holds a fixed number of blocks for its window (``window_blocks``).

Token identity is reduced to block hashes, which the caller computes with ``block_hashes``
(``Request.block_hashes``): from real token ids in the server, from stand-ins for the blocks
(the prefix group, the request) in virtual time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["Request", "KVCache", "Scheduler", "StepPlan", "NoBlocks", "block_hashes"]


def block_hashes(tokens: Sequence[Hashable], block_size: int) -> list[int]:
    """vLLM's prefix-cache keys: one hash per full block of ``block_size`` tokens, chained over the blocks
    before it, so two prompts have equal hashes for block i exactly when they agree up to the end of block i.

    ``tokens`` identify the prompt's tokens: its token ids where they are known (the server, with the
    engine's block size), else one stand-in per block with ``block_size`` 1 (virtual time, where a prompt
    is only a length, a prefix group and a request: ``virtual.prompt_blocks``).
    """
    out: list[int] = []
    h = 0
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


@dataclass(eq=False)
class Request:
    id: str
    prompt_len: int
    max_tokens: int
    arrival_s: float = 0.0
    # hash of each full block of the prompt (shared prefixes give equal hashes); output blocks
    # get hashes of their own as they fill
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_output: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the last admission
    blocks: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(default_factory=list)  # its sliding-window layers' pages (KVCache.window_blocks)
    num_hashed_blocks: int = 0  # blocks already offered to the prefix cache
    first_scheduled_s: float | None = None
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must be in the KV cache before the next token."""
        return self.prompt_len + self.num_output

    def hash_of_block(self, i: int) -> int:
        if i < len(self.block_hashes):
            return self.block_hashes[i]
        return hash((self.id, "out", i))  # generated tokens are this request's own


class NoBlocks(Exception):
    pass


class FreeQueue:
    """The free blocks in eviction order: the never-used ones first, in order (vLLM's queue starts as every
    block), then the freed ones, oldest first. Held as a counter and the freed blocks, so that a cache of a
    million blocks (a small model on a big host) costs nothing to set up."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.next_fresh = 0  # every block from here on was never used
        self.freed: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return self.num_blocks - self.next_fresh + len(self.freed)

    def __contains__(self, block: int) -> bool:
        return self.next_fresh <= block < self.num_blocks or block in self.freed

    def popleft(self) -> int:
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.freed.popitem(last=False)[0]

    def remove(self, block: int) -> None:
        del self.freed[block]  # only a block used before (a cached one) is taken out of order

    def append(self, block: int) -> None:
        self.freed[block] = None


class KVCache:
    """Blocks with reference counts, a free queue in eviction order, and the prefix-cache map."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool, window_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # what a running request's sliding-window layers hold, in blocks of the pool: vLLM's hybrid KV cache
        # manager keeps their last window of tokens only, in pages of the same size as the full layers'
        self.window_blocks = window_blocks
        self.ref = [0] * num_blocks
        self.free = FreeQueue(num_blocks)  # front: evicted first
        self.cached: dict[int, int] = {}  # block hash -> block
        self.hash_of: dict[int, int] = {}  # block -> its hash, while cached
        self.queries = 0  # prefix-cache lookups, in tokens (vllm:prefix_cache_queries_total)
        self.hits = 0  # tokens found (vllm:prefix_cache_hits_total)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0

    def computed_blocks(self, req: Request) -> list[int]:
        """The cached blocks a newly admitted request can start from (see ``record_lookup``)."""
        if not self.prefix_caching:
            return []
        out = []
        # at least the last prompt token is computed, so its block cannot come from the cache
        limit = (req.num_tokens - 1) // self.block_size
        for i in range(limit):
            b = self.cached.get(req.hash_of_block(i))
            if b is None:
                break
            out.append(b)
        return out

    def record_lookup(self, req: Request, hit_tokens: int) -> None:
        """Count an admitted request's lookup in the prefix-cache counters.

        Like vLLM (scheduler.py: "Record at admission so unscheduled lookups are not counted"):
        a request that stays blocked at the head of the queue is looked up again every step but
        counted once, and recomputation after a preemption is kept out of
        vllm:prefix_cache_queries/hits (PrefixCacheStats.record counts it as preempted_*).
        Counting every lookup inflated both counters while admission was blocked.
        """
        if self.prefix_caching and req.num_preemptions == 0:
            self.queries += req.num_tokens
            self.hits += hit_tokens

    def allocate(self, req: Request, num_new_tokens: int, computed: Sequence[int] = ()) -> bool:
        """Blocks for ``num_new_tokens`` more tokens of ``req``; False (and no change) when there are too few."""
        held = len(req.blocks) + len(computed)
        need = -(-(req.num_computed + len(computed) * self.block_size + num_new_tokens) // self.block_size) - held
        window = self.window_blocks - len(req.window_blocks)
        # computed blocks that nobody holds sit in the free queue: taking them uses free capacity too
        reuse_free = sum(1 for b in computed if self.ref[b] == 0)
        if need + window > len(self.free) - reuse_free:
            return False
        for _ in range(window):
            req.window_blocks.append(self._take())
        for b in computed:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            req.blocks.append(b)
        for _ in range(max(need, 0)):
            req.blocks.append(self._take())
        return True

    def _take(self) -> int:
        """The next free block, evicted from the prefix cache if it was there, held once."""
        b = self.free.popleft()
        h = self.hash_of.pop(b, None)
        if h is not None and self.cached.get(h) == b:
            del self.cached[h]  # evicted
        self.ref[b] = 1
        return b

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Offer the full blocks of the first ``num_tokens`` tokens (default: the computed ones) to the cache."""
        if not self.prefix_caching:
            return
        full = (req.num_computed if num_tokens is None else num_tokens) // self.block_size
        for i in range(req.num_hashed_blocks, full):
            b = req.blocks[i]
            if b in self.hash_of:
                continue  # came from the cache
            h = req.hash_of_block(i)
            if h not in self.cached:  # a twin computed at the same time keeps the first copy
                self.cached[h] = b
                self.hash_of[b] = h
        req.num_hashed_blocks = max(req.num_hashed_blocks, full)

    def release(self, req: Request) -> None:
        # tail first into the free queue, so a prompt's head (the shareable prefix) is evicted last
        for b in [*req.window_blocks, *reversed(req.blocks)]:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        req.blocks = []
        req.window_blocks = []
        req.num_hashed_blocks = 0


@dataclass
class StepPlan:
    """One step: tokens per request, and what each is (for the step's cost)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        max_model_len: int | None = None,
        window_blocks: int = 0,
    ) -> None:
        self.kv = KVCache(num_blocks, block_size, prefix_caching, window_blocks)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.on_finish: Callable[[Request], None] = lambda r: None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        """A client went away: free what it holds."""
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finished = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float = 0.0) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        kv, bs, running = self.kv, self.kv.block_size, self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + req.num_output - req.num_computed
            if 0 < self.threshold < n:
                n = self.threshold
            if n > budget:
                n = budget
            end = req.num_computed + n
            # most steps of a decoding request fit the blocks it holds: no allocation to try
            if end > len(req.blocks) * bs:
                preempted_self = False
                while not kv.allocate(req, n):
                    victim = running.pop()  # FCFS: the latest admitted goes first
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is req:
                        preempted_self = True
                        break
                if preempted_self:
                    break
            if kv.prefix_caching and end // bs > req.num_hashed_blocks:
                kv.cache_full_blocks(req, end)
            plan.scheduled.append((req, n))
            budget -= n
            i += 1
        if plan.preempted:
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed = self.kv.computed_blocks(req)
            cached = len(computed) * self.kv.block_size
            want = req.num_tokens - cached
            n = min(want, self.threshold) if self.threshold > 0 else want
            # vLLM cuts the prompt to long_prefill_token_threshold before this check (as it does for
            # running requests), so the threshold chunks even without chunked prefill
            if not self.chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.kv.allocate(req, n, computed):
                break
            self.kv.record_lookup(req, cached)
            self.waiting.popleft()
            req.num_computed = cached
            req.num_cached_tokens = cached
            # vLLM caches the blocks this step fills when it allocates them (allocate_slots ->
            # cache_blocks), so a request admitted later in this same step shares a prefix that is
            # being computed now instead of computing it again; caching only after the step made
            # every request of a burst compute a shared system prompt of its own
            self.kv.cache_full_blocks(req, cached + n)
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now
            self.running.append(req)
            plan.scheduled.append((req, n))
            budget -= n
        return plan

    def _preempt(self, req: Request) -> None:
        self.kv.release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish_step(self, plan: StepPlan) -> list[Request]:
        """Apply a step's work: returns the requests that produced a token in it."""
        produced = []
        done = []
        for req, n in plan.scheduled:
            req.num_computed += n  # its full blocks were offered to the cache when scheduled
            if req.num_computed >= req.num_tokens:  # caught up: this step sampled a token
                req.num_output += 1
                produced.append(req)
                # vLLM's check_stop also ends a request whose prompt and output reach max_model_len
                # (finish_reason "length"); without it a request grew past max_model_len, and past a
                # KV cache sized for max_model_len
                if req.num_output >= req.max_tokens or (
                    self.max_model_len is not None and req.num_tokens >= self.max_model_len
                ):
                    done.append(req)
        for req in done:
            req.finished = True
            self.running.remove(req)
            self.kv.release(req)
            self.on_finish(req)
        return produced
