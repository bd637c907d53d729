#!/usr/bin/env python3
"""Regenerate a version's entry in autotune/engine/vllm_flags.json from an installed vLLM.

    .venv/bin/python scripts/dump_vllm_flags.py [--python PATH_TO_VLLM_PYTHON] [--as 0.33]

Runs vLLM's own argument parser (the same code autotune runs at launch time when it can)
and stores its flags under the version's major.minor.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from autotune.engine.flags import DUMP_CODE

TABLE = Path(__file__).resolve().parents[1] / "autotune" / "engine" / "vllm_flags.json"

ap = argparse.ArgumentParser()
ap.add_argument("--python", default=sys.executable, help="the interpreter vLLM is installed in")
ap.add_argument("--as", dest="as_version", help="store under this major.minor instead of the detected one")
args = ap.parse_args()
out = subprocess.run([args.python, "-c", DUMP_CODE], capture_output=True, text=True, check=True)
dump = json.loads(out.stdout.strip().splitlines()[-1])
key = args.as_version or ".".join(dump["version"].split("+")[0].split(".")[:2])
tables = json.loads(TABLE.read_text()) if TABLE.exists() else {}
tables[key] = dump
TABLE.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")
print(f"{TABLE}: {key} <- vLLM {dump['version']}, {len(dump['flags'])} flags")
