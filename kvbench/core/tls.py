"""One TLS context for every HTTP client kvbench makes.

httpx builds a fresh ``ssl.SSLContext`` for each client it makes (``httpx.get`` makes one per call), and building
one loads the whole CA bundle: about 40 ms of CPU on the 2-core machine, for a plain ``http://`` call that never uses
it. kvbench polls ``/health`` while a server starts and scrapes ``/metrics`` while a run serves, so the contexts cost
more than the calls: in a vLLM conformance run they were 65% of the pytest process's CPU time, about 90 CPU-seconds
taken from the servers starting beside it (sampled with py-spy). One context, built once with httpx's own defaults
(certifi's bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` where set), verifies ``https://`` servers exactly as
before.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def client_context() -> ssl.SSLContext:
    """The TLS context every kvbench HTTP client is given (``verify=``): httpx's default, built once per process."""
    import httpx

    return httpx.create_ssl_context()
