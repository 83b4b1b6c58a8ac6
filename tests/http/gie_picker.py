"""The endpoint picker's reading of a model server's /metrics, re-implemented from its source.

Gateway API Inference Extension v1.5.0 (the module sigs.k8s.io/gateway-api-inference-extension):
- parsing: pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go, ``parseMetrics``:
  ``expfmt.NewTextParser(model.LegacyValidation).TextToMetricFamilies`` (classic text format; metric names
  ``[a-zA-Z_:][a-zA-Z0-9_:]*``, label names ``[a-zA-Z_][a-zA-Z0-9_]*``; one TYPE per family, before its samples);
- defaults: pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go (``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``,
  ``vllm:cache_config_info``);
- extraction: extractor/metrics/extractor.go ``Extract`` and ``populateLoRAMetrics``/``addAdapters``
  (split on ",", TrimSpace, skip empty; ``max_lora`` through strconv.Atoi);
- series choice: extractor/metrics/spec.go ``getLatestMetric`` (largest timestamp, first wins on ties) and
  loraspec.go (the LoRA family: the series with the largest *value*, the time it was written);
- scoring: pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go (see ``lora_affinity``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
SAMPLE = re.compile(r"(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+(?P<ts>-?\d+))?$")
LABEL = re.compile(r'\s*(?P<name>[^=\s]+)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

DEFAULTS = {
    "queued": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv": "vllm:kv_cache_usage_perc",
    "lora": "vllm:lora_requests_info",
    "cache": "vllm:cache_config_info",
}


class ParseError(ValueError):
    """What expfmt's TextParser would refuse."""


@dataclass
class Series:
    labels: dict[str, str]
    value: float
    timestamp_ms: int = 0


@dataclass
class Family:
    name: str
    type: str = "untyped"
    series: list[Series] = field(default_factory=list)


@dataclass
class PodMetrics:
    """fwkdl.Metrics: the fields the extractor fills."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage_percent: float = 0.0
    active_models: dict[str, int] = field(default_factory=dict)
    waiting_models: dict[str, int] = field(default_factory=dict)
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_gpu_blocks: int = 0
    errors: list[str] = field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    families: dict[str, Family] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "TYPE":
                name, kind = parts[2], parts[3].strip()
                _check_name(name)
                if name in typed:
                    raise ParseError(f"second TYPE line for metric name {name!r}")
                if name in families and families[name].series:
                    raise ParseError(f"TYPE reported after samples for {name!r}")
                typed.add(name)
                families.setdefault(name, Family(name)).type = kind
            continue
        match = SAMPLE.match(line)
        if match is None:
            raise ParseError(f"bad sample line {line!r}")
        name = match["name"]
        _check_name(name)
        family = families.get(_family_of(name, families)) or families.setdefault(name, Family(name))
        labels = _labels(match["labels"] or "")
        if family.type == "histogram" and name != family.name:
            continue  # buckets, sum and count: the extractor reads gauges and counters only
        family.series.append(Series(labels, float(match["value"]), int(match["ts"] or 0)))
    return families


def _check_name(name: str) -> None:
    if not METRIC_NAME.fullmatch(name):
        raise ParseError(f"invalid metric name {name!r} (legacy validation)")


def _family_of(sample: str, families: dict[str, Family]) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample.removesuffix(suffix)
        if base != sample and families.get(base) is not None and families[base].type != "untyped":
            return base
    return sample


def _labels(text: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(text):
        match = LABEL.match(text, pos)
        if match is None:
            raise ParseError(f"bad label block {text!r}")
        name = match["name"]
        if not LABEL_NAME.fullmatch(name):
            raise ParseError(f"invalid label name {name!r}")
        if name in out:
            raise ParseError(f"duplicate label {name!r}")
        out[name] = match["value"].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        pos = match.end()
    return out


def _latest(family: Family | None, name: str) -> Series:
    """spec.go getLatestMetric: the largest timestamp; an exposition without timestamps gives the first."""
    if family is None:
        raise LookupError(f"metric family {name!r} not found")
    if not family.series:
        raise LookupError(f"no metrics found for {name!r}")
    latest, recent = None, -1
    for series in family.series:
        if series.timestamp_ms > recent:
            latest, recent = series, series.timestamp_ms
    return latest


def _latest_lora(family: Family | None, name: str) -> Series:
    """loraspec.go getLatestMetric: the series whose value (its write time) is the largest."""
    if family is None:
        raise LookupError(f"metric family {name!r} not found")
    if not family.series:
        raise LookupError(f"no metrics found for {name!r}")
    latest, recent = None, -1.0
    for series in family.series:
        if series.value > recent:
            latest, recent = series, series.value
    return latest


def _add_adapters(into: dict[str, int], csv: str) -> None:
    for name in csv.split(","):
        if name.strip():
            into[name.strip()] = 0


def _atoi(value: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", value):
        raise ValueError(f'strconv.Atoi: parsing "{value}": invalid syntax')
    return int(value)


def extract(text: str, names: dict[str, str] = DEFAULTS) -> PodMetrics:
    """extractor.go Extract with the default mapping: what the picker knows of one pod after a scrape."""
    families, out = parse(text), PodMetrics()
    for key, attr, cast in (("queued", "waiting_queue_size", int), ("running", "running_requests_size", int),
                            ("kv", "kv_cache_usage_percent", float)):  # fmt: skip
        try:
            setattr(out, attr, cast(_latest(families.get(names[key]), names[key]).value))
        except LookupError as error:
            out.errors.append(str(error))
    try:
        lora = _latest_lora(families.get(names["lora"]), names["lora"])
        out.active_models, out.waiting_models = {}, {}
        for label, value in lora.labels.items():
            if label == "running_lora_adapters":
                _add_adapters(out.active_models, value)
            elif label == "waiting_lora_adapters":
                _add_adapters(out.waiting_models, value)
            elif label == "max_lora" and value != "":
                try:
                    out.max_active_models = _atoi(value)
                except ValueError as error:  # appended to the errors; the adapters still count
                    out.errors.append(str(error))
    except LookupError as error:
        out.errors.append(str(error))
    try:
        cache = _latest(families.get(names["cache"]), names["cache"])
        out.cache_block_size = _atoi(cache.labels.get("block_size", "0"))
        out.cache_num_gpu_blocks = _atoi(cache.labels.get("num_gpu_blocks", "0"))
    except LookupError as error:
        out.errors.append(str(error))
    return out


def lora_affinity(pod: PodMetrics, target_model: str) -> float:
    """lora_affinity.go Score for one endpoint."""
    if target_model in pod.active_models:
        return 1.0  # the adapter is active there already
    if len(pod.active_models) + len(pod.waiting_models) < pod.max_active_models:
        return 0.8  # room to load one more
    if target_model in pod.waiting_models:
        return 0.6  # queued there
    return 0.0
