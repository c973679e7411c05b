"""Who is asking: a bearer token or basic-auth users from the environment, and CSRF tokens for forms.

Credentials never live in the config file. A browser gets the basic-auth prompt (SAGA_CONSOLE_USERS);
scripts and proxies can send `Authorization: Bearer $SAGA_CONSOLE_TOKEN`. Basic auth is sent by the
browser on every request, including one a hostile page makes it send, so every POST also carries a
token only a page of this console can know: an HMAC of the user's name under a secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

TOKEN_ENV = "SAGA_CONSOLE_TOKEN"
USERS_ENV = "SAGA_CONSOLE_USERS"
SECRET_ENV = "SAGA_CONSOLE_SECRET"
# The operator name a bearer token acts as (it lands on the timeline as `by`).
TOKEN_USER = "token"


class CredentialsError(ValueError):
    """The environment's credentials are malformed; the message names the variable."""


@dataclass(frozen=True)
class Credentials:
    token: str | None = None
    # user name -> password
    users: Mapping[str, str] = field(default_factory=dict)
    # Signs CSRF tokens; random per process unless SAGA_CONSOLE_SECRET is set (several replicas).
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Credentials:
        token = environ.get(TOKEN_ENV) or None
        if token is not None and len(token) < 16:
            raise CredentialsError(f"{TOKEN_ENV} must be at least 16 characters")
        users: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in environ.get(USERS_ENV, "").split(","))):
            name, sep, password = item.partition(":")
            if not sep or not name or not password:
                raise CredentialsError(f"{USERS_ENV}: each entry is name:password, comma-separated")
            users[name] = password
        secret = environ.get(SECRET_ENV)
        return cls(token, users, secret.encode() if secret else secrets.token_bytes(32))

    @property
    def configured(self) -> bool:
        return bool(self.token or self.users)

    def authenticate(self, authorization: str | None) -> str | None:
        """The user an Authorization header proves, or None."""
        scheme, _, value = (authorization or "").partition(" ")
        scheme, value = scheme.lower(), value.strip()
        if scheme == "bearer" and self.token and hmac.compare_digest(value.encode(), self.token.encode()):
            return TOKEN_USER
        if scheme == "basic" and self.users:
            try:
                name, _, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            # Compare against a dummy for unknown names too, so timing does not tell which names exist.
            expected = self.users.get(name, "\0" + password)
            if hmac.compare_digest(password.encode(), expected.encode()) and name in self.users:
                return name
        return None

    def challenge(self) -> str:
        return 'Basic realm="saga console", charset="UTF-8"' if self.users else 'Bearer realm="saga console"'

    def csrf_token(self, user: str) -> str:
        return hmac.new(self.secret, f"csrf:{user}".encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, user: str, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.csrf_token(user), token or "")
