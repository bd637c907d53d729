"""Failure classification on the texts real vLLM printed (tests/fixtures/vllm-0.32, captured on CPU)."""

import signal
from pathlib import Path

import pytest

from autotune.engine.failures import FailureClass, LogWatch, classify_exit
from autotune.engine.vllm.failures import PATTERNS

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-0.32"


def watch_lines(*names):
    w = LogWatch(PATTERNS)
    for name in names:
        for line in (FIXTURES / name).read_text().splitlines():
            w.feed(line)
    return w


def test_kv_cache_too_small_is_oom_from_stdout_root_cause():
    w = watch_lines("kv-too-small.stdout")
    cls, line, excerpt = w.found
    assert cls is FailureClass.OOM
    assert "KV cache is needed, which is larger than the available KV cache memory" in line
    assert "(EngineCore pid=" in excerpt  # the root cause, with its context
    assert len(excerpt.splitlines()) > 5


def test_kv_cache_too_small_is_oom_from_stderr_too():
    w = watch_lines("kv-too-small.stderr")
    assert w.found[0] is FailureClass.OOM
    # the generic "Engine core initialization failed" later on does not overwrite the root cause
    assert "initialization failed" not in w.found[1]
    assert classify_exit(1, w).failure_class is FailureClass.OOM


def test_unrecognized_flag_is_invalid_args():
    w = watch_lines("unrecognized.stderr")
    assert w.found[0] is FailureClass.INVALID_ARGS
    assert "--swap-space" in w.found[1]


def test_scheduler_validation_is_invalid_args_with_the_specific_line():
    w = watch_lines("batched-below-seqs.stderr")
    cls, proof, excerpt = w.found
    assert cls is FailureClass.INVALID_ARGS
    # pydantic's header comes first; the line that names the fields wins, and both are in the excerpt
    assert "max_num_batched_tokens (2) must be greater than or equal to max_num_seqs (4)" in proof
    assert "validation error for SchedulerConfig" in excerpt


@pytest.mark.parametrize("line,cls", [
    ("(EngineCore pid=12) ERROR 01-01 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     FailureClass.OOM),
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.",
     FailureClass.OOM),
    ("ValueError: Free memory on device cuda:0 (10.1/79.2 GiB) on startup is less than desired GPU memory utilization (0.9, 71.3 GiB).",
     FailureClass.OOM),
    ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use",
     FailureClass.PORT_IN_USE),
    # vLLM's CPU build without VLLM_CPU_KVCACHE_SPACE on a host whose NUMA node has too little free (issue 55)
    ("(VllmWorker-0 pid=4242) ERROR 12-01 [multiproc_executor.py:1] ValueError: Available memory on node 0 "
     "(9.48/11.21 GiB) on startup is less than desired CPU memory utilization (0.92, 10.32 GiB).", FailureClass.OOM),
    ("vllm: error: argument --dtype: invalid choice: 'fp7'", FailureClass.INVALID_ARGS),
    ("ValueError: max_num_batched_tokens (2048) is smaller than max_model_len (32768). This effectively limits",
     FailureClass.INVALID_ARGS),
])
def test_known_texts(line, cls):
    w = LogWatch(PATTERNS)
    w.feed("INFO some harmless line")
    assert w.feed(line)[0] is cls


def test_harmless_lines_do_not_match():
    w = LogWatch(PATTERNS)
    for line in (FIXTURES / "kv-too-small.stdout").read_text().splitlines()[:40]:
        w.feed(line)  # start-up chatter, including a warning that mentions "error"
    assert w.found is None


def test_exit_codes_without_a_known_line():
    w = LogWatch(PATTERNS)
    w.feed("something odd")
    assert classify_exit(2, w).failure_class is FailureClass.INVALID_ARGS
    assert classify_exit(-signal.SIGKILL, w).failure_class is FailureClass.OOM
    assert classify_exit(137, w).failure_class is FailureClass.OOM
    crashed = classify_exit(1, w)
    assert crashed.failure_class is FailureClass.CRASHED and "something odd" in crashed.excerpt


def test_a_crash_no_pattern_names_says_its_root_cause_not_the_line_that_points_back_to_it():
    """vLLM's API server ends a failed start with "Engine core initialization failed. See root cause above": the
    failure's summary is the worker's own exception line, which the console then shows with the log's path."""
    w = LogWatch(PATTERNS)
    for line in ("INFO 12-01 [api_server.py:1] vLLM API server version 0.32.0",
                 "(VllmWorker-0 pid=4242) ERROR 12-01 [multiproc_executor.py:1] Traceback (most recent call last):",
                 "(VllmWorker-0 pid=4242) ERROR 12-01 [multiproc_executor.py:1] KeyError: 'model.layers.0.mlp'",
                 "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"):
        w.feed(line)
    crashed = classify_exit(1, w)
    assert crashed.failure_class is FailureClass.CRASHED
    assert crashed.summary == ("exited with code 1: (VllmWorker-0 pid=4242) ERROR 12-01 [multiproc_executor.py:1] "
                               "KeyError: 'model.layers.0.mlp'"), crashed.summary
    quiet = LogWatch(PATTERNS)
    quiet.feed("RuntimeError: Engine core initialization failed. See root cause above.")
    assert classify_exit(1, quiet).summary == "exited with code 1"  # nothing but the pointer: nothing to add


def test_the_console_names_the_engines_log_beside_its_failure(tmp_path, capsys):
    from autotune.console import print_result
    from autotune.engine.failures import Failure
    from autotune.measure.session import Outcome

    log = tmp_path / "engine.stdout.log"
    log.write_text("(VllmWorker-0 pid=1) ERROR ... ValueError: boom\n")
    print_result(Outcome("http://127.0.0.1:1", failure=Failure(FailureClass.CRASHED, "exited with code 1: boom"),
                         log_paths={"stdout": log, "stderr": tmp_path / "never-written.log"}))
    err = capsys.readouterr().err
    assert "engine failed: crashed" in err and f"the engine's whole output: {log}" in err.replace("\n", ""), err
    assert "never-written" not in err
