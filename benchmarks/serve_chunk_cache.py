"""Why greedy chunks do not pay off in the server's cache: one decode step at b = 1, single vs an 8-step
``SlotGreedySteps`` chunk (per step), in a 1-slot and in a 16-slot cache of 256 rows, one process, alternating.

    python benchmarks/serve_chunk_cache.py --threads 2

A random tiny GPT-2 (4 layers, 256 wide, converted with hf2ms). The 16-slot side reads the row's slot (slot 15),
as the server's 1-row bucket does.
"""
import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C  # noqa: E402  (imports neither MindSpore nor PyTorch)
    os.environ.update({k: str(args.threads) for k in C.THREAD_VARS})  # this process is the worker
    os.environ.setdefault("GPTLOCAL_LEAN", "1")
    C.check_threads(args.threads, "serve_chunk_cache")
    print(C.machine_line(args.threads), flush=True)
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    work = C.scratch_dir("gptlocal-chunk-cache-")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=1024, n_layer=4, n_embd=256, n_head=4, vocab_size=8192)
                    ).save_pretrained(os.path.join(work, "hf"))
    hf_to_ms(os.path.join(work, "hf"), os.path.join(work, "ms"))
    import mindspore as ms
    from mindspore import Tensor
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    from mindformers_gptlocal.serve.steps import SlotGreedySteps
    model = GPTLocalForCausalLM.from_pretrained(os.path.join(work, "ms"), max_batch_size=16)
    model.set_train(False)
    ids, pos, last = np.zeros((1, 1), np.int32), np.full((1, 1), 40, np.int32), np.zeros(1, np.int32)
    sides = {}
    for slots in (16, 1):
        cache = model.kv_cache(slots, 256)
        chunk = SlotGreedySteps(cache, 8)
        slot = np.array([slots - 1], np.int32)
        sides[f"{slots} x 256 cache, single step"] = (
            lambda cache=cache, slot=slot, slots=slots: cache.step(ids, pos, last, slot if slots > 1 else None), 1)
        sides[f"{slots} x 256 cache, 8-step chunk"] = (
            lambda chunk=chunk, slot=slot: chunk(Tensor(ids), Tensor(pos), Tensor(slot)).asnumpy(), 8)
    for call, _ in sides.values():
        call()  # compile
    per_step = {name: [] for name in sides}
    for index in range(args.rounds):
        for name in (list(sides) if index % 2 == 0 else list(reversed(sides))):
            call, steps = sides[name]
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            per_step[name].append(float(np.median(times)) / steps)
    print("\n| side | ms per decode step, median [min-max] of rounds |\n| --- | ---: |")
    for name, values in per_step.items():
        print(f"| {name} | {C.spread([v * 1e3 for v in values], '{:.2f}')} |")


if __name__ == "__main__":
    sys.exit(main())
