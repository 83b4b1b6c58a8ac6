"""adapter_config.json keys: accepted only when known not to change the math, every other key refused by
name (by pack here; the engine's loader and the admin API share the function, tested in their own suites)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from adapter_factory import make_peft_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.pack import pack_folder
from loraplane.artifacts.peft_config import HARMLESS_KEYS, NEUTRAL_KEYS, READ_KEYS, parse_adapter_config

HASH = "d" * 64


def _pack_with(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return pack_folder(folder, name="demo", version="v1", base_hash=HASH)


@pytest.mark.parametrize(
    "key, value",
    [("alora_invocation_tokens", [128, 7]), ("use_qalora", True), ("layers_to_transform", [0]),
     ("layers_pattern", "layers"), ("lora_bias", True), ("use_dora", True), ("init_lora_weights", "pissa"),
     ("init_lora_weights", "pissa_niter_4"), ("init_lora_weights", "loftq"), ("loftq_config", {"loftq_bits": 4}),
     ("layer_replication", [[0, 2]]), ("trainable_token_indices", [1, 2]), ("target_parameters", ["w"]),
     ("use_qalora", 1), ("some_future_option", None), ("modules_to_save", ["lm_head"])],
)  # fmt: skip
def test_a_key_that_changes_the_math_is_refused_by_name(tmp_path, key, value):
    with pytest.raises(E.ArtifactError) as err:
        _pack_with(make_peft_folder(tmp_path / "a"), **{key: value})
    assert err.value.reason == E.UNSUPPORTED_ADAPTER and err.value.field == f"adapter_config.json.{key}"


def test_keys_at_their_neutral_values_and_harmless_keys_pass(tmp_path):
    neutral = {key: values[0] for key, (values, _) in NEUTRAL_KEYS.items()}
    harmless = {"task_type": "CAUSAL_LM", "lora_dropout": 0.1, "inference_mode": True, "peft_version": "0.21.2",
                "exclude_modules": ["k_proj"], "init_lora_weights": "gaussian"}  # fmt: skip
    manifest = _pack_with(make_peft_folder(tmp_path / "a"), **{**neutral, **harmless})
    assert dict(manifest.ranks) == {"q_proj": 4, "v_proj": 4}


def test_every_key_peft_writes_is_classified_and_its_own_config_passes():
    """PEFT's save_pretrained writes every LoraConfig field; a new PEFT field fails here until it is classified."""
    peft = pytest.importorskip("peft")
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert fields - (READ_KEYS | HARMLESS_KEYS | NEUTRAL_KEYS.keys()) == set()
    saved = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]).to_dict()
    saved["target_modules"] = sorted(saved["target_modules"])  # a set in memory, a list in the JSON file
    config = parse_adapter_config(json.loads(json.dumps(saved, default=str)))
    assert (config.rank, config.alpha) == (4, 16.0)
