#!/usr/bin/env python3
"""Regenerate a version's entry in autotune/engine/vllm/vllm_flags.json from vLLM's own parser.

    # the vLLM installed beside an interpreter (e.g. the CPU venv)
    .venv/bin/python scripts/dump_vllm_flags.py [--python PATH]

    # another release, without installing it: its wheel's Python code over this venv's packages
    pip download --no-deps vllm==0.33.0 -d /tmp/w && unzip -q /tmp/w/vllm-*.whl 'vllm/*' -d /tmp/v33
    .venv/bin/python scripts/dump_vllm_flags.py --source /tmp/v33 --as 0.33.0

Runs the same DUMP_CODE autotune runs at launch time when it can reach the engine's Python.
With --source, the parser is built on the CPU platform (no GPU here); flag names and kinds do
not depend on the platform.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from autotune.engine.vllm.flags import DUMP_CODE

TABLE = Path(__file__).resolve().parents[1] / "autotune" / "engine" / "vllm" / "vllm_flags.json"

# vLLM picks its platform from its own version string; report the release we are reading.
OVERLAY = """
import importlib.metadata as md
_version = md.version
md.version = lambda name: {release!r} + "+cpu" if name == "vllm" else _version(name)
"""

ap = argparse.ArgumentParser()
ap.add_argument("--python", default=sys.executable, help="the interpreter vLLM is installed in")
ap.add_argument("--source", type=Path, help="a directory holding an unpacked vllm/ package to read instead")
ap.add_argument("--as", dest="release", help="the release being read (needed with --source), e.g. 0.33.0")
args = ap.parse_args()
env = dict(os.environ)
code = DUMP_CODE
if args.source:
    if not args.release:
        ap.error("--source needs --as RELEASE")
    env["PYTHONPATH"] = str(args.source)
    code = OVERLAY.format(release=args.release) + DUMP_CODE
out = subprocess.run([args.python, "-c", code], capture_output=True, text=True, env=env)
if out.returncode != 0:
    sys.exit(f"dump failed:\n{out.stderr[-3000:]}")
dump = json.loads(out.stdout.strip().splitlines()[-1])
if args.release:
    dump["version"] = args.release
key = ".".join(dump["version"].split("+")[0].split(".")[:2])
tables = json.loads(TABLE.read_text()) if TABLE.exists() else {}
tables[key] = dump
TABLE.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")
print(f"{TABLE}: {key} <- vLLM {dump['version']}, {len(dump['flags'])} flags")
