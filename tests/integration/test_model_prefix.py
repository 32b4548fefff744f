"""Proof 1: same answers, less prefill, on a real (small, random-weight) Qwen2 model.

Multi-turn shape of MindIE's prefix-cache example: request 1 is a long prompt, served by a
writer process that saves its KV blocks to the pool through a real master; request 2 is
request 1's prompt + the writer's answer + a new question, served by a fresh worker (this
process, a new client, an empty device cache). The fresh worker loads the shared prefix from
the pool and prefills only the rest; its logits must equal a full prefill's.

Tolerance: float32 weights and KV; max abs logit difference <= 1e-4 and the same greedy
token at every computed position.

Run as a script (``python test_model_prefix.py writer MASTER PROMPT_LEN``) it is the writer.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BLOCK_SIZE = 16
PROMPT_TOKENS = 1000  # 62 whole blocks and 8 tokens
ANSWER_TOKENS = 12
QUESTION_TOKENS = 40
VOCAB = 4096
TOLERANCE = 1e-4


def build_model() -> Any:
    """A small Qwen2 with seeded random weights (same weights in every process)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)
    return Qwen2ForCausalLM(config).eval()


def weights_checksum(model: Any) -> float:
    """Sum of every parameter: equal in two processes when the weights are equal."""
    return float(sum(p.double().sum().item() for p in model.parameters()))


def make_worker(client: Any, model: Any, num_blocks: int) -> tuple[Any, Any]:
    """A prefix cache over a fresh, empty paged KV cache of ``num_blocks`` blocks."""
    from kvpool_client.hashing import BlockHasher, HashNamespace
    from kvpool_client.prefix import TieredPrefixCache
    from kvpool_client.staging import make_block_io
    from kvpool_client.tensors import PagedKVCache

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = PagedKVCache.allocate(num_layers=cfg.num_hidden_layers, num_blocks=num_blocks,
                                  block_size=BLOCK_SIZE, num_heads=cfg.num_key_value_heads,
                                  head_dim=head_dim)
    hasher = BlockHasher(HashNamespace("qwen2-random-test", "float32", "kv-split", BLOCK_SIZE))
    prefix = TieredPrefixCache(num_blocks, key_fn=hasher.key, pool=client,
                               io=make_block_io(cache, client), hasher=hasher)
    return prefix, cache


def prompt_tokens() -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=gen).tolist()


def writer_main(master_address: str) -> None:
    """Serve request 1, save its blocks, print the answer, keep the segment until stdin ends."""
    import torch

    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_client.tensors import forward_cached, prefill

    torch.set_num_threads(1)
    model = build_model()
    config = ClientConfig.from_dict({"master_server_address": master_address,
                                     "global_segment_size": 16 * 2**20,
                                     "local_hostname": "127.0.0.1"})
    with KVPoolClient(config) as client:
        prefix, cache = make_worker(client, model, 128)
        tokens = prompt_tokens()
        logits, reused = prefill(model, tokens, prefix, cache)
        answer = [int(logits[0, -1].argmax())]
        with torch.no_grad():  # greedy decode of the answer (its KV is not saved: not prefill)
            _, past = forward_cached(model, torch.tensor([tokens]))
            for _ in range(ANSWER_TOKENS - 1):
                step_logits, past = forward_cached(model, torch.tensor([[answer[-1]]]), past)
                answer.append(int(step_logits[0, -1].argmax()))
        print(json.dumps({"answer": answer, "reused": reused,
                          "saved_blocks": prefix.stats.saved_blocks,
                          "checksum": weights_checksum(model)}), flush=True)
        sys.stdin.read()  # the test closes stdin when the fresh worker is done


def test_fresh_worker_loads_prefix_from_pool_and_matches_full_prefill(start_master: Any) -> None:
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_client.tensors import dynamic_cache, forward_cached, prefill

    torch.set_num_threads(1)
    master = start_master()
    writer = subprocess.Popen([sys.executable, str(Path(__file__)), "writer", master.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = writer.stdout.readline() if writer.stdout else ""
        assert line, f"writer exited with {writer.poll()}"
        written = json.loads(line)
        whole_blocks = PROMPT_TOKENS // BLOCK_SIZE
        assert written["reused"] == 0 and written["saved_blocks"] == whole_blocks

        model = build_model()
        assert weights_checksum(model) == written["checksum"]
        gen = torch.Generator().manual_seed(7)
        question = torch.randint(0, VOCAB, (QUESTION_TOKENS,), generator=gen).tolist()
        request2 = prompt_tokens() + written["answer"] + question

        config = ClientConfig.from_dict({"master_server_address": master.address,
                                         "global_segment_size": 4 * 2**20,
                                         "local_hostname": "127.0.0.1"})
        with KVPoolClient(config) as client:
            prefix, cache = make_worker(client, model, 128)
            assert prefix.hash_to_block_id == {}  # an empty device cache
            logits, reused = prefill(model, request2, prefix, cache)
            stats = copy.copy(prefix.stats)
            # negative control: the loaded KV is what the model used, so spoiling it shows
            again = prefix.match(request2)
            assert again.num_device_hits == len(request2) // BLOCK_SIZE
            reused_ids = again.block_ids[:whole_blocks]
            for block_id in reused_ids:
                cache.k_caches[0][block_id].mul_(-1.0)
            with torch.no_grad():
                spoiled, _ = forward_cached(model, torch.tensor([request2[reused:]]),
                                            dynamic_cache(cache, reused_ids, model.config))
            prefix.release(again)
        assert reused == whole_blocks * BLOCK_SIZE
        assert (stats.device_hit_blocks, stats.pool_hit_blocks, stats.loaded_blocks) == (
            0, whole_blocks, whole_blocks)
        assert stats.pool_queries == 1
        # only the new whole blocks were computed and written
        assert stats.saved_blocks == len(request2) // BLOCK_SIZE - whole_blocks

        with torch.no_grad():
            full = model(torch.tensor([request2])).logits
        tail = full[0, reused:]
        assert logits.shape[1] == len(request2) - reused
        diff = float((logits[0] - tail).abs().max())
        print(f"pooled prefill reused {reused} of {len(request2)} tokens; "
              f"max abs logit diff vs full prefill = {diff:.3e}")
        assert diff <= TOLERANCE
        assert torch.equal(logits[0].argmax(-1), tail.argmax(-1))
        assert float((spoiled[0] - tail).abs().max()) > 10 * TOLERANCE
    finally:
        if writer.stdin:
            writer.stdin.close()
        try:
            writer.wait(30)
        except subprocess.TimeoutExpired:
            writer.kill()  # by pid: only the writer this test started
            writer.wait(10)
        if writer.stdout:
            writer.stdout.close()
    assert writer.returncode == 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "writer":
        writer_main(sys.argv[2])
    else:
        sys.exit("usage: test_model_prefix.py writer MASTER_ADDRESS")
