"""The S-LoRA paper's baseline on the same trace: transformers + PEFT, which has no continuous batching and
serves one adapter at a time, so each request in arrival order loads its adapter from the same folder the
engine read (``PeftModel.load_adapter``), generates its tokens greedily, and drops the adapter again (a GPU
holds a few adapters, not a thousand). Only the trace's first requests are served (it is slow), and its
tokens/s over them is the anchor the engine's throughput is compared with.

The model is a transformers ``LlamaForCausalLM`` of the same config with its own random weights (speed does
not depend on the values), built on the device after the engine's has been freed.
"""

from __future__ import annotations

import gc
import json
import time

import torch


def peft_row(b, trace, adapters: list[str], folders: dict, alpha: float, n: int) -> dict:
    """tokens/s of transformers + PEFT over the first ``n`` requests of ``trace`` (``adapters``: each
    request's adapter key, ``folders``: name -> PEFT folder)."""
    import transformers
    from peft import PeftModel

    _, prompts, lens_out = trace
    n = min(n, len(prompts))
    config = transformers.AutoConfig.from_pretrained(b.tmp)
    with torch.device(b.device):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=b.dtype).eval()
    model, total = None, 0
    start = time.perf_counter()
    for i in range(n):
        name = adapters[i].split("@")[0]
        folder = str(folders[name])
        if model is None:
            model = PeftModel.from_pretrained(base, folder, adapter_name=name)
        else:
            model.load_adapter(folder, adapter_name=name)
        model.set_adapter(name)
        ids = torch.tensor([prompts[i]], device=b.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=int(lens_out[i]), min_new_tokens=int(lens_out[i]), pad_token_id=0,
            )  # fmt: skip
        total += out.shape[1] - ids.shape[1]
        if len(model.peft_config) > 1:  # keep only the active one: a GPU cannot hold the whole set
            for other in [a for a in model.peft_config if a != name]:
                model.delete_adapter(other)
    seconds = time.perf_counter() - start
    row = {"case": f"S-LoRA trace transformers + PEFT alpha={alpha} (first {n} req, one at a time)",
           "section": "slora", "alpha": alpha, "peft": True, "tok_s": total / seconds, "seconds": seconds,
           "requests": n, "tokens": total}  # fmt: skip
    del model, base
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row
