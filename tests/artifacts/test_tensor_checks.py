"""Every tensor byte is checked once: non-finite weights and broken layouts are refused by ``pack``,
``sign``, ``verify`` and the host cache, and hostile JSON gives a reason, never a traceback."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import pytest
from adapter_factory import make_base_folder, make_peft_folder, random_tensor_bytes, write_safetensors
from tamper import upload_folder

from loraplane.artifacts import errors as E
from loraplane.artifacts.base_hash import BaseHashError, compute_base_hash
from loraplane.artifacts.cache import HostCache
from loraplane.artifacts.cli import main as cli
from loraplane.artifacts.manifest import MANIFEST_FILE, SIGNATURE_FILE, FileEntry, Manifest
from loraplane.artifacts.pack import pack_folder
from loraplane.artifacts.signing import parse_signature, sign_manifest
from loraplane.artifacts.tensors import TensorScanner, first_non_finite
from loraplane.artifacts.verify import Policy, fetch_verified_manifest, verify_folder

W = "adapter_model.safetensors"
HASH = "d" * 64
NAN, INF = float("nan"), float("inf")


def _pack_refused(folder, reason):
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.reason == reason, err.value
    assert err.value.field == W
    return err.value


def _poison(folder, value: float, dtype: str = "float32") -> None:
    """Rewrite one lora_B with ``value`` in its last element (the layout stays valid)."""
    path = folder / W
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    name = next(k for k in sorted(header) if k.endswith("lora_B.weight"))
    end = 8 + header_len + header[name]["data_offsets"][1]
    data = bytearray(path.read_bytes())
    encoded = {"float32": struct.pack("<f", value), "float16": struct.pack("<e", value)}.get(dtype)
    encoded = encoded or struct.pack("<f", value)[2:]  # bfloat16: the top half of a float32
    data[end - len(encoded) : end] = encoded
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_pack_refuses_non_finite_weights(tmp_path, dtype, value):
    folder = make_peft_folder(tmp_path / "a", dtype=dtype)
    pack_folder(folder, name="demo", version="v1", base_hash=HASH)  # finite: fine
    _poison(folder, value, dtype)
    err = _pack_refused(folder, E.NON_FINITE_WEIGHTS)
    assert "lora_B" in err.message and "element" in err.message


def test_large_finite_values_are_not_mistaken_for_inf(tmp_path):
    for dtype, fmt, big in (("F32", "<f", 3.0e38), ("F16", "<e", 65504.0), ("F64", "<d", 1e308)):
        data = b"".join(
            struct.pack(fmt, v) for v in (big, -big, 0.0, -0.0, 1e-30 if dtype != "F16" else 6e-8)
        )
        assert first_non_finite(data, dtype) is None, dtype
        assert first_non_finite(data + struct.pack(fmt, NAN), dtype) == 5, dtype
    bf16 = b"".join(struct.pack("<f", v)[2:] for v in (3.0e38, -3.0e38, 1.0, -INF))
    assert first_non_finite(bf16, "BF16") == 3
    assert first_non_finite(bf16[:-2], "BF16") is None
    assert first_non_finite(bytes([0x7E, 0xFE, 0x00, 0xFF]), "F8_E4M3") == 3  # 448, -448, 0, NaN
    assert first_non_finite(bytes([0x7B, 0xFC]), "F8_E5M2") == 1  # 57344, -Inf
    assert first_non_finite(bytes([0xFF, 0x7F]), "I16") is None


def _layout_case(folder, edit) -> None:
    path = folder / W
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + header_len])
    data = raw[8 + header_len :]
    header, data = edit(header, data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _first(header) -> str:
    return next(k for k in sorted(header) if k != "__metadata__")


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "offsets_1e12",
        "shape_disagrees",
        "overlap",
        "trailing_bytes",
        "unknown_dtype",
        "negative",
    ],
)
def test_pack_refuses_broken_layouts(tmp_path, case):
    folder = make_peft_folder(tmp_path / "a")

    def edit(header, data):
        name = _first(header)
        if case == "truncated":
            return header, data[:-100]
        if case == "offsets_1e12":
            header[name]["data_offsets"][1] = 10**12
        elif case == "shape_disagrees":
            header[name]["shape"][0] += 1
        elif case == "overlap":
            header[name]["data_offsets"][1] += 4
        elif case == "trailing_bytes":
            return header, data + b"\0" * 16
        elif case == "unknown_dtype":
            header[name]["dtype"] = "F128"
        elif case == "negative":
            header[name]["data_offsets"][0] = -4
        return header, data

    _layout_case(folder, edit)
    err = _pack_refused(folder, E.BAD_TENSOR_LAYOUT)
    assert err.message


def test_deeply_nested_safetensors_header_is_a_reason(tmp_path):
    folder = make_peft_folder(tmp_path / "a")
    head = b'{"__metadata__":' + b"[" * 4000 + b"]" * 4000 + b"}"
    (folder / W).write_bytes(struct.pack("<Q", len(head)) + head)
    assert "nested" in _pack_refused(folder, E.BAD_TENSOR_LAYOUT).message


def test_scanner_gives_the_same_answer_for_any_chunking():
    rng = random.Random(7)
    tensors = {f"t{i}": (dt, (3, 5), random_tensor_bytes((3, 5), dt, rng)) for i, dt in
               enumerate(["float32", "float16", "bfloat16", "float32"])}  # fmt: skip
    tensors["t2"] = ("float32", (2, 3), struct.pack("<6f", 1, 2, 3, 4, 5, INF))
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        raw = write_safetensors(Path(tmp) / "x.safetensors", tensors).read_bytes()
    for _ in range(30):
        scanner, pos = TensorScanner(len(raw), W), 0
        while pos < len(raw):
            step = rng.choice([1, 2, 3, 7, 64, 1000, 10**6])
            scanner.update(raw[pos : pos + step])
            pos += step
        with pytest.raises(E.ArtifactError) as err:
            scanner.finish()
        assert err.value.reason == E.NON_FINITE_WEIGHTS and "'t2' element 5" in err.value.message


def _signed_by_hand(folder, keys, name="demo", version="v1") -> None:
    """A producer who bypasses pack: a manifest and a valid signature over whatever the folder holds."""
    files = {n: FileEntry(hashlib.sha256((folder / n).read_bytes()).hexdigest(), (folder / n).stat().st_size)
             for n in ("adapter_config.json", W)}  # fmt: skip
    manifest = Manifest(name=name, version=version, base_model_hash=HASH, ranks={"q_proj": 4, "v_proj": 4},
                        alpha=8, target_modules=("q_proj", "v_proj"), dtype="float32", files=files,
                        created="2026-11-30T00:00:00Z", producer="by hand")  # fmt: skip
    (folder / MANIFEST_FILE).write_bytes(manifest.canonical_bytes())
    (folder / SIGNATURE_FILE).write_bytes(sign_manifest(manifest, keys.private_pem))


@pytest.mark.parametrize("damage", ["nan", "offsets_1e12"])
def test_signed_bad_weights_are_refused_by_verify_and_by_the_host_cache(tmp_path, keys, s3, bucket, damage):
    folder = make_peft_folder(tmp_path / "a")
    if damage == "nan":
        _poison(folder, NAN)
        reason = E.NON_FINITE_WEIGHTS
    else:
        _layout_case(folder, lambda h, d: (h | {_first(h): {**h[_first(h)], "data_offsets": [0, 10**12]}}, d))
        reason = E.BAD_TENSOR_LAYOUT
    _signed_by_hand(folder, keys)
    with pytest.raises(E.ArtifactError) as err:
        verify_folder(folder, trusted_keys=keys.trusted, policy=Policy())
    assert err.value.reason == reason
    upload_folder(s3, bucket, "demo/v1/", folder)
    uri = f"s3://{bucket}/demo/v1/"
    fetch_verified_manifest(
        uri, trusted_keys=keys.trusted, expected_base_hash=HASH, s3_client=s3
    )  # header-free
    cache = HostCache(tmp_path / "cache", 1 << 30, s3)
    with pytest.raises(E.ArtifactError) as err:
        cache.pull(uri, trusted_keys=keys.trusted, expected_base_hash=HASH)
    assert err.value.reason == reason and err.value.field == W
    assert not list((tmp_path / "cache" / "adapters").iterdir()), "nothing unverified is cached"
    weights_sha = hashlib.sha256((folder / W).read_bytes()).hexdigest()
    assert not (tmp_path / "cache" / "blobs" / weights_sha).exists(), "refused weights never become a blob"
    assert not list((tmp_path / "cache" / "blobs").iterdir()), "nor does the config fetched before them"


def test_nested_json_signature_and_manifest_are_reasons_not_tracebacks(tmp_path, keys, capsys):
    with pytest.raises(E.ArtifactError) as err:
        parse_signature(b"[" * 4000)
    assert err.value.reason == E.BAD_SIGNATURE
    with pytest.raises(E.ArtifactError) as err:
        Manifest.from_json(b"[" * 4000)
    assert err.value.reason == E.BAD_MANIFEST
    folder = make_peft_folder(tmp_path / "a")
    pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    (folder / SIGNATURE_FILE).write_bytes(b"[" * 4000)
    code = cli(["verify", str(folder), "--trusted-keys", str(keys.trusted_dir), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code != 0 and out["reason"] == E.BAD_SIGNATURE
    (folder / "adapter_config.json").write_text("[" * 4000)
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(folder, name="demo", version="v1", base_hash=HASH)
    assert err.value.reason == E.BAD_MANIFEST and err.value.field == "adapter_config.json"


def test_base_index_without_weight_map_and_truncated_shards_are_clear(tmp_path):
    base = make_base_folder(tmp_path / "base")
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(BaseHashError, match="weight_map"):
        compute_base_hash(base)
    adapter = make_peft_folder(tmp_path / "a")
    with pytest.raises(E.ArtifactError) as err:
        pack_folder(adapter, name="demo", version="v1", base_dir=base)
    assert err.value.reason == E.BAD_MANIFEST and "weight_map" in err.value.message
    (base / "model.safetensors.index.json").write_text("[" * 4000)
    with pytest.raises(BaseHashError, match="unreadable"):
        compute_base_hash(base)
    (base / "model.safetensors.index.json").unlink()
    raw = (base / "model.safetensors").read_bytes()
    (base / "model.safetensors").write_bytes(
        raw[:8] + raw[8:].replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
    )
    with pytest.raises(BaseHashError, match="model.safetensors"):
        compute_base_hash(base)
