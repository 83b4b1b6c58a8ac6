"""RSS of a tiny-model `loraplane serve` process, step by step (imports, engine, first request), read from
/proc/self/status: `PYTHONPATH=src:. OMP_NUM_THREADS=1 python scripts/server_rss.py` (figures in docs/server.md).
Imports happen inside main() so that each step's cost shows."""

from __future__ import annotations

import asyncio
import pathlib
import tempfile


def memory() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile in MB, and the thread count."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            number = int(value.split()[0])
            out[key] = number if key == "Threads" else number // 1024
    return out


def main() -> None:
    print("start", memory())
    import fastapi  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    print("imports", memory())
    from tests.engine.conftest import build_tiny_hf_model
    from tests.http.conftest import build_chat_tokenizer

    folder = pathlib.Path(tempfile.mkdtemp())
    tokenizer = build_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    build_tiny_hf_model(
        folder, "llama", vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None, pad_token_id=None
    )
    tokenizer.save_pretrained(folder)
    print("model files written", memory())
    import httpx

    from loraplane.serve import main as serve
    from loraplane.serve.options import ServeOptions

    app, engine = serve.build_app(ServeOptions(model=str(folder)))
    print("engine and app built", memory())
    asyncio.run(serve.prepare(app))

    async def ask() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            body = {"model": folder.name, "prompt": "hello", "max_tokens": 8}
            return (await client.post("/v1/completions", json=body)).status_code

    print("first request", asyncio.run(ask()), memory())
    engine.close()


if __name__ == "__main__":
    main()
