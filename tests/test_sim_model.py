"""The vllm-sim model itself: scheduler invariants, prefix caching, chunked prefill, start-up
memory boundaries and the step-time model. Pure Python, no GPU, no engine; the whole file
runs in a few seconds.

The scheduler is driven directly (requests added over steps, ``schedule`` then
``finish_step``), and its state is checked after every ``schedule`` against what vLLM V1's
scheduler and KV cache manager guarantee.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from autotune.engine.failures import FailureClass, LogWatch, classify_exit
from autotune.engine.vllm.failures import PATTERNS
from autotune.sim.config import SimConfig
from autotune.sim.perf import StepModel, marlin_kernels, weight_only
from autotune.sim.profiles import gpu_profile, model_shape
from autotune.sim.scheduler import Request, Scheduler, StepPlan, block_hashes
from autotune.sim.startup import plan_startup
from autotune.sim.virtual import SimEngine, StartupFailed, capacity, simulate
from autotune.measure.metrics import summarize
from autotune.measure.slo import parse_slos
from autotune.workload.synth import SCENARIOS, synthesize

GiB = 1 << 30
H100 = gpu_profile("h100-80gb")


# --- helpers: requests with block hashes, a checked driver ----------------------------------

def hashes(rid: str, prompt_len: int, bs: int, group: str | None = None, shared_tokens: int = 0) -> list[int]:
    """Full prompt blocks inside the shared part hash by group (equal across the group), the rest by request."""
    shared = min(shared_tokens, prompt_len) // bs if group is not None else 0
    stand_ins = [("group", group, i) if i < shared else ("own", rid, i) for i in range(prompt_len // bs)]
    return block_hashes(stand_ins, 1)  # one stand-in per block


def make_req(rid: str, prompt_len: int, max_tokens: int, bs: int = 16, group: str | None = None,
             shared_tokens: int = 0) -> Request:
    return Request(rid, prompt_len, max_tokens, block_hashes=hashes(rid, prompt_len, bs, group, shared_tokens))


def make_sched(num_blocks: int = 64, bs: int = 16, seqs: int = 8, budget: int = 256, chunked: bool = True,
               caching: bool = True, threshold: int = 0, max_model_len: int | None = None) -> Scheduler:
    return Scheduler(num_blocks=num_blocks, block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=budget,
                     chunked_prefill=chunked, prefix_caching=caching, long_prefill_token_threshold=threshold,
                     max_model_len=max_model_len)


def check_after_schedule(s: Scheduler, plan: StepPlan, running_before: set[int]) -> None:
    kv = s.kv
    bs = kv.block_size
    # batch limits
    assert len(s.running) <= s.max_num_seqs
    assert plan.num_tokens <= s.max_num_batched_tokens
    ids = [id(r) for r, _ in plan.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    new_tokens = {id(r): n for r, n in plan.scheduled}
    running = {id(r) for r in s.running}
    for r, n in plan.scheduled:
        assert id(r) in running
        assert 1 <= n <= r.num_tokens - r.num_computed
        if s.threshold > 0:
            assert n <= s.threshold
        admitted = id(r) not in running_before
        if admitted:
            # starts from its prefix-cache hit, whole blocks only, never the last prompt token
            assert r.num_computed == r.num_cached_tokens
            assert r.num_cached_tokens % bs == 0
            assert r.num_cached_tokens <= r.num_tokens - 1
            if not kv.prefix_caching:
                assert r.num_cached_tokens == 0
            if not s.chunked_prefill and s.threshold == 0:
                assert n == r.num_tokens - r.num_computed, "a prompt was chunked without chunked prefill"
    if plan.preempted:
        # a step that preempts admits nobody
        assert all(id(r) in running_before for r, _ in plan.scheduled)
    for r in plan.preempted:
        assert r in s.waiting and r.blocks == [] and r.num_computed == 0 and r.num_preemptions > 0
    # waiting requests hold nothing and have computed nothing
    for r in s.waiting:
        assert r.blocks == [] and r.num_computed == 0 and not r.finished
    # each running request holds exactly the blocks for what it has computed plus this step's tokens
    holders: Counter[int] = Counter()
    for r in s.running:
        assert len(r.blocks) == len(set(r.blocks)), "a request holds one block twice"
        covered = r.num_computed + new_tokens.get(id(r), 0)
        assert len(r.blocks) == math.ceil(covered / bs), (r.id, len(r.blocks), covered)
        holders.update(r.blocks)
        for i, b in enumerate(r.blocks):
            if b in kv.hash_of:  # a cached block holds exactly this request's tokens at that position
                assert kv.hash_of[b] == r.hash_of_block(i)
                assert (i + 1) * bs <= covered, "a block is cached before it is full"
    # reference counts, sharing, the free queue, conservation
    for b in range(kv.num_blocks):
        assert kv.ref[b] == holders[b], f"block {b}: ref {kv.ref[b]} but {holders[b]} holders"
        assert (b in kv.free) == (holders[b] == 0), f"block {b}: free={b in kv.free}, holders={holders[b]}"
        if holders[b] > 1:
            assert kv.prefix_caching and b in kv.hash_of, f"block {b} shared by {holders[b]} but not a cached block"
    assert len(kv.free) + len(holders) == kv.num_blocks
    # the prefix-cache map and its inverse agree
    assert len(kv.cached) == len(kv.hash_of)
    for b, h in kv.hash_of.items():
        assert kv.cached[h] == b
    if not kv.prefix_caching:
        assert not kv.cached


def check_after_finish(s: Scheduler, plan: StepPlan, produced: list[Request]) -> None:
    for r, _ in plan.scheduled:
        assert r.num_output <= r.max_tokens
        if r.finished:
            assert r not in s.running and r.blocks == []
            assert r.num_output == r.max_tokens or (s.max_model_len and r.num_tokens >= s.max_model_len)
        else:
            assert r in s.running
            assert r.num_computed < r.num_tokens  # the newest token's KV is next step's work
    assert all(r.num_computed + 1 >= r.num_tokens for r in produced)


def drive(s: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 50_000) -> int:
    """Add each request at its step, run until all finish, check every step; returns steps taken."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    k = 0
    step = 0
    while k < len(arrivals) or s.has_work:
        assert step < max_steps, "no progress"
        while k < len(arrivals) and arrivals[k][0] <= step:
            s.add(arrivals[k][1])
            k += 1
        before = {id(r) for r in s.running}
        plan = s.schedule(float(step))
        check_after_schedule(s, plan, before)
        if s.has_work:
            assert plan.scheduled or plan.preempted, "work left but nothing scheduled"
        produced = s.finish_step(plan)
        check_after_finish(s, plan, produced)
        step += 1
    # everything handed back
    assert len(s.kv.free) == s.kv.num_blocks and not any(s.kv.ref)
    return step


def random_workload(seed: int, bs: int, n: int = 60, max_prompt: int = 360) -> list[tuple[int, Request]]:
    """Requests over steps: some share a system prompt, some repeat a whole prompt (block-aligned
    lengths included, so the last-token rule matters), the rest are their own."""
    rng = random.Random(seed)
    groups = [("sys-a", 64), ("sys-b", 160), ("sys-c", 5 * bs)]
    templates = [("tmpl-0", 4 * bs), ("tmpl-1", 100), ("tmpl-2", 8 * bs)]
    out = []
    t = 0
    for i in range(n):
        t += rng.choice((0, 0, 1, 2, 3, 5))
        rid = f"r{i}"
        kind = rng.random()
        if kind < 0.4:
            g, p = rng.choice(groups)
            length = min(p + rng.randint(1, 200), max_prompt)
            req = Request(rid, length, rng.randint(1, 120), block_hashes=hashes(rid, length, bs, g, p))
        elif kind < 0.6:
            g, length = rng.choice(templates)
            req = Request(rid, length, rng.randint(1, 120), block_hashes=hashes(rid, length, bs, g, length))
        else:
            length = rng.randint(1, max_prompt)
            req = Request(rid, length, rng.randint(1, 120), block_hashes=hashes(rid, length, bs))
        out.append((t, req))
    return out


# (name, scheduler kwargs, small cache: preemption must happen)
CONFIGS = [
    ("small-chunked-caching", dict(num_blocks=40, bs=16, seqs=8, budget=256), True),
    ("small-chunked-nocache-threshold", dict(num_blocks=40, bs=16, seqs=8, budget=256, caching=False, threshold=64), True),
    ("small-nochunk-caching", dict(num_blocks=40, bs=16, seqs=8, budget=512, chunked=False), True),
    ("small-nochunk-nocache", dict(num_blocks=36, bs=16, seqs=6, budget=400, chunked=False, caching=False), True),
    ("small-bs32-threshold", dict(num_blocks=20, bs=32, seqs=8, budget=300, threshold=100), True),
    ("large-chunked-threshold", dict(num_blocks=2000, bs=16, seqs=16, budget=512, threshold=100), False),
    ("few-seqs", dict(num_blocks=200, bs=16, seqs=2, budget=128), False),
    # prompt + max_tokens past max_model_len: stopped there (prompts stay below it, as the server ensures)
    ("max-model-len", dict(num_blocks=40, bs=16, seqs=8, budget=256, max_model_len=320), True),
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name,kw,small", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_scheduler_invariants_random(name, kw, small, seed):
    s = make_sched(**kw)
    mml = kw.get("max_model_len")
    work = random_workload(seed, kw["bs"], max_prompt=mml - 20 if mml else 360)
    drive(s, work)
    reqs = [r for _, r in work]
    if mml:
        assert all(r.finished and r.num_output == min(r.max_tokens, mml - r.prompt_len) for r in reqs)
        assert any(r.num_output < r.max_tokens for r in reqs)
    else:
        assert all(r.finished and r.num_output == r.max_tokens for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == s.num_preemptions
    if small:
        assert s.num_preemptions > 0, "the small cache never ran out: the test does not exercise preemption"
        assert any(r.num_preemptions > 0 for r in reqs)
    else:
        assert s.num_preemptions == 0
    if s.kv.prefix_caching:
        assert s.kv.hits > 0 and any(r.num_cached_tokens > 0 for r in reqs)
        # one lookup counted per request, at its first admission (recomputation is not counted)
        assert s.kv.queries == sum(r.prompt_len for r in reqs)
        assert s.kv.hits >= sum(r.num_cached_tokens for r in reqs if r.num_preemptions == 0)
        assert s.kv.hits < s.kv.queries
    else:
        assert s.kv.hits == 0 and all(r.num_cached_tokens == 0 for r in reqs)


def test_preempted_request_recomputes_prompt_and_outputs():
    # two requests that cannot both grow in 8 blocks: the later one is preempted and recomputed
    s = make_sched(num_blocks=8, bs=16, seqs=4, budget=256, caching=False)
    a, b = make_req("a", 60, 40), make_req("b", 60, 40)
    s.add(a)
    s.add(b)
    preempted_at = None
    step = 0
    while s.has_work:
        plan = s.schedule(float(step))
        if b in plan.preempted and preempted_at is None:
            preempted_at = b.num_output
            assert b.num_output > 0 and s.waiting[0] is b
        if preempted_at is not None and b.num_computed == 0 and any(r is b for r, _ in plan.scheduled):
            n = dict((r.id, n) for r, n in plan.scheduled)["b"]
            assert n == b.prompt_len + b.num_output  # recompute prompt and the tokens it already produced
        s.finish_step(plan)
        step += 1
    assert preempted_at is not None and b.num_preemptions >= 1
    assert a.num_output == 40 and b.num_output == 40


def test_fcfs_preemption_picks_latest_admitted():
    s = make_sched(num_blocks=6, bs=16, seqs=4, budget=256, caching=False)
    reqs = [make_req(f"r{i}", 16, 50) for i in range(3)]  # each takes one block, then grows
    for r in reqs:
        s.add(r)
    victims = []
    while s.has_work and not victims:
        plan = s.schedule()
        victims = plan.preempted
        s.finish_step(plan)
    assert victims and victims[0] is reqs[2]


def test_abort_frees_blocks():
    s = make_sched(num_blocks=32)
    a, b = make_req("a", 100, 10), make_req("b", 50, 10)
    s.add(a)
    s.add(b)
    s.finish_step(s.schedule())
    s.abort(a)
    assert a.finished and a.blocks == [] and a not in s.running
    plan = s.schedule()
    check_after_schedule(s, plan, {id(b)})


def test_stops_at_max_model_len():
    # vLLM finishes a request when prompt + output reaches max_model_len (check_stop), whatever max_tokens says
    s = make_sched(num_blocks=8, bs=16, max_model_len=64)
    r = make_req("r", 60, 100)
    s.add(r)
    for _ in range(50):
        if not s.has_work:
            break
        s.finish_step(s.schedule())
    assert r.finished and r.num_output == 4 and r.num_tokens == 64
    assert len(s.kv.free) == 8


# --- prefix caching -------------------------------------------------------------------------

def run_until_done(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.add(r)
    for _ in range(10_000):
        if not s.has_work:
            return
        s.finish_step(s.schedule())
    raise AssertionError("did not finish")


def admit(s: Scheduler, r: Request) -> int:
    """Add ``r`` to an idle scheduler and run one step; returns the tokens it was given."""
    s.add(r)
    plan = s.schedule()
    n = dict((id(q), n) for q, n in plan.scheduled)[id(r)]
    s.finish_step(plan)
    return n


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefix_hits_only_with_prefix_caching(caching):
    s = make_sched(num_blocks=64, caching=caching)
    a = make_req("a", 100, 5, group="sys", shared_tokens=64)
    run_until_done(s, a)
    assert a.num_cached_tokens == 0
    b = make_req("b", 90, 5, group="sys", shared_tokens=64)
    n = admit(s, b)
    if caching:
        assert b.num_cached_tokens == 64 and s.kv.hits == 64 and n == 90 - 64
        assert s.kv.queries == 100 + 90
    else:
        assert b.num_cached_tokens == 0 and s.kv.hits == 0 and n == 90
    # a prompt that shares nothing gets nothing
    c = make_req("c", 90, 5)
    admit(s, c)
    assert c.num_cached_tokens == 0


def test_concurrent_requests_share_prefix_blocks():
    s = make_sched(num_blocks=64)
    a = make_req("a", 100, 50, group="sys", shared_tokens=64)
    s.add(a)
    s.finish_step(s.schedule())  # a's prompt is computed and its full blocks cached
    b = make_req("b", 80, 50, group="sys", shared_tokens=64)
    s.add(b)
    plan = s.schedule()
    check_after_schedule(s, plan, {id(a)})
    assert b.blocks[:4] == a.blocks[:4]
    assert all(s.kv.ref[blk] == 2 for blk in a.blocks[:4])
    assert not set(a.blocks[4:]) & set(b.blocks[4:])


def test_requests_admitted_in_one_step_share_the_prefix_being_computed():
    # vLLM caches a request's full blocks when it allocates them (allocate_slots -> cache_blocks), so a
    # request admitted later in the same step already hits the prefix the earlier one is computing
    s = make_sched(num_blocks=64, budget=512)
    a = make_req("a", 100, 5, group="sys", shared_tokens=64)
    b = make_req("b", 90, 5, group="sys", shared_tokens=64)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    check_after_schedule(s, plan, set())
    assert {q.id: n for q, n in plan.scheduled} == {"a": 100, "b": 90 - 64}
    assert b.num_cached_tokens == 64 and b.blocks[:4] == a.blocks[:4]
    assert s.kv.hits == 64


@pytest.mark.parametrize("length,expect", [(64, 48), (65, 64), (16, 0), (17, 16), (100, 96)])
def test_last_prompt_token_is_never_cached(length, expect):
    s = make_sched(num_blocks=64)
    run_until_done(s, make_req("a", length, 1, group="doc", shared_tokens=length))
    twin = make_req("b", length, 1, group="doc", shared_tokens=length)
    n = admit(s, twin)
    assert twin.num_cached_tokens == expect
    assert n == length - expect >= 1


def test_evicted_blocks_are_no_longer_hits():
    s = make_sched(num_blocks=10, budget=512)
    a = make_req("a", 64, 1, group="sys", shared_tokens=64)
    run_until_done(s, a)
    sys_hashes = list(a.block_hashes)
    assert all(h in s.kv.cached for h in sys_hashes)  # freed but still cached
    # a request that takes 9 of 10 blocks evicts least recently freed first: a's tail before its head
    run_until_done(s, make_req("x", 9 * 16, 1))
    assert sys_hashes[0] in s.kv.cached and not any(h in s.kv.cached for h in sys_hashes[1:])
    b = make_req("b", 80, 1, group="sys", shared_tokens=64)
    admit(s, b)
    assert b.num_cached_tokens == 16  # only the surviving head block
    run_until_done(s)
    # a request that needs the whole cache evicts everything that was cached
    run_until_done(s, make_req("y", 10 * 16, 1))
    assert not any(h in s.kv.cached for h in sys_hashes)
    hits = s.kv.hits
    c = make_req("c", 80, 1, group="sys", shared_tokens=64)
    admit(s, c)
    assert c.num_cached_tokens == 0 and s.kv.hits == hits


def test_prefix_cache_stats_count_each_admission_once():
    # vLLM records prefix-cache queries/hits when a request is admitted (not on every blocked lookup),
    # and not for recomputation after preemption (those are counted apart)
    s = make_sched(num_blocks=12, seqs=4, budget=512)
    run_until_done(s, make_req("warm", 64, 1, group="sys", shared_tokens=64))
    big = make_req("big", 7 * 16, 10)  # holds most of the cache for a while
    s.add(big)
    s.finish_step(s.schedule())
    q0, h0 = s.kv.queries, s.kv.hits
    blocked = make_req("blocked", 164, 1, group="sys", shared_tokens=64)  # 4 cached blocks + 7 new
    s.add(blocked)
    for _ in range(5):
        plan = s.schedule()
        assert all(r is not blocked for r, _ in plan.scheduled)  # does not fit next to big
        s.finish_step(plan)
    assert (s.kv.queries, s.kv.hits) == (q0, h0)
    run_until_done(s)
    assert blocked.num_cached_tokens == 64
    assert s.kv.queries == q0 + 164 and s.kv.hits == h0 + blocked.num_cached_tokens


# --- chunked prefill ------------------------------------------------------------------------

def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    s = make_sched(num_blocks=200, budget=512, chunked=False)
    d = make_req("decoder", 100, 20)
    admit(s, d)  # now decoding: one token a step
    long = make_req("long", 512, 3)  # needs the whole budget; only 511 are left next to d
    small = make_req("small", 10, 3)  # behind it in the queue: FCFS, it waits too
    s.add(long)
    s.add(small)
    while not d.finished:
        plan = s.schedule()
        assert [r.id for r, _ in plan.scheduled] == ["decoder"]
        s.finish_step(plan)
    plan = s.schedule()
    got = {r.id: n for r, n in plan.scheduled}
    assert got == {"long": 512}  # whole, in one step; small does not fit the rest of this step's budget
    s.finish_step(plan)
    plan = s.schedule()
    assert {r.id: n for r, n in plan.scheduled} == {"long": 1, "small": 10}


def test_without_chunked_prefill_a_fitting_prompt_joins_the_batch():
    s = make_sched(num_blocks=200, budget=512, chunked=False)
    admit(s, make_req("decoder", 100, 20))
    s.add(make_req("fits", 511, 3))
    plan = s.schedule()
    assert {r.id: n for r, n in plan.scheduled} == {"decoder": 1, "fits": 511}


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    s = make_sched(num_blocks=200, budget=512)
    r = make_req("long", 1300, 2)
    s.add(r)
    chunks = []
    while r.num_output == 0:
        plan = s.schedule()
        chunks.append(dict((q.id, n) for q, n in plan.scheduled)["long"])
        s.finish_step(plan)
    assert chunks == [512, 512, 276]
    # next to a decoding request the first chunk takes what the decode leaves
    s2 = make_sched(num_blocks=200, budget=512)
    admit(s2, make_req("decoder", 100, 20))
    s2.add(make_req("long", 1300, 2))
    plan = s2.schedule()
    assert {q.id: n for q, n in plan.scheduled} == {"decoder": 1, "long": 511}


def test_long_prefill_threshold_caps_each_chunk():
    s = make_sched(num_blocks=400, budget=512, threshold=200)
    a, b, c = make_req("a", 700, 2), make_req("b", 450, 2), make_req("c", 30, 2)
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    assert {q.id: n for q, n in plan.scheduled} == {"a": 200, "b": 200, "c": 30}
    seen = []
    while s.has_work:
        plan = s.schedule()
        seen += [n for q, n in plan.scheduled]
        assert plan.num_tokens <= 512
        s.finish_step(plan)
    assert max(seen) <= 200


def test_threshold_applies_before_the_no_chunking_budget_check():
    # vLLM cuts a waiting prompt to long_prefill_token_threshold before it compares with the budget,
    # so with chunked prefill off the threshold still chunks (as it does for running requests)
    s = make_sched(num_blocks=200, budget=512, chunked=False, threshold=256)
    admit(s, make_req("decoder", 100, 20))
    s.add(make_req("long", 600, 2))
    plan = s.schedule()
    assert {q.id: n for q, n in plan.scheduled} == {"decoder": 1, "long": 256}


# --- start-up memory boundaries -------------------------------------------------------------

def startup(model: str, **args):
    shape = model_shape(model)
    used = args.pop("used_by_others", 0)
    cfg = SimConfig.from_args(args, H100, shape)
    return plan_startup(shape, H100, cfg, used_by_others=used), cfg


def classified(line: str) -> FailureClass | None:
    w = LogWatch(PATTERNS)
    w.feed("(EngineCore pid=1234) ERROR " + line)
    return classify_exit(1, w).failure_class


def bisect_utilization(model: str, lo: float, hi: float, **args) -> tuple[float, float]:
    """(fails, starts): gpu_memory_utilization values 1e-6 apart around the boundary."""
    assert startup(model, gpu_memory_utilization=lo, **args)[0].plan is None
    assert startup(model, gpu_memory_utilization=hi, **args)[0].plan is not None
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if startup(model, gpu_memory_utilization=mid, **args)[0].plan is None:
            lo = mid
        else:
            hi = mid
    return lo, hi


@pytest.mark.parametrize("mml", [32768, 8192])
def test_gpu_memory_utilization_boundary_qwen32b(mml):
    lo, hi = bisect_utilization("qwen2.5-32b", 0.5, 1.0, max_model_len=mml)
    ok, _ = startup("qwen2.5-32b", gpu_memory_utilization=hi, max_model_len=mml)
    bad, _ = startup("qwen2.5-32b", gpu_memory_utilization=lo, max_model_len=mml)
    assert ok.plan.num_blocks * ok.plan.block_size >= mml
    (msg,) = bad.failure
    assert ("No available memory for the cache blocks" in msg
            or f"To serve at least one request with the model's max seq len ({mml})" in msg)
    assert classified(msg) is FailureClass.OOM
    # just below the boundary the KV cache exists but is short of one sequence: the max seq len text
    assert "To serve at least one request" in msg and "estimated maximum model length is" in msg
    # far below it there is no KV cache at all
    far, _ = startup("qwen2.5-32b", gpu_memory_utilization=0.75, max_model_len=mml)  # less than the weights
    assert "No available memory for the cache blocks" in far.failure[0]
    assert classified(far.failure[0]) is FailureClass.OOM
    # a 32B model in bf16 (61 GiB) on an 80 GB card: the boundary is near vLLM's 0.9 default
    assert 0.8 < hi < 0.98
    assert (mml == 32768) == (hi > 0.92)  # 32k context does not fit at the default 0.92; 8k does


def test_max_model_len_boundary_is_the_kv_capacity():
    util = 0.90
    probe, _ = startup("qwen2.5-32b", gpu_memory_utilization=util, max_model_len=1024)
    cap = probe.plan.kv_tokens  # independent of max_model_len
    assert 1024 < cap < 32768 and cap % 16 == 0
    ok, _ = startup("qwen2.5-32b", gpu_memory_utilization=util, max_model_len=cap)
    assert ok.plan is not None and ok.plan.kv_tokens == cap
    for over in (cap + 1, cap + 15, cap + 16):
        bad, _ = startup("qwen2.5-32b", gpu_memory_utilization=util, max_model_len=over)
        assert bad.plan is None, f"max_model_len {over} started with a KV cache of {cap} tokens"
        (msg,) = bad.failure
        assert f"To serve at least one request with the model's max seq len ({over})" in msg
        assert f"the estimated maximum model length is {cap}." in msg
        assert classified(msg) is FailureClass.OOM


def test_llama70b_needs_tensor_parallelism():
    one, _ = startup("llama-3.1-70b", max_model_len=8192)
    assert one.plan is None and one.failure[0].startswith("torch.OutOfMemoryError")
    assert classified(one.failure[0]) is FailureClass.OOM
    four, cfg = startup("llama-3.1-70b", max_model_len=8192, tensor_parallel_size=4)
    assert four.plan is not None and four.plan.num_blocks > 0
    assert four.plan.weights < 40 * GiB  # a quarter of ~131 GiB per GPU
    # SimEngine.start goes by the same plan
    shape = model_shape("llama-3.1-70b")
    assert SimEngine.start(shape, H100, cfg).plan.num_blocks == four.plan.num_blocks
    with pytest.raises(StartupFailed, match="OutOfMemoryError"):
        SimEngine.start(shape, H100, SimConfig.from_args({"max_model_len": 8192}, H100, shape))


def test_memory_used_by_others():
    bad, cfg = startup("llama-3.1-8b", used_by_others=10 * GiB)
    (msg,) = bad.failure
    assert "on startup is less than desired GPU memory utilization (0.92," in msg
    assert classified(msg) is FailureClass.OOM
    # the same engine with a lower utilization fits beside the other process
    ok, _ = startup("llama-3.1-8b", used_by_others=10 * GiB, gpu_memory_utilization=0.85)
    assert ok.plan is not None
    small, _ = startup("llama-3.1-8b", used_by_others=2 * GiB)
    assert small.plan is not None


def test_enforce_eager_leaves_more_kv_blocks():
    graphs, _ = startup("llama-3.1-8b")
    eager, _ = startup("llama-3.1-8b", enforce_eager=True)
    assert graphs.plan.cudagraphs > 0 and eager.plan.cudagraphs == 0
    assert eager.plan.num_blocks > graphs.plan.num_blocks
    assert eager.seconds < graphs.seconds  # no torch.compile, no capture


@pytest.mark.parametrize("arg,small,large", [("max_num_batched_tokens", 2048, 32768), ("max_num_seqs", 64, 1024)])
def test_bigger_batches_leave_fewer_kv_blocks(arg, small, large):
    a, _ = startup("llama-3.1-8b", **{arg: small})
    b, _ = startup("llama-3.1-8b", **{arg: large})
    assert a.plan.num_blocks > b.plan.num_blocks
    assert a.plan.activation_peak < b.plan.activation_peak


def test_kv_cache_memory_bytes_sets_the_cache():
    ok, _ = startup("llama-3.1-8b", kv_cache_memory_bytes="20G")
    assert ok.plan.kv_cache == 20 * GiB  # vLLM's sizes: G is 1024**3, g is 1000**3
    bad, _ = startup("llama-3.1-8b", kv_cache_memory_bytes="70G")  # past what the card has
    assert bad.plan is None and classified(bad.failure[0]) is FailureClass.OOM


# --- the step-time model --------------------------------------------------------------------

def step_model(model: str = "llama-3.1-8b", **args) -> StepModel:
    shape = model_shape(model)
    return StepModel(shape, H100, SimConfig.from_args(args, H100, shape))


def decoding(ctx: int, rid: str = "d") -> Request:
    r = Request(rid, ctx, 10**6)
    r.num_output, r.num_computed = 1, ctx  # the next step computes one token
    return r


def decode_plan(batch: int, ctx: int = 1000) -> StepPlan:
    return StepPlan([(decoding(ctx, f"d{i}"), 1) for i in range(batch)])


def prefill_plan(tokens: int) -> StepPlan:
    return StepPlan([(Request("p", tokens, 1), tokens)])


def test_decode_batching_amortizes_weights():
    m = step_model()
    times = {b: m.step_seconds(decode_plan(b)) for b in (1, 8, 64, 256)}
    for small, big in ((1, 8), (8, 64), (64, 256)):
        assert times[big] > times[small]
        assert times[big] / big < times[small] / small
    # batch 1 decode of an 8B bf16 model on H100 reads 15 GiB of weights: a few ms, not us or s
    assert 0.004 < times[1] < 0.012


def test_long_context_decode_reads_more_kv():
    m = step_model()
    assert m.step_seconds(decode_plan(64, ctx=16000)) > 1.5 * m.step_seconds(decode_plan(64, ctx=500))


def test_enforce_eager_slows_small_decode_steps():
    graphs, eager = step_model(), step_model(enforce_eager=True)
    for b in (1, 4, 16):
        assert eager.step_seconds(decode_plan(b)) > 1.2 * graphs.step_seconds(decode_plan(b))
    # a large prefill is compute-bound: launch overhead is a small share of it
    assert eager.step_seconds(prefill_plan(8192)) < 1.1 * graphs.step_seconds(prefill_plan(8192))


def test_prefill_time_is_about_linear_when_compute_bound():
    m = step_model()
    t1, t2, t4 = (m.step_seconds(prefill_plan(n)) for n in (2048, 4096, 8192))
    assert 1.8 < t2 / t1 < 2.3 and 1.8 < t4 / t2 < 2.4
    assert t2 / t1 <= t4 / t2 + 1e-9  # attention's quadratic term only adds


def test_mixed_batch_costs_more_than_decode_only():
    m = step_model()
    decodes = decode_plan(32)
    mixed = StepPlan(decodes.scheduled + [(Request("p", 2000, 1), 512)])
    assert m.step_seconds(mixed) > m.step_seconds(decodes)


def test_tensor_parallel_is_faster_but_sublinear():
    times = {tp: step_model("llama-3.1-70b", tensor_parallel_size=tp).step_seconds(decode_plan(32)) for tp in (1, 2, 4, 8)}
    for a, b in ((1, 2), (2, 4), (4, 8)):
        assert times[b] < times[a]  # faster per step
        assert b * times[b] > a * times[a]  # but more GPU-seconds per step: all-reduces, host overhead
    pre = {tp: step_model("llama-3.1-70b", tensor_parallel_size=tp).step_seconds(prefill_plan(4096)) for tp in (2, 4)}
    assert pre[4] < pre[2]


def test_async_scheduling_hides_host_overhead():
    # on by default (vLLM 0.32+ when not set); --no-async-scheduling pays the whole host overhead
    assert step_model().step_seconds(decode_plan(8)) < step_model(async_scheduling=False).step_seconds(decode_plan(8))


def test_empty_step_takes_no_time():
    assert step_model().step_seconds(StepPlan()) == 0.0


# --- virtual time ---------------------------------------------------------------------------

def start_8b(**args):
    shape = model_shape("llama-3.1-8b")
    cfg = SimConfig.from_args(args, H100, shape)
    return lambda: SimEngine.start(shape, H100, cfg)


def test_simulate_a_chat_workload():
    w = synthesize(SCENARIOS["chat"], rate=4.0, num_requests=300, burstiness=1.0, seed=7)
    results = simulate(start_8b()(), w)
    assert len(results) == 300 and all(r.success for r in results)
    assert all(r.output_tokens == r.expected_output_tokens for r in results)
    assert all(0 < r.ttft <= r.e2e for r in results)
    s = summarize(results)
    assert s.completed == 300 and s.failed == 0
    assert 0.005 < s.tpot.mean < 0.2  # tens of ms per token, not micro- or whole seconds


def test_simulate_caps_output_at_max_model_len():
    w = synthesize(SCENARIOS["chat"], rate=2.0, num_requests=20, seed=3)
    mml = 2048
    results = simulate(start_8b(max_model_len=mml)(), w)
    capped = rejected = 0
    for r, req in zip(results, w.requests):
        if req.prompt_tokens > mml:
            assert not r.success
            rejected += 1
        else:
            assert r.success and r.output_tokens == min(req.output_tokens, mml - req.prompt_tokens)
            capped += req.prompt_tokens + req.output_tokens > mml
    assert capped >= 2 and rejected >= 2  # the workload exercises both


def test_capacity_drops_with_few_sequences():
    slos = parse_slos(["ttft<800ms", "tpot<50ms"])
    base = synthesize(SCENARIOS["chat"], rate=1.0, num_requests=150, burstiness=1.0, seed=11)
    cap_default, rate_default = capacity(start_8b(), base.scaled, slos, resolution=1.1)
    cap_8, rate_8 = capacity(start_8b(max_num_seqs=8), base.scaled, slos, resolution=1.1)
    assert 0 < cap_8 < cap_default
    assert 0 < rate_8 < rate_default


def _burst_seconds(gpu_name: str, workload, front_end, **flags) -> tuple[float, int]:
    """The virtual seconds until the last request of ``workload`` ends, and the tokens the engine computed."""
    from autotune.sim.perf import FrontEnd

    gpu, shape = gpu_profile(gpu_name), model_shape("llama-3.1-8b")
    engine = SimEngine.start(shape, gpu, SimConfig.from_args(flags, gpu, shape), front_end=front_end or FrontEnd())
    computed: list[int] = []
    results = simulate(engine, workload, on_step=lambda _, n: computed.append(n))
    assert all(r.success for r in results)
    return max(r.sent_s + r.e2e for r in results), sum(computed)


def test_preemption_by_recompute_pays_the_prefill_again():
    """Two prompts that fit a KV cache together but outgrow it as they decode: the later is preempted and computes
    its prompt (and the tokens it had produced) a second time, which a cache with room never does."""
    from autotune.workload.trace import Request as Sent, Workload

    per_token = model_shape("llama-3.1-8b").kv_bytes_per_token()
    two = Workload((Sent(0.0, 1500, prompt_tokens=2000), Sent(0.0, 1500, prompt_tokens=2000)), "two long requests")
    flags = {"enable_prefix_caching": False, "max_model_len": 4096}
    roomy_s, roomy_tokens = _burst_seconds("h100-80gb", two, None, kv_cache_memory_bytes=20_000 * per_token, **flags)
    tight_s, tight_tokens = _burst_seconds("h100-80gb", two, None, kv_cache_memory_bytes=5_000 * per_token, **flags)
    assert roomy_tokens == 2 * (2000 + 1500 - 1)  # each prompt once, each output token but the last sampled one
    assert tight_tokens - roomy_tokens >= 2000  # at least one prompt computed again
    assert tight_s > roomy_s


def test_the_api_servers_cost_per_request_makes_a_burst_of_short_requests_gpu_independent():
    """A thousand 16-token prompts, one output token each, sent at once: an A100 computes them ~3x slower than an
    H100, yet the burst takes about as long on both, paced by the API server's serial cost per request
    (perf.API_SERVER, measured by scripts/bench_front_end.py), as public short-request bursts are."""
    from autotune.sim.perf import API_SERVER
    from autotune.workload.trace import Request as Sent, Workload

    burst = Workload(tuple(Sent(0.0, 1, prompt_tokens=16) for _ in range(1000)), "short burst")
    engine_h100, _ = _burst_seconds("h100-80gb", burst, None)
    engine_a100, _ = _burst_seconds("a100-80gb", burst, None)
    served_h100, _ = _burst_seconds("h100-80gb", burst, API_SERVER)
    served_a100, _ = _burst_seconds("a100-80gb", burst, API_SERVER)
    assert engine_a100 > 2 * engine_h100  # the engines alone differ
    assert served_a100 < 1.1 * served_h100  # the API server sets the pace
    assert served_h100 >= 1000 * API_SERVER.request_s


# --- mixtures of experts, quantized weights, sliding windows (issue 29) -------------------------

# gpt-oss-20b by hand, from its config.json: hidden 2880, 64 query and 8 KV heads of 64, 24 layers (12 of them
# sliding-window), 32 experts of width 2880, 4 per token, vocabulary 201088, MXFP4 experts (4.25 bits a weight)
OSS_ATTENTION = 2880 * 64 * 64 + 2 * 2880 * 8 * 64 + 64 * 64 * 2880  # q, k and v, o
OSS_EXPERT = 3 * 2880 * 2880
OSS_ROUTER = 2880 * 32
OSS_EMBEDDINGS = 2 * 201088 * 2880  # untied: the embedding table and the LM head


def test_moe_parameters_and_weight_bytes_by_hand():
    s = model_shape("openai/gpt-oss-20b")
    assert s.active_params == 24 * (OSS_ATTENTION + 4 * OSS_EXPERT + OSS_ROUTER)
    assert s.params == 24 * (OSS_ATTENTION + 32 * OSS_EXPERT + OSS_ROUTER) + OSS_EMBEDDINGS
    experts = 24 * 32 * OSS_EXPERT * 4.25 / 8
    assert s.expert_weights_bytes == pytest.approx(experts)
    assert s.weights_bytes == pytest.approx(experts + 2 * (24 * (OSS_ATTENTION + OSS_ROUTER) + OSS_EMBEDDINGS))
    # and the checkpoint itself: model.safetensors.index.json's total_size
    assert s.weights_bytes == pytest.approx(13_761_264_768, rel=0.005)
    # KV: only the 12 full-attention layers hold a token's K and V for the whole context
    assert s.kv_bytes_per_token() == 2 * 12 * 8 * 64 * 2


def test_mixtral_by_its_hugging_face_id_is_the_published_size():
    # Mistral AI's announcement of Mixtral 8x7B: 46.7B parameters in all, 12.9B used per token; bf16 weights,
    # every layer a mixture of 8 experts of the MLP's width, 2 a token, and no sliding window in v0.1
    s = model_shape("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert (s.experts, s.experts_per_token, s.expert_intermediate, s.moe_layers) == (8, 2, 14336, 32)
    assert s.params == pytest.approx(46.7e9, rel=0.01)
    # Mistral's figure counts the embedding table and the LM head, which active_params leaves to the step model
    assert s.active_params + 2 * 4096 * 32000 == pytest.approx(12.9e9, rel=0.01)
    assert s.weights_bytes == pytest.approx(2 * s.params, rel=1e-6) and not s.not_modelled


def test_moe_step_time_by_hand():
    """A decode step of one sequence reads the dense weights and the 4 experts it is routed to in each layer, one
    fused-MoE call a layer; a large prefill reads every expert once and computes only the routed ones."""
    m = step_model("openai/gpt-oss-20b")
    assert m.experts_read(1) == pytest.approx(4)
    assert m.experts_read(2) == pytest.approx(32 * (1 - (28 / 32) ** 2))
    assert m.experts_read(8192) == pytest.approx(32)
    s, g = model_shape("openai/gpt-oss-20b"), H100
    # an expert as loaded: Marlin's tiles pad its width 2880 -> 2944 and the hidden size 2880 -> 3072
    expert_bytes = s.expert_weights_bytes * (2944 * 3072) / (2880 * 2880) / (24 * 32)
    dense_bytes = s.weights_bytes - s.expert_weights_bytes
    kv_token = 2 * 8 * 64 * 2  # one layer's K and V of one token
    ctx = 1000
    # one token: memory-bound linear layers; in each layer a fused-MoE call reading 4 experts (MXFP4: Marlin's
    # kernel, at the linear layers' bandwidth share); then attention over 1001 tokens in 12 layers, the window in 12
    bandwidth = g.bandwidth * g.bandwidth_efficiency
    linear = (dense_bytes + 24 * kv_token) / bandwidth
    routed = 3 * 4 * 2880 * 2  # the token's hidden vector for each of its 4 experts: gathered, written, summed
    experts = 24 * (g.moe_call_s + 4 * (expert_bytes / bandwidth + g.moe_expert_s) + routed / bandwidth)
    attention = (12 * (ctx + 1) + 12 * 128) * kv_token / (g.bandwidth * g.attention_bandwidth_efficiency)
    host = (g.host_step_s + g.host_seq_s) / 2  # async scheduling overlaps half
    launch = g.graph_layer_s * 24  # one CUDA graph replay
    assert m.step_seconds(decode_plan(1, ctx)) == pytest.approx(linear + experts + attention + host + launch, rel=1e-9)
    # 8192 prompt tokens: compute-bound on the active parameters, the routed experts at the grouped GEMMs' share
    rate = g.bf16_flops * g.compute_efficiency * g.sustained_compute
    dense = (8192 * 2 * 24 * (OSS_ATTENTION + OSS_ROUTER) + 2 * 2880 * 201088) / rate  # + the LM head, one sequence
    gemms = 8192 * 2 * 4 * OSS_EXPERT / g.grouped_gemm_share / rate * m.padding(8192)  # rows padded to Marlin's 64
    experts = 24 * (g.moe_call_s + gemms + 8192 * routed / bandwidth)
    t = m.step_seconds(prefill_plan(8192))
    assert t > dense + experts
    assert m.seconds(8192, 1, 1, 0.0, 0, False) == pytest.approx(dense + experts + host + 25e-6 * 24, rel=1e-9)


def test_one_moe_layer_reads_the_experts_it_touches_or_runs_their_gemms_whichever_takes_longer():
    """What vLLM's benchmark_moe.py times as one fused-MoE call (scripts/bench_moe_kernels.py): a fixed cost, plus
    the experts touched read (a cost each) or their GEMMs, whichever takes longer."""
    m, s, g = step_model("openai/gpt-oss-20b"), model_shape("openai/gpt-oss-20b"), H100
    expert = s.loaded_expert_weights_bytes(1) / (24 * 32)
    bandwidth = g.bandwidth * g.bandwidth_efficiency  # MXFP4 experts: Marlin's kernel, the linear layers' share
    routed = 3 * 4 * 2880 * 2 / bandwidth  # a token's 4 hidden vectors, gathered, written and summed (bf16)
    one = g.moe_call_s + 4 * (expert / bandwidth + g.moe_expert_s) + routed
    assert m.moe_layer_seconds(1) == pytest.approx(one)  # one token, its 4 experts
    # 8192 tokens touch all 32 experts, and their GEMMs at the grouped share take longer than reading them
    gemms = 8192 * 4 * 2 * OSS_EXPERT / (g.bf16_flops * g.compute_efficiency * g.sustained_compute * g.grouped_gemm_share)
    gemms *= m.padding(8192)  # each expert's 1024 rows, give or take, padded to Marlin's block of 64
    assert 1.0 < m.padding(8192) < 1.05
    assert gemms > 32 * (expert / bandwidth + g.moe_expert_s)
    assert m.moe_layer_seconds(8192) == pytest.approx(g.moe_call_s + gemms + 8192 * routed)
    assert step_model("llama-3.1-8b").moe_layer_seconds(64) == 0.0


def test_a_moe_layer_moves_every_routed_tokens_hidden_vector_however_thin_its_slice_of_the_experts():
    """Under tensor parallelism each GPU holds a slice of every expert, yet gathers, writes and sums the whole hidden
    vector of every (token, expert) pair: the routed activations' traffic does not shrink with TP as the GEMMs do,
    so it weighs most for thin experts split many ways (Qwen3-235B: 1536 columns an expert, 192 a GPU at TP 8).
    Under expert parallelism a GPU gathers and writes only its own experts' pairs, but zeroes and sums the whole
    cache."""
    tokens, g = 2048, H100
    shape = model_shape("Qwen/Qwen3-235B-A22B-Instruct-2507")
    models = {tp: StepModel(shape, g, SimConfig.from_args({"tensor_parallel_size": tp}, g, shape)) for tp in (1, 8)}
    by_hand = 3 * tokens * 8 * 4096 * 2 / (g.bandwidth * g.bandwidth_efficiency)  # top-8 pairs, hidden 4096, bf16
    assert models[1].routed_activation_seconds(tokens) == pytest.approx(by_hand)
    assert models[8].routed_activation_seconds(tokens) == pytest.approx(by_hand)  # not divided by 8
    share = {tp: m.routed_activation_seconds(tokens) / m.moe_layer_seconds(tokens) for tp, m in models.items()}
    assert share[8] > 2 * share[1]
    ep = StepModel(shape, g, SimConfig.from_args({"tensor_parallel_size": 8, "enable_expert_parallel": True}, g, shape))
    # zeroed and summed whole (2 of the 3), gathered and written for the busiest GPU's pairs (a bit over 1/8 each)
    assert by_hand * (2 + 2 / 8) / 3 < ep.routed_activation_seconds(tokens) < by_hand * (2 + 2 / 4) / 3


def test_the_grouped_gemms_compute_each_experts_rows_padded_to_the_kernels_row_block():
    """vLLM's moe_align_block_size pads each expert's tokens to the kernel's row block: Marlin picks the first of
    8/16/32/48/64 the mean rows an expert falls below 0.9 of (else 64); Triton's default config 16 rows while the
    step has no more tokens than experts, else 64. An expert routed a few rows past a block computes a whole block
    more, so the padding is large where the mean sits near a block (gpt-oss-120b's 128 experts at 2048 tokens: 64
    rows each) and small where it spans many (gpt-oss-20b's 32: 256 rows each)."""
    from autotune.sim.perf import moe_block_rows, padded_rows_share

    assert [moe_block_rows(m, False, True) for m in (4, 16, 30, 64, 256)] == [8, 32, 48, 64, 64]
    assert moe_block_rows(8, True, False) == 16 and moe_block_rows(64, False, False) == 64
    # Poisson rows: exactly one block's worth has no padding only in expectation's limit; by hand for a tiny mean
    mean = 0.5
    by_hand = sum(math.exp(-mean) * mean ** r / math.factorial(r) * 8 for r in range(1, 9)) / mean  # 1-8 rows: one block
    assert padded_rows_share(mean, 8) == pytest.approx(by_hand, rel=1e-6)
    assert padded_rows_share(256, 64) < 1.15 < 1.4 < padded_rows_share(64, 64) < 1.6
    big, small = step_model("openai/gpt-oss-120b"), step_model("openai/gpt-oss-20b")
    assert big.padding(2048) > small.padding(2048) + 0.25
    # and the step charges it: the GEMMs of a prefill step take that much longer than the routed rows alone
    g = H100
    rate = g.bf16_flops * g.compute_efficiency * g.sustained_compute * g.grouped_gemm_share
    unpadded = 2048 * 2 * 4 * OSS_EXPERT * 36 / rate / 36  # one layer of gpt-oss-120b (36 layers of the 20b's experts)
    assert big.moe_layer_seconds(2048) == pytest.approx(
        g.moe_call_s + unpadded * big.padding(2048) + big.routed_activation_seconds(2048))


def test_kv_heads_fewer_than_the_gpus_are_replicated_one_on_each():
    """vLLM splits the KV heads across tensor-parallel GPUs and, where there are fewer heads than GPUs, gives each
    GPU a whole one: Qwen3-235B's 4 KV heads at TP 8 cost each GPU what they cost at TP 4, so its KV pool holds
    half the tokens an even split would say."""
    shape = model_shape("Qwen/Qwen3-235B-A22B-Instruct-2507")
    assert shape.kv_heads == 4 and shape.kv_heads_per_gpu(8) == 1
    assert shape.kv_bytes_per_token(tp=4) == shape.kv_bytes_per_token() // 4 == 2 * 94 * 1 * 128 * 2
    assert shape.kv_bytes_per_token(tp=8) == shape.kv_bytes_per_token(tp=4)
    config = SimConfig.from_args({"tensor_parallel_size": 8}, H100, shape)
    plan = plan_startup(shape, H100, config).plan
    assert plan is not None and plan.kv_bytes_per_token == shape.kv_bytes_per_token(tp=8)
    # the bf16 checkpoint is the FP8 one's shape without its quantization: twice the expert bytes
    fp8 = model_shape("Qwen/Qwen3-235B-A22B-Instruct-2507-FP8")
    assert shape.weight_quant != "fp8" and fp8.weight_quant == "fp8"
    assert shape.expert_weights_bytes == pytest.approx(2 * fp8.expert_weights_bytes, rel=0.01)


def test_tritons_fused_moe_reads_experts_at_its_own_share_and_marlins_at_the_linear_layers():
    """The public kernel tables time Triton's fused MoE (bf16 experts, fp8 ones on fp8 tensor cores), whose reads
    reach ``expert_bandwidth_efficiency``; Marlin's weight-only kernel (fp8 experts on an A100) keeps the linear
    layers' share, as no table times it."""
    for gpu, triton in ((H100, True), (gpu_profile("a100-80gb"), False)):
        shape = model_shape("Qwen/Qwen3-30B-A3B").served("fp8")
        m = StepModel(shape, gpu, SimConfig.from_args({}, gpu, shape))
        expert = shape.loaded_expert_weights_bytes(1) / (shape.moe_layers * shape.experts)
        share = gpu.expert_bandwidth_efficiency if triton else gpu.bandwidth_efficiency
        assert marlin_kernels(shape, gpu) is not triton
        routed = m.routed_activation_seconds(1)
        assert m.moe_layer_seconds(1) == pytest.approx(gpu.moe_call_s + 8 * (expert / (gpu.bandwidth * share)
                                                                              + gpu.moe_expert_s) + routed)
    assert H100.expert_bandwidth_efficiency > H100.bandwidth_efficiency


def test_fp8_experts_on_fp8_tensor_cores_compute_at_tritons_own_share_of_the_fp8_rate():
    """At 4096 tokens the grouped GEMMs bind: fp8 experts on an H100 (Triton's W8A8 fused MoE) run at
    ``fp8_grouped_gemm_share`` of the fp8 rate, bf16 experts at ``grouped_gemm_share`` of the bf16 rate, and on an A100
    (no fp8 tensor cores: Marlin) fp8 experts take the latter too."""
    shape = model_shape("Qwen/Qwen3-30B-A3B")
    per_token = 2 * shape.moe_layers * shape.experts_per_token * shape.expert_params / shape.moe_layers

    def gemms(gpu, dtype: str) -> float:
        served = shape.served(dtype) if dtype else shape
        m = StepModel(served, gpu, SimConfig.from_args({}, gpu, served))
        return (m.moe_layer_seconds(4096) - gpu.moe_call_s - m.routed_activation_seconds(4096)) / m.padding(4096)

    rate = H100.compute_efficiency * H100.sustained_compute
    assert gemms(H100, "fp8") == pytest.approx(4096 * per_token / (H100.fp8_flops * rate * H100.fp8_grouped_gemm_share))
    assert gemms(H100, "") == pytest.approx(4096 * per_token / (H100.bf16_flops * rate * H100.grouped_gemm_share))
    assert H100.fp8_grouped_gemm_share < H100.grouped_gemm_share
    a100 = gpu_profile("a100-80gb")
    assert a100.fp8_grouped_gemm_share is None and gemms(a100, "fp8") == pytest.approx(gemms(a100, ""))


def test_attention_with_sinks_runs_on_vllms_triton_backend_before_hopper():
    """gpt-oss's learned attention sinks: FlashAttention 3 runs them on Hopper, vLLM's Triton attention elsewhere, at
    the A100's fitted ``sink_attention_share`` of its attention compute rate. A step that is nearly all attention
    (a billion query-key pairs) takes 1/share as long there; a model without sinks, or an H100, is unaffected."""
    oss, llama = model_shape("openai/gpt-oss-20b"), model_shape("llama-3.1-8b")
    assert oss.attention_sinks and not llama.attention_sinks
    a100 = gpu_profile("a100-80gb")
    assert a100.sink_attention_share < 1.0 and H100.sink_attention_share == 1.0

    def attention_bound(gpu, shape) -> float:
        m = StepModel(shape, gpu, SimConfig.from_args({}, gpu, shape))
        return m.seconds(1, 1, 0, 1e9, 1, False, 0.0, 0)

    plain = replace(a100, sink_attention_share=1.0)
    assert attention_bound(a100, oss) / attention_bound(plain, oss) == pytest.approx(1 / a100.sink_attention_share,
                                                                                     rel=0.02)
    assert attention_bound(a100, llama) == attention_bound(plain, llama)


def test_mxfp4_experts_load_padded_as_vllm_logs_them_and_other_weights_as_stored():
    """vLLM's log for gpt-oss-120b on one H100 reads "Model loading took 65.9651 GiB" (vllm-project/vllm#23278)
    where the checkpoint holds 60.7 GiB: Marlin pads each expert's width to 128 and the hidden size to 256."""
    oss = model_shape("openai/gpt-oss-120b")
    assert oss.weights_bytes / GiB == pytest.approx(60.69, abs=0.01)
    assert oss.loaded_weights_bytes(1) / GiB == pytest.approx(65.9651, rel=0.01)
    # at TP 2 each GPU's slice of the width, 1440, pads to 1536; under expert parallelism the whole width
    unpadded = oss.weights_bytes - oss.expert_weights_bytes
    assert oss.loaded_weights_bytes(2) - unpadded == round(oss.expert_weights_bytes * 1536 * 3072 / (1440 * 2880))
    assert oss.loaded_weights_bytes(2, expert_parallel=True) == oss.loaded_weights_bytes(1)
    plan = plan_startup(oss, H100, SimConfig.from_args({"max_model_len": 32768}, H100, oss))
    assert plan.plan is not None and plan.plan.weights == oss.loaded_weights_bytes(1)
    for dense in (model_shape("llama-3.1-70b"), model_shape("llama-3.1-70b").served("fp8")):
        assert dense.loaded_weights_bytes(4) == dense.weights_bytes


def test_a_moe_model_decodes_faster_than_a_dense_model_of_a_third_its_size():
    """gpt-oss-20b (21B parameters, 3.6B active, MXFP4 experts) reads less per decode step than a dense 8B in bf16;
    its prefill is compute-bound on the grouped GEMMs, which reach a third of a dense GEMM's rate on an H100."""
    moe, dense = step_model("openai/gpt-oss-20b"), step_model("llama-3.1-8b")
    for batch in (1, 64):
        assert moe.step_seconds(decode_plan(batch)) < dense.step_seconds(decode_plan(batch))


def test_fp8_weights_halve_the_weight_bytes():
    bf16 = model_shape("llama-3.1-70b")
    fp8 = bf16.served("fp8")
    embeddings = 2 * 128256 * 8192 * 2  # the embedding table and the LM head stay bf16
    assert fp8.weights_bytes == pytest.approx((bf16.weights_bytes - embeddings) / 2 + embeddings, rel=1e-6)
    # a checkpoint quantized to fp8 (quantization_config) is the same shape as fp8 applied at load
    assert model_shape("neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8").weights_bytes == fp8.weights_bytes
    assert fp8.served("fp8") is fp8 and bf16.served(None) is bf16


def test_a_70b_in_fp8_fits_one_h100_where_bf16_does_not():
    """As people run it: ``--quantization fp8 --gpu-memory-utilization 0.95 --max-num-seqs 256`` at an 8K context."""
    args = {"max_model_len": 8192, "gpu_memory_utilization": 0.95, "max_num_seqs": 256}
    bf16, _ = startup("llama-3.1-70b", **args)
    fp8, _ = startup("llama-3.1-70b", **args, quantization="fp8")
    assert bf16.plan is None and bf16.failure[0].startswith("torch.OutOfMemoryError")
    assert fp8.plan is not None and fp8.plan.kv_tokens >= 8192
    assert 60 * GiB < fp8.plan.weights < 70 * GiB
    # the real engine's pre-check agrees: the weights alone exceed the budget only in bf16
    from autotune.engine.args import EngineArgs
    from autotune.engine.vllm.precheck import precheck

    shape = model_shape("llama-3.1-70b")
    args = {"max_model_len": 8192, "gpu_memory_utilization": 0.92}
    assert "the weights alone" in precheck(shape, EngineArgs(args), "cuda", H100.memory_bytes)
    assert precheck(shape, EngineArgs({**args, "quantization": "fp8"}), "cuda", H100.memory_bytes) is None


def test_fp8_weights_compute_at_the_fp8_rate_only_where_the_gpu_has_one():
    a100 = gpu_profile("a100-80gb")
    shape = model_shape("qwen3-8b")

    def model(gpu, **args):
        return StepModel(shape, gpu, SimConfig.from_args(args, gpu, shape))

    # a prefill is compute-bound: fp8 GEMMs on an H100, bf16 ones (weight-only kernels) on an A100, at the share
    # of the bf16 rate those kernels reach (fitted on the A100's fp8 and AWQ points)
    assert model(H100, quantization="fp8").step_seconds(prefill_plan(8192)) < 0.8 * model(H100).step_seconds(
        prefill_plan(8192))
    assert a100.weight_only_share < 1.0 and H100.weight_only_share == 1.0
    assert model(a100, quantization="fp8").step_seconds(prefill_plan(8192)) > 1.3 * model(a100).step_seconds(
        prefill_plan(8192))
    at_full = replace(a100, weight_only_share=1.0)
    assert model(at_full, quantization="fp8").step_seconds(prefill_plan(8192)) == pytest.approx(
        model(at_full).step_seconds(prefill_plan(8192)), rel=0.02)
    # the share is for quantized linear layers: not bf16 ones, not fp8 on fp8 tensor cores, not MXFP4's experts only
    assert weight_only(shape.served("fp8"), a100) and weight_only(model_shape("Qwen/Qwen3-32B-AWQ"), H100)
    assert not weight_only(shape, a100) and not weight_only(shape.served("fp8"), H100)
    assert not weight_only(model_shape("openai/gpt-oss-20b"), a100)
    # a small decode batch is weight-read bound: half the bytes on both
    for gpu in (H100, a100):
        assert model(gpu, quantization="fp8").step_seconds(decode_plan(1)) < 0.75 * model(gpu).step_seconds(
            decode_plan(1))


def test_sliding_window_layers_read_only_the_window():
    m = step_model("openai/gpt-oss-20b")
    short, long = m.step_seconds(decode_plan(64, ctx=200)), m.step_seconds(decode_plan(64, ctx=20000))
    # half the layers read 100x the context, the other half the same 128 tokens
    full_only = m.seconds(64, 64, 64, 64 * 20001, 64 * 20001, True)  # every layer charged the whole context
    assert short < long < full_only


def test_expert_parallelism_waits_for_the_busiest_gpu_and_holds_the_same_memory():
    """Qwen3-235B on 4 GPUs: with --enable-expert-parallel each GPU holds 32 whole experts instead of a quarter of
    all 128. One token's 8 experts land on the GPUs unevenly, so a small decode step waits for the busiest; a
    large batch touches every expert everywhere and reads the same bytes either way. The fused-MoE call sees the
    GPU's own experts: 32 of them, so Triton's default row block (16 while the call has no more tokens than
    experts, else 64) pads their few rows to 64 from 33 tokens on, where the 128 slices keep 16 up to 128 tokens;
    and a GPU moves only its own experts' share of the routed tokens' hidden vectors."""
    from autotune.sim.perf import padded_rows_share

    model = "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"
    tp, ep = step_model(model, tensor_parallel_size=4), step_model(model, tensor_parallel_size=4,
                                                                    enable_expert_parallel=True)
    assert tp.experts_read(1) == pytest.approx(8)  # quarter-width experts: 2 whole experts' bytes a GPU
    assert 2 < ep.experts_read(1) < 8  # whole experts: the busiest GPU of four holds more than the mean 2
    assert ep.experts_read(10_000) == pytest.approx(32)
    assert ep.step_seconds(decode_plan(1)) > 1.1 * tp.step_seconds(decode_plan(1))
    assert tp.experts_read(10_000) == pytest.approx(128)
    assert tp.padding(64) == pytest.approx(padded_rows_share(4, 16))  # 64 tokens x 8 / 128 experts: 4 rows each
    assert ep.padding(64) == pytest.approx(padded_rows_share(4, 64))
    assert 0 < ep.routed_activation_seconds(256) < tp.routed_activation_seconds(256)
    a, _ = startup(model, tensor_parallel_size=4, max_model_len=32768)
    b, _ = startup(model, tensor_parallel_size=4, max_model_len=32768, enable_expert_parallel=True)
    assert a.plan is not None and a.plan.kv_tokens == b.plan.kv_tokens


def test_pipeline_stages_split_the_layers_and_the_batch():
    """gpt-oss-120b on two GPUs as two pipeline stages: a decode batch runs as two micro-batches, each through both
    stages; a single sequence cannot be split, so its step takes as long as on one GPU; the KV cache doubles."""
    one, two = step_model("openai/gpt-oss-120b"), step_model("openai/gpt-oss-120b", pipeline_parallel_size=2)
    assert two.step_seconds(prefill_plan(8192)) == pytest.approx(one.step_seconds(prefill_plan(8192)), rel=0.01)
    assert two.step_seconds(decode_plan(256)) < one.step_seconds(decode_plan(256))
    a, _ = startup("openai/gpt-oss-120b", max_model_len=32768)
    b, _ = startup("openai/gpt-oss-120b", max_model_len=32768, pipeline_parallel_size=2)
    assert b.plan.kv_tokens > 2 * a.plan.kv_tokens  # each stage's weights are half: more than twice the room


def test_a_sliding_window_holds_its_window_of_blocks_per_request_not_per_token():
    """gpt-oss: 12 sliding-window layers beside 12 full ones. The pool's block holds 16 tokens of the full layers;
    each running request also holds its window's 128 tokens (and the block being written) of the sliding ones,
    in blocks of the same size, whatever its length, and gives them back when it finishes."""
    s = model_shape("openai/gpt-oss-20b")
    assert s.window_blocks(16) == 128 // 16 + 1
    sched = Scheduler(num_blocks=100, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096,
                      window_blocks=s.window_blocks(16))
    short, long = Request("short", 20, 1), Request("long", 1000, 1)
    sched.add(short)
    sched.add(long)
    plan = sched.schedule()
    assert [r.id for r, _ in plan.scheduled] == ["short", "long"]
    assert len(short.blocks) == 2 and len(long.blocks) == 63
    assert len(short.window_blocks) == len(long.window_blocks) == 9
    assert len(sched.kv.free) == 100 - 2 - 63 - 18
    sched.finish_step(plan)  # both sampled their one token: finished, every block back
    assert len(sched.kv.free) == 100 and not short.window_blocks
    # a dense model holds none
    assert model_shape("llama-3.1-8b").window_blocks(16) == 0


def test_an_int4_checkpoint_weighs_a_quarter_and_a_little_more():
    """AWQ/GPTQ: 4 bits a weight plus an fp16 scale and a 4-bit zero per 128; embeddings and LM head in bf16."""
    bf16, awq = model_shape("qwen3-32b"), model_shape("Qwen/Qwen3-32B-AWQ")
    embeddings = 2 * 151936 * 5120 * 2
    linear = (bf16.weights_bytes - embeddings) / 2  # parameters
    assert awq.weight_quant == "int4" and awq.not_modelled == ""
    assert awq.weights_bytes == pytest.approx(linear * (4 + 20 / 128) / 8 + embeddings, rel=1e-6)
