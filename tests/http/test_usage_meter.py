"""The token meter's parts alone: the series cap under 10,000 label sets, and the usage log (lines, rotation,
restarts, a torn last line, reading across files, ``since``)."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.http.metrics import Metrics
from loraplane.http.usage import OTHER, SeriesCap, UsageMeter
from loraplane.http.usage_log import UsageLog, UsageRecord, parse_since, query


def token_samples(registry) -> list:
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return [
        s for f in families if f.name == "loraplane_tokens" for s in f.samples if s.name.endswith("_total")
    ]


def folded_total(registry) -> float:
    return registry.get_sample_value("loraplane_usage_folded_series_total")


def record(tenant, adapter, version, prompt, completion, status="ok", when=1000.0) -> UsageRecord:
    return UsageRecord(when, tenant, adapter, version, prompt, completion, status, f"cmpl-{tenant}-{adapter}")


def test_ten_thousand_label_sets_stay_within_the_cap_and_no_token_is_lost():
    metrics = Metrics(max_adapter_labels=20)
    meter = UsageMeter(metrics.registry, metrics.adapter_label, top_n=50)
    rng = random.Random(7)
    pairs = [(f"tenant-{i % 400}", f"adapter-{i // 400}", "v1") for i in range(10_000)]  # 10,000 distinct
    rng.shuffle(pairs)
    sent = {"prompt": 0, "completion": 0}
    seen_before: dict[tuple, float] = {}
    for step, (tenant, adapter, version) in enumerate(pairs + pairs[:500]):  # 500 come back: no new fold
        prompt, completion = rng.randint(1, 50), rng.randint(0, 20)
        meter.record(record(tenant, adapter, version, prompt, completion))
        sent["prompt"] += prompt
        sent["completion"] += completion
        if step % 997 == 0:  # counters only ever grow, series never move
            now = {tuple(sorted(s.labels.items())): s.value for s in token_samples(metrics.registry)}
            assert all(now[k] >= v for k, v in seen_before.items())
            seen_before = now
    samples = token_samples(metrics.registry)
    own = {(s.labels["tenant"], s.labels["adapter"]) for s in samples if s.labels["tenant"] != OTHER}
    folded = {s.labels["adapter"] for s in samples if s.labels["tenant"] == OTHER}
    assert len(own) == 50
    assert len(folded) <= 21 and OTHER in folded  # 20 adapter labels, then "other"
    assert len(samples) <= 2 * (50 + 21)
    assert folded_total(metrics.registry) == 10_000 - 50
    for kind in ("prompt", "completion"):
        assert sum(s.value for s in samples if s.labels["type"] == kind) == sent[kind]
    assert all(s.labels["version"] in ("v1", OTHER) for s in samples)


def test_the_cap_admits_first_come_and_refuses_bad_limits():
    cap = SeriesCap(2)
    assert cap.admit(("a", "x", "1")) == (True, False)
    assert cap.admit(("b", "x", "1")) == (True, False)
    assert cap.admit(("c", "x", "1")) == (False, True)
    assert cap.admit(("c", "x", "1")) == (False, False)  # folded once
    assert cap.admit(("a", "x", "1")) == (True, False)
    with pytest.raises(ValueError, match="usage_top_n"):
        SeriesCap(-1)


def test_the_base_model_has_its_own_labels():
    metrics = Metrics()
    meter = UsageMeter(metrics.registry, metrics.adapter_label, top_n=1)
    meter.record(record("anonymous", None, None, 5, 3))
    meter.record(record("team", None, None, 2, 1))  # folded: tenant other, adapter still base
    labels = {
        (s.labels["tenant"], s.labels["adapter"], s.labels["version"])
        for s in token_samples(metrics.registry)
    }
    assert labels == {("anonymous", "base", ""), (OTHER, "base", OTHER)}


def test_a_start_ranks_label_sets_by_their_use_in_the_log(tmp_path):
    log = UsageLog(tmp_path, fsync_interval_s=0)
    now = 10_000_000.0
    for tenant, tokens in [("light", 1), ("heavy", 900), ("middle", 50), ("old", 10**6)]:
        when = now - 2 * 86_400 if tenant == "old" else now - 60  # "old" is outside the day ranked
        log.append(record(tenant, "chat", "v1", tokens, 0, when=when))
    log.close()
    metrics = Metrics()
    meter = UsageMeter(
        metrics.registry, metrics.adapter_label, top_n=2, usage_log=UsageLog(tmp_path), clock=lambda: now
    )
    assert meter.labels("light", "chat", "v1")[0] == OTHER
    assert meter.labels("heavy", "chat", "v1")[0] == "heavy"
    assert meter.labels("middle", "chat", "v1")[0] == "middle"


def test_the_log_rotates_by_size_and_runs_on_across_restarts(tmp_path):
    log = UsageLog(tmp_path, max_bytes=4096, fsync_interval_s=0.01)
    written = [record(f"t{i}", "chat", "v1", i, i % 7, when=1000.0 + i) for i in range(200)]
    for r in written[:120]:
        log.append(r)
    log.close()
    again = UsageLog(tmp_path, max_bytes=4096, keep=0)
    for r in written[120:]:
        again.append(r)
    files = sorted(tmp_path.iterdir())
    assert len(files) > 3 and all(f.stat().st_size <= 4096 for f in files)
    assert list(again.read(0)) == written
    assert list(again.read(1150.0)) == written[150:]
    again.close()


def test_keep_deletes_the_oldest_rotated_files(tmp_path):
    log = UsageLog(tmp_path, max_bytes=4096, keep=2, fsync_interval_s=0)
    for i in range(300):
        log.append(record("t", "chat", "v1", i, 0, when=float(i)))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[-1].endswith(f"{log._seq:020d}.jsonl")
    kept = [r.prompt_tokens for r in UsageLog(tmp_path, fsync_interval_s=0).read(0)]
    assert kept == list(range(300 - len(kept), 300))


def test_a_torn_last_line_is_skipped_and_the_next_line_starts_fresh(tmp_path):
    log = UsageLog(tmp_path, fsync_interval_s=0)
    log.append(record("a", "chat", "v1", 1, 1))
    log.close()
    (path,) = tmp_path.iterdir()
    with path.open("ab") as f:
        f.write(b'{"time":1000.0,"tenant":"b","ada')  # a kill in the middle of a write
    log = UsageLog(tmp_path, fsync_interval_s=0)
    log.append(record("c", "chat", "v1", 3, 3))
    assert [r.tenant for r in log.read(0)] == ["a", "c"]
    lines = path.read_bytes().split(b"\n")
    assert json.loads(lines[0])["tenant"] == "a" and json.loads(lines[2])["tenant"] == "c"
    log.close()


def test_query_filters_and_totals(tmp_path):
    log = UsageLog(tmp_path, fsync_interval_s=0)
    for i in range(30):
        log.append(
            record(f"t{i % 3}", "chat" if i % 2 else None, "v1" if i % 2 else None, 10, i, when=100.0 + i)
        )
    answer = query(log, 110.0, tenant="t1", limit=3)
    assert answer["matched"] == 7 and answer["truncated"] and len(answer["records"]) == 3
    assert all(r["tenant"] == "t1" and r["time"] >= 110.0 for r in answer["records"])
    assert sum(t["requests"] for t in answer["totals"]) == 7
    assert sum(t["completion_tokens"] for t in answer["totals"]) == sum(
        i for i in range(10, 30) if i % 3 == 1
    )
    only_chat = query(log, 0, adapter="chat")
    assert only_chat["matched"] == 15 and {t["adapter"] for t in only_chat["totals"]} == {"chat"}
    log.close()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0", 0.0),
        ("1764650000.5", 1764650000.5),
        ("2026-01-31T12:00:00Z", 1769860800.0),
        ("2026-01-31T13:00:00+01:00", 1769860800.0),
    ],  # fmt: skip
)
def test_since_takes_unix_seconds_or_rfc3339(text, seconds):
    assert parse_since(text) == seconds


@pytest.mark.parametrize("text", ["yesterday", "-5", "2026-01-31T12:00:00", "nan", ""])
def test_a_bad_since_names_the_field(text):
    with pytest.raises(ValueError, match="^since: "):
        parse_since(text)


def test_bad_log_settings_name_their_field(tmp_path):
    with pytest.raises(ValueError, match="usage_log_max_bytes"):
        UsageLog(tmp_path, max_bytes=10)
    with pytest.raises(ValueError, match="usage_log_keep"):
        UsageLog(tmp_path, keep=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="usage_log_dir"):
        UsageLog(tmp_path / "file")


class _Out:
    def __init__(self, n: int) -> None:
        self.num_output_tokens = n


def test_a_request_is_recorded_once_when_its_last_holder_lets_go(tmp_path):
    metrics = Metrics()
    meter = UsageMeter(
        metrics.registry, metrics.adapter_label, usage_log=UsageLog(tmp_path, fsync_interval_s=0)
    )

    def written() -> list[UsageRecord]:
        return list(meter.log.read(0))

    request = meter.start("cmpl-1", "team", "chat", "v1", 12)
    assert request.hold() and request.hold()  # two choices stream
    request.add(0, _Out(3))
    request.add(1, _Out(2))
    request.add(1, _Out(4))  # the count so far, not a delta
    request.end_route("aborted")  # the client left; the runs still wind down
    request.let_go("ok")
    assert written() == []
    request.let_go("aborted")
    request.end_route("ok")  # a second word from the route changes nothing
    assert [(r.prompt_tokens, r.completion_tokens, r.status) for r in written()] == [(12, 7, "aborted")]
    assert not request.hold()  # a choice that starts after the record is not counted again
    request.let_go("ok")
    assert len(written()) == 1
    meter.log.close()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"usage_top_n": -1}, "usage_top_n"),
        ({"usage_log_max_bytes": 100}, "usage_log_max_bytes"),
        ({"usage_log_keep": -2}, "usage_log_keep"),
        ({"usage_fsync_ms": -1}, "usage_fsync_ms"),
        ({"usage_log_dir": __file__}, "usage_log_dir"),
    ],  # fmt: skip
)
def test_bad_usage_options_name_their_field(overrides, field, tiny_chat_model_dir):
    from loraplane.serve.options import ServeOptions

    with pytest.raises(ValueError, match=f"^{field}:"):
        ServeOptions(model=str(tiny_chat_model_dir), **overrides)
