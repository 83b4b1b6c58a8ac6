"""One admitted request's way through the engine: its outputs, timed and counted, and its key's ticket.

``Run.outputs`` wraps the engine's stream: TTFT (labelled by the adapter's tier at arrival), inter-token
latency, tokens, aborts by cause; a request that failed alone in the engine (``RequestOutput.error``)
raises RequestFailed here so the route answers for that request only. Whatever ends the stream, the
key's concurrency slot is given back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.engine.api import OverloadedError
from loraplane.engine.core.errors import EngineDeadError
from loraplane.http.limits import Ticket
from loraplane.http.metrics import Metrics
from loraplane.http.models import Target
from loraplane.http.usage import RequestMeter

if TYPE_CHECKING:  # the HTTP side imports only the engine's public modules at run time
    from loraplane.engine.core.llm_engine import RequestOutput

log = logging.getLogger("loraplane.http")


class RequestFailed(RuntimeError):
    """The engine failed this one request (the engine itself goes on)."""


@dataclass(slots=True)
class Run:
    request_id: str
    target: Target
    tier: str  # where the adapter was when the request arrived: gpu | host | disk | remote
    ticket: Ticket
    metrics: Metrics
    meter: RequestMeter | None = None  # the request's token meter (shared by its choices)
    index: int = 0  # which choice of the request this run is
    arrived: float = field(default_factory=time.perf_counter)

    async def outputs(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        m = self.metrics
        m.waiting.inc()
        waiting, last, cause = True, None, None
        label = m.adapter_label(self.target.adapter)
        metered = self.meter is not None and self.meter.hold()
        try:
            async for out in stream:
                error = getattr(out, "error", None)
                if error is not None or out.finish_reason == "error":
                    cause = "error"
                    raise RequestFailed(str(error or "the engine failed this request"))
                now, n = time.perf_counter(), len(out.new_token_ids)
                if n and waiting:
                    waiting = False
                    m.waiting.dec()
                    m.running.inc()
                    m.ttft.labels(self.tier).observe(now - self.arrived)
                elif n and last is not None:
                    m.itl.observe((now - last) / n)
                if n:
                    last = now
                    m.output_tokens.labels(label).inc(n)
                    self.ticket.add_tokens(n)
                if out.finished and out.finish_reason == "abort":
                    cause = "client"
                if self.meter is not None:
                    self.meter.add(self.index, out)
                yield out
        except OverloadedError:
            cause = "overload"
            raise
        except EngineDeadError:
            cause = "engine"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            cause = cause or "client"
            raise
        except ValueError:  # refused on the engine thread: the request's own values (the route says 400)
            cause = "error"
            raise
        except RequestFailed:
            raise
        except Exception as exc:  # anything else raised for this stream failed this request alone
            cause = "error"
            raise RequestFailed(str(exc)) from exc
        finally:
            (m.waiting if waiting else m.running).dec()
            self.ticket.release()
            if cause is not None:
                m.aborted.labels(cause).inc()
                log.info("request ended early", extra={"fields": {"cause": cause, "id": self.request_id}})
            if metered:
                self.meter.let_go("ok" if cause is None else "aborted" if cause == "client" else "error")
