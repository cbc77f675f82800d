"""A fake agent worker for `WorkerAgentEnv` tests: plain HTTP, no tir-rl import.

Usage: python external_worker.py LOG MODE   (MODE: ok | die_at_1 | hang | broken)

Speaks the worker protocol (tir_rl/envs/agent_worker.py). For each episode it asks the
endpoint one question and answers reward 1.0 if the reply says "yes", else 0.25, and appends
``{"pid", "id", "index"}`` to LOG. `die_at_1` exits (status 7) when task index 1 arrives,
`hang` never answers (and logs each cancel it gets), `broken` exits at start with a message.
"""

import asyncio
import json
import os
import sys

import httpx

log_path, mode = sys.argv[1], sys.argv[2]


def log(**fields):
    with open(log_path, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


async def play(request, client):
    question = {"role": "user", "content": f"Task {request['index']} of {request['split']}."}
    key = {"Authorization": f"Bearer {os.environ['TIR_RL_ENDPOINT_KEY']}"}
    url = f"{request['base_url']}/chat/completions"
    response = await client.post(url, json={"messages": [question]}, headers=key)
    response.raise_for_status()
    if mode == "hang":
        await asyncio.sleep(3600)
    reply = response.json()["choices"][0]["message"]["content"]
    log(id=request["id"], index=request["index"])
    print("a log line on stdout, not an answer", flush=True)
    answer = {"id": request["id"], "reward": 1.0 if "yes" in reply else 0.25}
    print(json.dumps(answer), flush=True)


async def main():
    if mode == "broken":
        print("the worker cannot start: no such environment", file=sys.stderr, flush=True)
        sys.exit(5)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    playing = {}
    async with httpx.AsyncClient(timeout=60) as client:
        while line := await reader.readline():
            request = json.loads(line)
            if "cancel" in request:
                log(cancel=request["cancel"])
                if request["cancel"] in playing:
                    playing.pop(request["cancel"]).cancel()
                continue
            if mode == "die_at_1" and request["index"] == 1:
                sys.exit(7)
            playing[request["id"]] = asyncio.create_task(play(request, client))


asyncio.run(main())
