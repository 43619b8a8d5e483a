"""Connect a :class:`~dcp_s3._objstore.throttle.RateController` to a botocore S3 client.

With ``ClientConfig(rate_control=True)`` (the default) botocore itself retries nothing (its
attempt limit is 1) and three event handlers take over:

- ``before-parameter-build``: tag the call with its :class:`RateKey` (bucket, key prefix, class);
- ``request-created`` (first, before signing, so that a signature is never older than the wait): every
  attempt waits for a token of its key, at most ``throttle_deadline`` seconds (and, once the call was
  refused, no later than ``throttle_deadline`` after its first refusal); past it the call fails with an
  ``S3ThrottledError`` naming the operation, the object, the key's rate and the deadline;
- ``needs-retry``: the attempt's token is returned with its outcome. A throttled answer (SlowDown,
  503, 429) is retried — paced by the tokens, after the server's ``x-amz-retry-after``/``Retry-After``
  if it sends one, never sleeping past the deadline — until ``throttle_deadline`` seconds have passed
  since the call's first refusal, outside botocore's retry quota; every other failure goes to a
  botocore ``standard`` retry handler with the usual ``retry_attempts`` and quota;
- ``after-call-error``: a token still held when the call fails without reaching ``needs-retry`` (a
  credential or signing failure after the token was taken, an exception in any later handler) is
  returned there. Every token taken is returned on every path: a leaked one would hold one of the
  key's ``max(2, rate)`` in-flight slots for the life of the process, and a few of them hang every
  later save at a small share.

A call that gives up at an answer carries ``DcpS3Throttle`` in its error response, which
:func:`~dcp_s3._objstore.s3_requests.translate_error` turns into an ``S3ThrottledError`` naming
the bucket, prefix, class, rate reached and refusals.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from botocore.retries import quota
from botocore.retries.standard import (
    ExponentialBackoff,
    RetryEventAdapter,
    RetryHandler,
    RetryPolicy,
    RetryQuotaChecker,
    StandardRetryConditions,
)

from dcp_s3._objstore.rate_limits import RateKey, is_throttle, rate_key
from dcp_s3._objstore.s3_requests import untrusted_certificate
from dcp_s3._objstore.throttle import JobProgress, RateController
from dcp_s3.errors import S3ThrottledError

__all__ = ["install_rate_control", "controller_for", "plan_share", "plan_progress", "end_progress", "request_stats"]

log = logging.getLogger(__name__)

_KEY = "dcp_s3.rate_key"
_OBJECT = "dcp_s3.object"  # s3://bucket/key of the call, for errors
_HELD = "dcp_s3.token_held"  # the call's current attempt holds a token of its key
_FIRST_REFUSAL = "dcp_s3.first_refusal"
_REFUSALS = "dcp_s3.refusals"

_CONTROLLERS: dict[tuple[str, float, float], RateController] = {}
_LOCK = threading.Lock()


def controller_for(endpoint: str, write_rate: float, read_rate: float) -> RateController:
    """The process's controller for ``endpoint`` and budget (shared by every client and thread)."""
    with _LOCK:
        key = (endpoint, float(write_rate), float(read_rate))
        if key not in _CONTROLLERS:
            _CONTROLLERS[key] = RateController(write_rate=write_rate, read_rate=read_rate)
        return _CONTROLLERS[key]


def plan_share(endpoint: str, ranks: int, prefixes: int) -> None:
    """Start this process's keys to ``endpoint`` at ``prefixes / ranks`` of the budget (see
    :meth:`RateController.set_share`)."""
    for controller in _controllers(endpoint):
        controller.set_share(ranks, prefixes)


def plan_progress(endpoint: str, progress: JobProgress) -> None:
    """Scale this process's rates to ``endpoint`` by the job's ranks still sending in ``progress`` (see
    :meth:`RateController.follow`) until :func:`end_progress`."""
    for controller in _controllers(endpoint):
        controller.follow(progress)


def end_progress(endpoint: str, progress: JobProgress) -> None:
    """The save or load that ``progress`` counts is over: back to the whole job's rates."""
    for controller in _controllers(endpoint):
        controller.unfollow(progress)


def _controllers(endpoint: str) -> list[RateController]:
    with _LOCK:
        return [c for (e, _, _), c in _CONTROLLERS.items() if e == endpoint]


def request_stats() -> dict[str, dict[str, float]]:
    """Per paced key (``"s3://bucket/prefix (write)"``) of this process: attempts, refusals,
    seconds waited for tokens, current and peak rate."""
    with _LOCK:
        controllers = list(_CONTROLLERS.values())
    out: dict[str, dict[str, float]] = {}
    for controller in controllers:
        for key, stats in controller.stats().items():
            out[str(key)] = dict(vars(stats))
    return out


def install_rate_control(
    client: Any, *, retry_attempts: int, deadline: float, write_rate: float, read_rate: float
) -> None:
    """Register the handlers above on ``client`` (made with botocore retries limited to 1 attempt)."""
    controller = controller_for(str(client.meta.endpoint_url), write_rate, read_rate)
    retry_quota = RetryQuotaChecker(quota.RetryQuota())
    others = RetryHandler(
        retry_policy=RetryPolicy(
            retry_checker=StandardRetryConditions(max_attempts=retry_attempts), retry_backoff=ExponentialBackoff()
        ),
        retry_event_adapter=RetryEventAdapter(),
        retry_quota=retry_quota,
    )
    hooks = _Hooks(controller, others, deadline)
    events = client.meta.events
    events.register("before-parameter-build.s3", hooks.tag)
    events.register_first("request-created.s3", hooks.pace)
    events.register("needs-retry.s3", hooks.decide)
    events.register_first("after-call-error.s3", hooks.drop)
    events.register("after-call.s3", retry_quota.release_retry_quota)


class _Hooks:
    def __init__(self, controller: RateController, others: RetryHandler, deadline: float) -> None:
        self.controller = controller
        self.others = others
        self.deadline = deadline

    def tag(self, params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        bucket = params.get("Bucket")
        if isinstance(bucket, str):
            key = params.get("Key", params.get("Prefix"))
            context[_KEY] = rate_key(model.name, bucket, key if isinstance(key, str) else None)
            context[_OBJECT] = f"s3://{bucket}/{key}" if isinstance(key, str) else f"s3://{bucket}"

    def pace(self, request: Any, operation_name: str = "", **_: Any) -> None:
        context = getattr(request, "context", {})
        key: RateKey | None = context.get(_KEY)
        if key is None:
            return
        if context.pop(_HELD, False):  # an attempt that never reached needs-retry (defensive): give its token back
            self.controller.release(key, refused=False)
        first = context.get(_FIRST_REFUSAL)
        timeout = self.deadline if first is None else max(0.0, first + self.deadline - time.monotonic())
        try:
            self.controller.acquire(key, timeout=timeout)
        except S3ThrottledError:  # no token in time: nothing taken
            refusals = context.get(_REFUSALS, 0)
            since = f", {refusals} refusals since the first {time.monotonic() - first:.1f} s ago" if first else ""
            log.warning(
                "%s %s: no request token of %s in time%s; giving up (throttle_deadline=%s s)",
                operation_name,
                context.get(_OBJECT),
                key,
                since,
                self.deadline,
            )
            raise S3ThrottledError(
                f"{operation_name} {context.get(_OBJECT)} failed: waited {timeout:.1f} s for a request token of {key} "
                f"(paced at {self.controller.rate(key):.3g} requests/s{since}): past ClientConfig "
                f"throttle_deadline={self.deadline} s; raise it, spread keys (key_prefixes=), or ask the provider for "
                "more request capacity on this prefix"
            ) from None
        context[_HELD] = True

    def drop(self, context: dict[str, Any], **_: Any) -> None:
        """The call failed without its last attempt reaching ``needs-retry``: give back the token it holds."""
        key: RateKey | None = context.get(_KEY)
        if key is not None and context.pop(_HELD, False):
            self.controller.release(key, refused=False)

    def decide(
        self,
        response: Any,
        attempts: int,
        caught_exception: BaseException | None,
        request_dict: dict[str, Any],
        **kwargs: Any,
    ) -> float | None:
        context = request_dict["context"]
        key: RateKey | None = context.get(_KEY)
        status = response[0].status_code if response is not None else None
        parsed = response[1] if response is not None else {}
        code = parsed.get("Error", {}).get("Code") if isinstance(parsed, dict) else None
        refused = caught_exception is None and is_throttle(status, code)
        if key is not None and context.pop(_HELD, False):
            self.controller.release(key, refused=refused)
        if not refused:
            if untrusted_certificate(caught_exception) is not None:
                return None  # no retry mends a certificate the client does not trust
            # Other failures: botocore's standard policy, counting only the attempts that were not refused.
            others = attempts - context.get(_REFUSALS, 0)
            return self.others.needs_retry(  # type: ignore[no-any-return]
                response=response,
                attempts=others,
                caught_exception=caught_exception,
                request_dict=request_dict,
                **kwargs,
            )
        now = time.monotonic()
        first = context.setdefault(_FIRST_REFUSAL, now)
        context[_REFUSALS] = context.get(_REFUSALS, 0) + 1
        waited = now - first
        if waited >= self.deadline:
            if isinstance(parsed, dict):
                rate = self.controller.rate(key) if key is not None else 0.0
                parsed["DcpS3Throttle"] = {
                    "key": str(key) if key is not None else "",
                    "refusals": context[_REFUSALS],
                    "seconds": round(waited, 1),
                    "rate": round(rate, 2),
                    "deadline": self.deadline,
                }
            log.warning(
                "%s: still refused (%s) after %.0f s and %d refusals; giving up (throttle_deadline=%s s)",
                key,
                code or status,
                waited,
                context[_REFUSALS],
                self.deadline,
            )
            return None
        delay = _retry_after(response[0].headers) if response is not None else None
        if delay is None:  # the tokens pace the retry; a little jitter spreads a burst of refusals
            delay = random.uniform(0.0, 0.05)
        return min(delay, max(0.0, self.deadline - waited))


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asks to wait: ``x-amz-retry-after`` (milliseconds) or ``Retry-After`` (seconds)."""
    for name, scale in (("x-amz-retry-after", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name) if headers is not None else None
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue  # an HTTP date: fall back to pacing
    return None


def request_stats_since(before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """What this process sent since ``before`` (an earlier :func:`request_stats`), per key it used since:
    the attempts, refusals and ``wait_s`` added; ``rate`` and ``peak_rate`` as they are now (the peak is
    the process's highest, which the interval may not have reached)."""
    out: dict[str, dict[str, float]] = {}
    for key, now in request_stats().items():
        then = before.get(key, {})
        if now["attempts"] < then.get("attempts", 0):  # forgotten since (idle) and made again: counted from zero
            then = {}
        delta = {**now, **{f: now[f] - then.get(f, 0) for f in ("attempts", "refusals", "wait_s")}}
        if delta["attempts"] > 0:
            out[key] = delta
    return out
