"""Time to first token, full prefill vs pooled prefix, on a small random-weight Qwen2.

For each prefix length: a writer client prefills the prefix and saves its blocks to the pool
(a local kvpool-master, real shared-memory segments); then a fresh worker (another client, an
empty device cache) serves prefix + a new question: it loads the prefix from the pool and
prefills only the question. TTFT = time from the request to the first token's logits. The
full figure is a plain prefill of the same tokens. Each figure is the median of --repeats.

    .venv/bin/python benchmarks/ttft_bench.py [--prefixes 1024,2048,4096,8192]
        [--device cuda --dtype bfloat16 --hidden 2048 --layers 16 ...]

On an accelerator the model, its KV cache and the timed prefills are on the device (the KV
crosses through ``staging.StagedBlockIO``: on CUDA by DMA to and from the segments); the clock
stops once the first token is on the host.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.hashing import BlockHasher, HashNamespace
from kvpool_client.prefix import TieredPrefixCache
from kvpool_client.replay import spawned_master
from kvpool_client.staging import make_block_io
from kvpool_client.tensors import PagedKVCache, prefill

BLOCK_SIZE = 16


def build_model(args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=8192, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=16384)
    # weights are made where they run, in their dtype (a large model's random init on the host
    # would take minutes)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with torch.device(args.device):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def worker(client: KVPoolClient, model: Any, num_blocks: int) -> tuple[TieredPrefixCache, Any]:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = PagedKVCache.allocate(num_layers=cfg.num_hidden_layers, num_blocks=num_blocks,
                                  block_size=BLOCK_SIZE, num_heads=cfg.num_key_value_heads,
                                  head_dim=cfg.hidden_size // cfg.num_attention_heads,
                                  dtype=dtype, device=model.device)
    hasher = BlockHasher(HashNamespace("qwen2-bench", str(dtype).removeprefix("torch."),
                                       "kv-split", BLOCK_SIZE))
    prefix = TieredPrefixCache(num_blocks, key_fn=hasher.key, pool=client,
                               io=make_block_io(cache, client), hasher=hasher)
    return prefix, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", default="1024,2048,4096,8192")
    parser.add_argument("--question", type=int, default=64, help="new tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, npu")
    parser.add_argument("--pool-gib", type=float, default=2.0, help="the writer's segment")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16",
                                                               "float16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    model = build_model(args)
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp)) as address:
        def client(segment_bytes: int) -> KVPoolClient:
            return KVPoolClient(ClientConfig.from_dict({
                "master_server_address": address, "local_hostname": "127.0.0.1",
                "global_segment_size": segment_bytes}))

        pool_bytes = int(args.pool_gib * (1 << 30))
        with client(pool_bytes) as writer_client, client(256 << 20) as reader_client:
            print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
                  f"({args.kv_heads} KV), {args.dtype} on {args.device}, {args.threads} CPU "
                  f"thread(s); block "
                  f"{BLOCK_SIZE} tokens; question {args.question} tokens")
            print(f"{'prefix':>7} {'full ms':>9} {'pooled ms':>10} {'ratio':>7} "
                  f"{'max |dlogit|':>13}")
            for length in prefixes:
                prefix_tokens = torch.randint(0, 8192, (length,), generator=gen).tolist()
                num_blocks = (length + args.question) // BLOCK_SIZE + 8
                writer, writer_cache = worker(writer_client, model, num_blocks)
                prefill(model, prefix_tokens, writer, writer_cache)
                full_s, pooled_s = [], []
                diff = 0.0
                for _ in range(args.repeats):
                    # a new question each time: the previous one's blocks are in the pool too
                    request = prefix_tokens + torch.randint(
                        0, 8192, (args.question,), generator=gen).tolist()
                    start = time.perf_counter()
                    with torch.no_grad():
                        full = model(torch.tensor([request], device=model.device)).logits
                    full[0, -1].argmax().item()  # the first token is on the host
                    full_s.append(time.perf_counter() - start)
                    fresh, fresh_cache = worker(reader_client, model, num_blocks)
                    start = time.perf_counter()
                    logits, reused = prefill(model, request, fresh, fresh_cache)
                    logits[0, -1].argmax().item()
                    pooled_s.append(time.perf_counter() - start)
                    assert reused == length // BLOCK_SIZE * BLOCK_SIZE, reused
                    diff = max(diff, float((logits[0, -1].float() - full[0, -1].float())
                                           .abs().max()))
                full_ms = statistics.median(full_s) * 1e3
                pooled_ms = statistics.median(pooled_s) * 1e3
                print(f"{length:>7} {full_ms:>9.1f} {pooled_ms:>10.1f} "
                      f"{full_ms / pooled_ms:>6.2f}x {diff:>13.2e}")


if __name__ == "__main__":
    main()
