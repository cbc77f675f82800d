"""How the trainer's weights reach the engines, in one place.

- `sync`: after an update, gather the trainer's weights, send them (or the injected sampler's)
  to the engine and probe parity with the trainer's own forward (`WeightSync`);
- `transfer`: the ways weights travel (`WeightTransfer`: a folder, NCCL, IPC, gloo) and the
  trainer side of vLLM's transfer engines;
- `clients`: the engines' side of a transfer, in this process or over a server's HTTP API;
- `files`: writing and reading state dicts as owner-only folders (`publish_state_dict`).

The code that receives weights inside vLLM's own processes is in `tir_rl.engine.in_vllm`.
"""
