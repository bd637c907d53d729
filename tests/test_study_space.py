"""The search space, baselines, pre-check and load ladder: pure parts of a study, no engine."""

import optuna
import pytest

from autotune.engine.args import EngineArgs
from autotune.errors import ConfigError
from autotune.study.baselines import baseline_points
from autotune.measure.profiles import FixedLoad, Ladder, next_load
from autotune.measure.session import Step
from autotune.engine.model import ModelShape, parse_bytes
from autotune.engine.vllm.precheck import precheck
from autotune.engine.kind import get_kind
from autotune.engine.vllm.defaults import default_batching as vllm_default_batching
from autotune.study.space import Param, Space, default_space
from autotune.measure.metrics import summarize

optuna.logging.set_verbosity(optuna.logging.WARNING)


def cpu_space(**kw):
    return Space(default_space(get_kind("vllm"), "cpu"), "cpu", **kw)


def test_sampled_points_never_break_vllms_rules():
    space = Space(default_space(get_kind("vllm"), "cuda", 80, "H100"), "cuda", max_model_len=8192)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(300):
        t = study.ask()
        values = space.sample(t)
        flags = space.engine_args(values).values
        assert flags["max_num_batched_tokens"] >= flags["max_num_seqs"]
        if not flags["enable_chunked_prefill"]:
            assert flags["max_num_batched_tokens"] >= 8192
            assert "long_prefill_token_threshold" not in flags  # conditional: only with chunked prefill
        assert flags["block_size"] in (16, 32)
        study.tell(t, 0.0)


def test_cpu_space_maps_memory_to_env_and_block_sizes():
    space = cpu_space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(50):
        t = study.ask()
        args = space.engine_args(space.sample(t))
        assert "VLLM_CPU_KVCACHE_SPACE" in args.env and "VLLM_CPU_KVCACHE_SPACE" not in args.values
        assert args.values["block_size"] % 32 == 0
        study.tell(t, 0.0)


def test_defaults_are_vllms_own():
    assert vllm_default_batching("cpu") == (128, 2048)
    assert vllm_default_batching("cuda", 80, "NVIDIA H100 80GB HBM3") == (1024, 8192)
    assert vllm_default_batching("cuda", 80, "NVIDIA A100-SXM4-80GB") == (256, 2048)
    assert vllm_default_batching("cuda", 180, "B200") == (1024, 16384)
    d = cpu_space().complete({})
    assert d["max_num_seqs"] == 128 and d["enable_chunked_prefill"] is True


def test_space_validation():
    with pytest.raises(ConfigError, match="not supported on cpu"):
        Space((Param("block_size", "categorical", 32, choices=(16, 32)),), "cpu")
    with pytest.raises(ConfigError, match="must name a bool parameter"):
        Space((Param("long_prefill_token_threshold", "int", 0, low=0, high=10, when="nope"),), "cpu")
    with pytest.raises(ConfigError, match="both a fixed engine arg and a search parameter"):
        Space((Param("max_num_seqs", "int", 8, low=1, high=9),), "cpu", EngineArgs({"max_num_seqs": 4}))
    with pytest.raises(ConfigError, match="needs low <= high"):
        Param("x", "int", 1, low=5, high=1)
    with pytest.raises(ConfigError, match="outside"):
        cpu_space().complete({"max_num_seqs": 100000})


def test_baselines_on_cpu_say_what_they_could_not_apply():
    points = {b.name: b for b in baseline_points(cpu_space(max_model_len=4096),
                                                 ("vllm-defaults", "xinference-4.1", "xinference-legacy"),
                                                 [("production", {"max_num_seqs": 64, "kv_cache_dtype": "auto"})])}
    assert points["vllm-defaults"].params["max_num_seqs"] == 128
    x41 = points["xinference-4.1"]
    assert x41.params["max_num_seqs"] == 256 and x41.params["block_size"] == 128
    assert any("block_size 16 is not supported on cpu" in n for n in x41.notes)
    assert any("gpu_memory_utilization" in n for n in x41.notes)
    legacy = points["xinference-legacy"]
    assert legacy.params["enable_chunked_prefill"] is False and legacy.params["enable_prefix_caching"] is False
    assert "long_prefill_token_threshold" not in legacy.params
    args = cpu_space(max_model_len=4096).engine_args(legacy.params, legacy.extra_args).values
    assert args["max_num_batched_tokens"] >= 4096  # without chunked prefill: at least max_model_len
    prod = points["production"]
    assert prod.params["max_num_seqs"] == 64 and prod.extra_args == {"kv_cache_dtype": "auto"}


def test_precheck_kv_formula_on_the_tiny_model(tiny_model):
    shape = ModelShape.from_dir(tiny_model)
    # 2 (K, V) x 4 layers x 2 KV heads x 64 head dim x 2 bytes (bf16)
    assert shape.kv_bytes_per_token() == 2 * 4 * 2 * 64 * 2
    small = EngineArgs({"kv_cache_memory_bytes": 33554432, "max_model_len": 32768})
    reason = precheck(shape, small, "cpu")
    assert "needs 64.0 MiB" in reason and "32.0 MiB" in reason
    assert precheck(shape, EngineArgs({"kv_cache_memory_bytes": 67108864, "max_model_len": 32768}), "cpu") is None
    assert precheck(shape, EngineArgs({"max_model_len": 4096}, {"VLLM_CPU_KVCACHE_SPACE": "1"}), "cpu") is None
    assert precheck(shape, EngineArgs({"kv_cache_dtype": "fp8", "kv_cache_memory_bytes": "40M",
                                       "max_model_len": 32768}), "cpu") is None  # fp8 halves it


def test_precheck_gpu_weights_and_utilization():
    llama70 = ModelShape(layers=80, kv_heads=8, head_dim=128, dtype="bfloat16", max_position=131072,
                         weights_bytes=140 * (1 << 30))
    h100 = 80 * (1 << 30)
    assert "weights alone" in precheck(llama70, EngineArgs({"gpu_memory_utilization": 0.9}), "cuda", h100)
    tp4 = EngineArgs({"gpu_memory_utilization": 0.9, "tensor_parallel_size": 4, "max_model_len": 131072})
    assert precheck(llama70, tp4, "cuda", h100) is None  # 40 GiB of KV need vs ~148 GiB left
    tp2 = EngineArgs({"gpu_memory_utilization": 0.9, "tensor_parallel_size": 2, "max_model_len": 131072})
    assert "KV cache" in precheck(llama70, tp2, "cuda", h100)  # 144 GiB share - 140 GiB weights < 40 GiB


def test_parse_bytes():
    assert parse_bytes(1024) == 1024
    assert parse_bytes("1k") == 1000 and parse_bytes("1K") == 1024 and parse_bytes("2G") == 2 << 30


def step(load, passed):
    from autotune.measure.metrics import RequestResult
    from autotune.measure.slo import parse_slos

    slo = parse_slos(["ttft<1s"])
    r = RequestResult(0, 0, 0, True, ttft=0.1 if passed else 5.0, itl=[0.01], e2e=0.2, output_tokens=2)
    s = summarize([r], slo)
    return Step(load, 4 * load, s, s.verdicts(slo), 1.0)


def test_load_ladder_doubles_halves_and_bisects():
    ladder = Ladder(1.0, 4, 1.25)
    assert ladder.next_load([]) == 1.0
    assert ladder.next_load([(1, True)]) == 2.0
    assert ladder.next_load([(1, True), (2, True)]) == 4.0
    assert ladder.next_load([(1, True), (2, False)]) == pytest.approx(2 ** 0.5)
    assert ladder.next_load([(1, False)]) == 0.5
    assert ladder.next_load([(1, True), (1.2, False)]) is None  # resolved
    assert ladder.next_load([(1, True)] * 4) is None  # budget spent
    assert next_load([(1, True)], 1.0, 2, 1.25) == 2.0


def test_a_ladder_that_starts_at_a_guess_gallops_from_the_resolution():
    """A ladder started at a predicted capacity strides by the resolution, then by its square, its fourth power
    (on the side the steps so far fell), and bisects once it has a pass and a miss, as the doubling ladder does."""
    guided = Ladder(2.0, 4, 1.25, gallop=True)
    assert guided.next_load([]) == 2.0
    assert guided.next_load([(2.0, True)]) == pytest.approx(2.5)
    assert guided.next_load([(2.0, True), (2.5, False)]) is None  # within the resolution: known in two steps
    assert guided.next_load([(2.0, False)]) == pytest.approx(1.6)
    assert guided.next_load([(2.0, False), (1.6, True)]) is None
    assert guided.next_load([(2.0, False), (1.6, False)]) == pytest.approx(1.6 / 1.25 ** 2)
    assert guided.next_load([(2.0, False), (1.6, False), (1.024, False)]) == pytest.approx(1.024 / 1.25 ** 4)
    assert guided.next_load([(2.0, True), (2.5, True)]) == pytest.approx(2.5 * 1.25 ** 2)
    assert guided.next_load([(2.0, True), (2.5, True), (3.9, False)]) == pytest.approx((2.5 * 3.9) ** 0.5)
    assert guided.next_load([(2.0, True)] * 4) is None  # budget spent
    # the same start, doubling: four steps to narrow what the gallop knew after two
    assert Ladder(2.0, 4, 1.25).next_load([(2.0, True)]) == 4.0


def test_a_fixed_load_is_one_step():
    assert FixedLoad(0.5).next_load([]) == 0.5
    assert FixedLoad(0.5).next_load([(0.5, False)]) is None


def test_a_failed_request_fails_the_step():
    s = step(1, True)
    assert s.passed
    s.summary.failed = 1
    assert not s.passed and s.slos_hold  # the SLOs may hold; a step that lost a request does not count


def test_a_step_counts_only_if_the_client_offered_its_load():
    from autotune.measure.metrics import RequestResult
    from autotune.measure.slo import parse_slos

    slo = parse_slos(["ttft<1s"])

    def results(lateness):
        return [RequestResult(i, i * 0.1, i * 0.1 * lateness, True, ttft=0.05, itl=[0.01], e2e=0.06, output_tokens=2)
                for i in range(20)]

    on_time = results(1.0)
    s = summarize(on_time, slo)
    assert Step(1, 10, s, s.verdicts(slo), 1.0, on_time).passed
    late = results(1.2)  # the sends stretched 20 % past the schedule: the load was not offered
    s = summarize(late, slo)
    step = Step(1, 10, s, s.verdicts(slo), 1.0, late)
    assert all(v.holds for v in step.verdicts) and not step.client_kept_up and not step.passed
    assert step.to_json()["offered_share"] == pytest.approx(1 / 1.2)


def test_a_stepped_float_is_the_decimal_its_step_means():
    """Optuna's 0.8 + 7 * 0.01 is 0.8700000000000001 in binary; the engine and a published YAML get 0.87."""
    import optuna

    from autotune.study.space import Param

    p = Param(name="gpu_memory_utilization", kind="float", default=0.9, low=0.8, high=0.95, step=0.01)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = []
    for _ in range(40):
        trial = study.ask()
        value = p.sample(trial)
        seen.append(value)
        assert value == round(value, 2), value
        assert abs(value - trial.params["gpu_memory_utilization"]) < 1e-9
        study.tell(trial, 0.0)
    assert len(set(seen)) > 5
