"""Build tiny, real adapter artifacts quickly (torch-free): base folders, PEFT LoRA folders with random
safetensors weights, and signed, pushed adapter versions.

    from adapter_factory import TINY_BASE_CONFIG, make_base_folder, make_keys, build_signed_adapter, push_adapter

    keys = make_keys(tmp_path / "keys")                       # Keys(private_pem, public_pem, key_id, trusted_dir)
    base = make_base_folder(tmp_path / "base")                # config.json + model.safetensors
    adapter = build_signed_adapter(tmp_path / "a", name="demo", version="v1", keys=keys, base_dir=base,
                                   rank=4, target_modules=("q_proj", "v_proj"))
    uri = push_adapter(adapter.folder, s3_client, "bucket")    # s3://bucket/demo/v1/
    # or all at once:
    published = publish_adapter(tmp_path, s3_client, "bucket", name="demo", version="v2", keys=keys, base_hash=h)
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE, Manifest
from loraplane.artifacts.pack import pack_folder, push_folder, sign_folder
from loraplane.artifacts.peft import expected_shapes
from loraplane.artifacts.signing import generate_keypair, key_id, sign_bytes

# A llama-shaped base small enough for CPU tests (the engine's tiny test model uses the same fields).
TINY_BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def random_tensor_bytes(shape: tuple[int, ...], dtype: str, rng: random.Random, scale: float = 0.02) -> bytes:
    n = 1
    for d in shape:
        n *= d
    try:
        import numpy as np

        values = np.random.default_rng(rng.getrandbits(32)).standard_normal(n).astype(np.float32) * scale
        if dtype == "float32":
            return values.tobytes()
        if dtype == "float16":
            return values.astype(np.float16).tobytes()
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bfloat16 = top half of float32
    except ImportError:
        values = [rng.gauss(0.0, scale) for _ in range(n)]
        if dtype == "float32":
            return struct.pack(f"<{n}f", *values)
        if dtype == "float16":
            return struct.pack(f"<{n}e", *values)
        return b"".join(struct.pack("<f", v)[2:] for v in values)


def write_safetensors(
    path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None
) -> Path:
    """tensors: name -> (dtype in float32|float16|bfloat16 or a raw safetensors dtype, shape, raw bytes)."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {
            "dtype": _ST_DTYPE.get(dtype, dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for data in blobs:
            f.write(data)
    return path


def make_base_folder(
    folder: Path, config: dict | None = None, *, dtype: str = "float32", seed: int = 0
) -> Path:
    """config.json + model.safetensors with llama-style tensor names and random weights."""
    config = dict(config or TINY_BASE_CONFIG)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n_layers, shapes = expected_shapes(config)
    tensors = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    tensors["model.norm.weight"] = (config["hidden_size"],)
    for i in range(n_layers):
        for module, (fan_in, fan_out) in shapes.items():
            tensors[f"model.layers.{i}.{_PARENT.get(module, 'self_attn')}.{module}.weight"] = (
                fan_out,
                fan_in,
            )
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (config["hidden_size"],)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = (config["hidden_size"],)
    write_safetensors(
        folder / "model.safetensors",
        {name: (dtype, shape, random_tensor_bytes(shape, dtype, rng)) for name, shape in tensors.items()},
    )
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    return folder


def make_peft_folder(
    folder: Path,
    *,
    base_config: dict | None = None,
    rank: int = 4,
    alpha: float = 8,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    ranks: dict[str, int] | None = None,
    layers: tuple[int, ...] | None = None,
    dtype: str = "float32",
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 0.02,
) -> Path:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for ``base_config``.

    lora_A is [r, in] and lora_B [out, r]; both random (real PEFT zero-inits B; tests want a visible effect).
    ``ranks`` overrides the rank per module (written as PEFT's rank_pattern).
    """
    base_config = dict(base_config or TINY_BASE_CONFIG)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n_layers, shapes = expected_shapes(base_config)
    ranks = {m: (ranks or {}).get(m, rank) for m in target_modules}
    tensors = {}
    for i in layers if layers is not None else range(n_layers):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{i}.{_PARENT.get(module, 'self_attn')}.{module}"
            r = ranks[module]
            tensors[f"{prefix}.lora_A.weight"] = (
                dtype,
                (r, fan_in),
                random_tensor_bytes((r, fan_in), dtype, rng, scale),
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                dtype,
                (fan_out, r),
                random_tensor_bytes((fan_out, r), dtype, rng, scale),
            )
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
        "alpha_pattern": {},
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "base_model_name_or_path": "tiny-llama",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


@dataclass(frozen=True, slots=True)
class Keys:
    private_pem: bytes
    public_pem: bytes
    key_id: str
    trusted_dir: Path  # holds <key_id>.pub: the shape of a mounted trusted-keys Secret

    @property
    def trusted(self) -> dict[str, bytes]:
        return {self.key_id: self.public_pem}


def make_keys(folder: Path) -> Keys:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    private_pem, public_pem = generate_keypair()
    kid = key_id(public_pem)
    (folder / "signing.key").write_bytes(private_pem)
    (folder / "trusted").mkdir(exist_ok=True)
    (folder / "trusted" / f"{kid}.pub").write_bytes(public_pem)
    return Keys(private_pem, public_pem, kid, folder / "trusted")


@dataclass(frozen=True, slots=True)
class SignedAdapter:
    folder: Path
    manifest: Manifest
    digest: str  # sha256:<hex>
    key_id: str


def build_signed_adapter(
    folder: Path,
    *,
    name: str,
    version: str,
    keys: Keys,
    base_dir: Path | None = None,
    base_hash: str | None = None,
    max_rank: int | None = 64,
    **peft_kwargs,
) -> SignedAdapter:
    """make_peft_folder + pack + sign. Give base_dir (shapes checked) or base_hash."""
    if base_dir is not None and "base_config" not in peft_kwargs:
        peft_kwargs["base_config"] = json.loads((Path(base_dir) / "config.json").read_text())
    make_peft_folder(folder, **peft_kwargs)
    manifest = pack_folder(
        folder, name=name, version=version, base_dir=base_dir, base_hash=base_hash, max_rank=max_rank
    )
    signed = sign_folder(folder, keys.private_pem)
    return SignedAdapter(Path(folder), manifest, signed["digest"], signed["key_id"])


def push_adapter(
    folder: Path, s3_client, bucket: str, prefix: str | None = None, *, force: bool = False
) -> str:
    """Upload a signed folder to s3://bucket/<name>/<version>/ (or the given prefix); returns the URI."""
    if prefix is None:
        manifest = Manifest.from_json((Path(folder) / "loraplane-manifest.json").read_bytes())
        prefix = f"{manifest.name}/{manifest.version}/"
    return push_folder(folder, f"s3://{bucket}/{prefix}", s3_client=s3_client, force=force)["uri"]


@dataclass(frozen=True, slots=True)
class PublishedAdapter:
    uri: str  # s3://bucket/name/version/
    digest: str  # sha256:<hex>: what a LoRAAdapter pins in spec.source.manifestDigest
    folder: Path
    manifest: Manifest
    key_id: str


def publish_adapter(
    workdir: Path, s3_client, bucket: str, *, name: str, version: str, keys: Keys, **build_kwargs
) -> PublishedAdapter:
    """One call for operator and e2e tests: build, pack, sign and push a random adapter version.

    ``build_kwargs`` go to build_signed_adapter (base_dir= or base_hash=, rank=, target_modules=, seed=, ...).
    """
    adapter = build_signed_adapter(
        Path(workdir) / f"{name}-{version}", name=name, version=version, keys=keys, **build_kwargs
    )
    uri = push_adapter(adapter.folder, s3_client, bucket)
    return PublishedAdapter(uri, adapter.digest, adapter.folder, adapter.manifest, adapter.key_id)


def resign_edited(source: Path, folder: Path, keys: Keys, edit: Callable[[Path], None], **manifest) -> str:
    """A copy of a signed folder, edited by ``edit(folder)`` past pack's checks, whose manifest lists the
    edited files (plus ``manifest`` field overrides) and is validly signed again: what a producer holding the
    signing key could publish. Returns the new manifest digest."""
    shutil.copytree(source, folder)
    edit(folder)
    data = {**json.loads((folder / MANIFEST_FILE).read_bytes()), **manifest}
    for name in data["files"]:
        blob = (folder / name).read_bytes()
        data["files"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    raw = Manifest.from_dict(data).canonical_bytes()  # the canonical spelling of the edited fields
    (folder / MANIFEST_FILE).write_bytes(raw)
    (folder / SIGNATURE_FILE).write_bytes(sign_bytes(raw, keys.private_pem))
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def edit_config(**changes) -> Callable[[Path], None]:
    """An ``edit`` for resign_edited: set adapter_config.json keys (a value of ``...`` drops the key)."""

    def edit(folder: Path) -> None:
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is ...:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))

    return edit
