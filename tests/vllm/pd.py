"""A toy prefill/decode proxy for the tests and `bench/pd.py`: each request goes to the prefill server with
`max_tokens: 1` and `do_remote_decode`, then to the decode server with the kv_transfer_params the
prefill server returned (what vLLM's own toy proxy for NixlConnector does)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from typing import Any


def completion(
    url: str,
    prompt: Sequence[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """POST /v1/completions (greedy, token ids in and out); the JSON answer."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def tokens(answer: dict[str, Any]) -> list[int]:
    return [int(t) for t in answer["choices"][0]["token_ids"]]


def prefill(url: str, prompt: Sequence[int]) -> dict[str, Any]:
    """The prefill step: one token, and the kv_transfer_params the decode server needs."""
    answer = completion(url, prompt, 1, {"do_remote_decode": True})
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise TypeError(f"the prefill server returned no kv_transfer_params: {answer}")
    return params


def disaggregated(prefill_url: str, decode_url: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Prefill on one server, decode on the other; the generated token ids (the decode server's)."""
    params = prefill(prefill_url, prompt)
    return tokens(completion(decode_url, prompt, max_tokens, params))
