"""An OpenAI-compatible chat endpoint in front of the run's engine, recording tokens.

Agents written with any harness (the OpenAI SDK, an agent framework, a verifiers
environment) talk to it; every call is kept in token ids with sampler logprobs and policy
versions under the episode id the client passes, and an episode's calls become training
samples. See docs/bring_your_agent.md.

    ChatRequest body ─► ChatEndpoint.complete ─► engine.generate (n choices)
                            │ TITO: an extended earlier call's tokens are reused verbatim
                            ▼
                        CallRecorder (per episode) ─► samples_from_calls ─► Trajectory
"""

from tir_rl.endpoint.call_samples import samples_from_calls
from tir_rl.endpoint.chat_endpoint import ChatEndpoint, EndpointConfig
from tir_rl.endpoint.openai_chat import ChatRequest, RequestError, parse_chat_request
from tir_rl.endpoint.recorder import CallRecorder, RecordedCall, UnknownEpisodeError
from tir_rl.endpoint.server import EndpointServer, build_app

__all__ = [
    "CallRecorder",
    "ChatEndpoint",
    "ChatRequest",
    "EndpointConfig",
    "EndpointServer",
    "RecordedCall",
    "RequestError",
    "UnknownEpisodeError",
    "build_app",
    "parse_chat_request",
    "samples_from_calls",
]
