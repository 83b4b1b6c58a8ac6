"""Check the committed demo adapters with transformers + PEFT and write docs/transcripts/demo-adapters.md.

For each held-out prompt (none of them is in demo/data/), the greedy answer of the base model and of every
adapter under demo/adapters/, loaded from the committed files exactly as PEFT would load them. Each adapter
folder is first verified with the project's CLI (signature by demo/keys/demo.pub, base hash of the converted
demo model, every file's hash). Exits 1 when an adapter fails verification or leaves an answer unchanged.

    nice -n 10 .venv/bin/python scripts/demo_adapters_transcript.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "Give me one tip for staying healthy.",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="converted base folder (default: the demo model cache)")
    p.add_argument("--adapters", default=str(REPO / "demo" / "adapters"))
    p.add_argument("--public-key", default=str(REPO / "demo" / "keys" / "demo.pub"))
    p.add_argument("--out", default=str(REPO / "docs" / "transcripts" / "demo-adapters.md"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def verify(folder: Path, public_key: str, base_dir: str) -> dict:
    cmd = [sys.executable, "-c", "import sys; from loraplane.cli import main; sys.exit(main())", "adapter"]
    args = ["verify", str(folder), "--trusted-keys", public_key, "--base", base_dir, "--json"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True)
    answer = json.loads(done.stdout) if done.stdout.strip() else {"ok": False, "message": done.stderr}
    answer["exit_code"] = done.returncode
    return answer


@torch.inference_mode()
def answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(
        **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def markdown(base_dir: str, rows: dict, checks: dict, args, seconds: float) -> str:
    names = list(checks)
    base_dir = base_dir.replace(str(Path.home()), "~", 1)
    lines = [
        "# Demo adapters: base vs each adapter",
        "",
        "Greedy answers (transformers + PEFT, fp32 on the CPU, at most "
        f"{args.max_new_tokens} new tokens) of SmolLM2-135M-Instruct and of each demo adapter in `demo/adapters/`, "
        "to prompts that are not in the training data (`demo/data/`). Regenerate with "
        "`nice -n 10 .venv/bin/python scripts/demo_adapters_transcript.py`; the adapters themselves come from "
        "`scripts/make_demo_adapters.py`.",
        "",
        "| adapter | verified (`loraplane adapter verify`) | key id | manifest digest | payload bytes |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        c = checks[name]
        ok = "yes" if c.get("verified") else f"NO: {c.get('reason')} {c.get('message')}"
        lines.append(f"| `{name}` | {ok} | `{c.get('key_id')}` | `{c.get('digest')}` | {c.get('bytes')} |")
    lines += [
        "",
        f"Base folder: `{base_dir}` (base hash `{next(iter(checks.values())).get('base_model_hash')}`).",
        "",
    ]
    for prompt, answers in rows.items():
        lines += [f"## {prompt}", ""]
        for who in ["base", *names]:
            text = answers[who].replace("\n", " ")
            lines.append(f"- **{who}**: {text}")
        lines.append("")
    lines.append(f"Generated in {seconds:.0f} s with {args.threads} threads.")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplane.engine.model.demo_model import ensure_demo_model

    t0 = time.perf_counter()
    base_dir = str(ensure_demo_model(args.base))
    folders = sorted(p for p in Path(args.adapters).iterdir() if (p / "adapter_config.json").is_file())
    checks = {f.name: verify(f, args.public_key, base_dir) for f in folders}
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    rows = {p: {"base": answer(model, tokenizer, p, args.max_new_tokens)} for p in PROMPTS}
    for i, folder in enumerate(folders):
        if i == 0:
            model = PeftModel.from_pretrained(model, str(folder), adapter_name=folder.name)
        else:
            model.load_adapter(str(folder), adapter_name=folder.name)
        model.set_adapter(folder.name)
        for prompt in PROMPTS:
            rows[prompt][folder.name] = answer(model, tokenizer, prompt, args.max_new_tokens)
            print(f"[{folder.name}] {prompt} -> {rows[prompt][folder.name]!r}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(base_dir, rows, checks, args, time.perf_counter() - t0))
    print(f"wrote {out}")
    failed = [n for n, c in checks.items() if c["exit_code"] != 0]
    unchanged = [(n, p) for p in PROMPTS for n in checks if rows[p][n] == rows[p]["base"]]
    for name in failed:
        print(f"adapter {name}: verification failed: {checks[name]}", file=sys.stderr)
    for name, prompt in unchanged:
        print(f"adapter {name}: same answer as the base to {prompt!r}", file=sys.stderr)
    return 1 if failed or unchanged else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
