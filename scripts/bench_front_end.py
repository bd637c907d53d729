"""What vLLM's API server costs per request, measured on real vLLM (CPU build, the tiny model).

vllm-sim's front-end model (``autotune.sim.perf.FrontEnd``) stands for the CPU work of vLLM's one API-server
process, which a faster GPU does not shorten: ``request_s`` per request (HTTP, JSON, the chat template, request
setup), ``prompt_token_s`` per prompt token (tokenization), ``output_token_s`` per output token (detokenization)
and ``chunk_s`` per SSE chunk (the response object, its JSON, the write). This script measures them where they run
here: one real ``vllm serve`` of the tiny local model (scripts/build_tiny_model.py), bursts of ``--requests``
streamed requests sent at once, and the API-server process's CPU seconds over each burst (``vllm serve``'s main
process; the engine core and its worker are its children and are not counted). Three completion bursts separate the
three costs (a short prompt and one output token; a long prompt; many output tokens), a chat burst adds the chat
template's and a chat long-output burst a chat chunk's; ``--repeats`` rounds of the five, each burst's median round
counting. A second server, started with ``--stream-interval``, runs the long-output burst again: the same tokens in
fewer SSE chunks (the client counts them), which splits a streamed token's cost into the per-token and the
per-chunk part.

The burst's requests/s here is not the API server's ceiling: on two shared cores the engine's own CPU forward
and this script's client take most of the time, which is why the CPU seconds, not the wall time, are the
measurement. CPU time carries to another host in proportion to single-core speed: the script prints this host's
CPU model and a pure-Python reference loop's time. Rerun:

    .venv/bin/python scripts/bench_front_end.py --repeats 5 --output-tokens 128 --stream-interval 16 \
        --json bench/front_end_cpu_xeon.json     # ~8 min on 2 cores

(bench/front_end_cpu.json is an earlier run, on another host, before the second server.) ``--streams`` instead
counts the chunks a request gets from bursts of so many concurrent streams (bench/front_end_merging.json):

    .venv/bin/python scripts/bench_front_end.py --streams 64,100,128,160,200,256 --repeats 3 \
        --json bench/front_end_merging.json     # ~2 min

``--order`` instead times each request of bursts of several sizes, sent at once over connections opened
beforehand (a raw-socket client, which costs this host far less than the API server does): how long the first
token of the burst's first answer takes as the burst grows is what the API server does for every request of the
burst before it hands the first one to the engine (the request handler's part before the tokenizer's thread,
``perf.FrontEnd.render_share``; bench/front_end_order.json):

    .venv/bin/python scripts/bench_front_end.py --order 50,100,200,400 --repeats 5 \
        --json bench/front_end_order.json     # ~3 min

Needs scripts/install_cpu.sh's vLLM beside the interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "The quick brown fox jumps over the lazy dog. "
SHORT, LONG = 3, 20  # sentences in a short and a long prompt


def reference_loop_s() -> float:
    """A fixed pure-Python loop's best time of 5 (seconds): this host's single-core speed, for scaling."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        total = 0
        for i in range(2_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def iteration_steps(url: str) -> float:
    """vLLM's count of engine steps so far (the iteration-tokens histogram's count)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:iteration_tokens_total":
            return sum(s.value for s in fam.samples if s.name.endswith("_count"))
    raise RuntimeError("vllm:iteration_tokens_total not found in /metrics")


async def _one(client: httpx.AsyncClient, url: str, chat: bool, max_tokens: int, prompt: str) -> int:
    """Stream one request to its end; the SSE chunks that carried it (``data:`` events other than ``[DONE]``)."""
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:400]}")
        return sum([line.startswith("data:") and line != "data: [DONE]" async for line in r.aiter_lines()])


async def burst(url: str, n: int, concurrency: int, chat: bool, max_tokens: int, prompt: str) -> tuple[float, int]:
    """Send ``n`` requests, at most ``concurrency`` at once; the wall seconds and the SSE chunks received."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def go() -> int:
            async with sem:
                return await _one(client, url, chat, max_tokens, prompt)

        t0 = time.perf_counter()
        chunks = await asyncio.gather(*(go() for _ in range(n)))
        return time.perf_counter() - t0, sum(chunks)


def prompt_tokens(url: str, prompt: str) -> int:
    """The prompt's length as the server counts it (vLLM's /tokenize)."""
    return len(httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30).json()["tokens"])


def measure(
    url: str,
    api: psutil.Process,
    core: psutil.Process,
    workers: list[psutil.Process],
    n: int,
    concurrency: int,
    chat: bool,
    max_tokens: int,
    sentences: int,
) -> dict:
    prompt = SENTENCE * sentences
    me = psutil.Process()
    a0, c0, s0 = cpu_s(api), cpu_s(core), iteration_steps(url)
    w0, m0 = sum(cpu_s(w) for w in workers), cpu_s(me)
    wall, chunks = asyncio.run(burst(url, n, concurrency, chat, max_tokens, prompt))
    a1, c1, s1 = cpu_s(api), cpu_s(core), iteration_steps(url)
    w1, m1 = sum(cpu_s(w) for w in workers), cpu_s(me)
    steps = s1 - s0
    return {
        "api": "chat" if chat else "completion",
        "prompt_tokens": prompt_tokens(url, prompt),
        "requests": n,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "chunks_per_request": round(chunks / n, 2),
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 1),
        "api_server_cpu_ms_per_request": round(1000 * (a1 - a0) / n, 3),
        "engine_core_cpu_s": round(c1 - c0, 3),
        "steps": steps,
        "engine_core_cpu_ms_per_step": round(1000 * (c1 - c0) / steps, 3) if steps else None,
        "worker_cpu_s": round(w1 - w0, 3),  # the model's forward and the sampler (vLLM's worker process)
        "client_cpu_s": round(m1 - m0, 3),  # this script's own HTTP client, on the same two cores
    }


def start_vllm(model: Path, port: int, workdir: Path, stream_interval: int = 1) -> tuple[subprocess.Popen, str]:
    vllm = Path(sys.executable).parent / "vllm"
    if not vllm.exists():
        sys.exit(f"bench_front_end: real vLLM is not installed beside {sys.executable}: run scripts/install_cpu.sh")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(workdir / "cache")}
    argv = [
        str(vllm),
        "serve",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--stream-interval",
        str(stream_interval),
    ]
    log = open(workdir / "vllm.log", "w")  # noqa: SIM115 -- the server's lifetime, closed at exit
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench_front_end: vLLM exited ({proc.returncode}); its log: {workdir / 'vllm.log'}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit("bench_front_end: vLLM did not become healthy in 600 s")


def serve_rounds(
    model: Path,
    port: int,
    work: Path,
    stream_interval: int,
    bursts: dict[str, tuple[int, bool, int, int]],
    repeats: int,
) -> list[dict[str, dict]]:
    """Start one ``vllm serve`` and run ``repeats`` rounds of ``bursts`` against it; one {name: row} per round."""
    proc, url = start_vllm(model, port, work, stream_interval)
    try:
        api = psutil.Process(proc.pid)
        cores = [c for c in api.children(recursive=True) if "EngineCore" in " ".join([*c.cmdline(), c.name()])]
        if len(cores) != 1:
            sys.exit(f"bench_front_end: expected one EngineCore process under {proc.pid}, found {len(cores)}")
        core = cores[0]
        workers = [
            c
            for c in api.children(recursive=True)
            if c.pid != core.pid and "Worker" in " ".join([*c.cmdline(), c.name()])
        ]
        asyncio.run(burst(url, 32, 32, True, 4, SENTENCE))  # warm-up: compile, first-request paths
        # rounds of every burst in turn, so that a drift of the shared host's speed touches each alike
        return [
            {
                name: measure(url, api, core, workers, k, k, chat, out, sents)
                for name, (k, chat, out, sents) in bursts.items()
            }
            for _ in range(repeats)
        ]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per burst (default 400)")
    ap.add_argument(
        "--output-tokens", type=int, default=64, help="tokens each request streams in the long-output burst"
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the five bursts; the median counts (default 3)")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=8,
        help="vLLM's --stream-interval for the second long-output burst (default 8)",
    )
    ap.add_argument(
        "--streams",
        help="instead: long-output bursts of these many concurrent streams (e.g. 64,100,128,160,200,256), to see "
        "how many SSE chunks a request gets: V1 merges a request's tokens only across steps of one output slice",
    )
    ap.add_argument(
        "--order",
        help="instead: bursts of these many requests (e.g. 50,100,200,400), each request's first token timed, to "
        "see how much of a request's cost the API server spends on every request of a burst before the first "
        "reaches the engine",
    )
    ap.add_argument("--json", type=Path, help="write the rows and the fitted figures here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-front-end-") as tmp:
        work = Path(tmp)
        model = work / "tiny-llama"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(model)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        ref = reference_loop_s()
        if a.order:
            return order(model, a, [int(x) for x in a.order.split(",")], ref)
        if a.streams:
            return merging(model, a, [int(x) for x in a.streams.split(",")], ref)
        n = a.requests
        bursts = {  # name: (requests, chat, max_tokens, sentences)
            "short": (n, False, 1, SHORT),
            "long prompt": (n, False, 1, LONG),
            "long output": (n // 4, False, a.output_tokens, SHORT),
            "chat": (n, True, 1, SHORT),
            "chat output": (n // 4, True, a.output_tokens, SHORT),
        }
        rounds = serve_rounds(model, a.port, work, 1, bursts, a.repeats)
        # the long-output burst again with --stream-interval: the same tokens in fewer SSE chunks, which separates
        # what a streamed chunk costs from what a token costs (vLLM V1 merges a request's tokens into one chunk
        # the same way when the API server falls behind the engine: RequestOutputCollector)
        coalesced = {"long output, interval": (n // 4, False, a.output_tokens, SHORT)}
        for r, extra in zip(
            rounds, serve_rounds(model, a.port, work, a.stream_interval, coalesced, a.repeats), strict=True
        ):
            r.update(extra)
    ms = "api_server_cpu_ms_per_request"
    # each burst's round with the median CPU per request
    rows = {name: sorted((r[name] for r in rounds), key=lambda row: row[ms])[len(rounds) // 2] for name in rounds[0]}
    short, long_prompt, long_output, chat, chat_output, coalesced = rows.values()
    prompt_token_ms = (long_prompt[ms] - short[ms]) / (long_prompt["prompt_tokens"] - short["prompt_tokens"])
    # a streamed request costs request + tokens x token + chunks x chunk: the two long-output bursts differ only
    # in chunks, the short and the long output in both
    chunk_ms = (long_output[ms] - coalesced[ms]) / (long_output["chunks_per_request"] - coalesced["chunks_per_request"])
    output_token_ms = (
        long_output[ms] - short[ms] - chunk_ms * (long_output["chunks_per_request"] - short["chunks_per_request"])
    ) / (long_output["max_tokens"] - short["max_tokens"])
    request_ms = (
        short[ms]
        - prompt_token_ms * short["prompt_tokens"]
        - output_token_ms * short["max_tokens"]
        - chunk_ms * short["chunks_per_request"]
    )
    streamed_token_ms = (long_output[ms] - short[ms]) / (long_output["max_tokens"] - short["max_tokens"])
    # a chat chunk (a ChatCompletionStreamResponse with its delta) against a completion chunk: the chat bursts differ
    # in tokens, detokenized alike, and in chunks
    chat_chunk_ms = (
        chat_output[ms] - chat[ms] - output_token_ms * (chat_output["max_tokens"] - chat["max_tokens"])
    ) / (chat_output["chunks_per_request"] - chat["chunks_per_request"])
    result = {
        "host": {
            "cpu": _cpu_model(),
            "cores": psutil.cpu_count(),
            "python": platform.python_version(),
            "reference_loop_s": round(ref, 3),
        },
        "vllm": _vllm_version(),
        "bursts": rows,  # the median round of each
        "rounds": rounds,
        "api_server": {  # perf.FrontEnd's three costs on this host, seconds
            "request_s": round(request_ms / 1000, 7),
            "chat_request_s": round((chat[ms] - short[ms] + request_ms) / 1000, 7),
            "prompt_token_s": round(prompt_token_ms / 1000, 9),
            "output_token_s": round(output_token_ms / 1000, 8),
            "chunk_s": round(chunk_ms / 1000, 8),
            "chat_chunk_s": round(chat_chunk_ms / 1000, 8),
            # a token streamed in its own chunk: output_token_s + chunk_s, as one figure (FrontEnd before chunks)
            "streamed_token_s": round(streamed_token_ms / 1000, 8),
        },
    }
    print(f"host: {result['host']['cpu']}, reference loop {ref:.3f} s; vLLM {result['vllm']}")
    print(
        f"{'burst':<22} {'requests':>8} {'prompt':>6} {'out':>4} {'chunks':>6} {'req/s':>7} {'API CPU ms/req':>15} "
        f"{'engine CPU s':>13} {'worker CPU s':>13} {'client CPU s':>13}"
    )
    for name, r in rows.items():
        print(
            f"{name:<22} {r['requests']:>8} {r['prompt_tokens']:>6} {r['max_tokens']:>4} {r['chunks_per_request']:>6} "
            f"{r['requests_per_s']:>7} "
            f"{r[ms]:>15} {r['engine_core_cpu_s']:>13} {r['worker_cpu_s']:>13} {r['client_cpu_s']:>13}"
        )
    fe = result["api_server"]
    print(
        f"API server per request {1000 * fe['request_s']:.2f} ms (chat {1000 * fe['chat_request_s']:.2f} ms), "
        f"per prompt token {1e6 * fe['prompt_token_s']:.2f} us, per output token {1e6 * fe['output_token_s']:.1f} us "
        f"and per SSE chunk {1e6 * fe['chunk_s']:.1f} us (chat {1e6 * fe['chat_chunk_s']:.1f} us) "
        f"(a token in its own chunk: {1e6 * fe['streamed_token_s']:.1f} us)"
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def merging(model: Path, a: argparse.Namespace, streams: list[int], ref: float) -> int:
    """``--streams``: each size's long-output burst, ``--repeats`` rounds, on one server; chunks a request got."""
    with tempfile.TemporaryDirectory(prefix="bench-front-end-") as tmp:
        bursts = {f"{n} streams": (n, False, a.output_tokens, SHORT) for n in streams}
        rounds = serve_rounds(model, a.port, Path(tmp), 1, bursts, a.repeats)
    print(f"host: {_cpu_model()}, reference loop {ref:.3f} s; vLLM {_vllm_version()}")
    print(f"SSE chunks a request got for {a.output_tokens} tokens, each round:")
    for name in bursts:
        print(f"{name:>12}: " + "  ".join(f"{r[name]['chunks_per_request']:>6}" for r in rounds))
    if a.json:
        result = {"host": {"cpu": _cpu_model(), "cores": psutil.cpu_count(), "reference_loop_s": round(ref, 3)},
                  "vllm": _vllm_version(), "output_tokens": a.output_tokens, "rounds": rounds}
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _request_bytes(chat: bool, sentences: int) -> bytes:
    """One streamed request of one token, as HTTP/1.1 bytes (the raw-socket client of ``--order``)."""
    body: dict = {"model": "tiny", "max_tokens": 1, "stream": True, "ignore_eos": True, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": SENTENCE * sentences}]
    else:
        body["prompt"] = SENTENCE * sentences
    data = json.dumps(body).encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    return (head + "\r\n\r\n").encode() + data


async def timed_burst(port: int, n: int, chat: bool) -> list[float]:
    """``n`` requests written at once on connections opened beforehand; each one's time to its first SSE event,
    in the order they were sent (seconds from the first write)."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    await asyncio.sleep(0.5)  # the server has accepted them all before the burst
    request = _request_bytes(chat, SHORT)
    first = [0.0] * n

    async def read(i: int, reader: asyncio.StreamReader) -> None:
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = await reader.read(65536)
            if not chunk:
                raise RuntimeError(f"request {i} of the burst: the server closed the connection")
            if not first[i] and b"data: {" in seen[-8:] + chunk:
                first[i] = time.perf_counter()
            seen += chunk

    readers = [asyncio.create_task(read(i, r)) for i, (r, _) in enumerate(conns)]
    t0 = time.perf_counter()
    for _, w in conns:
        w.write(request)
    await asyncio.gather(*readers)
    for _, w in conns:
        w.close()
    return [f - t0 for f in first]


def _slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def order(model: Path, a: argparse.Namespace, sizes: list[int], ref: float) -> int:
    """``--order``: bursts of each size, chat and completion, ``--repeats`` rounds on one server; each request's
    time to its first token by send order, and the API server's CPU per request."""
    runs: dict[str, dict[int, list[dict]]] = {"chat": {n: [] for n in sizes}, "completion": {n: [] for n in sizes}}
    with tempfile.TemporaryDirectory(prefix="bench-front-end-") as tmp:
        proc, _ = start_vllm(model, a.port, Path(tmp))
        try:
            api = psutil.Process(proc.pid)
            asyncio.run(timed_burst(a.port, 32, True))  # warm-up
            for _ in range(a.repeats):
                for n in sizes:
                    for api_name in runs:
                        c0 = cpu_s(api)
                        first = asyncio.run(timed_burst(a.port, n, api_name == "chat"))
                        tenth = sorted(first[: max(1, n // 10)])
                        runs[api_name][n].append({
                            "first_token_s": round(min(first), 4),
                            "first_tenth_p50_s": round(tenth[len(tenth) // 2], 4),
                            "p50_s": round(sorted(first)[n // 2], 4),
                            "last_token_s": round(max(first), 4),
                            "api_server_cpu_ms_per_request": round(1000 * (cpu_s(api) - c0) / n, 3),
                        })
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)

    def median(rows: list[dict], key: str) -> float:
        xs = sorted(r[key] for r in rows)
        return xs[len(xs) // 2]

    fits = {}
    print(f"host: {_cpu_model()}, reference loop {ref:.3f} s; vLLM {_vllm_version()}")
    print(f"{'api':<11} {'burst':>6} {'first token ms':>15} {'first tenth p50':>16} {'p50 ms':>8} {'last ms':>8} "
          f"{'API CPU ms/req':>15}")
    for api_name, by_n in runs.items():
        for n, rows in by_n.items():
            print(f"{api_name:<11} {n:>6} {1000 * median(rows, 'first_token_s'):>15.0f} "
                  f"{1000 * median(rows, 'first_tenth_p50_s'):>16.0f} {1000 * median(rows, 'p50_s'):>8.0f} "
                  f"{1000 * median(rows, 'last_token_s'):>8.0f} {median(rows, 'api_server_cpu_ms_per_request'):>15}")
        xs = [float(n) for n in sizes]
        # what the server does for every request of the burst before the first token of any leaves: the slope
        # of the first token's time over the burst's size; against the API server's CPU a request
        before_first = _slope(xs, [median(by_n[n], "first_token_s") for n in sizes])
        whole = _slope(xs, [median(by_n[n], "last_token_s") for n in sizes])
        cpu = median([r for rows in by_n.values() for r in rows], "api_server_cpu_ms_per_request") / 1000
        fits[api_name] = {
            "before_first_token_s_per_request": round(before_first, 7),
            "last_token_s_per_request": round(whole, 7),
            "api_server_cpu_s_per_request": round(cpu, 7),
            "render_share": round(before_first / cpu, 3),
        }
        print(f"{api_name}: before the first token {1e3 * before_first:.3f} ms a request of the burst, the last token "
              f"{1e3 * whole:.3f} ms; API server CPU {1e3 * cpu:.3f} ms a request: render share "
              f"{before_first / cpu:.2f}")
    if a.json:
        result = {"host": {"cpu": _cpu_model(), "cores": psutil.cpu_count(), "reference_loop_s": round(ref, 3)},
                  "vllm": _vllm_version(), "sizes": sizes, "runs": runs, "fits": fits}
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


if __name__ == "__main__":
    sys.exit(main())
