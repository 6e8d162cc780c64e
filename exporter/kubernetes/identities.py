"""Who is calling the admin API: the shared token, or a Kubernetes identity checked by the API.

With `admin_auth` naming `kubernetes`, a request's bearer token is sent to the API server's
TokenReview (who is this?) and the action to its SubjectAccessReview (may they?), as
kube-rbac-proxy does: `kubectl create token` users and ServiceAccounts get exactly what RBAC
gives them. What is asked of RBAC, by default, in the exporter's namespace:

    group gpumem-exporter, resource snapshots|caches|history|peaks|stats,
    verb get|list|create|delete (from the HTTP method)

or, with `admin_kubernetes_authorization: nodes/proxy` (the node daemon, like the kubelet's
own API), resource nodes, subresource proxy, name $NODE_NAME.

Answers are remembered for CACHE_TTL_S (under a hash of the token, never the token), so an
on-call's burst of requests makes one review each; failures are not remembered. The API
server being down or slow is a 503 with the reason, never a hang (exporter.kubernetes.api
bounds each call). Tokens never seen are what anyone can send: at most REVIEWS_IN_FLIGHT are
asked at once and REVIEWS_PER_S a second (a bucket of REVIEWS_BURST); past either, 503 at once
(round 4: 60 loops of made-up tokens drove 2,406 reviews in 15 s, and a hung API server held
40 worker threads 5 s each, the page's data behind them). A token the API server authenticated
is known for KNOWN_FOR_S: its reviews, once its answer expires, have a budget of their own,
which made-up tokens cannot drain (round 5: an admin's /stats got 503 in 8 of 20 while a
flood of made-up tokens emptied the one bucket).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.config import Config, ConfigError
from exporter.kubernetes.api import ApiError, ApiServer
from exporter.ratelimit import TokenBucket

CACHE_TTL_S = 10.0
CACHE_MAX = 1024
KNOWN_FOR_S = 3600.0
REVIEWS_IN_FLIGHT = 4
REVIEWS_PER_S = 10.0
REVIEWS_BURST = 20
GROUP = "gpumem-exporter"
# Each admin route (by its counter label) -> the resource RBAC rules name.
RESOURCES = {
    "snapshot": "snapshots",
    "snapshot_stop": "snapshots",
    "list": "snapshots",
    "download": "snapshots",
    "view": "snapshots",
    "delete": "snapshots",
    "empty_cache": "caches",
    "history": "history",
    "reset_peak": "peaks",
    "stats": "stats",
}
VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "DELETE": "delete"}
AUTHORIZATIONS = ("namespace", "nodes/proxy")


class IdentityUnavailable(RuntimeError):
    """The API server could not be asked (503); str() is one line."""


@dataclass(frozen=True)
class User:
    """A TokenReview's user."""

    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, list[str]] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Decision:
    user: User | None  # None: the token is not one the API server knows
    allowed: bool
    reason: str


class KubernetesIdentities:
    def __init__(
        self,
        api: ApiServer,
        *,
        namespace: str,
        authorization: str = "namespace",
        node_name: str = "",
        ttl_s: float | None = None,
    ) -> None:
        if authorization not in AUTHORIZATIONS:
            raise ValueError(f"unknown authorization {authorization!r}")
        if authorization == "nodes/proxy" and not node_name:
            raise ApiError("nodes/proxy authorization needs NODE_NAME (the Downward API)")
        self.api = api
        self.namespace = namespace
        self.authorization = authorization
        self.node_name = node_name
        self.ttl_s = CACHE_TTL_S if ttl_s is None else ttl_s
        self._lock = threading.Lock()
        self._cache: dict[tuple[bytes, str, str], tuple[float, Decision]] = {}
        # Tokens the API server authenticated -> until when they count as known.
        self._known: dict[bytes, float] = {}
        # (reviews a second, reviews at once) for tokens never seen, and apart for known ones.
        self._in_flight = threading.BoundedSemaphore(REVIEWS_IN_FLIGHT)
        self._reviews = TokenBucket(1.0 / REVIEWS_PER_S, REVIEWS_BURST)  # under self._lock
        self._known_in_flight = threading.BoundedSemaphore(REVIEWS_IN_FLIGHT)
        self._known_reviews = TokenBucket(1.0 / REVIEWS_PER_S, REVIEWS_BURST)  # under the lock

    def attributes(self, verb: str, resource: str) -> dict[str, str]:
        """The SubjectAccessReview's resourceAttributes for an action."""
        if self.authorization == "nodes/proxy":
            return {
                "verb": verb,
                "resource": "nodes",
                "subresource": "proxy",
                "name": self.node_name,
            }
        return {"namespace": self.namespace, "verb": verb, "group": GROUP, "resource": resource}

    def decide(self, token: str, verb: str, resource: str) -> Decision:
        """Who `token` is and whether they may `verb` `resource`; IdentityUnavailable when
        the API server cannot tell."""
        hashed = hashlib.sha256(token.encode()).digest()
        key = (hashed, verb, resource)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return cached[1]
            known = self._known.get(hashed, 0.0) > now
            allowed = (self._known_reviews if known else self._reviews).allow()
        in_flight = self._known_in_flight if known else self._in_flight
        if not allowed:
            raise IdentityUnavailable(
                f"more than {REVIEWS_PER_S:g} new identities a second to check with the "
                "Kubernetes API; retry shortly"
            )
        if not in_flight.acquire(blocking=False):
            raise IdentityUnavailable(
                f"{REVIEWS_IN_FLIGHT} identity checks with the Kubernetes API in progress; "
                "retry shortly"
            )
        try:
            decision = self._review(token, verb, resource)
        except ApiError as exc:
            raise IdentityUnavailable(
                f"cannot check the identity with the Kubernetes API: {exc}"
            ) from None
        finally:
            in_flight.release()
        with self._lock:
            if len(self._cache) >= CACHE_MAX:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                if len(self._cache) >= CACHE_MAX:
                    self._cache.clear()
            self._cache[key] = (now + self.ttl_s, decision)
            if decision.user is not None:  # authenticated: a real token, known from now on
                if len(self._known) >= CACHE_MAX and hashed not in self._known:
                    self._known = {k: v for k, v in self._known.items() if v > now}
                    if len(self._known) >= CACHE_MAX:
                        self._known.pop(min(self._known, key=self._known.__getitem__))
                self._known[hashed] = now + KNOWN_FOR_S
        return decision

    def _review(self, token: str, verb: str, resource: str) -> Decision:
        review = self.api.post(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status = _object(review.get("status"))
        if status.get("authenticated") is not True:
            # The API's own words (an expired token, ...) are safe to pass on: never the token.
            why = str(status.get("error") or "the Kubernetes API did not authenticate the token")
            return Decision(None, False, why[:200])
        user = _user(_object(status.get("user")))
        access = self.api.post(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user.name,
                    "uid": user.uid,
                    "groups": list(user.groups),
                    "extra": user.extra,
                    "resourceAttributes": self.attributes(verb, resource),
                },
            },
        )
        verdict = _object(access.get("status"))
        allowed = verdict.get("allowed") is True and verdict.get("denied") is not True
        reason = str(verdict.get("reason") or verdict.get("evaluationError") or "")[:200]
        return Decision(user, allowed, reason)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError("the API server's review has no status")
    return value


def _user(data: dict[str, Any]) -> User:
    name = data.get("username")
    if not isinstance(name, str) or not name:
        raise ApiError("the API server's TokenReview names no user")
    groups = data.get("groups") or []
    extra = data.get("extra") or {}
    if not isinstance(groups, list) or not isinstance(extra, dict):
        raise ApiError("the API server's TokenReview user is malformed")
    return User(
        name,
        str(data.get("uid") or ""),
        tuple(str(g) for g in groups),
        {str(k): [str(v) for v in (vs or [])] for k, vs in extra.items()},
    )


def kubernetes_identities(
    config: Config, env: Mapping[str, str] = os.environ
) -> KubernetesIdentities | None:
    """The API server's reviews of admin callers, where admin_auth names kubernetes."""
    if "kubernetes" not in config.admin_auth:
        return None
    try:
        api = ApiServer.in_cluster(env, credentials=Path(config.kubernetes_service_account_dir))
        return KubernetesIdentities(
            api,
            namespace=api.namespace() or env.get("POD_NAMESPACE", ""),
            authorization=config.admin_kubernetes_authorization,
            node_name=env.get("NODE_NAME", ""),
        )
    except ApiError as exc:
        raise ConfigError(f"admin_auth kubernetes: {exc}") from None
