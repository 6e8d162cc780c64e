"""urllib that never follows a redirect: a request's credentials (an admin token, a basic-auth
password) must not go wherever a 3xx points, plain http included. A redirect is an HTTPError
naming where it pointed."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl[:200]} not followed", headers, fp
        )


def opener(context: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """urllib without redirects, with `context` for https."""
    return urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=context))
