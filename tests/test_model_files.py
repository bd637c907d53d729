"""A model named as vLLM names it: a local directory, the Hugging Face cache, or (asked for) the Hub's small files.

The cache is written by huggingface_hub itself (``hf_hub_download`` from tests/fake_hub.py's stand-in for the
Hub), so its layout is the library's, not an imitation of it.
"""

import json
import os
import subprocess
import sys

import optuna
import pytest
from huggingface_hub import constants, hf_hub_download

from autotune.cli import main
from autotune.engine.model import SMALL_FILES, ModelShape, locate
from autotune.sim.profiles import MODELS
from autotune.study.definition import load_study
from tests.conftest import ROOT
from tests.fake_hub import FakeHub

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], **MODELS["llama-3.1-8b"]}).encode()


@pytest.fixture
def hub(tiny_model):
    """The stand-in Hub serving LLAMA's config.json (the real 8B shape), the tiny model's tokenizer and a
    weights file, at main and at revision "v2" (whose config says 16 layers)."""
    hub = FakeHub()
    files = {"config.json": CONFIG, "tokenizer.json": tiny_model / "tokenizer.json",
             "tokenizer_config.json": tiny_model / "tokenizer_config.json", "model.safetensors": b"\0" * 4096}
    hub.add(LLAMA, files)
    hub.add(LLAMA, {**files, "config.json": json.dumps({**json.loads(CONFIG), "num_hidden_layers": 16}).encode()}, "v2")
    with hub.serving():
        yield hub


def cache_with(hub, cache, revision=None, names=("config.json", "tokenizer.json")):
    """Files put in the cache the way vLLM's own download puts them there."""
    for name in names:
        hf_hub_download(LLAMA, name, revision=revision, cache_dir=cache, endpoint=hub.url)


def test_a_local_directory_comes_first(tiny_model, tmp_path):
    files = locate(str(tiny_model), cache_dir=tmp_path)
    assert files.directory == tiny_model and files.tokenizer == tiny_model
    assert files.found == f"model {tiny_model}: the local directory {tiny_model.resolve()}"


def test_a_hugging_face_id_is_found_in_the_cache_at_its_revision(hub, tmp_path):
    cache = tmp_path / "hub"
    cache_with(hub, cache, names=("config.json", "tokenizer.json", "model.safetensors"))
    cache_with(hub, cache, revision="v2", names=("config.json",))
    hub.requests.clear()
    files = locate(LLAMA, cache_dir=cache)
    snapshots = cache / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots"
    assert files.directory == snapshots / hub.commit(LLAMA, "main")
    assert files.tokenizer == files.directory
    assert files.found.startswith(f"model {LLAMA}: the Hugging Face cache {cache} (snapshot ")
    shape = ModelShape.from_dir(files.directory)
    assert shape.layers == 32 and shape.weights_bytes == 4096  # the snapshot's links followed to the blobs
    v2 = locate(LLAMA, "v2", cache_dir=cache)
    assert ModelShape.from_dir(v2.directory).layers == 16 and "at revision v2" in v2.found
    assert v2.tokenizer is None  # v2's tokenizer was never downloaded
    assert hub.requests == []  # finding a cached model asks the network nothing


def test_not_found_says_where_it_looked_and_how_to_fetch(tmp_path):
    files = locate(LLAMA, cache_dir=tmp_path)
    assert files.directory is None
    assert files.found == f"model {LLAMA}: not a local directory, and not in the Hugging Face cache {tmp_path}"
    assert files.fetch_command() == f"hf download {LLAMA} config.json tokenizer.json tokenizer_config.json"
    assert "no such directory" in locate("./models/nothing-here", cache_dir=tmp_path).found


def test_download_fetches_the_small_files_only(hub, tmp_path):
    files = locate(LLAMA, download=True, cache_dir=tmp_path, endpoint=hub.url)
    assert files.tokenizer is not None and ModelShape.from_dir(files.directory).layers == 32
    fetched = {path.rsplit("/", 1)[1] for method, path in hub.requests if method == "GET"}
    assert fetched == set(SMALL_FILES)  # never the weights
    assert files.found.startswith(f"model {LLAMA}: downloaded config.json, tokenizer.json, tokenizer_config.json "
                                  f"(not the weights) from {hub.url}")
    again = locate(LLAMA, cache_dir=tmp_path)  # now in the cache, as vLLM would find it
    assert again.directory == files.directory and "the Hugging Face cache" in again.found


def test_a_failed_download_says_why(hub, tmp_path):
    files = locate("nobody/no-such-model", download=True, cache_dir=tmp_path, endpoint=hub.url)
    assert files.directory is None
    assert files.found.startswith("model nobody/no-such-model: not a local directory, and not in the Hugging Face "
                                  f"cache {tmp_path}, and downloading its config.json from {hub.url} failed: ")


def test_a_study_file_finds_its_tokenizer_in_the_cache(hub, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    study = tmp_path / "s.toml"
    study.write_text(f'name = "s"\nslos = ["ttft<1s"]\n[engine]\nmodel = "{LLAMA}"\n'
                     '[workload]\nscenario = "chat"\nrate = 1\n')
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    before = load_study(study)
    assert before.workload.tokenizer is None
    assert "[workload].tokenizer = DIR" in before.workload.no_tokenizer and f"hf download {LLAMA}" in \
        before.workload.no_tokenizer  # the study file's key, not a flag the study command refuses with a file
    cache_with(hub, cache)
    after = load_study(study)
    assert after.workload.tokenizer == after.model_files().directory and after.workload.tokenizer.is_relative_to(cache)


@pytest.mark.parametrize("study", sorted(p.name for p in (ROOT / "studies").glob("*.toml")))
def test_every_shipped_study_dry_runs_with_no_model_here(study, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)  # no models/ here, as on a fresh clone before the quickstart
    assert main(["study", str(ROOT / "studies" / study), "--dry-run", "2"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and all(line["argv"] for line in lines)
    assert "a dry run builds no prompts" in err


def test_file_free_study_without_the_model_names_both_ways_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rc = main(["study", "--model", LLAMA, "--slo", "ttft<800ms", "--rate", "4", "--engine-cmd",
               "vllm-sim --gpu h100-80gb serve"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "not in the Hugging Face cache" in err and "--download" in err and f"hf download {LLAMA}" in err


def test_file_free_study_runs_on_the_cached_model_and_says_where_it_found_it(hub, tmp_path):
    """The issue's command as a user types it, with the model in the Hugging Face cache and no --tokenizer: its
    dry run; then the same study on a short recorded trace (token counts only, so its prompts are built with the
    cached tokenizer) runs for real on vllm-sim, which finds the model's config and tokenizer in the cache too."""
    home = tmp_path / "hf"
    cache_with(hub, home / "hub")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    env.pop("HF_HUB_CACHE", None)
    sim = f"{sys.executable} -m autotune.sim.cli --gpu h100-80gb --time-scale 0.01 serve"
    typed = ["--model", LLAMA, "--slo", "ttft<800ms", "--engine-cmd", sim, "--trials", "1"]
    found = f"autotune: model {LLAMA}: the Hugging Face cache {home / 'hub'} (snapshot "

    r = subprocess.run([sys.executable, "-m", "autotune", "study", *typed, "--rate", "4", "--dry-run", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert found in r.stderr and "a dry run builds no prompts" not in r.stderr  # the tokenizer was found
    written = (tmp_path / "runs" / "Llama-3.1-8B-Instruct-chat" / "study.toml").read_text()
    assert f'model = "{LLAMA}"' in written and "tokenizer =" not in written  # found where vLLM finds it, each run

    trace = tmp_path / "recorded.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i / 4, "prompt_tokens": 64 + 8 * i, "output_tokens": 16,
                                         "api": "chat"}) + "\n" for i in range(8)))
    r = subprocess.run([sys.executable, "-m", "autotune", "study", *typed, "--workload", str(trace),
                        "--no-remeasure"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-3000:]  # 1: no trial met the SLO, which is not this question
    assert found in r.stderr
    study = optuna.load_study(study_name="Llama-3.1-8B-Instruct-recorded",
                              storage=f"sqlite:///{tmp_path}/runs/studies.db")
    steps = [s for t in study.trials for s in t.user_attrs.get("steps", [])]
    # prompts built and served; a step stopped once it could not pass counts what it cut short as failed
    whole = [s for s in steps if not s.get("cut")]
    assert whole and all(s["completed"] > 0 and s["failed"] == 0 for s in whole), steps
    assert all(s["failed"] == 0 or s["cut"] for s in steps), steps
