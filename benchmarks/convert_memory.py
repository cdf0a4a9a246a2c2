"""Peak memory of `gptlocal convert hf2ms` and `ms2hf` on a GPT-2-medium-shaped checkpoint (random weights).

    python benchmarks/convert_memory.py [--size medium|small|large]

Conversion streams tensor by tensor, so peak RSS should stay near the interpreter's own
footprint plus the largest tensor, far below the checkpoint size. Each conversion runs in
its own process; its peak RSS is read from the OS (ru_maxrss of the child).
"""
import argparse
import os
import subprocess
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package; scratch_dir)

SIZES = {"small": (768, 12, 12), "medium": (1024, 24, 16), "large": (1280, 36, 20)}


def child_peak(command):
    """Run command in a child; return (seconds, peak RSS MB of that child)."""
    code = ("import resource, subprocess, sys, time; t = time.time(); "
            "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
            "print(time.time() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, check=True)
    seconds, peak = out.stdout.split()
    return float(seconds), float(peak)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="medium", choices=SIZES)
    args = parser.parse_args()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    hidden, layers, heads = SIZES[args.size]
    work = C.scratch_dir("gptlocal-convert-")
    hf_dir = os.path.join(work, "hf")
    GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads)).save_pretrained(hf_dir)
    del torch
    size_mb = os.path.getsize(os.path.join(hf_dir, "model.safetensors")) / 2 ** 20
    gptlocal = [sys.executable, "-m", "mindformers_gptlocal.cli"]
    baseline = child_peak([sys.executable, "-c", "import mindformers_gptlocal.checkpoint.hf_gpt2, safetensors, numpy"])
    to_ms = child_peak(gptlocal + ["convert", "hf2ms", "--hf-dir", hf_dir, "--out", os.path.join(work, "ms")])
    to_hf = child_peak(gptlocal + ["convert", "ms2hf", "--ms-dir", os.path.join(work, "ms"),
                                   "--out", os.path.join(work, "back")])
    print(f"GPT-2 {args.size} checkpoint: {size_mb:,.0f} MB safetensors")
    print(f"interpreter + imports alone: peak RSS {baseline[1]:,.0f} MB")
    for name, (seconds, peak) in (("hf2ms", to_ms), ("ms2hf", to_hf)):
        print(f"{name}: {seconds:.1f} s, peak RSS {peak:,.0f} MB ({peak / size_mb:.2f}x checkpoint, "
              f"{peak - baseline[1]:,.0f} MB above imports)")


if __name__ == "__main__":
    main()
