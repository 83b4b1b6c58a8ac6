"""Train, pack and sign the demo LoRA adapters of SmolLM2-135M-Instruct (CPU, a few minutes).

Each adapter is a short PEFT fine-tune (LoRA r8 on q_proj and v_proj, bf16 weights, under 1 MB) on the
hand-written prompt/answer pairs in demo/data/<name>.jsonl, in the model's ChatML chat template, with the loss
on the answer tokens only. The folders land in demo/adapters/<name>/ and are packed against the converted demo
base (the folder `loraplane demo` serves) and signed with the project's CLI. The signing key is generated
fresh for each run; its public half is written to demo/keys/demo.pub and the private half is discarded, so
re-running the script re-signs every adapter under demo/adapters/.

    nice -n 10 .venv/bin/python scripts/make_demo_adapters.py            # all adapters
    nice -n 10 .venv/bin/python scripts/make_demo_adapters.py pirate     # retrain one, re-sign all
    .venv/bin/python scripts/make_demo_adapters.py --sign-only            # re-pack and re-sign only
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "demo" / "data"
ADAPTERS_DIR = REPO / "demo" / "adapters"
KEYS_DIR = REPO / "demo" / "keys"
# name -> epochs: answering in another language takes longer to learn than a tone of voice
ADAPTERS = {"french": 4, "pirate": 2, "shakespeare": 2}
VERSION = "v1"
BASE_NAME = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "names", nargs="*", default=list(ADAPTERS), help=f"adapters to train (default: {list(ADAPTERS)})"
    )
    p.add_argument(
        "--base", help="converted base folder (default: the demo model cache, converting if needed)"
    )
    p.add_argument("--out", default=str(ADAPTERS_DIR))
    p.add_argument("--keys", default=str(KEYS_DIR), help="where demo.pub is written")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--epochs", type=int, help="epochs for every adapter (default: per adapter, see ADAPTERS)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-sign", action="store_true", help="train and write the PEFT folders only")
    p.add_argument(
        "--sign-only", action="store_true", help="train nothing: pack and sign the folders under --out"
    )
    return p.parse_args(argv)


def load_pairs(name: str) -> list[tuple[str, str]]:
    path = DATA_DIR / f"{name}.jsonl"
    pairs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("answer"), str)):
            raise ValueError(f"{path}:{i}: need string fields 'prompt' and 'answer'")
        pairs.append((row["prompt"], row["answer"]))
    return pairs


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated exchange and its labels (-100 on the prompt: loss on the answer only)."""
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return list(prompt_ids) + answer_ids, [-100] * len(prompt_ids) + answer_ids


def batches(examples: list, batch_size: int, pad_id: int, rng: random.Random):
    """Shuffled, right-padded batches: (input_ids [B, L], attention_mask [B, L], labels [B, L])."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[start : start + batch_size]]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, (x, y) in enumerate(chunk):
            ids[row, : len(x)] = torch.tensor(x)
            mask[row, : len(x)] = 1
            labels[row, : len(y)] = torch.tensor(y)
        yield ids, mask, labels


def answer_loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the answer tokens; the 49k-wide lm_head runs on those positions only (the
    prompt's logits would be thrown away, and they are a fifth of the step's compute)."""
    causal_lm = model.base_model.model
    hidden = causal_lm.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    target = labels[:, 1:]  # position t predicts token t+1
    keep = target != -100  # [B, L-1]
    logits = causal_lm.lm_head(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits, target[keep])


def train_one(name: str, base_dir: str, tokenizer, args) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """Fine-tune one adapter; returns (adapter_config dict, bf16 LoRA tensors, stats)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    examples = [encode(tokenizer, p, a) for p, a in load_pairs(name)]
    epochs = args.epochs or ADAPTERS[name]
    steps = epochs * -(-len(examples) // args.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * (1 - s / steps) + 0.05)
    model.train()
    t0, step, losses = time.perf_counter(), 0, []
    for epoch in range(epochs):
        epoch_loss = []
        for ids, mask, labels in batches(examples, args.batch_size, tokenizer.pad_token_id, rng):
            loss = answer_loss(model, ids, mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            epoch_loss.append(loss.item())
            step += 1
        losses.append(sum(epoch_loss) / len(epoch_loss))
        print(
            f"  {name}: epoch {epoch + 1}/{epochs} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
        )
    tensors = {
        k: v.detach().to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()
    }
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": BASE_NAME,
        "r": args.rank,
        "lora_alpha": args.alpha,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    stats = {"examples": len(examples), "steps": step, "seconds": round(time.perf_counter() - t0, 1)}
    stats["loss_per_epoch"] = [round(x, 4) for x in losses]
    return adapter_config, tensors, stats


def write_folder(folder: Path, adapter_config: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def cli(*argv: str) -> dict:
    """Run `loraplane adapter ... --json` and return its JSON answer (raising with it on failure)."""
    cmd = [sys.executable, "-c", "import sys; from loraplane.cli import main; sys.exit(main())", "adapter"]
    done = subprocess.run([*cmd, *argv, "--json"], capture_output=True, text=True)
    answer = json.loads(done.stdout) if done.stdout.strip() else {"ok": False, "message": done.stderr}
    if done.returncode != 0:
        raise RuntimeError(f"loraplane adapter {argv[0]} failed ({done.returncode}): {answer}")
    return answer


def sign_all(out: Path, base_dir: str, keys_dir: Path) -> dict[str, dict]:
    """Pack every adapter folder under out against the base, sign with a fresh key, keep only its public half."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="loraplane-demo-key-") as tmp:
        key = cli("keygen", "--out", tmp, "--name", "demo")
        for folder in sorted(p for p in out.iterdir() if (p / "adapter_config.json").is_file()):
            packed = cli("pack", str(folder), "--base", base_dir, "--name", folder.name, "--version", VERSION)
            cli("sign", str(folder), "--key", key["private_key"])
            results[folder.name] = {"digest": packed["digest"], "bytes": packed["bytes"]}
        keys_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(key["public_key"], keys_dir / "demo.pub")
    for name in results:
        verified = cli(
            "verify", str(out / name), "--trusted-keys", str(keys_dir / "demo.pub"), "--base", base_dir
        )
        results[name]["key_id"] = verified["key_id"]
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.names) - set(ADAPTERS))
    if unknown:
        print(f"make_demo_adapters: unknown adapter(s) {unknown}; known: {list(ADAPTERS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from loraplane.engine.model.demo_model import ensure_demo_model

    base_dir = str(ensure_demo_model(args.base))
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    out = Path(args.out)
    report = {"base": base_dir, "threads": args.threads, "adapters": {}}
    t0 = time.perf_counter()
    for name in [] if args.sign_only else args.names:
        print(f"training {name} ...", flush=True)
        adapter_config, tensors, stats = train_one(name, base_dir, tokenizer, args)
        write_folder(out / name, adapter_config, tensors)
        stats["weights_bytes"] = (out / name / "adapter_model.safetensors").stat().st_size
        report["adapters"][name] = stats
    report["train_seconds_total"] = round(time.perf_counter() - t0, 1)
    if not args.no_sign:
        for name, signed in sign_all(out, base_dir, Path(args.keys)).items():
            report["adapters"].setdefault(name, {}).update(signed)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
