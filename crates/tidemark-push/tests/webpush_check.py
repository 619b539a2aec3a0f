"""Checks a Web Push request with libraries Tidemark did not write.

Reads JSON on stdin: the request body (base64), the browser's private key
(raw 32 bytes, base64url), its auth secret (base64url), the Authorization
header and the endpoint. Decrypts the body with http_ece (RFC 8291/8188),
verifies the VAPID JWT's ES256 signature with py_vapid (RFC 8292) and its
claims, and prints {"plaintext": ..., "claims": ...}; exits non-zero on any
failure.
"""
import base64
import json
import sys
import time
from urllib.parse import urlsplit

import http_ece
import py_vapid.jwt
from cryptography.hazmat.primitives.asymmetric import ec


def b64url(s):
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


req = json.load(sys.stdin)
raw = b64url(req["ua_private"])
private_key = ec.derive_private_key(int.from_bytes(raw, "big"), ec.SECP256R1())
plaintext = http_ece.decrypt(
    base64.b64decode(req["body"]),
    private_key=private_key,
    auth_secret=b64url(req["auth"]),
    version="aes128gcm",
)

scheme, params = req["authorization"].split(" ", 1)
assert scheme.lower() == "vapid", scheme
parts = dict(p.strip().split("=", 1) for p in params.split(","))
claims = py_vapid.jwt.decode(parts["t"], parts["k"])
endpoint = urlsplit(req["endpoint"])
assert claims["aud"] == f"{endpoint.scheme}://{endpoint.netloc}", claims
now = time.time()
assert now < claims["exp"] <= now + 24 * 3600, claims
assert claims["sub"].startswith(("mailto:", "https:")), claims
print(json.dumps({"plaintext": plaintext.decode("utf-8"), "claims": claims}))
