"""Generation speed of gpt_local's KV cache against Hugging Face GPT-2 `generate` (PyTorch, with its
cache), same weights, same prompts, same machine, same run.

    python benchmarks/generate_throughput.py                      # tiny and GPT-2 small, batch 1 and 8
    python benchmarks/generate_throughput.py --shapes tiny --batches 1

For each shape a random HF GPT-2 is saved and converted with `gptlocal convert hf2ms`. Prompts are
32 random tokens, 128 new tokens, greedy (no EOS). Time to first token (TTFT) = the prefill call;
decode tokens/s = batch x (new tokens - 1) / time after the first token. Each side gets one
warm-up generation first (ours compiles its prefill and decode graphs there; the compile time is
printed). Also reported: our cache against our own recomputation of the whole sequence per token.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
PROMPT, NEW = 32, 128


def timed_ours(model, prompts, use_past):
    """(ttft, total) seconds of one greedy generation (after a warm-up call of the same shape)."""
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past)
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past)
    total = time.perf_counter() - start
    if use_past:  # TTFT: the prefill call of the cache that generation used (compiled by the warm-up)
        cache = model.kv_cache(len(prompts), PROMPT + NEW)
        start = time.perf_counter()
        cache.prefill(prompts)
        return time.perf_counter() - start, total
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, do_sample=False, use_past=use_past)
    return time.perf_counter() - start, total


def timed_hf(model, prompts):
    import torch
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, use_cache=True)
        total = time.perf_counter() - start
    assert out.shape[1] == PROMPT + NEW
    return ttft, total


def decode_rate(batch, ttft, total):
    return batch * (NEW - 1) / max(total - ttft, 1e-9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--recompute-shapes", default="tiny",
                        help="shapes that also time our no-cache path (slow: a full forward per token)")
    args = parser.parse_args()
    import torch
    import mindspore as ms
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal import GPTLocalForCausalLM
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    ms.set_context(mode=ms.GRAPH_MODE)
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="gptlocal-gen-")
    rows = []
    for shape in args.shapes.split(","):
        hf = GPT2LMHeadModel(GPT2Config(n_positions=1024, **SHAPES[shape])).eval()
        hf.save_pretrained(os.path.join(work, shape))
        hf_to_ms(os.path.join(work, shape), os.path.join(work, shape + "_ms"))
        ours = GPTLocalForCausalLM.from_pretrained(os.path.join(work, shape + "_ms"), max_batch_size=8)
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = np.random.default_rng(batch).integers(0, SHAPES[shape]["vocab_size"], (batch, PROMPT)).tolist()
            start = time.perf_counter()
            ours.generate(prompts, max_new_tokens=NEW, do_sample=False)  # compiles prefill + decode
            compile_s = time.perf_counter() - start
            print(f"{shape} batch {batch}: first call {compile_s:.1f} s", flush=True)
            o_ttft, o_total = timed_ours(ours, prompts, True)
            print(f"{shape} batch {batch}: ours timed", flush=True)
            timed_hf(hf, prompts)  # warm-up
            h_ttft, h_total = timed_hf(hf, prompts)
            row = dict(shape=shape, batch=batch, compile=compile_s, ours_ttft=o_ttft,
                       ours_rate=decode_rate(batch, o_ttft, o_total), hf_ttft=h_ttft,
                       hf_rate=decode_rate(batch, h_ttft, h_total))
            if shape in args.recompute_shapes.split(","):
                n_ttft, n_total = timed_ours(ours, prompts, False)
                row["nocache_rate"] = decode_rate(batch, n_ttft, n_total)
            rows.append(row)
            print(f"{shape} batch {batch}: ours {row['ours_rate']:.1f} tok/s, HF {row['hf_rate']:.1f} tok/s",
                  flush=True)
    print(f"\n{PROMPT}-token prompts, {NEW} new tokens, greedy, fp32, {os.cpu_count()} CPUs; threads: torch "
          f"{torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} (both sides share "
          f"this process; issue #15 moves them to pinned workers)")
    print(f"{'shape':6} {'batch':>5} {'ours TTFT s':>11} {'HF TTFT s':>9} {'ours tok/s':>10} {'HF tok/s':>8} "
          f"{'ours/HF':>7} {'cache/no-cache':>14} {'first call s':>12}")
    for r in rows:
        speedup = f"{r['ours_rate'] / r['nocache_rate']:.1f}x" if "nocache_rate" in r else "-"
        print(f"{r['shape']:6} {r['batch']:5d} {r['ours_ttft']:11.3f} {r['hf_ttft']:9.3f} {r['ours_rate']:10.1f} "
              f"{r['hf_rate']:8.1f} {r['ours_rate'] / r['hf_rate']:6.2f}x {speedup:>14} {r['compile']:12.1f}")


if __name__ == "__main__":
    main()
