"""Scenarios that need the server Pods to load and serve adapters: from `kubectl apply -f adapter.yaml` to an
answer from that adapter, version bumps under load, Pod and operator restarts, deletion, tenant keys.

They run when the server's admin API loads adapters; a server whose `PUT /admin/adapters/{name}` answers 501
(Not Implemented) skips them, with that answer as the reason.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import yaml

from e2e.stack import ADMIN_TOKEN, POD_START, admin_get, condition, ensure_base, wait_for

MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def serving(stack):
    """The stack, once its server Pods are known to load adapters."""
    pod = ensure_base(stack)[0]
    request = urllib.request.Request(f"http://{pod['status']['podIP']}:8001/admin/adapters/probe", method="PUT",
                                     data=b"{}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                                          "Content-Type": "application/json"})  # fmt: skip
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 501:
            pytest.skip(
                f"the server does not load adapters yet: PUT /admin/adapters answers 501 {exc.read()[:200]!r}"
            )
    return stack


def peft_answer(stack, label: str) -> str:
    """The PEFT reference: transformers + peft, greedy, on the same chat-templated prompt."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, stack.folders[label]).eval()
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def ask(pod: dict, model: str, key: str | None = None) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key=key or "none", timeout=60,
                    max_retries=0)  # fmt: skip
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    return answer.choices[0].message.content


def wait_adapter_ready(stack, name: str, version: str, timeout: float = 120) -> dict:
    def ready():
        a = stack.get("LoRAAdapter", name)
        ok = condition(a, "Ready").get("status") == "True" and a["status"].get("servingVersion") == version
        return ok and a["metadata"]["generation"] == a["status"].get("observedGeneration") and a

    return wait_for(ready, timeout, f"{name} {version} Ready\n{stack.logs()}")


def test_scenario_2_pushed_adapters_answer_like_peft_on_both_pods(serving):
    stack = serving
    for label, name, seed in (("a-v1", "alpha", 11), ("b-v1", "beta", 12)):
        stack.add_adapter(label, name, "v1", seed=seed)
    stack.apply(stack.adapter_manifest("alpha", "a-v1", "v1"), stack.adapter_manifest("beta", "b-v1", "v1"))
    for name, label in (("alpha", "a-v1"), ("beta", "b-v1")):
        adapter = wait_adapter_ready(stack, name, "v1")
        assert adapter["status"]["readyPods"] == 2
        expected = peft_answer(stack, label)
        for pod in stack.ready_pods():
            assert ask(pod, name) == expected, f"{name} on {pod['metadata']['name']}"


def test_scenario_3_version_bump_under_streaming_load(serving):
    stack = serving
    stack.add_adapter("a-v2", "alpha", "v2", seed=21)
    expected_v2 = peft_answer(stack, "a-v2")
    failures, answers, stop = [], [], threading.Event()

    def load(pod):
        from openai import OpenAI

        client = OpenAI(base_url=f"http://{pod['status']['podIP']}:8000/v1", api_key="none", timeout=60,
                        max_retries=0)  # fmt: skip
        for _ in range(400):
            if stop.is_set():
                return
            try:
                stream = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True)  # fmt: skip
                answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
            except Exception as exc:  # noqa: BLE001 - every failure counts
                failures.append(repr(exc))

    threads = [threading.Thread(target=load, args=(pod,), daemon=True) for pod in stack.ready_pods()]
    for thread in threads:
        thread.start()
    try:
        stack.apply(stack.adapter_manifest("alpha", "a-v2", "v2"))
        wait_adapter_ready(stack, "alpha", "v2", timeout=180)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
    assert not failures, failures[:5]
    assert answers and all(ask(pod, "alpha") == expected_v2 for pod in stack.ready_pods())


def test_scenario_5_a_killed_pods_replacement_gets_the_adapters_back(serving):
    stack = serving
    victim = stack.ready_pods()[0]["metadata"]["name"]
    stack.kubelet.kill(victim)
    wait_for(lambda: stack.get("LoRAAdapter", "beta")["status"].get("readyPods") == 1, 60, "the dip to 1 Pod")
    wait_for(lambda: len(stack.ready_pods()) == 2 and victim not in {p["metadata"]["name"] for p in
             stack.ready_pods()}, POD_START, "the replacement Pod Ready")  # fmt: skip
    wait_adapter_ready(stack, "beta", "v1")
    expected = peft_answer(stack, "b-v1")
    assert all(ask(pod, "beta") == expected for pod in stack.ready_pods())


def test_scenario_6_operator_restart_mid_rollout_converges_without_duplicate_loads(serving):
    stack = serving
    stack.add_adapter("b-v2", "beta", "v2", seed=22)
    puts = stack.admin_calls("PUT", "beta")
    stack.apply(stack.adapter_manifest("beta", "b-v2", "v2"))
    operator = next(p["metadata"]["name"] for p in stack.plane.list("v1", "Pod", stack.namespace)
                    if p["metadata"]["name"].startswith("lp-loraplane"))  # fmt: skip
    stack.kubelet.kill(operator)
    wait_adapter_ready(stack, "beta", "v2", timeout=240)
    assert stack.admin_calls("PUT", "beta") - puts == 2, "one load of v2 per Pod, restart or not"


def test_scenario_7_deleting_an_adapter_unloads_it_everywhere(serving):
    stack = serving
    stack.plane.kubectl(
        "delete", "loraadapter", "alpha", "-n", stack.namespace, "--wait=true", "--timeout=120s"
    )
    for pod in stack.ready_pods():
        request = urllib.request.Request(f"http://{pod['status']['podIP']}:8001/admin/adapters",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip
        listed = json.load(urllib.request.urlopen(request, timeout=10))
        assert "alpha" not in {a.get("name") for a in listed["adapters"]}
        with pytest.raises(Exception, match="404"):
            ask(pod, "alpha")


def test_scenario_8_a_tenant_key_cannot_call_another_tenants_adapter(serving):
    stack = serving
    keys = {"keys": [{"key": "tenant-a-key-0123456789", "adapters": ["beta"]},
                     {"key": "tenant-b-key-0123456789", "adapters": ["gamma"]}]}  # fmt: skip
    stack.secret("api-keys", {"api-keys.yaml": yaml.safe_dump(keys)})
    manifest = stack.base_manifest()
    manifest["spec"]["auth"] = {"apiKeysSecretRef": {"name": "api-keys"}}
    stack.apply(manifest)
    wait_for(lambda: len(stack.ready_pods()) == 2 and all("--api-keys-file" in " ".join(
        p["spec"]["containers"][0]["args"]) for p in stack.ready_pods()), POD_START, "Pods with API keys")  # fmt: skip
    wait_adapter_ready(stack, "beta", "v2", timeout=180)
    pod = stack.ready_pods()[0]
    assert ask(pod, "beta", key="tenant-a-key-0123456789")
    with pytest.raises(Exception, match="403|404"):
        ask(pod, "beta", key="tenant-b-key-0123456789")
    # Metered per tenant (the key's default name) and adapter version, in the Pod's usage log and counters.
    usage = json.loads(admin_get(pod, "/admin/usage?since=0&tenant=key-0&adapter=beta"))
    assert [(t["version"], t["requests"]) for t in usage["totals"]] == [("v2", 1)], usage
    (record,) = usage["records"]
    assert (
        record["status"] == "ok"
        and 1 <= record["completion_tokens"] <= MAX_TOKENS
        and record["prompt_tokens"]
    )
    exposition = admin_get(pod, "/metrics").decode()
    assert (
        'loraplane_tokens_total{adapter="beta",tenant="key-0",type="completion",version="v2"}' in exposition
    )
    assert "tenant-b" not in exposition and "key-1" not in exposition  # refused: never metered
