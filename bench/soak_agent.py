"""The agent of `bench/soak_pool.py`: plays one episode, misbehaving as its task asks.

Usage: python soak_agent.py BASE_URL INDEX   (CommandAgentEnv's command; plain HTTP)

The task index picks the fault (`FAULTS[index % len(FAULTS)]`). Whatever the endpoint
answers to the fault is appended, as one JSON line, to the file named by SOAK_AGENT_LOG;
then the agent plays its episode as a well-behaved one would (two turns) and prints its
reward, except `hang`, which never returns.
"""

import asyncio
import json
import os
import random
import sys
import time

import httpx

FAULTS = ("none", "none", "malformed_json", "oversized_body", "unknown_episode",
          "finished_episode", "flood", "hang")  # fmt: skip
FLOOD = 32


def ask(client: httpx.Client, url: str, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
    return client.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)


async def flood() -> list[int]:
    body = {"messages": [{"role": "user", "content": "flood"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=120) as client:
        calls = [
            client.post(f"{base_url}/chat/completions", json=body, headers=headers)
            for _ in range(FLOOD)
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
    return [a.status_code if isinstance(a, httpx.Response) else -1 for a in answers]


def inject(client: httpx.Client) -> dict:
    if fault == "malformed_json":
        r = client.post(f"{base_url}/chat/completions", content=b'{"messages": [', headers={
            **headers, "Content-Type": "application/json"})  # fmt: skip
        return {"status": r.status_code}
    if fault == "oversized_body":
        text = "x" * (20 * 1024 * 1024)
        r = ask(client, base_url, text)
        return {"status": r.status_code}
    if fault == "unknown_episode":
        other = f"{root}/episodes/no-such-episode-{random.randrange(10**9)}/v1"
        return {"status": ask(client, other, "who am I?").status_code}
    if fault == "finished_episode":
        # try to end its own episode early (taking its calls), then call into it again
        finish = client.post(f"{root}/episodes/{episode_id}/finish", json={"reward": 1.0},
                             headers=headers)  # fmt: skip
        return {"status": [finish.status_code, ask(client, base_url, "still there?").status_code]}
    if fault == "flood":
        statuses = asyncio.run(flood())
        return {"status": sorted(set(statuses)), "calls": len(statuses)}
    return {}


def main() -> None:
    with httpx.Client() as client:
        observed = inject(client)
        log = os.environ.get("SOAK_AGENT_LOG")
        if log:
            line = {"index": index, "episode": episode_id, "fault": fault, **observed}
            with open(log, "a") as out:
                out.write(json.dumps(line) + "\n")
        if fault == "hang":
            time.sleep(3600)
        reply = ""
        for turn in range(2):
            r = ask(client, base_url, f"task {index}, turn {turn}")
            r.raise_for_status()
            reply = r.json()["choices"][0]["message"]["content"]
    print(json.dumps({"reward": (sum(map(ord, reply)) % 97) / 97}))


if __name__ == "__main__":  # soak_pool.py imports FAULTS
    base_url, index = sys.argv[1], int(sys.argv[2])
    fault = FAULTS[index % len(FAULTS)]
    headers = {"Authorization": f"Bearer {os.environ['TIR_RL_ENDPOINT_KEY']}"}
    root, _, episode_path = base_url.rpartition("/episodes/")
    episode_id = episode_path.split("/")[0]
    main()
