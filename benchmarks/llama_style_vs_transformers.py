"""A Llama-style gpt_local model (~125M: rope, GQA, SwiGLU, RMSNorm, no biases, untied head) against
transformers' LlamaForCausalLM with the same weights: forward tokens/s and greedy decode tokens/s, plus the
decode KV-cache memory that grouped-query attention saves (arithmetic).

    python benchmarks/llama_style_vs_transformers.py                 # ~125M, batch 1 and 4
    python benchmarks/llama_style_vs_transformers.py --shape tiny --batches 1 --threads 2

The parent builds a random LlamaForCausalLM, saves it and converts it with `gptlocal convert hf2ms`
(``checkpoint/hf_models.py``); each side then runs in its own worker subprocess with an explicit
OMP/MKL/OpenBLAS thread count (``import mindspore`` would otherwise set OMP_NUM_THREADS=1 for children),
which the worker checks and prints. fp32, CPU, graph mode for gpt_local.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package; scratch_dir)

SHAPES = {  # ~125M: GPT-2 small's width and depth with Llama's layers, 12 heads over 4 key/value groups
    "120m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=8192),
}
PROMPT, NEW, FORWARD_SEQ = 32, 64, 256


def kv_cache_bytes(shape, batch, length, groups, dtype_bytes=4):
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * batch * groups * length * head_dim * dtype_bytes


def worker(side, directory, batches, threads):
    """One side's timings as a JSON line: forward tokens/s at [batch, FORWARD_SEQ], greedy decode tokens/s."""
    env_threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    assert all(v == str(threads) for v in env_threads.values()), env_threads
    rows = []
    if side == "hf":
        import torch
        from transformers import LlamaForCausalLM
        torch.set_num_threads(threads)
        print(f"[hf worker] torch threads {torch.get_num_threads()}, env {env_threads}", flush=True)
        model = LlamaForCausalLM.from_pretrained(os.path.join(directory, "hf")).eval()
        vocab = model.config.vocab_size

        def forward(ids):
            with torch.no_grad():
                model(torch.from_numpy(ids))

        def generate(prompts):
            ids = torch.tensor(prompts)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW
    else:
        import mindspore as ms
        from mindspore import Tensor
        from mindformers_gptlocal import GPTLocalForCausalLM
        ms.set_context(mode=ms.GRAPH_MODE)
        print(f"[ours worker] env {env_threads}, OMP_NUM_THREADS now {os.environ.get('OMP_NUM_THREADS')}",
              flush=True)
        model = GPTLocalForCausalLM.from_pretrained(os.path.join(directory, "ms"), max_batch_size=8,
                                                    seq_length=FORWARD_SEQ)
        model.set_train(False)
        vocab = model.config.vocab_size

        def forward(ids):
            model(Tensor(ids, ms.int32)).asnumpy()

        def generate(prompts):
            out = model.generate(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
            assert all(len(row) == PROMPT + NEW for row in out)
    for batch in batches:
        rng = np.random.default_rng(batch)
        ids = rng.integers(0, vocab, (batch, FORWARD_SEQ)).astype(np.int64)
        forward(ids)  # warm-up (our graph compiles here)
        start = time.perf_counter()
        for _ in range(3):
            forward(ids)
        forward_rate = 3 * batch * FORWARD_SEQ / (time.perf_counter() - start)
        prompts = rng.integers(0, vocab, (batch, PROMPT)).tolist()
        generate(prompts)  # warm-up
        start = time.perf_counter()
        generate(prompts)
        decode_rate = batch * NEW / (time.perf_counter() - start)
        rows.append(dict(side=side, batch=batch, forward=forward_rate, generate=decode_rate))
    print("RESULT " + json.dumps(rows), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="120m", choices=list(SHAPES))
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--worker", choices=("ours", "hf"))
    parser.add_argument("--dir")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        return worker(args.worker, args.dir, batches, args.threads)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms
    shape = SHAPES[args.shape]
    work = C.scratch_dir("gptlocal-llama-")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=0, **shape))
    params = sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(os.path.join(work, "hf"))
    del hf
    hf_to_ms(os.path.join(work, "hf"), os.path.join(work, "ms"))
    env = dict(os.environ, **{k: str(args.threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                               "OPENBLAS_NUM_THREADS")})
    rows = []
    for side in ("ours", "hf"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", side, "--dir", work,
                               "--batches", args.batches, "--threads", str(args.threads)],
                              env=env, capture_output=True, text=True, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(("RESULT", "["))]
        print("\n".join(line for line in lines if not line.startswith("RESULT")))
        if proc.returncode:
            raise SystemExit(f"{side} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        rows += json.loads(next(line for line in lines if line.startswith("RESULT"))[len("RESULT "):])
    print(f"\n{args.shape}: {params / 1e6:.1f}M parameters, {shape['num_attention_heads']} heads over "
          f"{shape['num_key_value_heads']} key/value groups; fp32 CPU, {args.threads} threads; forward "
          f"[batch, {FORWARD_SEQ}], generate {PROMPT}-token prompts + {NEW} greedy tokens")
    print(f"{'batch':>5} {'ours fwd tok/s':>14} {'HF fwd tok/s':>12} {'ours gen tok/s':>14} {'HF gen tok/s':>12}")
    for batch in batches:
        ours = next(r for r in rows if r["side"] == "ours" and r["batch"] == batch)
        theirs = next(r for r in rows if r["side"] == "hf" and r["batch"] == batch)
        print(f"{batch:5d} {ours['forward']:14.0f} {theirs['forward']:12.0f} {ours['generate']:14.1f} "
              f"{theirs['generate']:12.1f}")
    length = 1024
    gqa = kv_cache_bytes(shape, 1, length, shape["num_key_value_heads"])
    mha = kv_cache_bytes(shape, 1, length, shape["num_attention_heads"])
    print(f"decode KV cache per {length}-token sequence (fp32): {gqa / 2 ** 20:.1f} MiB with "
          f"{shape['num_key_value_heads']} key/value heads, {mha / 2 ** 20:.1f} MiB with "
          f"{shape['num_attention_heads']} ({mha / gqa:.0f}x)")


if __name__ == "__main__":
    main()
