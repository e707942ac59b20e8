"""Which SDPA backend PyTorch picks for HF BERT's prefill attention (and why the others are refused), traced the
way the backend sees it: the ATen graph of a compiled BertModel forward, with and without an attention mask.

    python benchmarks/sdpa_choice_probe.py [--batch 4] [--tokens 256]
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch_mirage.bench import models as M  # noqa: E402
from torch_mirage.testing.aten import trace_aten  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", default="bert", choices=list(M.MODELS))
    args = ap.parse_args()
    spec = M.get([args.model])[0]
    model = M.build(spec, "default", torch.bfloat16, "cuda", tiny=False)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.tokens), device="cuda")
    for mask in (None, torch.ones_like(ids)):
        extra = {} if mask is None else {"attention_mask": mask}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gm = trace_aten(lambda i: model(input_ids=i, **extra).logits, ids)
        sdpa = sorted({str(n.target) for n in gm.graph.nodes if "dot_product" in str(n.target)
                       or "safe_softmax" in str(n.target)})
        bmm = sum(1 for n in gm.graph.nodes if str(n.target) == "aten.bmm.default")
        print(f"mask={'none' if mask is None else 'ones'}: {sdpa}; bmm nodes {bmm}")
        for w in caught:
            if "attention" in str(w.message).lower():
                print("   warning:", str(w.message)[:300])
    b, s_, h = args.batch, args.tokens, model.config.num_attention_heads
    d = model.config.hidden_size // h
    q, k, v = (torch.randn(b, s_, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    # transformers passes enable_gqa=True to SDPA when there is no mask (use_gqa_in_sdpa), even for MHA models
    for enable_gqa in (False, True):
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, enable_gqa)
        for name in ("flash", "efficient", "cudnn"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok = getattr(torch.backends.cuda, f"can_use_{name}_attention")(params, True)
            print(f"enable_gqa={enable_gqa} can_use_{name}_attention: {ok}",
                  *[str(w.message)[:200] for w in caught], sep="\n   ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
