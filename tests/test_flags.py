import pytest

from autotune.engine.args import EngineArgs

from autotune.engine.command import EngineCommand
from autotune.engine.flags import check_args
from autotune.engine.vllm.flags import REMOVED, bundled_table, bundled_versions, engine_python
from autotune.errors import ConfigError, UnknownFlagError


@pytest.fixture(scope="module", params=["0.32", "0.33"])
def table(request):
    return bundled_table(request.param)


def test_supported_versions_are_bundled():
    assert {"0.32", "0.33"} <= set(bundled_versions())
    assert bundled_table("0.32.0+cpu").version.startswith("0.32")
    assert bundled_table("0.33.1").version.startswith("0.33")


@pytest.mark.parametrize("flag", sorted(REMOVED))
def test_blog_post_flags_are_refused_with_what_to_use(table, flag):
    if table.lookup(flag) is not None:
        pytest.fail(f"{flag} is in REMOVED but vLLM {table.version} accepts it")
    with pytest.raises(UnknownFlagError) as e:
        check_args([flag], table)
    assert e.value.flag == flag
    assert REMOVED[flag] in str(e.value)


def test_seed_flags_point_somewhere_real(table):
    # every replacement a hint names must itself be a real flag
    import re
    for hint in REMOVED.values():
        for named in re.findall(r"--[a-z][a-z-]+", hint):
            assert table.lookup(named) is not None, f"hint names {named}, which vLLM {table.version} lacks"


def test_typo_gets_close_matches(table):
    with pytest.raises(UnknownFlagError, match="did you mean --max-num-seqs"):
        check_args(["--max-num-seq", "8"], table)


def test_current_flags_and_forms(table):
    parsed = check_args(["--max-num-seqs", "64", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                         "--gpu-memory-utilization=0.9", "-tp", "2", "--enforce-eager", "--block-size", "32"], table)
    assert [p[0].name for p in parsed] == ["--max-num-seqs", "--enable-prefix-caching", "--enable-chunked-prefill",
                                           "--gpu-memory-utilization", "--tensor-parallel-size", "--enforce-eager",
                                           "--block-size"]
    assert parsed[3][2] == "0.9"


@pytest.mark.parametrize("args,needle", [
    (["--max-num-seqs"], "needs a value"),
    (["--max-num-seqs", "many"], "expects int"),
    (["--dtype", "fp7"], "is not one of"),
    (["--enforce-eager=true"], "takes no value"),
    (["--port", "9000"], "autotune picks the engine port"),
    (["--config", "x.yaml"], "validated space"),
    (["some-model"], "the model is given separately"),
])
def test_bad_args(table, args, needle):
    with pytest.raises(ConfigError, match=needle):
        check_args(args, table)


def test_engine_args_render_typed_values(table):
    args = EngineArgs.from_cli(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85"],
                               table)
    assert args.values == {"max_num_seqs": 8, "enable_prefix_caching": False, "gpu_memory_utilization": 0.85}
    assert args.to_args() == ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85"]
    cmd = EngineCommand(model="m", command=("vllm", "serve"), port=8123)
    assert cmd.argv(args, table) == ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "8123", *args.to_args()]


def test_trust_remote_code_needs_permission(table):
    args = EngineArgs({"trust_remote_code": True})
    with pytest.raises(ConfigError, match="allow_trust_remote_code"):
        EngineCommand(model="m").argv(args, table)
    assert "--trust-remote-code" in EngineCommand(model="m", allow_trust_remote_code=True).argv(args, table)


def test_typed_values_that_do_not_exist_are_caught_at_argv(table):
    with pytest.raises(UnknownFlagError):
        EngineCommand(model="m").argv(EngineArgs({"swap_space": 4}), table)


def test_engine_python_from_shebang(tmp_path):
    script = tmp_path / "vllm"
    script.write_text("#!/opt/venv/bin/python3.11\nprint()\n")
    assert engine_python([str(script), "serve"]) == "/opt/venv/bin/python3.11"
    assert engine_python(["/usr/bin/python3", "-m", "vllm"]) == "/usr/bin/python3"
    assert engine_python([str(tmp_path / "missing")]) is None
