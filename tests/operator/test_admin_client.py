"""The admin API client against the recording fake pod: the contract and its failures."""

from __future__ import annotations

import asyncio

import pytest

from loraplane.operator.admin_client import AdminClient, AdminError, LoadRequest, PodAddress
from tests.operator.fake_admin import FakePod
from tests.s3_servers import free_port

REQUEST = LoadRequest("s3://b/chat/v1/", "v1", "sha256:" + "1" * 64, pin=False, warm="host")


@pytest.fixture
def fake():
    pod = FakePod("127.0.0.1", free_port(), "tok", "ab" * 32)
    yield pod
    pod.stop()


async def test_load_switch_list_unload(fake):
    client = AdminClient(connect_timeout=0.5, read_timeout=1.0)
    at = PodAddress("p", fake.ip, fake.port)
    try:
        assert (await client.ready(at, "tok"))["base_hash"] == "ab" * 32
        loaded = await client.load(at, "tok", "chat", REQUEST)
        assert (loaded.state, loaded.serving) == ("warm", True)  # the first version serves at once
        v2 = LoadRequest("s3://b/chat/v2/", "v2", "sha256:" + "2" * 64, pin=True, warm="gpu")
        assert not (await client.load(at, "tok", "chat", v2)).serving  # beside the old one
        await client.switch(at, "tok", "chat", "v2")
        assert {(v.version, v.serving) for v in await client.list(at, "tok", "chat")} == {
            ("v1", False),
            ("v2", True),
        }
        await client.unload(at, "tok", "chat", "v1")
        await client.unload(at, "tok", "chat", "v1")  # absent is success
        assert fake.versions("chat") == {"v2"}
        assert fake.requests[1][2] == REQUEST.body()
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "failure, reason",
    [
        ("500", "PodFailed"),
        ("wrong_base", "BaseMismatch"),
        ("warm_fail:v1", "WarmFailed"),
        ("hang", "PodUnreachable"),
    ],
)
async def test_failures_carry_a_reason(fake, failure, reason):
    client = AdminClient(connect_timeout=0.5, read_timeout=0.5)
    fake.fail = failure
    try:
        with pytest.raises(AdminError) as info:
            await client.load(PodAddress("p", fake.ip, fake.port), "tok", "chat", REQUEST)
        assert info.value.reason == reason and info.value.pod == "p"
    finally:
        await client.aclose()


async def test_refused_and_bad_token(fake):
    client = AdminClient(connect_timeout=0.5, read_timeout=0.5)
    at = PodAddress("p", fake.ip, fake.port)
    try:
        with pytest.raises(AdminError) as info:
            await client.list(at, "wrong")
        assert "401" in info.value.message
        fake.stop()
        with pytest.raises(AdminError) as info:
            await client.list(at, "tok")
        assert info.value.reason == "PodUnreachable"
    finally:
        await client.aclose()


async def test_a_burst_of_calls_to_one_pod_shares_a_few_connections():
    """20 calls at once to one pod go over at most ``per_pod`` connections (a new pod's burst of loads)."""
    open_now, most = 0, 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                await asyncio.sleep(0.02)  # long enough for the burst to pile up
                body = b'{"status": "ready", "base_hash": ""}'
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nContent-Type: application/json\r\n\r\n"
                writer.write(head.encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            open_now -= 1
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AdminClient(connect_timeout=1.0, read_timeout=5.0, per_pod=3)
    try:
        at = PodAddress("p", "127.0.0.1", port)
        answers = await asyncio.gather(*(client.ready(at, "tok") for _ in range(20)))
        assert [a["status"] for a in answers] == ["ready"] * 20
        assert most == 3
    finally:
        await client.aclose()
        server.close()
