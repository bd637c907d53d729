"""Production as a model served by Xinference 4.1, driven through its REST API.

What Xinference 4.1 requires (read from its source, ``xinference/api/restful_api.py``,
``api/routers/models.py``, ``api/oauth2/advanced/routes.py``, ``core/supervisor.py``):

    POST /v1/admin/setup      {"setup_token", "username", "password"} -> 201; once only, while no
                              account exists (token printed in the server log; 403 afterwards)
    POST /token               {"username", "password"} (JSON, not a form) -> {"access_token", ...};
                              every call below sends "Authorization: Bearer <access_token>"
                              (API keys only get models:read/models:list: they cannot launch)
    GET  /v1/models/instances?model_uid=U    [{"status": CREATING|LOADING|READY|ERROR|..., "instance_created_ts",
                              "replica_statuses": [{"error_message", ...}]}]
    DELETE /v1/models/U       terminate; 400 "Model not found ..." when nothing runs under U
    POST /v1/models/U/cancel  abort a launch in progress
    POST /v1/models?wait_ready=false   the launch body: named fields (LAUNCH_FIELDS) and every other
                              top-level key becomes an engine kwarg (for vLLM: AsyncEngineArgs(**kwargs));
                              a nested "engine_config" is NOT unwrapped (vLLM raises TypeError)
    GET  /v1/models/U         the model's description (model_engine, format, ...): no engine kwargs
    GET  /v1/models/U/reload/config    vLLM/SGLang only: "model_config", the launch kwargs among
                              max_num_seqs, max_num_batched_tokens, max_model_len, gpu_memory_utilization,
                              enforce_eager (400 for other engines)
    POST/GET /v1/launch_history        the launch records Xinference's web UI keeps (and relaunches from)

Xinference reports no other launch kwargs of a running model, so ``deploy`` also writes its
launch body to the launch history, the way Xinference's own UI does, and ``deployed`` reads it
back (only if it is newer than the running instance), with what vLLM's reload config reports
laid over it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import httpx

from autotune.engine.kind import get_kind
from autotune.errors import (
    ConfigError,
    UnmappableEngineArgError,
    XinferenceAuthError,
    XinferenceDeployError,
    XinferenceError,
    XinferenceUnavailable,
)
from autotune.publish.target import CanaryClient, Target

__all__ = [
    "LAUNCH_FIELDS",
    "RESERVED_VLLM_ARGS",
    "XINFERENCE_OPTIONS",
    "Deployment",
    "XinferenceAuth",
    "XinferenceTarget",
    "engine_kwargs",
    "setup_token_from_log",
    "target_from_config",
]

# Top-level keys of POST /v1/models that Xinference takes itself (restful_api.py, launch_model's
# exclude_keys): everything else in the body becomes an engine kwarg.
LAUNCH_FIELDS: frozenset[str] = frozenset(
    {
        "model_uid",
        "model_name",
        "model_engine",
        "model_size_in_billions",
        "model_format",
        "quantization",
        "model_type",
        "replica",
        "n_gpu",
        "request_limits",
        "peft_model_config",
        "worker_ip",
        "gpu_idx",
        "download_hub",
        "model_path",
        "enable_virtual_env",
        "virtual_env_packages",
        "model_python_executable",
        "virtual_env_find_links",
        "envs",
        "replica_config",
    }
)

# Keys that pass as kwargs but that Xinference consumes before the engine sees them (worker.py,
# model/llm/vllm/core.py): they are Xinference settings, given in ``launch_fields``.
XINFERENCE_OPTIONS: frozenset[str] = frozenset(
    {
        "n_worker",
        "shard",
        "driver_info",
        "address",
        "launch_ts",
        "virtual_env_name",
        "xavier_config",
        "xinference_vllm_executor_backend",
        "enable_weight_cache",
        "reasoning_content",
        "enable_thinking",
        "context_length",
        "model_quantization",
        "draft_model_path",
        "num_speculative_tokens",
        "rope_scaling",
        "min_pixels",
        "max_pixels",
    }
)

# vLLM engine args that cannot go through Xinference, and why.
RESERVED_VLLM_ARGS: dict[str, str] = {
    "model": "Xinference passes the model path itself (the registered model spec, or the launch field model_path)",
    "tensor_parallel_size": "Xinference derives it from the GPUs it allocates: set the launch field n_gpu",
    "pipeline_parallel_size": "Xinference derives it from the launch field n_worker",
    "distributed_executor_backend": "Xinference chooses vLLM's executor itself (and overwrites this value)",
    "nnodes": "Xinference sets it for multi-worker launches (launch field n_worker)",
    "node_rank": "Xinference sets it for multi-worker launches (launch field n_worker)",
    "master_addr": "Xinference sets it for multi-worker launches (launch field n_worker)",
    "master_port": "Xinference sets it for multi-worker launches (launch field n_worker)",
    "enable_lora": "Xinference passes it to AsyncEngineArgs itself (from the launch field peft_model_config); "
    "a second value is a TypeError",
    "max_loras": "Xinference passes it to AsyncEngineArgs itself (from the launch field peft_model_config); "
    "a second value is a TypeError",
}

# vLLM's `quantization` collides with Xinference's launch field of that name (the model spec's
# quantization); Xinference takes the engine's under this name and renames it back.
_RENAMED = {"quantization": "model_quantization"}
_UNRENAMED = {v: k for k, v in _RENAMED.items()}

# Fields whose JSON text Xinference parses itself before vLLM sees them (VLLMModel._sanitize_model_config):
# a string stays a string. Other JSON text becomes the object AsyncEngineArgs expects.
_XINFERENCE_PARSES_JSON = frozenset(
    {
        "compilation_config",
        "additional_config",
        "model_loader_extra_config",
        "structured_outputs_config",
        "reasoning_config",
        "speculative_config",
        "limit_mm_per_prompt",
        "mm_processor_kwargs",
    }
)

_ENGINES_WITH_RELOAD_CONFIG = frozenset({"vllm", "sglang"})


# --- errors ------------------------------------------------------------------------------------

# --- the mapping -------------------------------------------------------------------------------


def engine_kwargs(vllm_values: Mapping[str, Any], *, engine_fields: frozenset[str] | None = None) -> dict[str, Any]:
    """autotune's vLLM engine args (snake-case CLI dests) -> the top-level kwargs of Xinference's launch body.

    In vLLM (0.32, checked) every engine flag's dest is the AsyncEngineArgs field of the same name,
    so names pass unchanged, except ``quantization`` (sent as ``model_quantization``). JSON text for a
    field Xinference does not parse itself becomes the object. Rejected, all at once and each with its
    reason: args Xinference sets itself (RESERVED_VLLM_ARGS), `vllm serve` API-server options
    (the vLLM kind's ``frontend_args``), names Xinference would take as its own launch fields or options, a nested
    ``engine_config``, and, when ``engine_fields`` (the target vLLM's AsyncEngineArgs fields) is given,
    anything that is not one of them.
    """
    out: dict[str, Any] = {}
    bad: dict[str, str] = {}
    for name, value in vllm_values.items():
        if name == "engine_config":
            bad[name] = (
                "Xinference 4.1 does not unwrap a nested engine_config (vLLM raises TypeError); "
                "give each engine arg as its own key"
            )
        elif name in RESERVED_VLLM_ARGS:
            bad[name] = RESERVED_VLLM_ARGS[name]
        elif name in get_kind("vllm").frontend_args:
            bad[name] = "an option of vllm serve's API server, not an engine arg: Xinference serves its own API"
        elif name not in _RENAMED and (name in LAUNCH_FIELDS or name in XINFERENCE_OPTIONS):
            bad[name] = "a field Xinference takes itself, not a vLLM engine arg: put it in launch_fields"
        elif engine_fields is not None and name not in engine_fields:
            bad[name] = "not a field of the target vLLM's AsyncEngineArgs"
        else:
            try:
                out[_RENAMED.get(name, name)] = _engine_value(name, value)
            except ValueError as e:
                bad[name] = str(e)
    if bad:
        raise UnmappableEngineArgError(bad)
    return out


def _engine_value(name: str, value: Any) -> Any:
    if isinstance(value, str) and name not in _XINFERENCE_PARSES_JSON and value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"JSON value does not parse ({e.msg} at {e.pos})") from e
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{type(value).__name__} value cannot be sent as JSON") from e
    return value


def _vllm_values(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``engine_kwargs`` on names: launch kwargs -> autotune's vLLM names."""
    return {_UNRENAMED.get(k, k): v for k, v in kwargs.items()}


def setup_token_from_log(text: str) -> str | None:
    """The first-run setup token from an Xinference server log (restful_api._log_setup_required_notice)."""
    m = re.search(r"Setup token: (\S+)", text)
    return m.group(1) if m else None


# --- auth --------------------------------------------------------------------------------------


@dataclass
class XinferenceAuth:
    """An Xinference account, turned into a bearer JWT (``POST /token``).

    With ``setup_token`` (printed in the log of a fresh server) the account is first created as the
    initial admin through ``POST /v1/admin/setup``; a server already set up answers 403 "Setup already
    completed", and the login goes ahead. Tokens expire (30 min by default): a 401 logs in again.
    """

    username: str
    password: str = field(repr=False)
    setup_token: str | None = field(default=None, repr=False)
    access_token: str | None = field(default=None, repr=False)
    _setup_done: bool = field(default=False, repr=False)

    def login(self, send: Callable[..., httpx.Response]) -> str:
        if self.setup_token and not self._setup_done:
            r = send(
                "POST",
                "/v1/admin/setup",
                json={"setup_token": self.setup_token, "username": self.username, "password": self.password},
            )
            if r.status_code != 201 and not (r.status_code == 403 and "already completed" in _detail(r)):
                raise XinferenceAuthError(
                    f"Xinference refused the initial setup ({r.status_code}): {_detail(r)}",
                    status=r.status_code,
                    detail=_detail(r),
                )
            self._setup_done = True
        r = send("POST", "/token", json={"username": self.username, "password": self.password})
        body = _json(r)
        if r.status_code != 200 or not isinstance(body, dict) or "access_token" not in body:
            raise XinferenceAuthError(
                f"Xinference refused the login of {self.username!r} ({r.status_code}): {_detail(r)}",
                status=r.status_code,
                detail=_detail(r),
            )
        self.access_token = str(body["access_token"])
        return self.access_token


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _detail(r: httpx.Response) -> str:
    body = _json(r)
    if isinstance(body, dict) and "detail" in body:
        d = body["detail"]
        return d if isinstance(d, str) else json.dumps(d)
    return r.text.strip()[:2000]


# --- the target --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """What runs under the model uid now, and where its engine kwargs were read.

    ``source``: "record" (the launch body in Xinference's launch history, newer than the instance),
    "engine" (vLLM's reload config alone), "record+engine" (both; the engine's values win).
    """

    model_uid: str
    model_engine: str | None
    created_ts: int
    values: dict[str, Any]
    source: str


_RUNNING = ("CREATING", "LOADING", "UPDATING")


class XinferenceTarget:
    """One model uid on an Xinference 4.1 server, as a publish target (transaction.Target).

    ``launch_fields`` are the launch body's named fields and Xinference's own options (model_format,
    model_size_in_billions, quantization, n_gpu, replica, envs, reasoning_content, ...); the engine
    kwargs given to ``deploy`` go next to them as top-level keys, never in a nested engine_config.
    ``auth`` None is for a server started with XINFERENCE_AUTH_ADVANCED=0.
    """

    def __init__(
        self,
        url: str,
        model_uid: str,
        model_name: str,
        model_engine: str = "vllm",
        launch_fields: Mapping[str, Any] | None = None,
        auth: XinferenceAuth | None = None,
        *,
        deploy_timeout: float = 1800.0,
        request_timeout: float = 60.0,
        poll_interval: float = 1.0,
        endpoint_url: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.endpoint_url = (endpoint_url or url).rstrip("/")
        self.model_uid = model_uid
        self.model_name = model_name
        self.model_engine = model_engine
        self.launch_fields = dict(launch_fields or {})
        own = {"model_uid", "model_name", "model_engine", "engine_config"} & self.launch_fields.keys()
        if own:
            raise ConfigError(
                f"launch_fields cannot hold {', '.join(sorted(own))}: model_uid, model_name and "
                "model_engine are the target's own arguments, and a nested engine_config is not "
                "unwrapped by Xinference 4.1"
            )
        self.auth = auth
        self.deploy_timeout = deploy_timeout
        self.poll_interval = poll_interval
        self.name = f"xinference:{model_uid}"
        self._client = client or httpx.Client(base_url=self.url, timeout=request_timeout)
        self._sleep: Callable[[float], None] = time.sleep
        self._clock: Callable[[], float] = time.monotonic

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place httpx meets autotune's errors --

    def _raw(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._client.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise XinferenceUnavailable(f"Xinference at {self.url} timed out on {method} {path}") from e
        except httpx.TransportError as e:
            raise XinferenceUnavailable(f"Xinference at {self.url} did not answer {method} {path}: {e}") from e

    def _call(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kw: Any) -> httpx.Response:
        """An authenticated call; a 401 logs in again once. Statuses outside ``ok`` raise XinferenceError."""
        r = self._raw(method, path, headers=self.headers(), **kw)
        if r.status_code == 401 and self.auth is not None:
            self.auth.access_token = None
            r = self._raw(method, path, headers=self.headers(), **kw)
        if r.status_code in ok:
            return r
        detail = _detail(r)
        cls = XinferenceAuthError if r.status_code in (401, 403) else XinferenceError
        raise cls(
            f"Xinference answered {method} {path} with {r.status_code}: {detail}", status=r.status_code, detail=detail
        )

    def headers(self) -> dict[str, str]:
        """The bearer header (logging in first if needed): also what a canary replay must send."""
        if self.auth is None:
            return {}
        token = self.auth.access_token or self.auth.login(self._raw)
        return {"Authorization": f"Bearer {token}"}

    def api_key(self) -> str | None:
        """The bearer token alone, for ReplayOptions(api_key=...) or an OpenAI client."""
        return self.headers().get("Authorization", "").removeprefix("Bearer ") or None

    # -- reading --

    def instance(self) -> dict[str, Any] | None:
        """Xinference's instance info for the uid (status, instance_created_ts, replica_statuses), or None."""
        infos = _json(self._call("GET", "/v1/models/instances", params={"model_uid": self.model_uid})) or []
        return next((i for i in infos if i.get("model_uid") == self.model_uid), None)

    def describe(self) -> dict[str, Any] | None:
        """GET /v1/models/{uid}: the running model's description, None when nothing runs under the uid."""
        r = self._call("GET", f"/v1/models/{self.model_uid}", ok=(200, 400, 503))
        return _json(r) if r.status_code == 200 else None

    def deployment(self) -> Deployment | None:
        """The READY model under the uid and its engine kwargs; None when none runs or they are unknown."""
        info = self.instance()
        if info is None or info.get("status") != "READY":
            return None
        created = int(info.get("instance_created_ts") or 0)
        desc = self.describe() or {}
        engine = desc.get("model_engine")
        values: dict[str, Any] | None = None
        record = self._launch_record()
        if record is not None and _epoch(record.get("updated_at")) >= created - 1:
            values = self._engine_values(record.get("data") or {})
        reported = None
        if str(engine or self.model_engine).lower() in _ENGINES_WITH_RELOAD_CONFIG:
            r = self._call("GET", f"/v1/models/{self.model_uid}/reload/config", ok=(200, 400))
            if r.status_code == 200:
                reported = self._engine_values((_json(r) or {}).get("model_config") or {})
        if values is None and reported is None:
            return None
        source = "+".join(s for s, v in (("record", values), ("engine", reported)) if v is not None)
        return Deployment(self.model_uid, engine, created, {**(values or {}), **(reported or {})}, source)

    def deployed(self) -> dict[str, Any] | None:
        """The running model's engine kwargs in autotune's names, as Xinference reports them (see module doc).

        None when nothing is READY under the uid, or when it was not launched through this target and
        its engine reports nothing (Transformers, say).
        """
        d = self.deployment()
        return None if d is None else d.values

    def _launch_record(self) -> dict[str, Any] | None:
        rows = (
            _json(self._call("GET", "/v1/launch_history", params={"model_name": self.model_name, "scope": "mine"}))
            or []
        )
        mine = [r for r in rows if isinstance(r, dict) and r.get("model_uid") == self.model_uid]
        return max(mine, key=lambda r: _epoch(r.get("updated_at")), default=None)

    def _engine_values(self, body: Mapping[str, Any]) -> dict[str, Any]:
        skip = LAUNCH_FIELDS | (XINFERENCE_OPTIONS - set(_UNRENAMED)) | self.launch_fields.keys()
        kwargs = {k: v for k, v in body.items() if k not in skip}
        return _vllm_values(kwargs) if self._is_vllm else kwargs

    # -- writing --

    @property
    def _is_vllm(self) -> bool:
        return self.model_engine.lower() == "vllm"

    def launch_body(self, engine_args: Mapping[str, Any]) -> dict[str, Any]:
        """The POST /v1/models body for ``engine_args``: checked, nothing sent. ConfigError when it cannot be."""
        if self._is_vllm:
            kwargs = engine_kwargs(engine_args)
        else:  # Transformers, SGLang, llama.cpp, ...: their own kwarg names, passed as they are
            bad = {
                k: "a field Xinference takes itself, not an engine kwarg: put it in launch_fields"
                for k in engine_args
                if k in LAUNCH_FIELDS or k in XINFERENCE_OPTIONS
            }
            if "engine_config" in engine_args:
                bad["engine_config"] = "Xinference 4.1 does not unwrap a nested engine_config"
            if bad:
                raise UnmappableEngineArgError(bad)
            kwargs = {k: _engine_value(k, v) for k, v in engine_args.items()}
        clash = sorted(kwargs.keys() & self.launch_fields.keys())
        if clash:
            raise ConfigError(f"{', '.join(clash)} given both as engine args and in launch_fields")
        return {
            "model_uid": self.model_uid,
            "model_name": self.model_name,
            "model_engine": self.model_engine,
            **self.launch_fields,
            **kwargs,
        }

    def terminate(self) -> bool:
        """Stop what runs (or is launching) under the uid; False when nothing did."""
        info = self.instance()
        if info is not None and info.get("status") in _RUNNING:
            self._call("POST", f"/v1/models/{self.model_uid}/cancel", ok=(200, 400, 404))
        r = self._call("DELETE", f"/v1/models/{self.model_uid}", ok=(200, 400))
        if r.status_code == 400 and "not found" not in _detail(r).lower():
            raise XinferenceError(
                f"Xinference refused to terminate {self.model_uid}: {_detail(r)}", status=400, detail=_detail(r)
            )
        return r.status_code == 200

    def deploy(self, values: Mapping[str, Any], timeout: float | None = None) -> None:
        """Replace the model under the uid by one launched with ``values`` as its engine kwargs.

        The body is checked before anything is stopped. Then: terminate, launch with wait_ready=false,
        poll the instance until READY (or ERROR: XinferenceDeployError with the engine's error text;
        or the deadline: the launch is cancelled), and record the launch body in the launch history.
        """
        body = self.launch_body(values)
        deadline = self._clock() + (self.deploy_timeout if timeout is None else timeout)
        self.terminate()
        try:
            self._call("POST", "/v1/models", params={"wait_ready": "false"}, json=body)
        except (XinferenceUnavailable, XinferenceAuthError):
            raise
        except XinferenceError as e:
            raise XinferenceDeployError(
                f"Xinference refused to launch {self.model_uid}: {e.detail}", status=e.status, detail=e.detail
            ) from e
        self._wait_ready(deadline)
        self._call(
            "POST",
            "/v1/launch_history",
            json={"model_name": self.model_name, "model_uid": self.model_uid, "data": body},
        )

    def _wait_ready(self, deadline: float) -> None:
        status = "unknown"
        while True:
            info = self.instance()
            if info is None:
                raise XinferenceDeployError(f"{self.model_uid} vanished from Xinference while launching")
            status = str(info.get("status"))
            if status == "READY":
                return
            if status not in _RUNNING:
                errors = [s["error_message"] for s in info.get("replica_statuses") or [] if s.get("error_message")]
                detail = " | ".join(errors) or f"status {status}, no error text (cancelled?)"
                raise XinferenceDeployError(f"{self.model_uid} failed to launch on Xinference: {detail}", detail=detail)
            if self._clock() >= deadline:
                break
            self._sleep(self.poll_interval)
        cancelled = "the launch was cancelled"
        try:
            self.terminate()
        except XinferenceError as e:
            cancelled = f"cancelling the launch failed too: {e}"
        raise XinferenceDeployError(
            f"{self.model_uid} not ready on Xinference before the deadline (last status {status}); {cancelled}"
        )

    def endpoint(self) -> str:
        """Production's base URL (the REST URL unless ``endpoint_url`` says otherwise), for the canary
        replay, which adds /v1/chat/completions itself: the model is the uid, and with auth on it must
        send ``headers()`` (ReplayOptions(api_key=target.api_key(), model=target.model_uid))."""
        return self.endpoint_url

    def canary_client(self) -> CanaryClient:
        """Chat (its Transformers engine cannot stream completions), the model uid, the bearer token."""
        return CanaryClient("chat", self.model_uid, self.api_key())

    def production_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return get_kind("vllm").production_values(values)

    @classmethod
    def check_settings(cls, table: Mapping[str, Any], where: str) -> None:
        _settings(table, where)

    @classmethod
    def from_settings(cls, url: str, table: Mapping[str, Any], where: str) -> Target:
        return target_from_config(url, table, where)

    def openai_base_url(self) -> str:
        """What an OpenAI client takes as base_url (its api_key: ``api_key()``)."""
        return f"{self.endpoint_url}/v1"


_KEYS = {"xinference_url", "model_uid", "model_name", "model_engine", "username", "password_file", "launch"}


def _settings(cfg: Mapping[str, Any], where: str) -> None:
    extra = set(cfg) - _KEYS - {"url", "kind"}
    if extra:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(extra))} for kind xinference "
            f"(known: {', '.join(sorted(_KEYS))})"
        )
    missing = [k for k in ("model_uid", "model_name") if not cfg.get(k)]
    if missing:
        raise ConfigError(
            f"{where} needs {' and '.join(missing)}: the uid Xinference serves the model under "
            "and the registered model name it is launched from"
        )
    if not isinstance(cfg.get("launch", {}), Mapping):
        raise ConfigError(f'{where}.launch must be a table of launch fields, e.g. {{ model_format = "pytorch" }}')


def target_from_config(
    url: str, cfg: Mapping[str, Any], where: str = '[production] (kind = "xinference")'
) -> XinferenceTarget:
    """The target for the daemon's ``[production]`` table with ``kind = "xinference"``.

    ``url`` is production's URL (the canary's endpoint); ``cfg`` holds xinference_url (the REST API,
    default ``url``), model_uid, model_name, model_engine (default "vllm"), username and password_file
    (the account that logs in through /token; both absent: a server with auth off) and launch (the
    launch fields: model_format, model_size_in_billions, quantization, n_gpu, ...).
    """
    _settings(cfg, where)
    launch = cfg.get("launch", {})
    auth = None
    if cfg.get("username") or cfg.get("password_file"):
        if not cfg.get("username") or not cfg.get("password_file"):
            raise ConfigError(
                f"{where}: give both username and password_file (a file holding the password), "
                "or neither for a server started with XINFERENCE_AUTH_ADVANCED=0"
            )
        try:
            password = Path(str(cfg["password_file"])).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{where}.password_file {cfg['password_file']}: {e.strerror}") from e
        if not password:
            raise ConfigError(f"{where}.password_file {cfg['password_file']} is empty")
        auth = XinferenceAuth(str(cfg["username"]), password)
    return XinferenceTarget(
        str(cfg.get("xinference_url") or url),
        str(cfg["model_uid"]),
        str(cfg["model_name"]),
        str(cfg.get("model_engine", "vllm")),
        dict(launch),
        auth,
        endpoint_url=url,
    )


def _epoch(stamp: Any) -> float:
    """'2026-11-22T10:31:31Z' (launch history, UTC) -> seconds since the epoch; 0 when absent."""
    if not isinstance(stamp, str) or not stamp:
        return 0.0
    try:
        return datetime.strptime(stamp.rstrip("Z")[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0
