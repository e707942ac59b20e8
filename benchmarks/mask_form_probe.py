"""Which mask form an HF model's attention regions take on this machine (transformers' version, the device): the
attention info of each claimed region, after one prefill of a tiny model. Run: python benchmarks/mask_form_probe.py
--model bloom --device cuda --dtype float16."""
import argparse

import torch
import transformers

from torch_mirage.bench import models as M
from torch_mirage.report import Report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bloom")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--full", action="store_true", help="the bench's size, not the tiny model")
    ap.add_argument("--attn", default="default", help="attn_implementation: default, eager, sdpa")
    args = ap.parse_args()
    print("torch", torch.__version__, "transformers", transformers.__version__, "device", args.device)
    spec = M.MODELS[args.model]
    model = M.build(spec, args.attn, getattr(torch, args.dtype), args.device, tiny=not args.full)
    ids = torch.randint(0, model.config.vocab_size, (2, args.seq), device=args.device)
    report = Report()
    with torch.no_grad():
        M.compile_forward(model, "mirage", report)
        M.forward_logits(model, spec)(ids)
    for r in report.regions:
        if r.claimer == "attention":
            print(r.info.get("attention", "")[:160])


if __name__ == "__main__":
    main()
