"""The Xinference publish target at the unit level: the mapping, the requests it sends, auth, errors.

The server here is an httpx.MockTransport that answers like Xinference 4.1's REST API (status codes
and error texts copied from its source); tests/test_xinference_real.py runs the real one.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.engine.flags import dest_of
from autotune.engine.vllm.flags import bundled_table
from autotune.errors import ConfigError
from autotune.errors import UnmappableEngineArgError, XinferenceAuthError, XinferenceDeployError, XinferenceUnavailable
from autotune.engine.kind import get_kind
from autotune.publish.xinference import (
    LAUNCH_FIELDS,
    RESERVED_VLLM_ARGS,
    XinferenceAuth,
    XinferenceTarget,
    engine_kwargs,
    setup_token_from_log,
)

URL = "http://xinference.test:9997"
TUNED = {  # what a study hands to publish: autotune's names (vLLM CLI dests)
    "max_num_seqs": 64,
    "gpu_memory_utilization": 0.85,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": False,
    "block_size": 32,
    "enforce_eager": False,
    "max_model_len": 8192,
    "max_num_batched_tokens": 16384,
    "kv_cache_dtype": "fp8",
}


# --- the mapping -------------------------------------------------------------------------------

def test_engine_args_become_top_level_kwargs_under_their_own_names():
    kwargs = engine_kwargs(TUNED)
    assert kwargs == TUNED
    assert "engine_config" not in kwargs


def test_quantization_goes_as_model_quantization_because_xinference_owns_the_name():
    assert engine_kwargs({"quantization": "fp8", "max_num_seqs": 8}) == {"model_quantization": "fp8", "max_num_seqs": 8}


def test_json_text_becomes_an_object_unless_xinference_parses_it_itself():
    kwargs = engine_kwargs({"kv_transfer_config": '{"kv_connector": "X"}',
                            "compilation_config": '{"cudagraph_mode": "NONE"}'})
    assert kwargs["kv_transfer_config"] == {"kv_connector": "X"}
    assert kwargs["compilation_config"] == '{"cudagraph_mode": "NONE"}'  # _sanitize_model_config parses it


def test_unmappable_args_are_all_named_with_their_reason():
    with pytest.raises(UnmappableEngineArgError) as e:
        engine_kwargs({"max_num_seqs": 8, "tensor_parallel_size": 2, "model": "/m", "enable_lora": True,
                       "port": 8000, "engine_config": {"max_num_seqs": 8}, "n_gpu": 2, "reasoning_content": True,
                       "kv_transfer_config": "{oops"})
    reasons = e.value.reasons
    assert set(reasons) == {"tensor_parallel_size", "model", "enable_lora", "port", "engine_config", "n_gpu",
                            "reasoning_content", "kv_transfer_config"}
    assert "n_gpu" in reasons["tensor_parallel_size"]
    assert "not unwrap" in reasons["engine_config"]
    assert "API server" in reasons["port"]
    assert "launch_fields" in reasons["n_gpu"]
    assert "JSON" in reasons["kv_transfer_config"]
    assert isinstance(e.value, ConfigError) and e.value.exit_code == 2
    for name in reasons:
        assert name in str(e.value)


def test_unknown_names_are_refused_when_the_target_vllm_fields_are_known():
    with pytest.raises(UnmappableEngineArgError, match="swap_space"):
        engine_kwargs({"swap_space": 4, "max_num_seqs": 8}, engine_fields=frozenset({"max_num_seqs"}))


def _vllm_engine_fields() -> frozenset[str]:
    """EngineArgs + AsyncEngineArgs dataclass fields of the installed vLLM, read from its source (no import)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vLLM is not installed in this environment: run scripts/install_cpu.sh")
    source = Path(next(iter(spec.submodule_search_locations)), "engine", "arg_utils.py").read_text()
    fields = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                       and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")}
    return frozenset(fields)


def test_the_tables_agree_with_the_installed_vllm():
    fields = _vllm_engine_fields()
    assert set(TUNED) <= fields
    assert engine_kwargs(TUNED, engine_fields=fields) == TUNED
    assert fields & LAUNCH_FIELDS == {"quantization"}  # the one collision, handled by the rename
    assert set(RESERVED_VLLM_ARGS) <= fields
    assert not fields & get_kind("vllm").frontend_args
    from importlib.metadata import version
    table = bundled_table(version("vllm"))
    dests = {dest_of(f.name) for f in table.flags.values()}
    assert dests - {"help"} <= fields | get_kind("vllm").frontend_args  # every flag is an engine arg or a frontend option


def test_setup_token_is_read_from_the_log_notice():
    log = ("WARNING xinference.api.restful_api \n" + "=" * 60 + "\n  FIRST-RUN SETUP REQUIRED\n"
           "  Setup token: QgnbI5n3A4oScjeORYzByrySfblxQk3v0zfi4IoG-Kg\n  Create the initial admin account ...")
    assert setup_token_from_log(log) == "QgnbI5n3A4oScjeORYzByrySfblxQk3v0zfi4IoG-Kg"
    assert setup_token_from_log("no notice") is None


# --- a fake Xinference 4.1 ---------------------------------------------------------------------

class FakeXinference:
    """Just enough of Xinference 4.1's REST API, with the answers its source gives."""

    def __init__(self, *, setup_done: bool = False, launch_error: str | None = None, polls_until_ready: int = 1,
                 reload_config: dict[str, Any] | None = None, now: int = 1_795_000_000) -> None:
        self.requests: list[httpx.Request] = []
        self.setup_done = setup_done
        self.launch_error = launch_error
        self.polls_until_ready = polls_until_ready
        self.reload_config = reload_config
        self.now = now
        self.tokens = 0
        self.instances: dict[str, dict[str, Any]] = {}
        self.bodies: dict[str, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []
        self.expire_next_token = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, method = request.url.path, request.method
        body = json.loads(request.content) if request.content else None
        if path == "/v1/admin/setup":
            if self.setup_done:
                return httpx.Response(403, json={"detail": "Setup already completed; an account already exists."})
            if body.get("setup_token") != "SETUP":
                return httpx.Response(403, json={"detail": "Invalid setup token."})
            self.setup_done = True
            return httpx.Response(201, json={"id": 1, "username": body["username"]})
        if path == "/token":
            if not self.setup_done or body != {"username": "autotune", "password": "s3cret-pass"}:
                return httpx.Response(401, json={"detail": "Incorrect username or password"})
            self.tokens += 1
            return httpx.Response(200, json={"access_token": f"jwt{self.tokens}", "refresh_token": "r",
                                             "token_type": "bearer"})
        if request.headers.get("authorization") != f"Bearer jwt{self.tokens}" or self.expire_next_token:
            self.expire_next_token = False
            return httpx.Response(401, json={"detail": "Could not validate credentials"})
        return self._models(method, path, request, body)

    def _models(self, method: str, path: str, request: httpx.Request, body: Any) -> httpx.Response:
        uid = path.split("/")[3] if path.count("/") >= 3 else None
        if method == "GET" and path == "/v1/models/instances":
            info = self.instances.get(request.url.params.get("model_uid"))
            if info is not None and info["status"] in ("CREATING", "LOADING"):
                info["polls"] += 1
                if info["polls"] >= self.polls_until_ready:
                    if self.launch_error:
                        info["status"] = "ERROR"
                        info["replica_statuses"][0]["error_message"] = self.launch_error
                    else:
                        info["status"] = "READY"
            return httpx.Response(200, json=[info] if info else [])
        if method == "POST" and path == "/v1/models":
            if body["model_uid"] in self.instances and self.instances[body["model_uid"]]["status"] == "READY":
                detail = f"Model is already in the model list, uid: {body['model_uid']}"
                return httpx.Response(400, json={"detail": detail})
            if body.get("model_name") == "missing":
                return httpx.Response(400, json={"detail": "Model not found, name: missing"})
            self.bodies[body["model_uid"]] = body
            self.instances[body["model_uid"]] = {
                "model_name": body["model_name"], "model_uid": body["model_uid"], "status": "CREATING", "polls": 0,
                "instance_created_ts": self.now, "replica_statuses": [{"status": "CREATING", "error_message": None}]}
            return httpx.Response(200, json={"model_uid": body["model_uid"]})
        if method == "DELETE" and path.startswith("/v1/models/"):
            info = self.instances.get(uid)
            if info is None or info["status"] == "ERROR":
                return httpx.Response(400, json={"detail": f"Model not found in the model list, uid: {uid}"})
            del self.instances[uid]
            return httpx.Response(200, json=None)
        if method == "POST" and path.endswith("/cancel"):
            if uid in self.instances:
                self.instances[uid]["status"] = "ERROR"
            return httpx.Response(200, json=None)
        if method == "GET" and path.endswith("/reload/config"):
            if self.reload_config is None:
                return httpx.Response(400, json={"detail": "Reload with retained weights requires vLLM or SGLang"})
            return httpx.Response(200, json={"engine": "vllm", "model_config": self.reload_config})
        if method == "GET" and path.startswith("/v1/models/"):
            if uid not in self.instances:
                return httpx.Response(400, json={"detail": f"Model not found in the model list, uid: {uid}"})
            return httpx.Response(200, json={"model_name": self.instances[uid]["model_name"],
                                             "model_engine": self.bodies[uid]["model_engine"]})
        if path == "/v1/launch_history" and method == "POST":
            key = (body["model_name"], body["model_uid"])
            self.history = [h for h in self.history if (h["model_name"], h["model_uid"]) != key]
            self.history.append({**body, "created_by": "autotune", "updated_at": _stamp(self.now + 5)})
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/launch_history" and method == "GET":
            name = request.url.params.get("model_name")
            return httpx.Response(200, json=[h for h in self.history if h["model_name"] == name])
        return httpx.Response(404, json={"detail": "Not Found"})

    def calls(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]


def _stamp(epoch: int) -> str:
    import datetime as dt
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _target(fake: FakeXinference, engine: str = "vllm", auth: XinferenceAuth | None = None,
            **launch: Any) -> XinferenceTarget:
    client = httpx.Client(base_url=URL, transport=httpx.MockTransport(fake))
    fields = launch or {"model_format": "pytorch", "model_size_in_billions": 8, "quantization": "none", "n_gpu": 1}
    t = XinferenceTarget(URL, "prod", "qwen3", engine, fields,
                         auth or XinferenceAuth("autotune", "s3cret-pass", setup_token="SETUP"),
                         poll_interval=0.0, client=client)
    t._sleep = lambda _s: None
    return t


# --- requests and auth -------------------------------------------------------------------------

def test_deploy_sends_engine_args_as_top_level_keys_of_the_launch_body():
    fake = FakeXinference()
    _target(fake).deploy({**TUNED, "quantization": "fp8"}, timeout=30)
    launch = next(r for r in fake.requests if r.method == "POST" and r.url.path == "/v1/models")
    assert launch.url.params["wait_ready"] == "false"
    assert json.loads(launch.content) == {
        "model_uid": "prod", "model_name": "qwen3", "model_engine": "vllm", "model_format": "pytorch",
        "model_size_in_billions": 8, "quantization": "none", "n_gpu": 1, **TUNED, "model_quantization": "fp8"}
    assert "engine_config" not in json.loads(launch.content)


def test_auth_is_setup_then_token_then_bearer_on_every_call():
    fake = FakeXinference()
    _target(fake).deploy(TUNED, timeout=30)
    assert fake.calls()[:2] == ["POST /v1/admin/setup", "POST /token"]
    assert json.loads(fake.requests[0].content) == {"setup_token": "SETUP", "username": "autotune",
                                                    "password": "s3cret-pass"}
    assert "authorization" not in fake.requests[0].headers and "authorization" not in fake.requests[1].headers
    assert all(r.headers["authorization"] == "Bearer jwt1" for r in fake.requests[2:])
    assert fake.calls()[2:] == [
        "GET /v1/models/instances", "DELETE /v1/models/prod",  # terminate: nothing ran
        "POST /v1/models", "GET /v1/models/instances",  # launch, poll until READY
        "POST /v1/launch_history"]  # the record deployed() reads back


def test_a_server_already_set_up_just_logs_in():
    fake = FakeXinference(setup_done=True)
    t = _target(fake)
    assert t.api_key() == "jwt1"
    assert fake.calls() == ["POST /v1/admin/setup", "POST /token"]


def test_an_expired_token_logs_in_again_once():
    fake = FakeXinference(setup_done=True)
    t = _target(fake, auth=XinferenceAuth("autotune", "s3cret-pass"))
    assert t.instance() is None
    fake.expire_next_token = True
    assert t.instance() is None
    assert fake.calls() == ["POST /token", "GET /v1/models/instances", "GET /v1/models/instances", "POST /token",
                            "GET /v1/models/instances"]


def test_refused_login_says_what_xinference_said():
    fake = FakeXinference(setup_done=True)
    with pytest.raises(XinferenceAuthError, match="Incorrect username or password") as e:
        _target(fake, auth=XinferenceAuth("autotune", "wrong-pass")).deploy(TUNED)
    assert e.value.status == 401


def test_wrong_setup_token_is_an_auth_error():
    with pytest.raises(XinferenceAuthError, match="Invalid setup token"):
        _target(FakeXinference(), auth=XinferenceAuth("autotune", "s3cret-pass", setup_token="nope")).instance()


def test_no_auth_sends_no_header():
    fake = FakeXinference()
    t = _target(fake)
    t.auth = None
    with pytest.raises(XinferenceAuthError, match="Could not validate credentials"):
        t.instance()
    assert "authorization" not in fake.requests[0].headers


# --- errors ------------------------------------------------------------------------------------

def test_unmappable_args_fail_before_production_is_touched():
    fake = FakeXinference()
    with pytest.raises(UnmappableEngineArgError, match="tensor_parallel_size"):
        _target(fake).deploy({**TUNED, "tensor_parallel_size": 2})
    assert fake.requests == []


def test_engine_args_may_not_repeat_launch_fields():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        _target(FakeXinference(), "transformers", max_num_seqs=4, model_format="pytorch").deploy({"max_num_seqs": 8})
    with pytest.raises(ConfigError, match="engine_config"):
        XinferenceTarget(URL, "prod", "qwen3", launch_fields={"engine_config": {}})


def test_the_engine_error_text_comes_out_of_a_failed_launch():
    text = "[address=127.0.0.1:44843, pid=8319] ValueError: No available memory for the cache blocks."
    fake = FakeXinference(launch_error=text, polls_until_ready=3)
    with pytest.raises(XinferenceDeployError) as e:
        _target(fake).deploy(TUNED, timeout=30)
    assert text in str(e.value) and e.value.detail == text
    assert fake.calls().count("GET /v1/models/instances") == 4  # the one before terminating, then three polls


def test_a_refused_launch_says_why():
    fake = FakeXinference()
    t = _target(fake)
    t.model_name = "missing"
    with pytest.raises(XinferenceDeployError, match="Model not found, name: missing") as e:
        t.deploy(TUNED)
    assert e.value.status == 400


def test_a_launch_past_the_deadline_is_cancelled():
    fake = FakeXinference(polls_until_ready=10**6)
    t = _target(fake)
    clock = iter(range(100))
    t._clock = lambda: float(next(clock))
    with pytest.raises(XinferenceDeployError, match="not ready on Xinference before the deadline"):
        t.deploy(TUNED, timeout=5)
    assert fake.calls()[-3:] == ["GET /v1/models/instances", "POST /v1/models/prod/cancel", "DELETE /v1/models/prod"]


def test_an_unreachable_server_is_unavailable_not_a_crash():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)
    t = XinferenceTarget(URL, "prod", "qwen3", client=httpx.Client(base_url=URL, transport=httpx.MockTransport(refuse)))
    with pytest.raises(XinferenceUnavailable, match="did not answer"):
        t.deployed()


def test_terminate_tells_whether_anything_ran():
    fake = FakeXinference()
    t = _target(fake)
    assert t.terminate() is False
    t.deploy(TUNED)
    assert t.terminate() is True


# --- reading back ------------------------------------------------------------------------------

def test_deployed_reads_the_launch_record_back_in_autotune_names():
    fake = FakeXinference()
    t = _target(fake)
    assert t.deployed() is None
    t.deploy({**TUNED, "quantization": "fp8"})
    assert t.deployed() == {**TUNED, "quantization": "fp8"}
    assert t.deployment().source == "record"


def test_deployed_prefers_what_vllm_reports_and_ignores_a_stale_record():
    fake = FakeXinference(reload_config={"max_num_seqs": 32, "gpu_memory_utilization": 0.85,
                                         "reasoning_content": False})
    t = _target(fake)
    t.deploy(TUNED)
    d = t.deployment()
    assert d.source == "record+engine" and d.values == {**TUNED, "max_num_seqs": 32}
    fake.instances["prod"]["instance_created_ts"] += 60  # relaunched by someone else since the record
    d = t.deployment()
    assert d.source == "engine" and d.values == {"max_num_seqs": 32, "gpu_memory_utilization": 0.85}


def test_engines_without_a_reload_config_are_not_asked():
    fake = FakeXinference()
    t = _target(fake, "transformers", model_format="pytorch", model_size_in_billions="0_01", quantization="none")
    t.deploy({"max_num_seqs": 4, "torch_dtype": "float32"})
    assert t.deployed() == {"max_num_seqs": 4, "torch_dtype": "float32"}
    assert not any(c.endswith("/reload/config") for c in fake.calls())


def test_endpoint_is_the_base_url_the_replay_extends():
    t = XinferenceTarget(URL + "/", "prod", "qwen3")
    assert t.endpoint() == URL and t.openai_base_url() == URL + "/v1" and t.name == "xinference:prod"


def test_secrets_stay_out_of_reprs():
    auth = XinferenceAuth("autotune", "s3cret-pass", setup_token="SETUP", access_token="jwt1")
    assert "s3cret" not in repr(auth) and "SETUP" not in repr(auth) and "jwt1" not in repr(auth)


# --- the daemon's [production] table -----------------------------------------------------------

def test_target_from_the_daemon_config(tmp_path):
    from autotune.publish.xinference import target_from_config

    pw = tmp_path / "pw"
    pw.write_text("s3cret-pass\n")
    t = target_from_config("http://lb:80", {"xinference_url": "http://xi:9997", "model_uid": "prod",
                                            "model_name": "qwen3", "username": "autotune", "password_file": str(pw),
                                            "launch": {"model_format": "pytorch", "n_gpu": 2}})
    assert (t.url, t.endpoint(), t.model_engine, t.launch_fields) == (
        "http://xi:9997", "http://lb:80", "vllm", {"model_format": "pytorch", "n_gpu": 2})
    assert t.auth is not None and t.auth.password == "s3cret-pass"
    assert target_from_config("http://xi:9997", {"model_uid": "p", "model_name": "m"}).auth is None
    with pytest.raises(ConfigError, match="model_name"):
        target_from_config("http://xi:9997", {"model_uid": "p"})
    with pytest.raises(ConfigError, match="both username and password_file"):
        target_from_config("http://xi:9997", {"model_uid": "p", "model_name": "m", "username": "u"})
    with pytest.raises(ConfigError, match="password_file"):
        target_from_config("http://xi:9997", {"model_uid": "p", "model_name": "m", "username": "u",
                                              "password_file": str(tmp_path / "absent")})


# --- publishing through the transaction (autotune/publish/transaction.py) ------------------------

OLD = {"max_num_seqs": 8, "gpu_memory_utilization": 0.8}  # what production runs before the publish
NEW = {**TUNED, "load_format": "dummy"}  # a study's winner as staging measured it (random weights)


def _launches(fake: FakeXinference) -> list[dict[str, Any]]:
    """The engine kwargs of every launch the fake saw, in order (the launch fields left out)."""
    fields = {"model_uid", "model_name", "model_engine", "model_format", "model_size_in_billions", "quantization",
              "n_gpu"}
    return [{k: v for k, v in json.loads(r.content).items() if k not in fields}
            for r in fake.requests if r.method == "POST" and r.url.path == "/v1/models"]


def _running(values: dict[str, Any]) -> tuple[FakeXinference, XinferenceTarget]:
    fake = FakeXinference()
    t = _target(fake)
    t.deploy(values)  # production, launched before autotune came: its launch record is what gets adopted
    fake.requests.clear()
    return fake, t


def test_publish_to_xinference_relaunches_with_the_winner_and_keeps_it_when_the_canary_passes(tmp_path):
    from autotune.publish.history import History
    from autotune.publish.transaction import CanaryResult, publish

    fake, t = _running(OLD)
    history = History(tmp_path / "history")
    asked = []
    passed = CanaryResult(True, {"slos": [{"slo": "ttft<1s", "holds": True, "measured": 0.2}]})
    result = publish(t, NEW, history, lambda url: asked.append(url) or passed, source={"study": "s", "trial": 3})
    assert result.ok and result.outcome == "published"
    assert asked == [URL]  # the canary replayed against production's endpoint, after the relaunch
    assert _launches(fake) == [TUNED]  # staging's load_format=dummy never reaches production
    adopted, entry = history.entries()
    assert (adopted.outcome, adopted.values) == ("adopted", OLD)  # Xinference's launch record, read back
    assert entry.values == TUNED and entry.canary == passed.summary and entry.source == {"study": "s", "trial": 3}
    assert t.deployed() == TUNED


def test_a_canary_miss_on_xinference_relaunches_the_last_good_config(tmp_path):
    from autotune.publish.history import History
    from autotune.publish.transaction import CanaryResult, publish

    fake, t = _running(OLD)
    history = History(tmp_path / "history")
    phases = []
    miss = CanaryResult(False, {"slos": [{"slo": "ttft<1s", "holds": False, "measured": 3.5}]})
    result = publish(t, NEW, history, lambda url: miss, on_phase=phases.append)
    assert not result.ok and result.outcome == "rolled-back"
    assert phases == ["verifying", "rolling_back"]
    assert _launches(fake) == [TUNED, OLD]  # the winner, then production's own config again
    assert fake.calls().count("DELETE /v1/models/prod") == 2  # each launch replaced the model under the uid
    adopted, entry = history.entries()
    assert entry.restored == adopted.number == 1 and entry.canary == miss.summary
    assert entry.reason == "canary missed ttft<1s (measured 3.5)"
    assert t.deployed() == OLD and fake.instances["prod"]["status"] == "READY"


def test_a_winner_that_fails_to_launch_on_xinference_is_rolled_back_with_the_engine_error(tmp_path):
    from autotune.publish.history import History
    from autotune.publish.transaction import CanaryResult, publish

    fake, t = _running(OLD)
    error = "ValueError: No available memory for the cache blocks."
    launch = fake._models

    def models(method, path, request, body):  # only the winner's launch fails, as an oversized KV cache would
        if method == "POST" and path == "/v1/models":  # the polls that follow report this launch's fate
            fake.launch_error = error if body.get("max_num_seqs") == TUNED["max_num_seqs"] else None
        return launch(method, path, request, body)

    fake._models = models
    history = History(tmp_path / "history")
    asked = []
    result = publish(t, NEW, history, lambda url: asked.append(url) or CanaryResult(True, {}))
    assert not result.ok and asked == []  # no canary on a model that never came up
    assert _launches(fake) == [TUNED, OLD]
    adopted, entry = history.entries()
    assert entry.outcome == "rolled-back" and entry.restored == adopted.number and error in entry.reason
    assert t.deployed() == OLD
