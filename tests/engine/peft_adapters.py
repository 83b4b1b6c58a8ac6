"""Real PEFT adapters for the engine's tests: saved by peft itself from a tiny base, random (non-zero) B.

ADAPTER_SPECS covers what the engine must reproduce exactly: ranks 8, 16 and 64, rsLoRA, rank_pattern +
alpha_pattern, a q,v-only adapter (k stays at zero delta) and an MLP-only one, these two with a scale per module.
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_SPECS: dict[str, dict] = {
    "r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "r16": dict(r=16, lora_alpha=8, target_modules="all-linear"),
    "r64": dict(r=64, lora_alpha=32, target_modules="all-linear"),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    "pattern": dict(
        r=8,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
        rank_pattern={"layers.0.self_attn.q_proj": 4, "down_proj": 12},
        alpha_pattern={"o_proj": 3, "layers.1.self_attn.k_proj": 40},
    ),
    # Different scales for modules that share one launch (q and v; gate and up): each slot applies its own.
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 32}),
    "mlp": dict(
        r=16,
        lora_alpha=16,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"up_proj": 48},
    ),
}


def save_peft_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kwargs) -> Path:
    """Build a LoraConfig adapter on the base with random A and B (B scaled up so deltas matter) and save it."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    if lora_kwargs.get("target_modules") == "all-linear":
        config.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.15)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def peft_reference(base_dir: Path, folders: dict[str, Path]):
    """A PeftModel holding every adapter under its own name, in eval mode (the mixed-batch reference)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    names = list(folders)
    model = peft.PeftModel.from_pretrained(base, folders[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(folders[name], adapter_name=name)
    return model.eval()
