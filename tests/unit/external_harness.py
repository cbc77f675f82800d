"""A harness in another process for `CommandAgentEnv` tests: plain HTTP, no tir-rl import.

Usage: python external_harness.py MODE BASE_URL INDEX   (MODE: ok | fail | garbage | sleep)
It reads {"base_url", "split", "index"} from stdin and the endpoint's key from
TIR_RL_ENDPOINT_KEY, asks the endpoint one question, and
prints a reward line (ok), exits 3 (fail), prints a non-reward (garbage) or hangs (sleep).
"""

import json
import os
import sys
import time

import httpx

mode, base_url, index = sys.argv[1], sys.argv[2], sys.argv[3]
given = json.loads(sys.stdin.read())
assert given["base_url"] == base_url and given["index"] == index, (given, sys.argv)
question = {"role": "user", "content": f"Task {index} of the {given['split']} split."}
key = {"Authorization": f"Bearer {os.environ['TIR_RL_ENDPOINT_KEY']}"}
body = {"messages": [question]}
response = httpx.post(f"{base_url}/chat/completions", json=body, headers=key, timeout=60)
response.raise_for_status()
reply = response.json()["choices"][0]["message"]["content"]
if mode == "fail":
    print("the harness broke on purpose", file=sys.stderr)
    sys.exit(3)
if mode == "garbage":
    print("no reward here")
    sys.exit(0)
if mode == "sleep":
    print(f"sleeping, pid {__import__('os').getpid()}", file=sys.stderr, flush=True)
    time.sleep(60)
print("some log line")
print(json.dumps({"reward": 1.0 if "yes" in reply else 0.25}))
